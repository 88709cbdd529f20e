"""End-to-end runs of the one entrypoint on the embedded digits set."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import REPO, compose_cfg, results, run_cfg, train_cli

DIGITS = ["dataset=digits", "model=mlp", "method=map"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # same thread count as train_cli: bitwise-comparable runs


def test_digits_map_sgd_reaches_90_percent(tmp_path):
    res = run_cfg(DIGITS + ["flatness=none", "optimizer=sgd", "trainer.epochs=15"], tmp_path)
    m = res["metrics"]
    assert m["accuracy"] >= 0.90, m
    # the results contract other issues rely on
    for k in ("accuracy", "nll", "ece", "brier", "auroc_misclassification"):
        assert isinstance(m[k], float)
    assert 0.0 <= m["accuracy"] <= 1.0 and 0.0 <= m["ece"] <= 1.0
    meta = res["meta"]
    for k in ("dataset", "model", "method", "flatness", "seed", "epochs", "budget", "hardware", "git",
              "wall_seconds"):
        assert k in meta, k
    assert meta["dataset"] == "digits" and meta["method"]["name"] == "map"
    assert meta["budget"]["epochs"] == 15 and meta["budget"]["train_size"] > 1000
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["metrics"]["accuracy"] == m["accuracy"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 15
    rec = json.loads(lines[-1])
    assert rec["epoch"] == 15 and "train/loss" in rec and "test/accuracy" in rec


def test_digits_sam_learns_and_records_rho(tmp_path):
    res = run_cfg(DIGITS + ["flatness=sam", "flatness.rho=0.05", "trainer.epochs=15"], tmp_path)
    assert res["metrics"]["accuracy"] >= 0.90
    assert res["meta"]["flatness"] == {"name": "sam", "rho": 0.05, "m": 1, "rho_schedule": "constant",
                                       "bn_stats": "first", "bn_chunks": "all", "sync_ascent": False,
                                       "effective_m": 1}


def test_same_seed_same_result_and_seed_changes_it(tmp_path):
    args = DIGITS + ["trainer.epochs=2", "trainer.eval_every=0"]
    a = run_cfg(args + ["seed=3"], tmp_path / "a")["metrics"]
    b = run_cfg(args + ["seed=3"], tmp_path / "b")["metrics"]
    c = run_cfg(args + ["seed=4"], tmp_path / "c")["metrics"]
    assert a["nll"] == b["nll"]
    assert a["nll"] != c["nll"]


def test_cli_writes_resolved_config_and_results(tmp_path):
    train_cli(DIGITS + ["flatness=sam", "trainer.epochs=1", "trainer.limit_train_batches=3"], tmp_path)
    assert (tmp_path / ".hydra" / "config.yaml").exists()
    assert results(tmp_path)["meta"]["budget"]["steps"] == 3
    assert (tmp_path / "checkpoints" / "last.pt").exists()
    assert (tmp_path / "reliability.png").stat().st_size > 1000


@pytest.mark.parametrize("args,needle", [
    (["flatness=samm"], "flatness=samm"),
    (["trainer.epochz=3"], "epochz"),
    (["dataset=cifar10", "dataset.root=/nonexistent/cifar"], "dataset.root"),
])
def test_bad_input_is_one_clear_line(tmp_path, args, needle):
    p = train_cli(DIGITS + args, tmp_path, check=False)
    assert p.returncode != 0
    err = p.stderr.strip()
    assert needle in err, err
    assert "Traceback" not in err, err


def test_corrupt_checkpoint_is_one_line_and_untouched(tmp_path):
    ckpt = tmp_path / "checkpoints" / "last.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"not a checkpoint")
    p = train_cli(DIGITS + ["trainer.epochs=1"], tmp_path, check=False)
    assert p.returncode == 2
    assert "unreadable" in p.stderr and "trainer.resume=false" in p.stderr and "Traceback" not in p.stderr
    assert ckpt.read_bytes() == b"not a checkpoint"


def test_diverged_run_stops_with_one_line(tmp_path):
    p = train_cli(DIGITS + ["optimizer.lr=1e30", "trainer.epochs=2"], tmp_path, check=False)
    assert p.returncode == 2
    assert "non-finite loss" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_killed_run_resumes_to_identical_result(tmp_path):
    """SIGKILL after a few epochs, rerun the same command in the same dir: same final metrics."""
    args = DIGITS + ["flatness=sam", "trainer.epochs=8", "trainer.batch_size=16"]
    ref = tmp_path / "ref"
    train_cli(args, ref)

    run = tmp_path / "killed"
    cmd = [sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run}", "trainer.progress=false"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert not (run / "results.json").exists(), "run finished before it could be killed; make it longer"
    train_cli(args, run)
    assert _same(results(run)["metrics"], results(ref)["metrics"])
    assert len(metrics.read_text().splitlines()) == 8


@pytest.mark.slow
def test_sigterm_checkpoints_mid_epoch_and_resumes_identically(tmp_path):
    args = DIGITS + ["flatness=sam", "trainer.epochs=4", "trainer.batch_size=4"]
    ref = tmp_path / "ref"
    train_cli(args, ref)
    run = tmp_path / "term"
    cmd = [sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run}", "trainer.progress=false"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "metrics.jsonl").exists():
        time.sleep(0.05)
    time.sleep(0.1)  # early in epoch 2 (of 4): the run cannot finish before the signal lands
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert state["epoch"] >= 1
    train_cli(args, run)
    assert _same(results(run)["metrics"], results(ref)["metrics"])


def _same(a: dict, b: dict) -> bool:
    skip = {"eval_seconds"}
    return all(a[k] == b[k] for k in a if k not in skip and not isinstance(a[k], dict))


def test_compose_reports_resolved_groups():
    cfg = compose_cfg(["flatness=sam", "flatness.rho=0.1"])
    assert cfg.flatness.rho == 0.1 and cfg.flatness._target_.endswith("SAM")


@pytest.mark.slow
def test_wandb_logger_works_offline(tmp_path):
    p = train_cli(DIGITS + ["logger=wandb", "trainer.epochs=2"], tmp_path, env={"WANDB_MODE": "offline"})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, p.stderr[-2000:]
    assert (tmp_path / "results.json").exists() and (tmp_path / "wandb_id.txt").exists()


@pytest.mark.slow
def test_multirun_sweep_and_aggregate(tmp_path):
    """--multirun over flatness x seed, then scripts/aggregate.py builds the table from results.json files."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "train.py"), "--multirun", *DIGITS, "flatness=none,sam", "seed=0,1",
           "trainer.epochs=2", "trainer.progress=false", f"hydra.sweep.dir={sweep}"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(list(sweep.rglob("results.json"))) == 4
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "aggregate.py"), str(sweep),
                          "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, check=True)
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["flatness"], r["seeds"]) for r in rows] == [("none", [0, 1]), ("sam(rho=0.05)", [0, 1])]
    per_run = [json.loads(f.read_text()) for f in sweep.rglob("results.json")]
    sam_acc = [r["metrics"]["accuracy"] for r in per_run if r["meta"]["flatness"]["name"] == "sam"]
    assert rows[1]["accuracy"][0] == pytest.approx(sum(sam_acc) / 2)
    assert "| digits | mlp | map | sam(rho=0.05) |" in out.stdout
