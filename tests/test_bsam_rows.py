"""The bSAM paper's rows (rows/bsam_*.yaml, issue 13): the Table 3 no-noise switch equals a hand-computed noiseless
update, BatchNorm statistics under m-sharpness come from the first sub-batch only (bSAM and the SAM baselines, as
the official code), the SAM-Adam preset trains Adam at its own lr / weight decay whatever the dataset-model pair
config says, and every bSAM row is defined at the smoke and cpu scales."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import SAM, NoFlatness
from flatbnn.methods import RunContext
from flatbnn.methods.bsam import BSAM
from flatbnn.reproduce.spec import load_row

from helpers import compose_cfg

CPU = torch.device("cpu")
HP = dict(lr=0.3, beta1=0.8, beta2=0.95, rho=0.05, prior_precision=4.0, n_data_factor=2.0, damping=0.1,
          s_init=1.5)
N_TRAIN = 50
BN_MOMENTUM = 0.1


def _ce64(logits, y):  # stay in float64 (the default criterion casts to float32)
    return F.cross_entropy(logits, y)


def _ctx(module, generator=None):
    return RunContext(model=module, module=module, device=CPU, n_train=N_TRAIN, steps_per_epoch=1, epochs=10,
                      optimizer_factory=None, scheduler_factory=None, generator=generator, criterion=_ce64)


def _batch(n=8, d=3, c=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) * 2 + 1, torch.randint(0, c, (n,), generator=g)


# ------------------------------------------------------------------------------------------ Table 3: no noise
def _noiseless_steps(w, b, batches, m):
    """Alg. 1 without line 3: g, the ascent and h at the mean w; momentum, mean and precision lines unchanged."""
    N = N_TRAIN * HP["n_data_factor"]
    delta = HP["prior_precision"] / N
    params = [w.clone(), b.clone()]
    s = [torch.full_like(p, HP["s_init"]) for p in params]
    mom = [torch.zeros_like(p) for p in params]

    def grad_at(ps, x, y):
        ps = [p.clone().requires_grad_(True) for p in ps]
        return torch.autograd.grad(F.cross_entropy(x @ ps[0].T + ps[1], y), ps)

    for x, y in batches:
        gp_avg = [torch.zeros_like(p) for p in params]
        h_avg = [torch.zeros_like(p) for p in params]
        for xk, yk in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
            g = grad_at(params, xk, yk)  # at the mean: no w + n sqrt(1/(N s))
            gp = grad_at([p + HP["rho"] * gi / si for p, gi, si in zip(params, g, s)], xk, yk)
            for i in range(2):
                gp_avg[i] += gp[i] / m
                h_avg[i] += torch.sqrt(s[i]) * g[i].abs() / m
        mom = [HP["beta1"] * mi + (1 - HP["beta1"]) * (gi + delta * p) for mi, gi, p in zip(mom, gp_avg, params)]
        params = [p - HP["lr"] * mi / si for p, mi, si in zip(params, mom, s)]
        s = [HP["beta2"] * si + (1 - HP["beta2"]) * (hi + HP["damping"] + delta) for si, hi in zip(s, h_avg)]
    return params, s


def _train_linear(noise, batches, m):
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).double()
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    method = BSAM(m=m, num_samples=2, noise=noise, **HP)
    method.setup(_ctx(lin, generator=torch.Generator().manual_seed(5)))
    bp = Backprop(lin, CPU)
    for batch in batches:
        method.train_step(batch, NoFlatness(), bp)
    return lin, method, (w0, b0)


@pytest.mark.parametrize("m", [1, 2])
def test_bsam_without_noise_equals_the_hand_computed_noiseless_update(m):
    batches = [_batch(seed=i) for i in range(3)]
    lin, method, (w0, b0) = _train_linear(False, batches, m)
    params, s = _noiseless_steps(w0, b0, batches, m)
    torch.testing.assert_close(lin.weight.detach(), params[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lin.bias.detach(), params[1], rtol=1e-12, atol=1e-12)
    for p, s_ref in zip(method.optimizer.params(), s):
        torch.testing.assert_close(method.optimizer.state[p]["precision"], s_ref, rtol=1e-12, atol=1e-12)
    assert method.describe()["noise"] is False
    # the switch matters: with the noise (the default) the same steps land elsewhere
    noisy, _, _ = _train_linear(True, batches, m)
    assert (noisy.weight - lin.weight).abs().max().item() > 1e-6


def test_bsam_noise_switch_composes_and_defaults_on():
    assert compose_cfg(["method=bsam"]).method.noise is True
    cfg = compose_cfg(["method=bsam", "method.noise=false"])
    assert cfg.method.noise is False


# ------------------------------------------------------------------------------------------ BN under m-sharpness
def _bn_net():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, momentum=BN_MOMENTUM)
    return nn.Sequential(bn, nn.Linear(3, 2)).double(), bn


def _expected_stats(x_first, updates):
    """Running mean / var after ``updates`` BN updates with the same sub-batch (PyTorch: unbiased var)."""
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for _ in range(updates):
        mean = (1 - BN_MOMENTUM) * mean + BN_MOMENTUM * x_first.mean(0)
        var = (1 - BN_MOMENTUM) * var + BN_MOMENTUM * x_first.var(0, unbiased=True)
    return mean, var


@pytest.mark.parametrize("bn_stats,updates", [("both", 2), ("first", 1), ("second", 1), ("none", 0)])
def test_bsam_batchnorm_statistics_come_from_the_first_sub_batch_only(bn_stats, updates):
    """BN on the inputs: its statistics depend on the data only, so the expected running stats are hand-computed
    from the first of the 4 sub-batches (updated by the passes ``bn_stats`` names; the official default: both)."""
    net, bn = _bn_net()
    x, y = _batch(n=8)
    method = BSAM(m=4, num_samples=2, bn_stats=bn_stats, **HP)
    method.setup(_ctx(net, generator=torch.Generator().manual_seed(1)))
    method.train_step((x, y), NoFlatness(), Backprop(net, CPU))
    mean, var = _expected_stats(x[:2], updates)
    torch.testing.assert_close(bn.running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, var, rtol=1e-12, atol=1e-12)
    assert int(bn.num_batches_tracked) == updates


@pytest.mark.parametrize("bn_chunks,bn_stats,expect", [
    ("first", "both", "first2"),   # the official bSAM code's SAM (sam_adam preset)
    ("first", "first", "first1"),
    ("all", "first", "all1"),      # project default: every chunk's first pass
])
def test_sam_m_sharpness_batchnorm_chunk_policy(bn_chunks, bn_stats, expect):
    net, bn = _bn_net()
    x, y = _batch(n=8)
    sam = SAM(rho=0.05, m=4, bn_stats=bn_stats, bn_chunks=bn_chunks)
    params = list(net.parameters())
    sam.gradient(params, lambda b: _ce64(net(b[0]), b[1]), (x, y), Backprop(net, CPU))
    if expect.startswith("first"):
        mean, var = _expected_stats(x[:2], int(expect[-1]))
        n_updates = int(expect[-1])
    else:  # one update per chunk, in order
        mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        for xk in torch.tensor_split(x, 4):
            mean = (1 - BN_MOMENTUM) * mean + BN_MOMENTUM * xk.mean(0)
            var = (1 - BN_MOMENTUM) * var + BN_MOMENTUM * xk.var(0, unbiased=True)
        n_updates = 4
    torch.testing.assert_close(bn.running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, var, rtol=1e-12, atol=1e-12)
    assert int(bn.num_batches_tracked) == n_updates
    # a second step starts counting chunks again (the first chunk of every step updates)
    sam.gradient(params, lambda b: _ce64(net(b[0]), b[1]), (x, y), Backprop(net, CPU))
    assert int(bn.num_batches_tracked) == 2 * n_updates


def test_sam_bn_chunks_refuses_unknown_policy():
    with pytest.raises(ValueError, match="bn_chunks"):
        SAM(bn_chunks="last")


# ------------------------------------------------------------------------------------------ SAM-Adam composition
def test_sam_adam_preset_wins_over_the_pair_configs_sgd_recipe():
    """dataset_model/cifar10_resnet20_frn.yaml sets the SGD recipe (lr 0.03); SAM-Adam must not inherit it."""
    pair = ["dataset=cifar10", "model=resnet20_frn"]
    cfg = compose_cfg(["method=sam_adam", *pair])
    assert cfg.optimizer._target_ == "torch.optim.Adam"
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (1e-3, 5e-4)
    assert (cfg.flatness.m, cfg.flatness.bn_stats, cfg.flatness.bn_chunks) == (8, "both", "first")
    assert cfg.trainer.epochs == 180 and cfg.trainer.batch_size == 200  # the pair's non-optimiser keys still apply
    sgd = compose_cfg(["method=map", *pair])
    assert sgd.optimizer._target_ == "torch.optim.SGD" and sgd.optimizer.lr == 0.03
    assert sgd.flatness._target_ != "flatbnn.flatness.sam.SAM"
    # the command line still wins over the preset
    assert compose_cfg(["method=sam_adam", *pair, "optimizer.lr=3e-4"]).optimizer.lr == 3e-4


# ------------------------------------------------------------------------------------------ the rows
BSAM_ROWS = ["bsam_t1", "bsam_t2", "bsam_t3", "bsam_t4", "bsam_t5", "bsam_t6", "bsam_fig4"]


@pytest.mark.parametrize("name", BSAM_ROWS)
def test_every_bsam_row_has_smoke_and_cpu_scales_with_a_budget(name):
    row = load_row(name)
    assert row.scale("smoke") is not None
    cpu = row.scale("cpu")
    assert cpu is not None, f"{name}: cpu scale missing"
    assert "budget" in cpu and "2 CPU cores" in cpu["budget"], f"{name}: the cpu budget must be stated"
    if name != "bsam_t2":  # Table 2's cpu scale (ResNet-18 cells, ~10x slower) keeps 1 seed
        assert len(cpu.get("seeds", row.seeds)) == 3
    assert all(not c.blocked for c in row.cells_for("smoke")), f"{name}: a blocked smoke cell"


def test_bsam_t3_no_noise_cells_switch_the_noise_off_and_only_them():
    row = load_row("bsam_t3")
    for cell in row.cells_for("paper"):
        assert cell.blocked is None
        assert ("method.noise=false" in cell.overrides) == cell.id.endswith("bsam_no_noise")


def test_bsam_t4_is_an_eval_row_over_t1s_bsam_runs():
    from flatbnn.reproduce.launch import source_cell
    row = load_row("bsam_t4")
    assert row.kind == "eval" and row.eval_from["row"] == "bsam_t1"
    t1_cells = set(load_row("bsam_t1").cell_ids())
    samples = {}
    for cell in row.cells_for("paper"):
        assert source_cell(row, cell.id) in t1_cells and source_cell(row, cell.id).endswith("/bsam")
        (k,) = [o for o in cell.overrides if o.startswith("method.num_samples=")]
        samples[cell.id.split("/")[-1]] = int(k.split("=")[1])
    assert samples["mean"] == 0 and samples["mc32"] == 32 and len(set(samples.values())) == len(samples)


def test_bsam_t5_and_fig4_cells_set_their_axis_value():
    for cell in load_row("bsam_t5").cells_for("paper"):
        m = cell.id.split("/")[-1][1:]
        key = "method.m" if "/bsam/" in cell.id else "flatness.m"
        assert cell.overrides[-1] == f"{key}={m}" or f"{key}={m}" in cell.overrides
        assert [o for o in cell.overrides if o.startswith(key + "=")][-1] == f"{key}={m}"
    for cell in load_row("bsam_fig4").cells_for("paper"):
        rho = cell.id.split("/")[-1][3:]
        key = "method.rho" if "/bsam/" in cell.id else "flatness.rho"
        assert [o for o in cell.overrides if o.startswith(key + "=")][-1] == f"{key}={rho}"
