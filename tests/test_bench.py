"""scripts/benchmark.py: the smoke run's machine-readable result, and the reference loops it times
beside our engine compute what ours computes (so the side-by-side compares the same step)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys

import pytest
import torch
from torch import nn

from flatbnn.bench.reference import ReferenceBSAM, ReferenceSAM, ReferenceSWAG, reference_sam_step
from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import ASAM, SAM, NoFlatness
from flatbnn.methods import MAP, SWAG, RunContext
from flatbnn.methods.bsam import BSAM
from helpers import REPO

CPU = torch.device("cpu")


def _benchmark():
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------- the JSON
def _check_schema(res: dict, path) -> None:
    assert res["schema"] == "flatbnn-benchmark/1"
    for key in ("label", "date", "device", "torch", "python", "git", "hardware", "settings", "rows", "ratios"):
        assert key in res, key
    assert res["device"]["type"] == "cpu" and res["torch"] == torch.__version__
    assert set(res["git"]) >= {"commit", "dirty"} and res["git"]["commit"]
    s = res["settings"]
    assert (s["model"], s["batch_size"], s["steps"], s["precision"], s["smoke"]) == ("mlp", 16, 2, "fp32", True)
    for name, row in res["rows"].items():
        ms = row["step_ms"]
        assert len(ms) == s["repeats"] and all(t > 0 for t in ms), name
        assert row["step_ms_median"] == statistics.median(ms)
        assert row["step_ms_min"] <= row["step_ms_median"] <= row["step_ms_max"]
        if row["kind"] in ("step", "predict"):  # predict: images through the K-sample predictive
            assert row["images_per_s"] == pytest.approx(s["batch_size"] / row["step_ms_median"] * 1e3, rel=1e-12)
    # the Markdown table beside it names every row and ratio
    md = path.with_suffix(".md").read_text()
    assert all(f"| {name} |" in md for name in res["rows"]) and all(name in md for name in res["ratios"])


def _check_ratios(res: dict, expected: set[str]) -> None:
    assert set(res["ratios"]) == expected
    for name, r in res["ratios"].items():  # a ratio is the ratio of the two REPORTED median step times
        num, den = res["rows"][r["numerator"]], res["rows"][r["denominator"]]
        assert r["value"] == pytest.approx(num["step_ms_median"] / den["step_ms_median"], rel=1e-12), name
        assert r["meets_target"] == (r["value"] <= r["target"])


def test_smoke_run_writes_the_result_and_its_ratios(tmp_path):
    bench = _benchmark()
    out = tmp_path / "bench" / "cpu.json"
    res = bench.main(["--smoke", "--configs", "map+none,map+sam,map+fsam,map+asam,swag+none", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))  # what was returned is what was written
    _check_schema(res, out)
    _check_ratios(res, {"SAM/SGD", "FSAM/SAM", "ASAM/SAM", "SWAG/SGD", "predictive chunk4/chunk1"})
    assert res["rows"]["swag+none"]["collect_ms"] > 0  # no timing inequality: the CI machine is shared


@pytest.mark.slow
def test_smoke_reference_run_has_every_side_by_side_ratio(tmp_path):
    bench = _benchmark()
    out = tmp_path / "ref.json"
    res = bench.main(["--smoke", "--reference", "--json", str(out)])
    _check_schema(res, out)
    _check_ratios(res, {n for n, *_ in bench.RATIOS} | {n for n, *_ in bench.REFERENCE_RATIOS}
                  | {"predictive chunk4/chunk1"})
    assert {"ref:sam", "ref:asam", "ref:swag", "ref:bsam", "collect:swag", "sample:swag"} <= set(res["rows"])


def test_default_output_name_is_device_and_date(tmp_path):
    bench = _benchmark()
    res = bench.main(["--smoke", "--configs", "map+none", "--repeats", "1", "--out", str(tmp_path)])
    assert [p.name for p in sorted(tmp_path.iterdir())] == [f"cpu-{res['date'][:10]}-smoke.json",
                                                              f"cpu-{res['date'][:10]}-smoke.md"]


def test_bad_pair_raises_bad_input_before_timing(tmp_path):
    bench = _benchmark()
    with pytest.raises(bench.BadInput, match="unknown pair map\\+nope"):
        bench.main(["--smoke", "--configs", "map+none,map+nope", "--out", str(tmp_path)])
    with pytest.raises(bench.BadInput, match="--model 'nope'"):
        bench.main(["--model", "nope", "--configs", "map+none", "--out", str(tmp_path)])
    with pytest.raises(bench.BadInput, match="--steps must be >= 1"):
        bench.main(["--steps", "0", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_bad_pair_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--smoke", "--configs", "map+nope",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "unknown pair map+nope" in p.stderr
    assert not list(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------------------------------------- reference == ours
def _net(seed: int = 0, bn: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4) if bn else nn.Identity(), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5))


def _ours(module, method, optimizer_factory=None, n_train=1000):
    ctx = RunContext(model=module, module=module, device=CPU, n_train=n_train, steps_per_epoch=3, epochs=1,
                     optimizer_factory=optimizer_factory or (lambda p: torch.optim.SGD(
                         p, lr=0.1, momentum=0.9, weight_decay=5e-4)),
                     scheduler_factory=None, generator=torch.Generator().manual_seed(3))
    method.setup(ctx)
    return ctx


def _data(n=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.parametrize("adaptive", [False, True])
def test_reference_sam_loop_and_our_sam_give_the_same_weights_after_3_steps(adaptive):
    """davda54/sam's step (first_step / second_step around SGD) vs our MAP x SAM; adaptive: its
    T = |w| on every tensor = our ASAM with eta = 0 and only_weights = false."""
    x, y = _data()
    ours = _net()
    method = MAP()
    ctx = _ours(ours, method)
    flat = ASAM(rho=0.5, eta=0.0, only_weights=False) if adaptive else SAM(rho=0.05)
    flat.setup(ctx, method)
    bp = Backprop(ours, CPU)
    ref = _net()
    opt = ReferenceSAM(ref.parameters(), torch.optim.SGD, rho=0.5 if adaptive else 0.05, adaptive=adaptive,
                       lr=0.1, momentum=0.9, weight_decay=5e-4)
    ours.train(), ref.train()
    for _ in range(3):
        loss_ours = method.train_step((x, y), flat, bp)["loss"]
        loss_ref = reference_sam_step(ref, opt, x, y)
        torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-6, atol=0)
    start = _net()
    for a, b, w0 in zip(ours.parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, w0)  # they did move
    # BatchNorm running statistics: first pass only on both sides
    bn_ours, bn_ref = ours[1], ref[1]
    torch.testing.assert_close(bn_ours.running_mean, bn_ref.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bn_ours.running_var, bn_ref.running_var, rtol=1e-6, atol=1e-7)


def test_reference_swag_collection_and_sample_equal_ours():
    module = _net()
    swag = SWAG(mode="swag", max_rank=5)
    _ours(module, swag)
    ref = ReferenceSWAG(module.parameters(), max_num_models=5)
    g = torch.Generator().manual_seed(2)

    def move():
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    for _ in range(5):  # buffer exactly full: same column order on both sides
        move()
        swag.collect()
        ref.collect_model()
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    torch.testing.assert_close(swag.mean, flat(ref.mean), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(swag.sq_mean, flat(ref.sq_mean), rtol=1e-6, atol=1e-7)
    s_ours = swag.sample_vector(torch.Generator().manual_seed(9))
    s_ref = ref.sample(0.5, True, torch.Generator().manual_seed(9))
    torch.testing.assert_close(s_ours, s_ref, rtol=1e-5, atol=1e-6)
    for _ in range(3):  # past max_rank: the oldest deviations are dropped on both sides
        move()
        swag.collect()
        ref.collect_model()
    torch.testing.assert_close(swag.deviations, torch.cat(ref.cov_mat_sqrt, dim=1), rtol=1e-5, atol=1e-6)


def test_reference_bsam_loop_equals_our_bsam_after_3_steps():
    """The official update (bayesian-sam's optimiser, flatbnn/bench/reference.py) written per tensor, with the same
    noise draws, vs BSAM."""
    x, y = _data()
    ours = _net()
    method = BSAM(m=4)
    _ours(ours, method)
    bp = Backprop(ours, CPU)
    ref = _net()
    rb = ReferenceBSAM(ref, m=4, n_data=1000, generator=torch.Generator().manual_seed(3))
    ours.train(), ref.train()
    for _ in range(3):
        lo = method.train_step((x, y), NoFlatness(), bp)["loss"]
        lr = rb.step(x, y)
        torch.testing.assert_close(lo, lr, rtol=1e-5, atol=1e-6)
    moved = 0.0
    for a, b, w0 in zip(ours.parameters(), ref.parameters(), _net().parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        moved = max(moved, float((a - w0).detach().abs().max()))
    assert moved > 1e-3
    for a, b in zip(method.optimizer.precisions(), rb.precision):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1].running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6)


def test_graphed_rows_come_with_their_ratio_and_fallback_reasons(tmp_path):
    """make bench --graphed: each pair also through trainer.cuda_graph's GraphedStep (on the CPU via EagerReplay:
    the pipeline, not a speed number); a pair that cannot be graphed is skipped with its one-line reason (none here)."""
    bench = _benchmark()
    out = tmp_path / "g.json"
    res = bench.main(["--smoke", "--graphed", "--configs", "map+sam,bsam+none", "--repeats", "1", "--json", str(out)])
    assert "map+sam:graphed" in res["rows"] and res["rows"]["map+sam:graphed"]["images_per_s"] > 0
    assert "map+sam graphed/eager" in res["ratios"]
    assert res["skipped"] == {}  # bSAM takes a device lr since issue 41
    assert "bsam+none:graphed" in res["rows"] and res["rows"]["bsam+none:graphed"]["images_per_s"] > 0


def test_the_m8_loop_floor_is_16_small_passes_with_two_sgd_steps_of_arithmetic(tmp_path):
    """``floor:passes_m8`` is what an m = 8 loop must compute and nothing more: 2 x 8 forward + backward passes of batch
    / 8, i.e. exactly the FLOPs of two SGD steps (the MLP's GEMMs scale with the batch) -- so where it costs more than
    2 SGD steps, that is the small GEMMs' efficiency, not extra work. And a smoke run with --floors reports it."""
    import argparse

    from torch.utils.flop_counter import FlopCounterMode

    bench = _benchmark()
    args = argparse.Namespace(model="mlp", batch_size=16, steps=1, warmup=0, repeats=1, device="cpu", precision="fp32",
                              channels_last=False, compile=False, model_overrides={"hidden": [12, 7]}, smoke=False)
    flops = {}
    for name in ("floor:sgd", "floor:passes_m8", "floor:parts_bsam_m8"):
        step = bench.build_floor(name, args, torch.device("cpu"))
        with FlopCounterMode(display=False) as counter:
            step()
        flops[name] = counter.get_total_flops()
    assert flops["floor:sgd"] > 0 and flops["floor:passes_m8"] == 2 * flops["floor:sgd"], flops
    # bSAM's per-part arithmetic is the same products: 2 forwards, 2 backwards (per-part or summed weight gradients)
    assert flops["floor:parts_bsam_m8"] == 2 * flops["floor:sgd"], flops
    out = tmp_path / "floors.json"
    res = bench.main(["--smoke", "--floors", "--configs", "map+none,map+sam_m8", "--json", str(out)])
    t = res["cpu_targets"]
    assert t["SAM m=8 / 16 passes"]["target"] is None and t["SAM m=8 / 16 passes"]["floor_ms"] == \
        res["rows"]["floor:passes_m8"]["step_ms_median"]
    assert "| 16 passes of batch / 8 / SGD floor |" in out.with_suffix(".md").read_text()
