"""Interrupted the way clusters and people interrupt (issue 36): nothing mislabelled, every exit as the README
says. Tiny digits/MLP runs of a few steps; subprocesses have timeouts."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, run_cfg, train_cli

SMALL = ["dataset=digits", "model=mlp", "model.hidden=[16]", "method=map", "dataset.train_subset=256",
         "dataset.test_subset=50", "trainer.batch_size=64", "trainer.reliability_diagram=false"]  # 4 steps an epoch
WALL_FIELDS = ("train/seconds", "train/images_per_s")


def _stop_at(monkeypatch, global_step: int, signum=signal.SIGTERM):
    """Send ``signum`` to this process just before the step after ``global_step`` steps (in-process runs)."""
    from flatbnn.engine.trainer import Trainer
    to_device = Trainer.to_device

    def patched(self, batch):
        if self.global_step == global_step:
            signal.raise_signal(signum)
        return to_device(self, batch)

    monkeypatch.setattr(Trainer, "to_device", patched)


def _lines(run):
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ 1. resume=false moves the old run's outputs aside
def test_restart_with_resume_false_moves_the_finished_runs_outputs_aside_before_its_first_step(tmp_path, monkeypatch):
    from flatbnn.engine.trainer import Preempted
    run = tmp_path / "run"
    from flatbnn.engine.run import run as train
    from helpers import compose_cfg
    old = train(compose_cfg(SMALL + ["trainer.epochs=1", "trainer.progress=false", "trainer.reliability_diagram=true"]),
                run_dir=run)
    assert (run / "reliability.png").exists()
    _stop_at(monkeypatch, 2)  # the restart is stopped before it finishes
    with pytest.raises(Preempted):
        run_cfg(SMALL + ["trainer.epochs=1", "trainer.resume=false", "optimizer.lr=0.01"], run)
    assert not (run / "results.json").exists() and not (run / "reliability.png").exists()
    aside = list((run / ".flatbnn" / "replaced").iterdir())
    assert len(aside) == 1
    kept = json.loads((aside[0] / "results.json.replaced").read_text())
    assert kept["metrics"]["nll"] == old["metrics"]["nll"]
    assert (aside[0] / "reliability.png").exists() and (aside[0] / "metrics.jsonl").exists()
    from flatbnn.reproduce.launch import job_state
    assert job_state(tmp_path, "run", 0)[0] != "done"  # (reproduce's view of a dir: not done)


# ------------------------------------------------------------------ 3. the resumed epoch's metrics line
def test_a_run_stopped_mid_epoch_writes_the_uninterrupted_runs_metrics_lines(tmp_path, monkeypatch):
    from flatbnn.engine.trainer import Preempted
    args = SMALL + ["trainer.epochs=2"]
    run_cfg(args, tmp_path / "straight")
    _stop_at(monkeypatch, 6)  # epoch 2, after 2 of its 4 steps
    with pytest.raises(Preempted):
        run_cfg(args, tmp_path / "cut")
    monkeypatch.undo()
    run_cfg(args, tmp_path / "cut")
    straight, cut = _lines(tmp_path / "straight"), _lines(tmp_path / "cut")
    assert [{k: v for k, v in r.items() if k not in WALL_FIELDS} for r in cut] == \
        [{k: v for k, v in r.items() if k not in WALL_FIELDS} for r in straight]
    # images/s is over the whole epoch's steps: 256 images in the epoch's seconds (before + after the stop)
    assert cut[1]["train/images_per_s"] * cut[1]["train/seconds"] == pytest.approx(256)


def test_a_stop_during_an_epochs_last_step_resumes_with_the_uninterrupted_runs_metrics(tmp_path, monkeypatch):
    """The signal lands while the epoch's last step runs: the checkpoint holds step 4 of 4 (the epoch's end-of-epoch
    work not done yet), which is a position the resume must accept (it was refused as 'disagrees with the
    schedule ... global step 4, the checkpoint says 4': a run stopped at that moment could not be resumed)."""
    from flatbnn.engine.trainer import Preempted
    args = SMALL + ["trainer.epochs=2"]
    run_cfg(args, tmp_path / "straight")
    _stop_at(monkeypatch, 3)  # raised before step 4 (epoch 1's last) runs; honoured right after it
    with pytest.raises(Preempted) as e:
        run_cfg(args, tmp_path / "cut")
    assert "at epoch 1, step 4 of 4" in str(e.value)
    monkeypatch.undo()
    run_cfg(args, tmp_path / "cut")
    straight, cut = _lines(tmp_path / "straight"), _lines(tmp_path / "cut")
    assert [{k: v for k, v in r.items() if k not in WALL_FIELDS} for r in cut] == \
        [{k: v for k, v in r.items() if k not in WALL_FIELDS} for r in straight]


# ------------------------------------------------------------------ 4 / 12. checkpoint position and structure
def _ckpt_edit(tmp_path, edit, epochs=2):
    """A run stopped after epoch 1 of ``epochs``, its checkpoint edited; returns (run dir, checkpoint)."""
    run = tmp_path / "run"
    run_cfg(SMALL + ["trainer.epochs=1"], run)
    ckpt = run / "checkpoints" / "last.pt"
    state = torch.load(ckpt, weights_only=False)
    edit(state)
    torch.save(state, ckpt)
    (run / "results.json").unlink()
    return run, ckpt


@pytest.mark.parametrize("edit, needle", [
    (lambda s: s.update(epoch=0), "disagrees with the schedule"),         # 4: a hand-edited epoch
    (lambda s: s.update(epoch=3), "past this run's 1 epochs"),
    (lambda s: s.update(rng=[]), "'rng' entry holds 0 RNG state"),         # 12: an empty rng list
    (lambda s: s.pop("rng"), "has no 'rng' entry"),                        # 12: a missing key
    (lambda s: s.update(format=2), "its format is 2, this flatbnn reads format 1"),  # another version's layout
    (lambda s: s["method"]["model"].update({"net.0.weight": torch.zeros(3, 3)}), "does not fit this run"),
])
def test_a_checkpoint_that_does_not_fit_is_one_line_naming_it_and_changes_nothing(tmp_path, edit, needle):
    from flatbnn.engine.checkpoint import CheckpointError
    run, ckpt = _ckpt_edit(tmp_path, edit)
    state = torch.load(ckpt, weights_only=False)
    if "model" in state.get("method", {}) and needle == "does not fit this run":
        assert any(k == "net.0.weight" for k in state["method"]["model"]), list(state["method"]["model"])
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError) as e:
        run_cfg(SMALL + ["trainer.epochs=1"], run)
    line = str(e.value)
    assert needle in line and str(ckpt) in line and "\n" not in line, line
    assert (run / "metrics.jsonl").read_bytes() == before and not (run / ".flatbnn" / "replaced").exists()


# ------------------------------------------------------------------ 10. one numbering; a finished run is not redone
def test_stop_and_resume_lines_use_one_numbering_and_a_finished_run_is_left_alone(tmp_path, monkeypatch, capsys):
    from flatbnn.engine.trainer import Preempted
    run = tmp_path / "run"
    _stop_at(monkeypatch, 6)
    with pytest.raises(Preempted) as e:
        run_cfg(SMALL + ["trainer.epochs=2"], run)
    assert "at epoch 2, step 3 of 4" in str(e.value)
    monkeypatch.undo()
    capsys.readouterr()
    run_cfg(SMALL + ["trainer.epochs=2"], run)
    assert "at epoch 2, step 3 of 4" in capsys.readouterr().err
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    again = run_cfg(SMALL + ["trainer.epochs=2"], run)
    assert "already finished" in capsys.readouterr().err
    assert again == json.loads((run / "results.json").read_text())
    after = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and ".hydra" not in p.parts
             and p.name not in ("config_resolved.yaml",) and "hydra" not in p.parts}
    assert {p: t for p, t in before.items() if p in after} == after  # nothing rewritten (results, metrics, ckpt)


# ------------------------------------------------------------------ 5 / 14. W&B: summary = results.json; bounded start
class _FakeWandb:
    """What the W&B client does with ``log(step=...)``: a row stays open until a later step or ``commit=True``
    and is flushed into the summary at ``finish()`` -- after anything the summary was set to before."""

    class Settings:
        def __init__(self, **kw):
            self.kw = kw

    def __init__(self):
        self.summary, self.open_row = {}, None

    def init(self, **kw):
        return self

    def log(self, row, step=None, commit=None):
        if self.open_row is not None and (step is None or step > self.open_row[0]):
            self.summary.update(self.open_row[1])
            self.open_row = None
        if self.open_row is not None:
            self.open_row[1].update(row)
        else:
            self.open_row = (step, dict(row))
        if commit:
            self.summary.update(self.open_row[1])
            self.open_row = None

    def finish(self):
        self.log({}, step=None)


def test_wandb_summary_is_the_final_predictive_of_results_json(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from flatbnn.engine.run import run as train
    from helpers import compose_cfg
    res = train(compose_cfg(SMALL + ["trainer.epochs=2", "logger=wandb", "trainer.progress=false", "method=mc_dropout",
                                          "model.dropout=0.5", "method.num_samples=4"]), run_dir=tmp_path)
    last_epoch = _lines(tmp_path)[-1]
    assert last_epoch["test/nll"] != res["metrics"]["nll"]  # (the per-epoch test/* differ from the final predictive)
    for k in ("accuracy", "nll", "ece"):
        assert fake.summary[f"test/{k}"] == res["metrics"][k]
        assert fake.summary[f"final/{k}"] == res["metrics"][k]


def test_wandb_start_up_is_bounded_and_goes_offline_or_stops(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from flatbnn.engine.loggers import WandbLogger, WandbStartError
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # loopback, nothing listens: no network needed
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    t0 = time.monotonic()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with pytest.raises(WandbStartError, match="init_timeout_s=1 s"):
        WandbLogger(tmp_path / "a", {}, init_timeout_s=1, on_init_failure="stop")
    lg = WandbLogger(tmp_path / "b", {}, init_timeout_s=1)  # default: offline, one warning line
    assert lg.run.settings.mode == "offline"
    lg.finish()
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------ 7 / 8 / 9. signals as clusters and people send them
def _wait_for(pred, proc, timeout=120):
    t0 = time.monotonic()
    while not pred():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before the signal:\n{err[-3000:]}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


def _epochs_done(run):
    p = Path(run) / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 75), (signal.SIGINT, 130),
                                          (signal.SIGHUP, 75)])  # SIGHUP: the terminal closed
def test_a_stop_signal_to_the_process_group_with_dataloader_workers_checkpoints_and_exits_as_documented(
        tmp_path, signum, code):
    """What SLURM / docker / systemd (SIGTERM) and a terminal (Ctrl-C: SIGINT) do: signal the whole process group,
    DataLoader workers included. The workers ignore it; the main process finishes the step, checkpoints, one line."""
    run = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), *SMALL, "trainer.epochs=500", "trainer.num_workers=2",
           "trainer.eval_every=0", f"hydra.run.dir={run}", "trainer.progress=false"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for(lambda: _epochs_done(run) >= 1, proc)
        os.killpg(proc.pid, signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("flatbnn")]
    assert "Traceback" not in err and len(lines) == 1 and signal.Signals(signum).name in lines[0], err[-3000:]
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert state["global_step"] >= 4 and not (run / "results.json").exists()


def test_sigterm_to_reproduce_is_handed_to_its_sweep_which_checkpoints_and_reproduce_exits_75(tmp_path):
    """``timeout`` / ``kill`` / CI cancellation signal scripts/reproduce.py alone: it must not leave its
    ``train.py --multirun`` running as an orphan."""
    import yaml
    rows, out = tmp_path / "rows", tmp_path / "out"
    rows.mkdir()
    (rows / "r.yaml").write_text(yaml.safe_dump(
        {"row": "r", "paper": "none", "title": "r", "kind": "train", "axes": ["method"],
         "base": SMALL + ["trainer.epochs=500", "trainer.eval_every=0", "trainer.progress=false"],
         "values": {"method": {"sgd": ["flatness=none"]}}, "seeds": [0],
         "scales": {"cpu": {"overrides": []}, "smoke": {"overrides": []}}}))
    code = ("import runpy, sys; from pathlib import Path; from flatbnn.reproduce import spec; "
            f"spec.ROWS_DIR = Path({str(rows)!r}); sys.argv = ['reproduce.py', 'run', 'r', '--scale', 'cpu', "
            f"'--out', {str(out)!r}, '--no-compare']; runpy.run_path({str(REPO / 'scripts' / 'reproduce.py')!r}, "
            "run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    run = out / "sgd" / "seed0"
    try:
        _wait_for(lambda: _epochs_done(run) >= 1, proc)
        proc.send_signal(signal.SIGTERM)  # the script alone, not its process group
        _, err = proc.communicate(timeout=120)
        time.sleep(1)
        n = _epochs_done(run)
        time.sleep(2)
        assert _epochs_done(run) == n  # nothing keeps training after the stop (no orphan)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # an orphan would still be in the group
        except ProcessLookupError:
            pass
    assert proc.returncode == 75, err[-3000:]
    assert (run / "checkpoints" / "last.pt").exists() and not (run / "results.json").exists()
    assert "reproduce r: stopped (exit 75); the running job (sgd/seed0) checkpointed" in err, err[-2000:]


# ------------------------------------------------------------------ 2. cell configs: atomic, unchanged not rewritten
def test_cell_configs_are_never_seen_half_written_and_a_cell_without_its_keys_is_refused(tmp_path):
    import threading

    from flatbnn.reproduce.launch import _write_cell_config, check_cell_choice
    from flatbnn.reproduce.spec import SpecError
    from helpers import compose_cfg
    cfgs = [{"seed": 0, "reproduce": {"cell": "a", "row": "r", "scale": "cpu"}, "pad": "x" * (20000 + 1000 * i)}
            for i in range(2)]
    path = tmp_path / "cell" / "a__s0.yaml"
    _write_cell_config(tmp_path, "a__s0", cfgs[0], "test")
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            seen.append(len(path.read_text()))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(100):  # a second launcher rewriting the row's cells while a sweep composes them
        _write_cell_config(tmp_path, "a__s0", cfgs[i % 2], "test")
    stop.set()
    t.join()
    full = {len(path.read_text())} | {len(path.read_text()) + 1000, len(path.read_text()) - 1000}
    assert seen and all(n in full for n in seen), sorted(set(seen))[:5]
    before = path.stat().st_mtime_ns
    time.sleep(0.01)
    _write_cell_config(tmp_path, "a__s0", cfgs[1], "test")  # unchanged: not rewritten
    assert path.stat().st_mtime_ns == before
    # an empty cell file composes to the default config: refused, not filed under the cell's name
    with pytest.raises(SpecError, match=r"\+cell=cifar100__vgg19_bn__sgd__s0: the composed config is not that cell"):
        check_cell_choice(compose_cfg(["dataset=digits"]), "cifar100__vgg19_bn__sgd__s0")
    check_cell_choice(compose_cfg(["reproduce.cell=cifar100/vgg19_bn/sgd", "seed=0"]), "cifar100__vgg19_bn__sgd__s0")


# ------------------------------------------------------------------ 11. disk full inside torch.save
def test_disk_full_inside_torch_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    from flatbnn.engine import checkpoint
    path = tmp_path / "last.pt"
    checkpoint.save_checkpoint(path, {"format": 1, "w": torch.zeros(10)})
    before = path.read_bytes()

    class Full:  # a file system that runs out of space after 1 kB, as a 2 MB tmpfs does for a bigger model
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 1024:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    from flatbnn import atomic_io  # the one atomic writer, which checkpoint.save_checkpoint goes through

    monkeypatch.setattr(atomic_io, "open", lambda *a, **k: Full(open(*a, **k)), raising=False)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.save_checkpoint(path, {"format": 1, "w": torch.randn(100_000)})
    assert "No space left on device" in str(e.value) and "previous checkpoint is intact" in str(e.value)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


# ------------------------------------------------------------------ 13. YAML errors
def test_a_yaml_syntax_error_is_file_line_column_and_a_yaml_list_experiment_is_refused(tmp_path):
    from hydra import compose, initialize_config_dir

    from flatbnn.cli import hydra_error_line
    from flatbnn.engine.validate import check_group_files
    from flatbnn.engine.validate import ConfigError
    exp = tmp_path / "experiment"
    exp.mkdir()
    (exp / "bad.yaml").write_text("# @package _global_\ntrainer:\n  epochs: [1, 2\nseed: 3\n")
    (exp / "alist.yaml").write_text("- trainer.epochs=1\n- seed: 2\n")
    with pytest.raises(Exception) as e:
        with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
            compose(config_name="experiment/bad", overrides=[])
    line = hydra_error_line(e.value)
    assert line is not None and line.startswith(f"{exp / 'bad.yaml'}:4:5: YAML syntax error") and "\n" not in line

    class Source:
        schema, path = "file", str(tmp_path)
    with pytest.raises(ConfigError, match="experiment=alist is a YAML list"):
        check_group_files({"experiment": "alist", "method": "map"}, [Source()])


# ------------------------------------------------------------------ 15. m vs the smallest batch
def test_m_larger_than_the_last_partial_batch_is_refused_before_any_step(tmp_path):
    from flatbnn.engine.validate import ConfigError
    from flatbnn.engine.build import smallest_batch
    assert smallest_batch(260, 64, 5) == 4 and smallest_batch(260, 64, 4) == 64 and smallest_batch(30, 64, 1) == 30
    with pytest.raises(ConfigError, match=r"flatness.m=8 exceeds the smallest batch of an epoch \(4 images"):
        run_cfg(SMALL + ["dataset.train_subset=260", "flatness=sam", "flatness.m=8", "trainer.epochs=1"], tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    res = run_cfg(SMALL + ["dataset.train_subset=260", "flatness=sam", "flatness.m=4", "trainer.epochs=1"], tmp_path)
    assert res["meta"]["budget"]["steps"] == 5  # m = 4 fits the 4-image last batch


# ------------------------------------------------------------------ 16. smaller ones
def test_small_ones_temp_files_global_batch_seed_range_divergence_lr_cache_hint(tmp_path):
    from flatbnn.cli import one_line_error
    from flatbnn.engine.trainer import Diverged
    from flatbnn.engine.validate import ConfigError, check_values
    from helpers import compose_cfg
    tmp_path.joinpath("run").mkdir()
    stale = tmp_path / "run" / ".results.json.tmp.999999"  # left by a writer killed mid-write
    stale.write_text("{")
    res = run_cfg(SMALL + ["trainer.epochs=1", "trainer.batch_size=5000"], tmp_path / "run")
    assert not stale.exists()
    assert res["meta"]["budget"]["global_batch"] == 256 == res["meta"]["budget"]["train_size"]
    with pytest.raises(ConfigError, match=r"seed=35184372088832: must be <= "):
        check_values(compose_cfg(["seed=35184372088832"]))  # 2**45
    # the divergence line names the lr of the failing step (1 epoch, cosine: the lr is 0 when the epoch ends)
    with pytest.raises(Diverged) as e:
        run_cfg(SMALL + ["trainer.epochs=1", "optimizer.lr=1e30"], tmp_path / "div")
    assert "step 2 (global step 2, lr 8.54e+29)" in str(e.value), str(e.value)  # 1e30 * (1 + cos(pi / 4)) / 2
    cache = Path.home() / ".cache" / "flatbnn" / "cifar10" / "train-all-x.images.npy"
    line = one_line_error(PermissionError(13, "Permission denied", str(cache)))
    assert "FLATBNN_CACHE" in line and "hydra.run.dir" not in line


def test_a_refused_config_leaves_no_stray_run_dir(tmp_path):
    p = train_cli(SMALL + ["seed=-1"], tmp_path / "run", check=False, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("flatbnn: error: seed=-1"), p.stderr
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ 6. no smaller re-render of a committed comparison
def test_a_comparison_from_fewer_runs_does_not_replace_the_committed_one_without_force(tmp_path, capsys):
    import shutil

    from flatbnn.reproduce import compare_markdown, spec
    from test_reproduce import _fake_run
    row, cell = spec.load_row("bsam_t1"), "cifar10/resnet20_frn/bsam"
    dest = tmp_path / "results" / "bsam_t1"
    for s in (0, 1, 2):
        _fake_run(tmp_path / "full", cell, s, 0.60 + s / 100, 1.1)
    compare_markdown.write_comparison(row, "cpu", out=tmp_path / "full", dest=dest)
    committed = (dest / "cpu.md").read_text(), (dest / "cpu.json").read_text()
    assert "(n=3)" in committed[0]
    shutil.rmtree(dest / "cpu" / "runs")  # a row whose earlier runs have no committed records
    _fake_run(tmp_path / "cut", cell, 0, 0.50, 1.3)  # an interrupted rerun: 1 finished run
    compare_markdown.write_comparison(row, "cpu", out=tmp_path / "cut", dest=dest)
    assert ((dest / "cpu.md").read_text(), (dest / "cpu.json").read_text()) == committed
    assert "3 finished runs" in capsys.readouterr().err
    compare_markdown.write_comparison(row, "cpu", out=tmp_path / "cut", dest=dest, force=True)
    assert "(n=1)" in (dest / "cpu.md").read_text()


# ------------------------------------------------------------------ 8 / 14. a stop that something swallowed is still a stop
def test_a_stop_signal_swallowed_during_the_final_evaluation_still_stops_before_results(tmp_path, monkeypatch):
    """Found by hand: SIGTERM while the final evaluation's DataLoader forks its workers raised Preempted inside
    logging's at-fork hook, where Python ignores exceptions: the run wrote results.json and exited 0."""
    from flatbnn.engine import preemption, run as run_mod
    from flatbnn.engine.trainer import Preempted
    final_evaluate = run_mod.final_evaluate

    def swallowed(b):
        out = final_evaluate(b)
        try:
            signal.raise_signal(signal.SIGTERM)
        except Preempted:
            pass  # what a fork hook / __del__ / a library catching Exception does with it
        return out

    monkeypatch.setattr(run_mod, "final_evaluate", swallowed)
    with preemption.JobSignals():
        with pytest.raises(Preempted, match="SIGTERM"):
            run_cfg(SMALL + ["trainer.epochs=1"], tmp_path)
    assert not (tmp_path / "results.json").exists() and (tmp_path / "checkpoints" / "last.pt").exists()


def test_a_stop_signal_during_wandb_start_up_is_not_taken_for_a_failed_start(tmp_path, monkeypatch):
    from flatbnn.engine.loggers import WandbLogger
    from flatbnn.engine.trainer import Preempted
    fake = _FakeWandb()

    def init(**kw):
        raise Preempted("stopped by SIGTERM outside the training loop", signal.SIGTERM)

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(Preempted):  # not "logging offline" and training on
        WandbLogger(tmp_path, {})


def test_the_board_says_which_committed_comparisons_have_no_run_records_to_rebuild_them():
    """Issue 36 #6: flatbnn_t2's committed cpu comparison (30 runs) has no committed run records, so a fresh clone
    cannot rebuild it; the status board says so for that row and not for a row whose records are committed."""
    from flatbnn.reproduce import status

    lines = {ln.split("|")[1].strip(" `"): ln for ln in status.render().splitlines() if ln.startswith("| `")}
    assert "no run records committed" in lines["flatbnn_t2"]
    assert "no run records committed" not in lines["bsam_t1"]


def test_a_stop_signal_between_a_workers_fork_and_its_init_does_not_kill_it():
    """The race behind a flaky CI hang: the group's SIGTERM landing in a freshly forked DataLoader worker before its
    worker_init_fn ignores it killed the worker (RuntimeError in the main process instead of a checkpoint)."""
    from flatbnn.engine.trainer import ignore_stop_signals, workers_forked_deaf

    def init(worker_id):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives in the window between fork and the init function
        ignore_stop_signals(worker_id)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4,
                                         num_workers=1, worker_init_fn=init)
    assert [b[0].tolist() for b in workers_forked_deaf(loader)] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]


@pytest.mark.parametrize("where, code", [("save_reliability_diagram", 0), ("final_evaluate", 75)])
def test_a_stop_signal_a_library_turned_into_its_own_error_is_still_the_stop(tmp_path, where, code):
    """A SIGTERM while matplotlib drew the reliability diagram came back as 'flatbnn: error: Invalid bounding box',
    exit 2 (CI, tests/test_cluster.py, 2026-11-27): matplotlib caught our Preempted and raised its own error. Any
    error after a stop signal is the stop: exit 0 once results.json is written, else 75 with the way back."""
    run_dir = tmp_path / "run"
    args = SMALL + ["trainer.epochs=1", "trainer.progress=false", "trainer.reliability_diagram=true",
                    f"hydra.run.dir={run_dir}"]
    code_ = ("import os, runpy, signal, sys; import flatbnn.engine.run as R\n"
             f"def hit(*a, **k):\n"
             "    try:\n"
             "        os.kill(os.getpid(), signal.SIGTERM)\n"
             "    except Exception:\n"  # what a library that catches everything does with our Preempted
             "        pass\n"
             "    raise ValueError('Invalid bounding box')\n"
             f"R.{where} = hit\n"
             f"sys.argv = ['train.py'] + {args!r}\n"
             f"runpy.run_path({str(REPO / 'train.py')!r}, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", code_], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == code, p.stderr[-1500:]
    assert "Invalid bounding box" not in p.stderr and "stopped by SIGTERM outside the training loop" in p.stderr
    assert (run_dir / "results.json").exists() == (code == 0)
    if code == 75:
        assert "to resume:" in p.stderr


# ------------------------------------------------------------------ issue 54: every signal, every command
def _hook_env(hook: str) -> dict:
    hooks = str(Path(__file__).parent / "hooks")
    return {**{k: v for k, v in os.environ.items() if k != "FLATBNN_TEST_HOOK"}, "OMP_NUM_THREADS": "1",
            "FLATBNN_TEST_HOOK": hook,
            "PYTHONPATH": os.pathsep.join([str(REPO), hooks] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    train_cli(SMALL + ["trainer.epochs=1", "trainer.eval_every=0"], run)
    return run


@pytest.mark.parametrize("sig, code", [("SIGTERM", 75), ("SIGINT", 130)])
def test_a_stop_signal_to_evaluate_py_is_one_line_its_code_and_leaves_no_temp_file_or_eval_dir(finished_run, sig,
                                                                                                code):
    """Issue 54: SIGTERM to evaluate.py died with 143 and no line, and its .results.json.tmp.<pid> stayed. Stopped
    half-way through writing the evaluation's results.json: one line, 75 (130 for Ctrl-C), no temp file, no eval dir."""
    run = finished_run
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    p = subprocess.run([sys.executable, str(REPO / "evaluate.py"), f"run={run}", "metrics.ece_bins=20"], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=_hook_env(f"signal_while_writing:results.json,{sig}"))
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("flatbnn: ") or "Traceback" in ln]
    assert p.returncode == code and lines == [f"flatbnn: stopped by {sig} while evaluating: nothing of this "
                                              f"evaluation was kept; rerun the same command"], p.stderr[-3000:]
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # no temp file, no eval/<name>/


def test_a_resume_with_fewer_steps_an_epoch_says_where_it_stands_not_step_6_of_3(tmp_path, monkeypatch, capsys):
    """Issue 54 (cosmetic): a run stopped at step 6 of 8 and resumed with trainer.limit_train_batches=3 (as a resume
    override) said 'at epoch 1, step 6 of 3'. It is at the end of epoch 1, and says so; then it trains on."""
    from flatbnn.engine.trainer import Preempted
    args = SMALL + ["dataset.train_subset=512", "trainer.epochs=2", "trainer.progress=false", "trainer.eval_every=0"]
    _stop_at(monkeypatch, 5)  # the checkpoint: epoch 1, step 6 of 8
    with pytest.raises(Preempted):
        run_cfg(args, tmp_path)
    monkeypatch.undo()
    capsys.readouterr()
    res = run_cfg(args + ["trainer.limit_train_batches=3", "trainer.resume_overrides=[trainer.limit_train_batches]"],
                  tmp_path)
    err = capsys.readouterr().err
    assert "step 6 of 3" not in err and "at the end of epoch 1 (6 steps of it done, more than the 3 an epoch has now" \
        in err, err
    assert res["meta"]["budget"]["steps"] == 6 + 3  # epoch 1 ended where it stood, epoch 2 ran its 3 steps
