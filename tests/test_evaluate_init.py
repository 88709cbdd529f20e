"""evaluate.py (re-evaluating a finished run from its checkpoint) and trainer.init_from (training from
another run's weights), on the embedded digits set."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import REPO, compose_cfg, results, run_cfg, train_cli

SMALL = ["dataset=digits", "model=mlp", "model.hidden=[32]", "trainer.reliability_diagram=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # as train_cli: bitwise-comparable to its runs


# evaluate.py at the root is a thin entry; the CLI's functions live in the package
from flatbnn import evaluate as cli  # noqa: E402


def eval_cli(args):
    return subprocess.run([sys.executable, str(REPO / "evaluate.py"), *args], capture_output=True, text=True,
                          timeout=600, env=ENV, cwd=REPO)


def metrics_of(res: dict) -> dict:
    return {k: v for k, v in res["metrics"].items() if k != "eval_seconds"}  # wall time, not a metric


def one_line(err: str) -> str:
    err = err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def swag_run(tmp_path_factory):
    """A finished 4-epoch SWAG run (4 predictive samples) written by train.py."""
    run = tmp_path_factory.mktemp("swag") / "run"
    train_cli(SMALL + ["method=swag", "method.num_samples=4", "trainer.epochs=4", "trainer.progress=false"], run)
    return run


# ---------------------------------------------------------------- evaluate.py
@pytest.mark.parametrize("kind", ["mlp", "batchnorm"])
def test_evaluate_reproduces_the_runs_own_metrics(kind, swag_run, tmp_path):
    if kind == "mlp":
        run = swag_run
    else:  # ResNet-20 has BatchNorm: every SWAG sample is followed by a BN refresh on the training data
        run = tmp_path / "bn"
        # model.min_input_size=null: ResNet-20 is meant for >= 16 px images; here the 8x8 digits keep the test small
        train_cli(["dataset=digits", "model=resnet20", "model.min_input_size=null", "method=swag",
                   "method.num_samples=2", "trainer.epochs=2", "trainer.limit_train_batches=4",
                   "trainer.reliability_diagram=false"], run)
    own = (run / "results.json").read_bytes()
    p = eval_cli([f"run={run}"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = results(run / "eval" / "default")
    assert metrics_of(out) == metrics_of(results(run))
    assert (run / "results.json").read_bytes() == own  # the run's own results are never touched
    orig, meta = results(run)["meta"], out["meta"]
    assert set(orig) <= set(meta)
    for k in ("dataset", "model", "method", "flatness", "seed", "epochs", "budget", "metric_conventions",
              "overrides", "init_from"):
        assert meta[k] == orig[k], k
    ev = meta["evaluated_from"]
    assert ev["run_dir"] == str(run) and ev["checkpoint"] == str(run / "checkpoints" / "last.pt")
    assert ev["overrides"] == [] and ev["epoch"] == orig["epochs"]


def test_evaluate_with_other_sample_count_and_bins(swag_run, capsys):
    base = results(swag_run)
    args = ["method.num_samples=2", "metrics.ece_bins=20"]
    assert cli.main([f"run={swag_run}", *args]) == 0, capsys.readouterr().err
    out = results(swag_run / "eval" / cli.eval_name(args))
    assert out["meta"]["method"]["num_samples"] == 2 and out["metrics"]["num_samples"] == 2
    assert base["metrics"]["num_samples"] == 4
    assert out["meta"]["metric_conventions"]["ece_bins"] == 20
    assert out["meta"]["evaluated_from"]["overrides"] == args
    assert out["metrics"]["nll"] != base["metrics"]["nll"]
    assert out["metrics"]["single_sample"] != base["metrics"]["single_sample"]
    # eval.name names the directory; one sample = no single-sample summary
    assert cli.main([f"run={swag_run}", "eval.name=one", "method.num_samples=1"]) == 0
    one = results(swag_run / "eval" / "one")
    assert one["metrics"]["num_samples"] == 1 and "single_sample" not in one["metrics"]
    assert one["meta"]["evaluated_from"]["name"] == "one"


@pytest.mark.parametrize("override,needle", [
    ("optimizer.lr=0.3", "alter the trained weights"),
    ("model.hidden=[64]", "alter the trained weights"),
    ("seed=1", "alter the trained weights"),
    ("trainer.epochs=9", "alter the trained weights"),
    ("method.swa_start=0.25", "alter the trained weights"),
    ("flatness=sam", "alter the trained weights"),
    ("metrics.ece_binz=20", "unknown key"),
    ("method.num_samples=2,4", "one value per key"),
])
def test_evaluate_refuses_training_side_and_unknown_keys(override, needle, swag_run, capsys):
    assert cli.main([f"run={swag_run}", "eval.name=refused", override]) == 2
    err = one_line(capsys.readouterr().err)
    assert needle in err and override.split("=")[0] in err, err
    assert not (swag_run / "eval" / "refused").exists()


def test_evaluate_cli_exit_status_and_unchanged_keys(swag_run):
    p = eval_cli([f"run={swag_run}", "eval.name=refused", "optimizer.lr=0.3"])
    assert p.returncode == 2
    assert "optimizer.lr" in one_line(p.stderr)
    # the run's own values are no change: accepted (a pasted-back command line)
    assert cli.main([f"run={swag_run}", "eval.name=same", "seed=0", "trainer.epochs=4"]) == 0
    assert results(swag_run / "eval" / "same")["meta"]["evaluated_from"]["overrides"] == []


@pytest.mark.parametrize("epoch,step", [(3, 0), (3, 5)])
def test_evaluate_refuses_an_unfinished_checkpoint(epoch, step, swag_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(swag_run, run, ignore=shutil.ignore_patterns("eval"))
    ckpt = run / "checkpoints" / "last.pt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    state["epoch"], state["step_in_epoch"] = epoch, step  # as a run stopped there writes it
    torch.save(state, ckpt)
    assert cli.main([f"run={run}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "unfinished" in err and f"epoch {epoch}" in err and "of 4" in err, err
    assert not (run / "eval").exists()


# ---------------------------------------------------------------- trainer.init_from
def _build(overrides, run_dir):
    from flatbnn.engine.build import build
    return build(compose_cfg(overrides + ["trainer.progress=false"]), run_dir=run_dir)


def _weights(run):
    return torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["method"]["model"]


@pytest.mark.parametrize("method", ["map", "sgld", "sgvb"])
def test_init_from_loads_the_runs_weights_before_training(method, swag_run, tmp_path):
    src = _weights(swag_run)
    b = _build(SMALL + [f"method={method}", f"trainer.init_from={swag_run}"], tmp_path / "b")
    got = b.module.state_dict()
    for k, v in src.items():  # Bayesian layers (sgvb) take mu from the weights, sigma stays at its init
        mu = k if k in got else k.replace("weight", "weight_mu").replace("bias", "bias_mu")
        assert torch.equal(got[mu], v), k
    assert b.init_from["path"] == str(swag_run / "checkpoints" / "last.pt")
    assert b.init_from["key"] == "method.model"
    fresh = _build(SMALL + [f"method={method}"], tmp_path / "fresh")
    assert fresh.init_from is None
    assert not torch.equal(fresh.module.state_dict()[mu], src[k])


def test_init_from_continues_where_the_run_ended(swag_run, tmp_path):
    final_loss = json.loads((swag_run / "metrics.jsonl").read_text().splitlines()[-1])["train/loss"]
    res = run_cfg(SMALL + ["method=map", "trainer.epochs=1", "trainer.eval_every=0",
                           f"trainer.init_from={swag_run / 'checkpoints' / 'last.pt'}"], tmp_path)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]
    assert abs(first - final_loss) < 0.05, (first, final_loss)  # a fresh init starts near 1.9
    assert res["meta"]["init_from"]["path"] == str(swag_run / "checkpoints" / "last.pt")
    assert results(tmp_path)["meta"]["init_from"]["source"].startswith("flatbnn checkpoint (epoch 4")


def test_init_from_plain_state_dict_under_init_key(swag_run, tmp_path):
    src = _weights(swag_run)
    f = tmp_path / "weights.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in src.items()}, "epoch": 7}, f)  # a DDP-saved dict
    b = _build(SMALL + ["method=map", f"trainer.init_from={f}", "trainer.init_key=state_dict"], tmp_path / "b")
    for k, v in b.module.state_dict().items():
        assert torch.equal(v, src[k]), k
    with pytest.raises(ValueError, match="trainer.init_key") as e:
        _build(SMALL + ["method=map", f"trainer.init_from={f}"], tmp_path / "c")
    assert "\n" not in str(e.value)


def test_init_from_a_mismatched_model_is_one_line(swag_run, tmp_path):
    p = train_cli(["dataset=digits", "model=mlp", "model.hidden=[48,16]", "method=map", "trainer.epochs=1",
                   f"trainer.init_from={swag_run}"], tmp_path / "x", check=False)
    assert p.returncode == 2
    err = one_line(p.stderr)
    assert "init_from" in err and "missing keys: 5.weight" in err and "shape mismatch: 1.weight [32, 64]" in err, err
    assert not (tmp_path / "x" / "checkpoints").exists()


def test_resume_wins_over_init_from(swag_run, tmp_path):
    bad = tmp_path / "other.pt"
    torch.save({"not.a.layer": torch.zeros(3)}, bad)  # would fail strict loading
    args = SMALL + ["method=swag", "method.num_samples=4", "trainer.epochs=4", f"trainer.init_from={bad}"]
    with pytest.raises(ValueError, match="does not fit the model"):
        _build(args, tmp_path / "fresh")
    run = tmp_path / "run"
    shutil.copytree(swag_run, run, ignore=shutil.ignore_patterns("eval"))
    b = _build(args, run)  # a checkpoint to resume from: init_from is not read
    assert b.resume_ckpt == run / "checkpoints" / "last.pt"
    assert b.init_from == {"path": str(bad), "key": None, "resumed_from": str(run / "checkpoints" / "last.pt")}
