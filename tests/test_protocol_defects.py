"""Issue 32, "defects that would change a paper-scale number": each fixed protocol fact, checked on the composed
paper-scale config or against a closed form written here (not the code under test)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.methods import RunContext
from flatbnn.methods.param_vector import unflatten
from flatbnn.reproduce.launch import compose_cell
from flatbnn.reproduce.spec import load_row

CPU = torch.device("cpu")


def _paper_cells(row: str):
    return [c for c in load_row(row).cells_for("paper") if not c.blocked]


# ------------------------------------------------------------------------------------------ 1. VSAM prior
def test_vsam_config_penalty_and_m_gradient_match_the_official_closed_form():
    """meanfieldsam.VSAM (zsiga007/Rethinking-SAM): mloss + mpenalty = rho sqrt(sum g^2/M^2)
    + (1/2N)(sum M^-2 / sigma_0 + sum log M^2), sigma_0 = sqrt(2)/5, no epsilon under the root. Checked at the
    SAM-sized init regime (M ~ 2e4, sum g^2/M^2 ~ 1e-9), where a 1e-12 under the root moved dL/dM by 0.3%."""
    from hydra.utils import instantiate

    method = instantiate(compose_cell(["method=vsam"]).method)
    assert method.prior_std == pytest.approx(math.sqrt(2) / 5, rel=1e-15)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    n = 50_000
    method.setup(RunContext(model=net, module=net, device=CPU, n_train=n, steps_per_epoch=1, epochs=1,
                            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1), scheduler_factory=None,
                            generator=torch.Generator().manual_seed(0)))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in method.M:
            m.copy_(torch.rand(m.shape, generator=gen, dtype=torch.float64) * 1e4 + 1e4)
    x, y = torch.randn(32, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (32,), generator=gen)
    g = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    rho, s0 = 1000.0, math.sqrt(2) / 5
    M = [m.detach() for m in method.M]
    quad = sum((gi ** 2 / mi ** 2).sum() for gi, mi in zip(g, M))
    want = rho * torch.sqrt(quad) + (sum((mi ** -2).sum() for mi in M) / s0
                                     + sum(torch.log(mi ** 2).sum() for mi in M)) / (2 * n)
    assert float(method.m_loss(g).detach()) == pytest.approx(float(want), rel=1e-12)
    want_grad = [-rho * gi ** 2 / (mi ** 3 * torch.sqrt(quad)) + (-2 / (s0 * mi ** 3) + 2 / mi) / (2 * n)
                 for gi, mi in zip(g, M)]
    got = unflatten(method.m_grad(*method._ellipsoid(g)), method.M)
    for a, b in zip(got, want_grad):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-24)


# ------------------------------------------------------------------------------------------ 2. files in preflight
def test_flatbnn_t4_refuses_to_start_without_each_networks_pretrained_weights(tmp_path, monkeypatch):
    from flatbnn.reproduce.preflight import check_files

    monkeypatch.delenv("FLATBNN_DENSENET161_WEIGHTS", raising=False)
    monkeypatch.delenv("FLATBNN_RESNET152_WEIGHTS", raising=False)
    row = load_row("flatbnn_t4")
    with pytest.raises(FileNotFoundError) as e:
        check_files(row, "paper", [])
    msg = str(e.value)
    assert "\n" not in msg and "model.pretrained_path" in msg and "densenet161-8d451a50.pth" in msg and "not set" in msg
    (tmp_path / "d.pth").write_bytes(b"x")
    monkeypatch.setenv("FLATBNN_DENSENET161_WEIGHTS", str(tmp_path / "d.pth"))
    with pytest.raises(FileNotFoundError, match=r"resnet152-394f9c45\.pth.*not set|not set.*resnet152-394f9c45"):
        check_files(row, "paper", [])  # one network's weights do not stand in for the other's
    monkeypatch.setenv("FLATBNN_RESNET152_WEIGHTS", str(tmp_path / "missing.pth"))
    with pytest.raises(FileNotFoundError, match="missing.pth does not exist"):
        check_files(row, "paper", [])
    (tmp_path / "missing.pth").write_bytes(b"x")
    check_files(row, "paper", [])


def test_flatbnn_t5_refuses_to_start_without_a_cifar10_c_folder(tmp_path, monkeypatch):
    from flatbnn.reproduce.preflight import check_data

    monkeypatch.delenv("FLATBNN_CIFAR10_C", raising=False)
    row = load_row("flatbnn_t5")
    for scale in ("paper", "cpu"):
        with pytest.raises(FileNotFoundError) as e:
            check_data(row, scale, [])
        assert "\n" not in str(e.value) and "dataset.shift_root" in str(e.value) and "not set" in str(e.value)
    monkeypatch.setenv("FLATBNN_CIFAR10_C", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        check_data(row, "paper", [])
    check_data(row, "paper", [f"dataset.shift_root={tmp_path}"])  # a folder: accepted (its files: the loader's)


def test_reproduce_run_preflights_an_eval_row_in_one_line(tmp_path, monkeypatch, capsys):
    """`scripts/reproduce.py run flatbnn_t5 --scale paper` without CIFAR-10-C: exit 2 and one line before any job
    (it used to start every evaluation job, each failing on an unresolved ${oc.env:FLATBNN_CIFAR10_C})."""
    from flatbnn.reproduce import cli
    monkeypatch.delenv("FLATBNN_CIFAR10_C", raising=False)
    assert cli.main(["run", "flatbnn_t5", "--scale", "paper", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dataset.shift_root" in err and "not set" in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ 3. T5 "Average"
def test_flatbnn_t5_average_is_the_unweighted_mean_of_the_four_groups_as_printed():
    """The paper's SWAG-Diag accuracy groups 74.26 / 91.13 / 89.47 / 87.03 print Average 85.47 = their plain mean;
    the mean over the 15 corruptions (groups 3:4:4:4) is 86.22. The comparison reads the former."""
    from flatbnn.data.cifar10_c import GROUPS
    from flatbnn.metrics.evaluate import shift_summary
    from flatbnn.reproduce.compare import _paper_to_ours

    printed = {"noise": 74.26, "blur": 91.13, "weather": 89.47, "digital": 87.03}
    per_set = {f"{c}/{s}": {"accuracy": printed[g], "nll": 0.0, "ece": 0.0, "brier": 0.0}
               for g, cs in GROUPS.items() for c in cs for s in (1, 2, 3, 4, 5)}
    assert len(per_set) == 75
    summary = shift_summary(per_set)
    assert summary["group_mean"]["accuracy"] == pytest.approx(85.4725, abs=1e-12)  # printed: 85.47
    assert summary["mean"]["accuracy"] == pytest.approx((3 * 74.26 + 4 * (91.13 + 89.47 + 87.03)) / 15, abs=1e-12)
    assert round(summary["mean"]["accuracy"], 2) == 86.22
    row = load_row("flatbnn_t5")
    assert _paper_to_ours(row, "average/swag_diag", "accuracy", "paper") == ("preresnet164/swag_diag",
                                                                             "shift.group_mean.accuracy")
    assert _paper_to_ours(row, "noise/swag", "ece", "paper") == ("preresnet164/swag", "shift.per_group.noise.ece")
    assert "frost in the official release" not in row.choices["groups"] and "snow/frost/fog" in row.choices["groups"]


# ------------------------------------------------------------------------------------------ 4. bSAM AUROC
@pytest.mark.parametrize("row", ["bsam_t1", "bsam_t2", "bsam_t3", "bsam_t4", "bsam_t5", "bsam_t6", "bsam_fig4"])
def test_every_bsam_paper_cell_integrates_the_auroc_over_2500_thresholds(row):
    """The official bSAM code's AUROC: a trapezoid over 2,500 thresholds. bsam_t4 (an eval row) re-evaluates
    bsam_t1's runs: composed on their cells, it inherits the convention."""
    from flatbnn.reproduce.preflight import _eval_base

    r = load_row(row)
    cells = _paper_cells(row)
    assert cells
    for cell in {c.id: c for c in (cells[0], cells[-1])}.values():  # the override is the scale's: two cells suffice
        cfg = compose_cell(_eval_base(r, "paper", cell.id) + cell.overrides)
        assert (cfg.metrics.auroc, cfg.metrics.auroc_thresholds, cfg.metrics.misclass_score) == \
            ("thresholds", 2500, "max_prob"), cell.id


# ------------------------------------------------------------------------------------------ 9. loader workers
@pytest.mark.parametrize("row, cell, workers", [
    ("flatbnn_t4", "resnet152/swag", 8),              # ImageNet JPEGs decoded per item
    ("fsam_t1", "cifar10/resnet20/sgd", 8),           # tensor CIFAR, AutoAugment + Cutout per item
    ("flatbnn_t2", "preresnet164/swag", 4),           # tensor CIFAR, crop + flip
    ("bsam_t1", "cifar10/resnet20_frn/sgd", 0)])      # tensor CIFAR, no augmentation: nothing to overlap
def test_paper_scale_cells_get_loader_workers_by_their_data(row, cell, workers, tmp_path):
    import yaml

    from flatbnn.reproduce.launch import write_cells

    r = load_row(row)
    cells = [c for c in r.cells_for("paper") if c.id == cell]
    search, _ = write_cells(r, cells, "paper", tmp_path, [])
    cfg = yaml.safe_load(next((search / "cell").glob("*.yaml")).read_text())
    assert cfg.get("trainer", {}).get("num_workers", 0) == workers
    # the command line (and a cell's own value) wins over the default
    search, _ = write_cells(r, cells, "paper", tmp_path / "cli", ["trainer.num_workers=2"])
    assert "num_workers" not in (yaml.safe_load(next((search / "cell").glob("*.yaml")).read_text()).get("trainer") or {})
    if row == "flatbnn_t4":  # ImageNet has no device loader
        return
    search, _ = write_cells(r, cells, "paper", tmp_path / "dev", ["dataset.loader=device"])  # GPU-resident: none
    assert "num_workers" not in (yaml.safe_load(next((search / "cell").glob("*.yaml")).read_text()).get("trainer") or {})


# ------------------------------------------------------------------------------------------ 6. the SWAG-code WRN
def test_swag_code_wrn_options_init_and_final_bn_momentum():
    """The SWAG code's WideResNet28x10: PyTorch's default layer init (kaiming_uniform(a=sqrt 5): |w| <= 1/sqrt(fan_in),
    biases drawn, not zero) and its final BN's momentum=0.9. He-normal (std sqrt(2/fan_out)) exceeds that bound."""
    from flatbnn.models.wrn import WideResNet

    kw = {"num_classes": 10, "depth": 10, "widen_factor": 1, "conv_bias": True, "stride_on": "second",
          "shortcut_input": "raw"}
    official = WideResNet(**kw, init="torch_default", final_bn_momentum=0.9)
    ours = WideResNet(**kw)
    assert official.bn.momentum == 0.9 and ours.bn.momentum == 0.1
    assert all(m.momentum == 0.1 for m in official.modules() if isinstance(m, nn.BatchNorm2d) and m is not official.bn)

    def within_default_bound(net):
        convs = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        return all(float(m.weight.abs().max()) <= 1 / math.sqrt(m.weight[0].numel()) + 1e-7 for m in convs), \
            all(float(m.bias.abs().max()) > 0 for m in convs)

    assert within_default_bound(official) == (True, True)
    assert within_default_bound(ours) == (False, False)  # He-normal weights, zero biases


def test_flatbnn_wrn_paper_cells_use_the_swag_code_details():
    for row in ("flatbnn_t2", "flatbnn_t1"):
        for cell in ("wrn28x10/mc_dropout", "wrn28x10/sgld", "wrn28x10/f_swag"):
            c = next(c for c in _paper_cells(row) if c.id == cell)
            m = compose_cell(c.overrides).model
            assert (m.init, m.final_bn_momentum, m.stride_on, m.shortcut_input) == \
                ("torch_default", 0.9, "second", "raw"), (row, cell)


# ------------------------------------------------------------------------------------------ 5. FlatBNN SGLD
@pytest.mark.parametrize("row", ["flatbnn_t2", "flatbnn_t1"])
def test_flatbnn_paper_sgld_cells_fine_tune_the_rows_own_runs_with_the_official_recipe(row):
    r = load_row(row)
    for scale in ("paper", "smoke"):  # the smoke scale runs the paper scale's chain (one step each)
        cells = {c.id: c for c in r.cells_for(scale)}
        assert {k: c.init_from for k, c in cells.items() if c.init_from} == {
            "preresnet164/sgld": "preresnet164/swag", "preresnet164/f_sgld": "preresnet164/f_swag",
            "wrn28x10/sgld": "wrn28x10/swag", "wrn28x10/f_sgld": "wrn28x10/f_swag"}
    cells = {c.id: c for c in r.cells_for("paper")}
    sgld = compose_cell(cells["wrn28x10/sgld"].overrides)
    assert (sgld.method.noise_mode, sgld.method.noise_factor, sgld.method.lr_schedule.a, sgld.method.lr_schedule.unit,
            sgld.method.burn_in, sgld.trainer.epochs, sgld.flatness._target_) == \
        ("linear", 0.1, 10.0, "step", 160, 199, "flatbnn.flatness.none.NoFlatness")
    f_sgld = compose_cell(cells["preresnet164/f_sgld"].overrides)
    assert (f_sgld.method.noise_mode, f_sgld.method.noise_a, f_sgld.method.noise_b, f_sgld.method.lr_schedule.a,
            f_sgld.flatness._target_, f_sgld.trainer.epochs) == \
        ("schedule", 40.304, 15476.4, 0.2, "flatbnn.flatness.sam.SAM", 199)
    assert not any(c.init_from for c in r.cells_for("cpu"))  # textbook SGLD from scratch (its committed runs)


@pytest.mark.slow  # two multirun subprocesses
def test_a_cell_declared_to_fine_tune_another_runs_after_it_from_its_run(tmp_path, monkeypatch):
    """scales.<scale>.init_from: the launcher runs the source cells first, then the dependents with
    trainer.init_from = the source's run dir of the same seed; without a finished source, one failed.txt line."""
    import json

    import yaml

    from flatbnn.reproduce import launch, spec

    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    base = ["dataset=digits", "model=mlp", "dataset.train_subset=64", "trainer.epochs=1", "trainer.progress=false",
            "trainer.eval_every=0", "trainer.reliability_diagram=false", "trainer.batch_size=32"]
    (rows_dir / "ft.yaml").write_text(yaml.safe_dump(
        {"row": "ft", "paper": "none", "title": "ft", "axes": ["method"], "base": base, "seeds": [0],
         "values": {"method": {"scratch": ["flatness=none"], "tune": ["flatness=none"]}},
         "scales": {"cpu": {"overrides": [], "init_from": {"tune": "scratch"}}, "smoke": {"overrides": []}}}))
    (rows_dir / "bad.yaml").write_text((rows_dir / "ft.yaml").read_text().replace("row: ft", "row: bad")
                                       .replace("tune: scratch", "tune: nowhere"))
    with pytest.raises(spec.SpecError, match="not a from-scratch cell"):
        spec.load_row("bad")
    (rows_dir / "bad.yaml").unlink()  # the launcher reads every row (who reads this one's runs)
    row = spec.load_row("ft")
    out = tmp_path / "out"
    alone = launch.launch(row, "cpu", out=tmp_path / "alone", cells_glob="tune")  # its source never ran
    assert alone["jobs"]["tune/seed0"]["state"] == "failed" and alone["returncode"] == 1
    assert "scratch" in alone["jobs"]["tune/seed0"]["detail"] and "not finished" in alone["jobs"]["tune/seed0"]["detail"]
    summary = launch.launch(row, "cpu", out=out)
    assert summary["returncode"] == 0 and {j["state"] for j in summary["jobs"].values()} == {"done"}
    ran = yaml.safe_load((out / "tune" / "seed0" / "config_resolved.yaml").read_text())
    assert ran["trainer"]["init_from"] == str((out / "scratch" / "seed0").resolve())
    meta = json.loads((out / "tune" / "seed0" / "results.json").read_text())["meta"]
    assert meta["init_from"]["path"].startswith(str((out / "scratch" / "seed0").resolve()))
    assert json.loads((out / "scratch" / "seed0" / "results.json").read_text())["meta"]["init_from"] is None
    tune = next(c for c in row.cells_for("cpu") if c.id == "tune")
    assert launch.stale_run(tune, 0, out / "tune" / "seed0") is None  # the source's path is not a config change


# ------------------------------------------------------------------------------------------ 8. m under DDP
def test_paper_scale_sam_cells_all_reduce_their_ascent(tmp_path):
    """A job on k processes would otherwise be m-sharpness with m = k (per-process ascent under no_sync)."""
    import yaml

    from flatbnn.reproduce.launch import run_overrides, write_cells

    row = load_row("fsam_t1")
    cells = [c for c in row.cells_for("paper") if c.id in ("cifar10/resnet20/asam", "cifar10/resnet20/sgd")]
    search, _ = write_cells(row, cells, "paper", tmp_path, [])
    written = {p.name: yaml.safe_load(p.read_text()) for p in (search / "cell").glob("*.yaml")}
    assert written["cifar10__resnet20__asam__s0.yaml"]["flatness"]["sync_ascent"] is True
    assert written["cifar10__resnet20__asam__s0.yaml"]["flatness"]["m"] == 1
    assert "sync_ascent" not in (written["cifar10__resnet20__sgd__s0.yaml"].get("flatness") or {})  # no ascent
    asam = cells[[c.id for c in cells].index("cifar10/resnet20/asam")]
    assert "flatness.sync_ascent=true" not in run_overrides(asam, "cpu")  # cpu scale: its committed runs' config
    assert "flatness.sync_ascent=true" not in run_overrides(asam, "paper", ["flatness.sync_ascent=false"])  # cli wins


def test_sam_effective_m_is_m_times_the_processes_unless_the_ascent_is_synced():
    from types import SimpleNamespace

    from flatbnn.flatness import SAM

    for sync, m, want in ((False, 1, 2), (True, 1, 1), (False, 4, 8), (True, 4, 4)):
        f = SAM(rho=0.05, m=m, sync_ascent=sync)
        f.setup(SimpleNamespace(generator=None, world_size=2), None)
        assert (f.effective_m, f.describe()["effective_m"]) == (want, want), (sync, m)


@pytest.mark.slow  # a torchrun job of 2 gloo processes
def test_two_processes_with_the_paper_scales_synced_ascent_keep_m_1(tmp_path):
    from helpers import results, train_cli

    args = ["dataset=digits", "model=mlp", "method=map", "flatness=sam", "flatness.rho=0.05",
            "dataset.train_subset=112", "trainer.batch_size=56", "trainer.epochs=1", "trainer.device=cpu",
            "trainer.eval_every=0", "trainer.reliability_diagram=false"]
    train_cli(args + ["flatness.sync_ascent=true"], tmp_path / "synced", torchrun=2)
    synced = results(tmp_path / "synced")
    assert synced["meta"]["budget"]["world_size"] == 2
    assert (synced["meta"]["flatness"]["m"], synced["meta"]["flatness"]["effective_m"]) == (1, 1)  # the row's m


# ------------------------------------------------------------------------------------------ 7. ASAM BatchNorm
@pytest.mark.parametrize("row, cell", [("fsam_t1", "cifar100/wrn28x10/asam"), ("fsam_t4", "n40/asam")])
def test_asam_paper_cells_update_batchnorm_on_both_passes_as_the_official_code(row, cell):
    c = next(c for c in _paper_cells(row) if c.id == cell)
    assert compose_cell(c.overrides).flatness.bn_stats == "both"


def test_methods_with_their_own_ascent_keep_their_m_on_any_number_of_processes():
    """Never a silent m-sharpness (issue 42): bSAM's m is the split of the global batch (m / k parts per process,
    refused when k does not divide m) and VSAM's ascent uses the all-reduced gradient; results.json says so.
    (tests/test_bsam.py / test_vsam.py: 2 torchrun processes train as 1.)"""
    from types import SimpleNamespace

    from flatbnn.methods.bsam import BSAM
    from flatbnn.methods.vsam import VariationalSAM as VSAM

    for world in (1, 2, 4):
        b, v = BSAM(m=8), VSAM()
        b.ctx = v.ctx = SimpleNamespace(world_size=world)
        assert (b.describe()["effective_m"], v.describe()["effective_m"]) == (8, 1), world
    with pytest.raises(ValueError, match=r"method.m=8: .* 3 processes must share them equally"):
        BSAM(m=8).setup(SimpleNamespace(world_size=3))  # refused before anything is built
