"""Posterior methods I through the one entrypoint (digits, CPU): metrics, composition, resume."""

import os
import subprocess
import sys
import time

import pytest

from helpers import REPO, results, run_cfg, train_cli

DIGITS = ["dataset=digits", "model=mlp", "trainer.eval_every=0"]


@pytest.mark.parametrize("method,extra,min_acc", [
    ("swa", ["method.swa_start=4"], 0.9),
    ("swag", ["method.swa_start=4", "method.num_samples=5"], 0.9),
    ("f_swag_diag", ["method.swa_start=4", "method.num_samples=5"], 0.9),
    ("sgld", ["optimizer.momentum=0", "method.burn_in=4"], 0.85),
    ("f_mc_dropout", ["model.dropout=0.2", "method.num_samples=5"], 0.9),
    ("deep_ens", ["method.num_members=2", "trainer.epochs=4"], 0.9),
])
def test_method_runs_end_to_end_and_reports_every_metric(method, extra, min_acc, tmp_path):
    res = run_cfg(DIGITS + [f"method={method}", "trainer.epochs=8"] + extra, tmp_path)
    m, meta = res["metrics"], res["meta"]
    assert m["accuracy"] >= min_acc, m
    for k in ("nll", "ece", "brier", "auroc_misclassification", "num_samples", "eval_seconds"):
        assert k in m
    if m["num_samples"] > 1:
        assert set(m["single_sample"]) >= {"accuracy", "nll", "ece"}
    if method.startswith("f_"):
        assert meta["flatness"]["name"] == "sam"
    if method == "swag":
        assert meta["method"]["n_collected"] == 4 and m["num_samples"] == 5
    if method == "sgld":
        assert meta["method"]["kept_samples"] == 4 and m["num_samples"] == 4
    if method == "deep_ens":
        assert meta["method"]["trained_members"] == 2 and meta["epochs"] == 8 and m["num_samples"] == 2


@pytest.mark.parametrize("flatness", ["sam", "fsam", "asam", "random"])
def test_swag_composes_with_any_flatness_variant(flatness, tmp_path):
    """method=swag flatness=fsam is a combination no paper ran; it must work like F-SWAG does."""
    res = run_cfg(DIGITS + ["method=swag", f"flatness={flatness}", "flatness.rho=0.1", "trainer.epochs=4",
                            "method.swa_start=2", "method.num_samples=3"], tmp_path)
    assert res["meta"]["flatness"]["name"] == flatness and res["meta"]["flatness"]["rho"] == 0.1
    assert res["meta"]["method"]["name"] == "swag" and res["meta"]["method"]["n_collected"] == 2
    assert res["metrics"]["num_samples"] == 3 and res["metrics"]["accuracy"] >= 0.85, res["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize("method,extra", [
    ("f_swag", ["method.swa_start=2", "method.num_samples=3"]),
    ("sgld", ["optimizer.momentum=0", "method.burn_in=2"]),
    ("deep_ens", ["method.num_members=2", "trainer.epochs=3"]),
    # variational methods: mu, rho, momenta, noise generator; HWA's averages, deviations and restarts
    ("f_sgvb_lrt", ["method.num_samples=3"]),
    ("hwa", ["method.covariance=lowrank", "method.num_samples=3"]),
    ("vsam", ["method.num_samples=3"]),
    ("mfvi", ["method.num_samples=3"]),
    # IVON's mean, momentum, Hessian estimate and device step count; its noise from the run's generator, under SAM
    ("ivon", ["flatness=sam", "method.mc_samples=2", "method.num_samples=3"]),
])
def test_killed_posterior_run_resumes_to_identical_result(method, extra, tmp_path):
    """Collected moments / kept samples / finished members / variational state live in the checkpoint.

    metrics.jsonl gets one line an epoch: the kill after 4 lines lands in epoch 5 of 6, mid-training (with 4 epochs
    it landed in the final evaluation, or after the run had finished)."""
    args = DIGITS + [f"method={method}", "trainer.epochs=6", "trainer.batch_size=16"] + extra
    train_cli(args, tmp_path / "ref")
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run}",
                             "trainer.progress=false"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        f = run / "metrics.jsonl"
        if f.exists() and len(f.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert not (run / "results.json").exists()
    train_cli(args, run)
    a, b = results(run)["metrics"], results(tmp_path / "ref")["metrics"]
    for k in ("accuracy", "nll", "ece", "brier"):
        assert a[k] == b[k], k


@pytest.mark.slow
def test_separately_trained_members_combine_into_an_ensemble(tmp_path):
    """The cluster path: members as separate runs, combined afterwards by scripts/ensemble.py."""
    for seed in (0, 1):
        train_cli(DIGITS + ["method=map", "trainer.epochs=3", f"seed={seed}"], tmp_path / f"m{seed}")
    subprocess.run([sys.executable, str(REPO / "scripts" / "ensemble.py"), str(tmp_path / "m0"), str(tmp_path / "m1"),
                    "--out", str(tmp_path / "ens"), "--device", "cpu"], check=True, capture_output=True, cwd=REPO)
    ens = results(tmp_path / "ens")
    members = [results(tmp_path / f"m{s}")["metrics"] for s in (0, 1)]
    assert ens["metrics"]["num_samples"] == 2 and ens["meta"]["member_seeds"] == [0, 1]
    assert ens["metrics"]["single_sample"]["nll"] == pytest.approx(sum(m["nll"] for m in members) / 2, rel=1e-5)
    assert ens["metrics"]["nll"] <= ens["metrics"]["single_sample"]["nll"]
