"""Model registry and backbones: every configs/model YAML against its published size, built through
Hydra and trained one forward/backward step; structure cross-checks; MC-Dropout placement; FRN;
local pretrained weights (never downloaded)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from flatbnn.models import create_model, list_models
from flatbnn.models._common import read_state_dict
from flatbnn.models.reference import MODEL_REFS, count_parameters
from flatbnn.models.resnet_frn import FilterResponseNorm2d
from helpers import compose_cfg

CIFAR = (3, 32, 32)
REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs" / "model"
CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))

# Exact count of our implementation for every config, at the input shape and class count of
# flatbnn/models/reference.py (CIFAR 3x32x32 / 10 classes unless listed there). A change here is a
# change of architecture: update docs/models.md (scripts/param_counts.py --markdown --update ...).
EXACT = {
    "deit_base": 86_567_656,
    "densenet121": 6_956_298,
    "densenet161": 28_681_000,
    "lenet5": 61_706,
    "mlp": 545_810,
    "preresnet110": 1_730_522,
    "preresnet164": 1_703_258,
    "preresnet164_drop": 2_537_882,
    "pyramidnet272": 26_288_692,
    "resnet10": 4_903_242,
    "resnet152": 60_192_808,
    "resnet18": 11_173_962,
    "resnet20": 269_722,
    "resnet20_frn": 274_042,
    "resnet32": 464_154,
    "resnet34": 21_282_122,
    "resnet56": 853_018,
    "resnext29_32x4d": 4_775_754,
    "vgg16_bn": 15_253_578,
    "vgg19_bn": 20_040_522,
    "vgg_hwa": 9_416_010,
    "vit_b16": 86_567_656,
    "wrn16x4": 2_748_890,
    "wrn28x10": 36_479_194,
    "wrn28x10_swag": 36_489_290,
    "wrn28x2": 1_467_610,
}
SLOW = {"densenet161", "resnet152", "deit_base", "vit_b16", "pyramidnet272", "wrn28x10", "wrn28x10_swag"}
TIMM = {"deit_base", "vit_b16"}


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Batch-2 passes gain little from intra-op threads, and on a shared 2-core machine OpenMP
    threads spinning against other processes made them 10-20x slower (ResNet-152: 20 s vs 2 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def config_kwargs(config: str) -> tuple[str, dict]:
    kw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{config}.yaml"), resolve=False)
    for key in ("_target_", "num_classes", "input_shape"):
        kw.pop(key)
    return kw.pop("name"), kw


def meta_count(name: str, num_classes: int, shape, basis: str = "all", **kw) -> int:
    """Parameter count without allocating or initialising anything."""
    with torch.device("meta"):
        model = create_model(name, num_classes=num_classes, input_shape=shape, **kw)
    return count_parameters(model, basis)


def agrees(count: int, published_m: str) -> bool:
    """Equal to a figure printed in millions at its precision (half a unit in its last digit)."""
    decimals = len(published_m.partition(".")[2])
    return abs(count / 1e6 - float(published_m)) <= 0.5 * 10**-decimals


def test_every_config_has_a_reference_and_an_exact_count():
    assert set(CONFIGS) == set(EXACT) == set(MODEL_REFS)


@pytest.mark.parametrize("config", CONFIGS)
def test_param_count_matches_published(config):
    """Exact count of this implementation, and agreement with the printed figure where one exists."""
    if config in TIMM:
        pytest.importorskip("timm")
    ref = MODEL_REFS[config]
    name, kw = config_kwargs(config)
    count = meta_count(name, ref.num_classes, ref.input_shape, **kw)
    assert count == EXACT[config]
    if ref.published is None:
        return
    classes = ref.published_classes or ref.num_classes
    basis_count = (
        count
        if (ref.published_basis, classes) == ("all", ref.num_classes)
        else meta_count(name, classes, ref.input_shape, ref.published_basis, **kw)
    )
    print(f"{config}: {count:,} ({ref.published_basis} at {classes} classes: {basis_count:,}); "
          f"published {ref.published}M, {ref.published_by}")
    assert agrees(basis_count, ref.published), (basis_count, ref.published)


def _compose(config: str):
    ref = MODEL_REFS[config]
    shape = list(ref.input_shape)
    cfg = compose_cfg([
        "dataset=cifar10", f"model={config}",
        f"dataset.input_shape=[{','.join(map(str, shape))}]", f"dataset.num_classes={ref.num_classes}",
    ])
    return cfg, shape, ref.num_classes


@pytest.mark.parametrize(
    "config", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CONFIGS]
)
def test_config_builds_through_hydra_and_trains(config):
    """Hydra composition (dataset values interpolated) -> instantiate -> forward/backward at batch 2."""
    if config in TIMM:
        pytest.importorskip("timm")
    cfg, shape, classes = _compose(config)
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    assert n_params(model) == EXACT[config]
    model.train()
    logits = model(torch.randn(2, *shape))
    assert logits.shape == (2, classes)
    logits.logsumexp(-1).sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_cifar_models_build_from_the_cifar10_config_as_is():
    """No override needed for the CIFAR models: the dataset group's shape and classes flow in."""
    cfg = compose_cfg(["dataset=cifar10", "model=resnet20"])
    model = instantiate(cfg.model)
    assert model(torch.randn(2, *CIFAR)).shape == (2, 10)


# ---------------------------------------------------------------- structure cross-checks


@pytest.mark.parametrize(
    "name,kw,tv_name,stem_channels",
    [
        ("resnet", dict(depth=18), "resnet18", 64),
        ("resnet", dict(depth=34), "resnet34", 64),
        ("densenet_cifar", dict(depth=121), "densenet121", 64),
    ],
)
def test_cifar_stem_nets_equal_torchvision_with_the_stem_swapped(name, kw, tv_name, stem_channels):
    """torchvision's ImageNet net minus its 7x7 stem conv (and the BN after it for DenseNet, whose
    CIFAR stem has none) plus a 3x3 conv == ours, at the same class count."""
    import torchvision

    with torch.device("meta"):
        tv = count_parameters(getattr(torchvision.models, tv_name)(num_classes=10))
    imagenet_stem = 3 * stem_channels * 7 * 7 + (2 * stem_channels if name == "densenet_cifar" else 0)
    cifar_stem = 3 * stem_channels * 3 * 3
    assert meta_count(name, 10, CIFAR, **kw) == tv - imagenet_stem + cifar_stem


def test_resnet_seeds_and_computes_as_the_former_hand_written_module():
    """models/resnet.py became torchvision's ResNet with a CIFAR stem: a seed gives the weights it gave
    before (values recorded from the former module, seed 0) and they compute the same logits (eval: running
    BN statistics; train: batch statistics), so committed runs reproduce."""
    import torchvision

    torch.manual_seed(0)
    model = create_model("resnet", 10, CIFAR, depth=10)
    assert isinstance(model, torchvision.models.ResNet) and isinstance(model.maxpool, nn.Identity)
    sd = model.state_dict()
    former_init = {  # first two values per tensor, as the former module initialised them
        "conv1.weight": [0.0633554682135582, 0.03434492275118828],
        "layer4.0.downsample.0.weight": [-0.08721960335969925, 0.04548611491918564],
        "layer3.0.conv2.weight": [0.0398733951151371, -0.029175477102398872],
        "fc.weight": [-0.04079809412360191, 0.02127680368721485],
        "fc.bias": [0.025396056473255157, 0.006788945756852627],
    }
    for key, values in former_init.items():
        torch.testing.assert_close(sd[key].flatten()[:2], torch.tensor(values), rtol=1e-6, atol=0)
    torch.manual_seed(1)
    x = torch.randn(8, *CIFAR)
    former_logits = {
        "eval": [0.4775181710720062, -0.016696549952030182, -0.34251904487609863, 0.11284787952899933,
                 0.16653972864151, 0.2834072411060333, -0.2779567837715149, 0.050079815089702606,
                 0.06396865844726562, -0.1828490048646927],
        "train": [0.770399272441864, 0.1419067084789276, -0.550837516784668, 0.39154598116874695,
                  -0.27100682258605957, 0.7162660360336304, -0.042827308177948, 0.07036560773849487,
                  0.19644282758235931, 0.17850781977176666],
    }
    with torch.no_grad():
        for mode, logits in former_logits.items():
            model.train(mode == "train")
            torch.testing.assert_close(model(x)[0], torch.tensor(logits), rtol=1e-4, atol=1e-5)


def _former_key(key: str) -> str:
    """The former hand-written module's name for a torchvision key (stem / stages / shortcut / head)."""
    key = re.sub(r"^conv1\.", "stem.0.", re.sub(r"^bn1\.", "stem.1.", key))
    key = re.sub(r"^layer(\d)\.", lambda m: f"stages.{int(m.group(1)) - 1}.", key)
    return re.sub(r"^fc\.", "head.", key.replace(".downsample.", ".shortcut."))


def test_resnet_loads_checkpoints_of_the_former_module():
    """Run directories written before the switch resume and evaluate: their keys are renamed on load,
    also under a prefix (a wrapper module, DDP's 'module.')."""
    torch.manual_seed(0)
    source = create_model("resnet", 10, CIFAR, depth=10)
    source(torch.randn(4, *CIFAR))  # running statistics != their initial values
    former = {_former_key(k): v for k, v in source.state_dict().items()}
    assert {"stem.0.weight", "stem.1.running_var", "stages.3.0.shortcut.1.running_mean", "head.bias"} <= set(former)
    torch.manual_seed(1)
    target = nn.ModuleDict({"module": create_model("resnet", 10, CIFAR, depth=10)})
    target.load_state_dict({f"module.{k}": v for k, v in former.items()})  # strict
    for (k, a), b in zip(source.state_dict().items(), target["module"].state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize(
    "kw,published",
    [
        (dict(cardinality=8, base_width=64), ["34.4", "34.43"]),  # Xie et al. 2017; bearpaw
        (dict(cardinality=16, base_width=64), ["68.16"]),  # bearpaw (Xie et al. print 68.1)
    ],
)
def test_resnext_matches_published_cifar_resnexts(kw, published):
    count = meta_count("resnext_cifar", 10, CIFAR, depth=29, **kw)
    assert all(agrees(count, p) for p in published), count


@pytest.mark.parametrize(
    "depth,alpha,published",
    [(272, 200, "26.0"), (236, 220, "26.8"), (200, 240, "26.6"), (164, 48, "1.7")],
)
def test_pyramidnet_matches_han_et_al(depth, alpha, published):
    """Han et al.'s bottleneck counts are conv + linear parameters (no BN affine) at 10 classes."""
    count = meta_count("pyramidnet", 10, CIFAR, "conv_linear", depth=depth, alpha=alpha)
    assert agrees(count, published), count


def test_resnet_cifar_shortcuts_and_he_et_al_resnet110():
    a = create_model("resnet_cifar", 10, CIFAR, depth=20)
    b = create_model("resnet_cifar", 10, CIFAR, depth=20, shortcut="B")
    # option B: 1x1 conv + BN at the two stage transitions (16->32, 32->64)
    assert n_params(b) - n_params(a) == (16 * 32 + 2 * 32) + (32 * 64 + 2 * 64)
    x = torch.randn(2, *CIFAR)
    assert a(x).shape == b(x).shape == (2, 10)
    assert agrees(meta_count("resnet_cifar", 10, CIFAR, depth=110), "1.7")  # He et al. Table 6
    with pytest.raises(ValueError):
        create_model("resnet_cifar", 10, CIFAR, depth=21)


def test_preresnet_depth_rules():
    he = create_model("preresnet", 10, CIFAR, depth=164)
    swag = create_model("preresnet", 10, CIFAR, depth=164, depth_rule="swag_dropout")
    assert [len(s) for s in he.stages] == [18, 18, 18]
    assert [len(s) for s in swag.stages] == [27, 27, 27]  # the SWAG code's PreResNet164Drop
    assert meta_count("preresnet", 10, CIFAR, depth=110) == 1_146_842  # SWAG code's PreResNet110
    raw = create_model("preresnet", 10, CIFAR, depth=20, shortcut_input="raw")
    assert n_params(raw) == n_params(create_model("preresnet", 10, CIFAR, depth=20))
    assert raw(torch.randn(2, *CIFAR)).shape == (2, 10)


def test_stride_on_moves_downsampling_not_parameters():
    kw = dict(num_classes=10, input_shape=CIFAR, depth=10, widen_factor=2)
    first = create_model("wrn", stride_on="first", **kw)
    second = create_model("wrn", stride_on="second", **kw)
    assert n_params(first) == n_params(second)

    def conv1_output_size(model):
        sizes = []
        block = model.stages[1][0]  # first block of stage 2 downsamples 32x32 -> 16x16
        handle = block.conv1.register_forward_hook(lambda m, i, o: sizes.append(tuple(o.shape[-2:])))
        out = model(torch.randn(2, *CIFAR))
        handle.remove()
        return sizes[0], out.shape

    assert conv1_output_size(first) == ((16, 16), (2, 10))
    assert conv1_output_size(second) == ((32, 32), (2, 10))
    with pytest.raises(ValueError):
        create_model("wrn", stride_on="third", **kw)


def test_wrn_swag_options():
    kw = dict(num_classes=10, input_shape=CIFAR, depth=10, widen_factor=2)
    plain = create_model("wrn", **kw)
    biased = create_model("wrn", conv_bias=True, **kw)
    n_conv_channels = sum(m.out_channels for m in plain.modules() if isinstance(m, nn.Conv2d))
    assert n_params(biased) - n_params(plain) == n_conv_channels
    raw = create_model("wrn", shortcut_input="raw", **kw)
    assert raw(torch.randn(2, *CIFAR)).shape == (2, 10)
    for bad in (dict(dropout_placement="middle"), dict(shortcut_input="both")):
        with pytest.raises(ValueError):
            create_model("wrn", **kw, **bad)


def test_wrn_fan_in_zero_head_init_is_davda54_sams():
    """VariationalSAM's notebooks train davda54/sam's WideResNet: He-normal convs with fan_in, zero classifier.
    The stem conv (3 -> 16, 3x3) tells fan_in (27: std sqrt(2/27) = 0.27) from fan_out (144: 0.12)."""
    kw = dict(num_classes=10, input_shape=CIFAR, depth=10, widen_factor=1)
    torch.manual_seed(0)
    sam_code, ours = create_model("wrn", init="fan_in_zero_head", **kw), create_model("wrn", **kw)
    assert sam_code.stem.weight.std().item() == pytest.approx((2 / 27) ** 0.5, rel=0.1)
    assert ours.stem.weight.std().item() == pytest.approx((2 / 144) ** 0.5, rel=0.1)
    assert not sam_code.head.weight.any() and not sam_code.head.bias.any() and ours.head.weight.any()
    assert not sam_code(torch.randn(2, *CIFAR)).any()  # a zero head: every logit 0 at step 0
    with pytest.raises(ValueError):
        create_model("wrn", init="fan_out", **kw)


@pytest.mark.parametrize(
    "name,kw,shape",
    [
        ("resnet20_frn", {}, (1, 28, 28)),
        ("wrn", dict(depth=10, widen_factor=1), (1, 20, 24)),
        ("preresnet", dict(depth=11, block="bottleneck"), (5, 9, 9)),
        ("resnet_cifar", dict(depth=8), (1, 28, 28)),
        ("resnet", dict(depth=10), (4, 20, 20)),
        ("vgg", dict(depth=11), (1, 48, 40)),
        ("densenet_cifar", dict(depth=121), (1, 28, 28)),
        ("resnext_cifar", dict(depth=11, cardinality=2, base_width=4), (2, 17, 17)),
        ("pyramidnet", dict(depth=11, alpha=12), (1, 28, 28)),
        ("lenet5", {}, (3, 32, 32)),
        ("lenet5", dict(variant="tfp"), (1, 28, 28)),
        ("lenet5", dict(variant="bsam"), (1, 28, 28)),
        ("vgg_hwa", {}, (1, 64, 48)),
    ],
)
def test_conv_nets_take_any_channels_and_size(name, kw, shape):
    model = create_model(name, num_classes=4, input_shape=shape, **kw)
    assert model(torch.randn(3, *shape)).shape == (3, 4)


def test_vgg_hwa_bn_momentum():
    """Keras' 0.99 decay by default; model.bn_momentum reaches every BN layer (cpu-scale runs use 0.1)."""
    bns = lambda m: [b for b in m.modules() if isinstance(b, nn.BatchNorm2d)]
    default = create_model("vgg_hwa", 10, CIFAR)
    assert len(bns(default)) == 10 and {(b.momentum, b.eps) for b in bns(default)} == {(0.01, 1e-3)}
    fast = create_model("vgg_hwa", 10, CIFAR, bn_momentum=0.1)
    assert {b.momentum for b in bns(fast)} == {0.1}
    # 16 train-mode batches: the running mean keeps 1 - (1 - m)^16 of the batches' mean
    x = torch.randn(8, *CIFAR) + 3.0
    for model, m in ((default, 0.01), (fast, 0.1)):
        model.train()
        with torch.no_grad():
            for _ in range(16):
                model(x)
        first = bns(model)[0]
        batch_mean = model.features[0](x).mean((0, 2, 3))
        torch.testing.assert_close(first.running_mean, (1 - (1 - m) ** 16) * batch_mean, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="bn_momentum"):
        create_model("vgg_hwa", 10, CIFAR, bn_momentum=0.0)


def test_lenet5_variants():
    counts = {v: meta_count("lenet5", 10, (1, 28, 28), variant=v) for v in ("classic", "tfp", "bsam")}
    # classic: C5 on 5x5 maps (conv1 padded by 2); tfp: 'SAME' convs, fc on 7*7*120; bsam: 3x3/2 pools
    assert counts == {"classic": 61_706, "tfp": 545_546, "bsam": 82_126}
    assert meta_count("lenet5", 10, CIFAR) == 62_006
    with pytest.raises(ValueError):
        create_model("lenet5", 10, (1, 8, 8))
    with pytest.raises(ValueError):
        create_model("lenet5", 10, (1, 28, 28), variant="lenet4")


def test_mlp_small_input_dropout_and_activation():
    model = create_model("mlp", num_classes=10, input_shape=(1, 8, 8), hidden=[32, 16], dropout=0.5)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 16), (16, 10)]
    assert sum(isinstance(m, nn.Dropout) for m in model) == 2
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    no_dropout = create_model("mlp", num_classes=10, input_shape=(1, 8, 8))
    assert not any(isinstance(m, nn.Dropout) for m in no_dropout)
    elu = create_model("mlp", num_classes=10, input_shape=(1, 28, 28), activation="elu")
    assert sum(isinstance(m, nn.ELU) for m in elu) == 2 and n_params(elu) == EXACT["mlp"]


# ---------------------------------------------------------------- MC-Dropout placement


def _dropouts(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Dropout)]


# (builder, small kwargs, input shape, expected names of the nn.Dropout modules at dropout=p)
DROPOUT_CASES = {
    "mlp": ("mlp", dict(hidden=[16, 8]), (1, 8, 8), ["3", "6"]),
    "lenet5": ("lenet5", {}, (1, 28, 28), ["classifier.1", "classifier.4"]),
    "resnet_cifar": ("resnet_cifar", dict(depth=8), CIFAR, ["dropout"]),
    "resnet": ("resnet", dict(depth=10), CIFAR, ["dropout"]),
    # SWAG PreResNetDrop: before every residual-branch conv and projection conv, and the classifier
    "preresnet": (
        "preresnet", dict(depth=8, block="basic"), CIFAR,
        [f"stages.{s}.0.drop{i}" for s in range(3) for i in (1, 2)]
        + ["stages.1.0.shortcut_drop", "stages.2.0.shortcut_drop", "dropout"],
    ),
    "preresnet_bottleneck": (
        "preresnet", dict(depth=11, block="bottleneck"), CIFAR,
        [f"stages.{s}.0.drop{i}" for s in range(3) for i in (1, 2, 3)]
        + [f"stages.{s}.0.shortcut_drop" for s in range(3)] + ["dropout"],
    ),
    "wrn_original": (
        "wrn", dict(depth=10, widen_factor=1), CIFAR, [f"stages.{s}.0.dropout" for s in range(3)]
    ),
    "wrn_swag": (
        "wrn", dict(depth=10, widen_factor=1, dropout_placement="swag"), CIFAR,
        [f"stages.{s}.0.dropout" for s in range(3)] + ["head_dropout"],
    ),
    # SWAG VGGDrop: before every conv (VGG-11: 8 convs), and before the classifier
    "vgg": (
        "vgg", dict(depth=11), CIFAR,
        [f"features.{i}" for i in (0, 5, 10, 14, 19, 23, 28, 32)] + ["classifier.0"],
    ),
    "vgg_hwa": ("vgg_hwa", {}, CIFAR, ["dropout"]),
    "densenet": ("densenet_cifar", dict(depth=121, growth_rate=8), CIFAR, ["dropout"]),
    "resnext": ("resnext_cifar", dict(depth=11, cardinality=2, base_width=4), CIFAR, ["dropout"]),
    "pyramidnet": ("pyramidnet", dict(depth=11, alpha=12), CIFAR, ["dropout"]),
}


def enable_dropout(m: nn.Module) -> None:
    if isinstance(m, nn.Dropout):
        m.train()


@pytest.mark.parametrize("case", DROPOUT_CASES)
def test_dropout_placement_and_mc_sampling(case):
    name, kw, shape, expected = DROPOUT_CASES[case]
    torch.manual_seed(0)
    off = create_model(name, 10, shape, **kw)
    assert _dropouts(off) == []  # dropout=0: no Dropout module at all
    torch.manual_seed(0)
    on = create_model(name, 10, shape, dropout=0.3, **kw)
    assert sorted(_dropouts(on)) == sorted(expected)
    assert all(m.p == 0.3 for m in on.modules() if isinstance(m, nn.Dropout))
    # same parameters, same state_dict keys (not the MLP's: a plain Sequential whose indices shift)
    # and, with dropout off, the same function
    if case == "mlp":
        on.load_state_dict(dict(zip(on.state_dict(), off.state_dict().values())))
    else:
        assert on.state_dict().keys() == off.state_dict().keys()
        on.load_state_dict(off.state_dict())
    x = torch.randn(4, *shape)
    on.eval(), off.eval()
    with torch.no_grad():
        torch.testing.assert_close(on(x), off(x))
        on.train()
        assert not torch.equal(on(x), on(x))  # train mode: fresh masks
        on.eval()
        on.apply(enable_dropout)  # MC-Dropout at test time: BN frozen, masks sampled
        assert not torch.equal(on(x), on(x))


def test_wrn_dropout_placements_act_where_documented():
    """original: dropout sees BN2-ReLU output (>= 0); swag: it sees the first conv's raw output."""
    for placement in ("original", "swag"):
        model = create_model("wrn", 10, CIFAR, depth=10, widen_factor=1, dropout=0.3,
                             dropout_placement=placement)
        block = model.stages[0][0]
        seen = {}
        block.conv1.register_forward_hook(lambda m, i, o: seen.setdefault("conv1", o))
        block.dropout.register_forward_hook(lambda m, i, o: seen.setdefault("drop_in", i[0]))
        model(torch.randn(2, *CIFAR))
        if placement == "swag":
            assert torch.equal(seen["drop_in"], seen["conv1"])
        else:
            assert (seen["drop_in"] >= 0).all() and not torch.equal(seen["drop_in"], seen["conv1"])


def test_vgg_mlp_head_dropout_is_architectural():
    swag = create_model("vgg", 10, CIFAR, depth=11, head="mlp")
    assert _dropouts(swag) == ["classifier.0", "classifier.3"]  # the SWAG VGG's Dropout(0.5) pair
    assert _dropouts(create_model("vgg", 10, CIFAR, depth=11, head="mlp", head_dropout=0)) == []
    drop = create_model("vgg", 10, CIFAR, depth=11, head="mlp", dropout=0.05, head_dropout=0.05)
    assert len(_dropouts(drop)) == 8 + 2  # VGG11BNDrop: 8 convs + the two head dropouts


@pytest.mark.parametrize("config", ["preresnet164_drop", "wrn28x10_swag"])
def test_swag_code_configs(config):
    name, kw = config_kwargs(config)
    with torch.device("meta"):
        model = create_model(name, 10, CIFAR, **{**kw, "dropout": 0.05})
    drops = _dropouts(model)
    if config == "preresnet164_drop":
        assert kw["dropout"] == 0.01
        assert len(drops) == 81 * 3 + 3 + 1  # 81 bottlenecks x 3 convs, 3 projections, classifier
    else:
        assert len(drops) == 12 + 1  # WideResNet28x10Drop: one per block + the classifier


# ---------------------------------------------------------------- FRN


def test_frn_normalises_and_tlu_thresholds():
    torch.manual_seed(0)
    frn = FilterResponseNorm2d(4)
    x = 3.0 * torch.randn(8, 4, 6, 6) + 1.5
    x_hat = frn.normalize(x)
    # Unit mean square per (example, channel) before the affine map and TLU.
    torch.testing.assert_close(x_hat.square().mean(dim=(2, 3)), torch.ones(8, 4), atol=1e-5, rtol=0)
    # Identity affine + tau = -inf gives the plain normalisation...
    with torch.no_grad():
        frn.tau.fill_(-float("inf"))
    torch.testing.assert_close(frn(x), x_hat)
    # ...and the output is max(gamma * x_hat + beta, tau), per channel.
    with torch.no_grad():
        frn.gamma.copy_(torch.tensor([1.0, 2.0, -1.0, 0.5]).view(1, 4, 1, 1))
        frn.beta.copy_(torch.tensor([0.0, 0.1, -0.2, 0.3]).view(1, 4, 1, 1))
        frn.tau.copy_(torch.tensor([0.0, -0.5, 0.2, 1.0]).view(1, 4, 1, 1))
    expected = torch.maximum(frn.gamma * x_hat + frn.beta, frn.tau)
    torch.testing.assert_close(frn(x), expected)
    assert (frn(x) >= frn.tau).all()
    assert {n for n, _ in frn.named_parameters()} == {"gamma", "beta", "tau"}


def _frn_with_plain_maximum(self, x):  # the TLU as autograd differentiates it, the reference for _TLU
    return torch.maximum(self.gamma * self.normalize(x) + self.beta, self.tau)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_frn_tlu_backward_equals_autograds_bit_for_bit(dtype, monkeypatch):
    """resnet_frn._TLU replaces autograd's backward of maximum (speed): the gradients training uses -- parameter and
    input gradients, per-example gradients under vmap (VOGN) -- must be the same to the bit, ties (z == tau: half the
    gradient to each side) included, else runs trained before and after it would differ. Hessian-vector products
    (sharpness metrics only) go through another double-backward graph: equal to rounding."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = create_model("resnet20_frn", num_classes=10, input_shape=CIFAR).to(dtype)
    frns = [m for m in model.modules() if isinstance(m, FilterResponseNorm2d)]
    with torch.no_grad():
        for m in frns:
            m.tau.normal_(0, 0.3)
            m.beta.normal_(0, 0.3)
        frns[1].gamma[:, :4] = 0.0  # ties: z = beta = tau on 4 channels of one layer
        frns[1].beta[:, :4] = frns[1].tau[:, :4]
    x, y = torch.randn(4, 3, 16, 16, dtype=dtype), torch.arange(4)  # small: global pooling takes any size
    params = dict(model.named_parameters())
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def everything():
        xr = x.clone().requires_grad_()
        loss = nn.functional.cross_entropy(model(xr), y)
        gs = torch.autograd.grad(loss, [xr, *params.values()], create_graph=True)
        hvp = torch.autograd.grad(sum((g * v[k]).sum() for k, g in zip(params, gs[1:])), list(params.values()))

        def one(p, xi, yi):
            return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])
        per_example = vmap(grad(one), in_dims=(None, 0, 0))({k: p.detach() for k, p in params.items()}, x, y)
        return [g.detach() for g in gs] + list(per_example.values()), list(hvp)

    ours, ours_hvp = everything()
    monkeypatch.setattr(FilterResponseNorm2d, "forward", _frn_with_plain_maximum)
    reference, reference_hvp = everything()
    assert len(ours) == len(reference) == 1 + 2 * len(params)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))
    tol = 1e-12 if dtype == torch.float64 else 1e-4  # relative to each tensor's largest entry
    for a, b in zip(ours_hvp, reference_hvp):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
    z = frns[1].gamma * 0 + frns[1].beta
    assert torch.equal(z[:, :4], frns[1].tau[:, :4])  # the ties are there


def test_frn_is_per_example():
    """No batch statistics: an example's logits do not depend on the rest of the batch."""
    torch.manual_seed(0)
    model = create_model("resnet20_frn", num_classes=10, input_shape=CIFAR)
    x = torch.randn(4, *CIFAR)
    torch.testing.assert_close(model(x)[:1], model(x[:1]))


def test_unknown_model_lists_registered_names():
    assert {"mlp", "wrn", "preresnet", "resnet20_frn", "resnet_cifar", "vgg", "densenet161"} <= set(
        list_models()
    )
    with pytest.raises(KeyError) as err:
        create_model("resnet9000", num_classes=10, input_shape=CIFAR)
    message = str(err.value)
    assert "resnet9000" in message and "\n" not in message
    assert all(name in message for name in list_models())


# ---------------------------------------------------------------- local pretrained weights


@pytest.mark.parametrize("name", ["densenet161", "resnet152", "deit_base", "vit_b16"])
def test_missing_pretrained_path_is_a_clear_error(name, tmp_path):
    if name in TIMM:
        pytest.importorskip("timm")
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        create_model(name, 10, (3, 224, 224), pretrained_path=str(tmp_path / "nope.pth"))


def test_torchvision_pretrained_path_loads_and_replaces_the_head(tmp_path):
    import torchvision

    from flatbnn.models.torchvision_models import _build

    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=1000)
    state = {"module." + k: v for k, v in source.state_dict().items()}  # a DataParallel checkpoint
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "r18.pth")
    same = _build("resnet18", 1000, (3, 224, 224), str(tmp_path / "r18.pth"), False)
    for k, v in source.state_dict().items():
        assert torch.equal(same.state_dict()[k], v), k
    other = _build("resnet18", 10, (3, 64, 64), str(tmp_path / "r18.pth"), False)
    assert other.fc.out_features == 10
    for k, v in source.state_dict().items():
        if not k.startswith("fc."):
            assert torch.equal(other.state_dict()[k], v), k


def test_legacy_densenet_keys_are_renamed(tmp_path):
    t = torch.zeros(1)
    legacy = {"features.denseblock1.denselayer1.norm.1.weight": t, "classifier.bias": t}
    torch.save(legacy, tmp_path / "d.pth")
    assert set(read_state_dict(tmp_path / "d.pth")) == {
        "features.denseblock1.denselayer1.norm1.weight", "classifier.bias"
    }


def test_timm_pretrained_path_loads_locally(tmp_path):
    """timm's own loader on a local file (DeiT-style {'model': ...}); another head size is dropped."""
    pytest.importorskip("timm")
    from flatbnn.models.vit import build_timm_vit

    torch.manual_seed(0)
    source = build_timm_vit("vit_tiny_patch16_224", 1000, CIFAR)
    torch.save({"model": source.state_dict()}, tmp_path / "vit.pth")
    model = build_timm_vit("vit_tiny_patch16_224", 10, CIFAR, pretrained_path=str(tmp_path / "vit.pth"))
    assert model.head.out_features == 10
    for k, v in source.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(model.state_dict()[k], v), k


# ---------------------------------------------------------------- docs


def test_docs_table_lists_every_config_with_its_count():
    text = (REPO / "docs" / "models.md").read_text()
    text = text[text.index("<!-- param-table:start -->") : text.index("<!-- param-table:end -->")]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (\w+) \|.*$", text, re.M)}
    for config, count in EXACT.items():
        assert config in rows, f"docs/models.md has no row for {config}"
        assert f"{count:,}" in rows[config], f"docs/models.md: stale count for {config}"
