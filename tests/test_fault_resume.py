"""Trust under faults: a resume never relabels another config's run, one process per run dir, a diverged
run recovers from a checkpoint whose next step was finite, and killed / failed checkpoint writes leave
nothing behind."""

import errno
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from helpers import REPO, run_cfg, train_cli

SMALL = ["dataset=digits", "model=mlp", "model.hidden=[16]", "method=map", "dataset.train_subset=256",
         "dataset.test_subset=50", "trainer.batch_size=64", "trainer.eval_every=0", "trainer.reliability_diagram=false"]


def _snapshot(run, names):
    return {n: (run / n).read_bytes() for n in names if (run / n).exists()}


# ------------------------------------------------------------------ 2. resume checks the config
def test_rerun_with_another_config_is_refused_and_nothing_is_overwritten(tmp_path):
    run = tmp_path / "run"
    train_cli(SMALL + ["trainer.epochs=1"], run)
    names = ["results.json", "metrics.jsonl", ".hydra/config.yaml", ".hydra/overrides.yaml", "checkpoints/last.pt",
             "config_resolved.yaml"]
    before = _snapshot(run, names)
    assert len(before) == len(names)
    p = train_cli(SMALL + ["trainer.epochs=1", "optimizer.lr=0.01", "seed=3"], run, check=False)
    err = p.stderr.strip()
    assert p.returncode == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in ("optimizer.lr: 0.05 -> 0.01", "seed: 0 -> 3", "trainer.resume=false", "hydra.run.dir"):
        assert needle in err, (needle, err)
    assert _snapshot(run, names) == before  # Hydra's rewritten files were put back, the rest never touched


def test_a_refused_sweep_member_writes_nothing_into_the_run_it_was_refused_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    train_cli(SMALL + ["trainer.epochs=1"], sweep / "seed0")  # an earlier run where member seed=0 will land
    before = _snapshot(sweep / "seed0", ["results.json", "metrics.jsonl", "checkpoints/last.pt"])
    cmd = [sys.executable, str(REPO / "train.py"), "--multirun", *SMALL, "trainer.epochs=1", "optimizer.lr=0.01",
           "seed=0,1", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=seed${seed}", "trainer.progress=false"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 1, p.stderr[-2000:]                  # a member failed: non-zero at the end
    assert "another config" in p.stderr
    assert not (sweep / "seed0" / "failed.txt").exists()        # the other run's dir is not written into
    assert _snapshot(sweep / "seed0", list(before)) == before
    assert json.loads((sweep / "seed1" / "results.json").read_text())["meta"]["seed"] == 1  # the sweep went on


def test_resume_accepts_watching_keys_and_refuses_a_finished_run_without_checkpoint(tmp_path):
    args = SMALL + ["trainer.epochs=1"]
    ref = run_cfg(args, tmp_path / "a")
    # how the run is watched / how fast it goes may change: the same run (eval batches of 7: float sums differ)
    again = run_cfg(args + ["trainer.eval_every=1", "trainer.num_workers=0", "trainer.eval_batch_size=7",
                            "trainer.checkpoint_every=2"], tmp_path / "a")
    assert again["metrics"]["nll"] == pytest.approx(ref["metrics"]["nll"], rel=1e-6)
    assert again["meta"]["budget"]["steps"] == ref["meta"]["budget"]["steps"] == 4
    # a finished run without a checkpoint is still protected (config_resolved.yaml is the reference)
    from flatbnn.engine.run_dir import ResumeConfigMismatch
    run_cfg(args + ["trainer.checkpoint_every=0"], tmp_path / "b")
    before = (tmp_path / "b" / "results.json").read_bytes()
    with pytest.raises(ResumeConfigMismatch, match="seed: 0 -> 1"):
        run_cfg(args + ["trainer.checkpoint_every=0", "seed=1"], tmp_path / "b")
    assert (tmp_path / "b" / "results.json").read_bytes() == before
    # the two ways out work
    run_cfg(args + ["seed=1"], tmp_path / "c")
    run_cfg(args + ["trainer.checkpoint_every=0", "seed=1", "trainer.resume=false"], tmp_path / "b")


def test_resume_override_applies_the_new_lr_to_the_restored_optimizer(tmp_path):
    """constant schedule: epoch 2 of a run resumed with optimizer.lr changed logs the new lr; a key that
    is not in the config is one clear error."""
    args = SMALL + ["scheduler=constant", "optimizer.lr=0.05"]
    run_cfg(args + ["trainer.epochs=1"], tmp_path)
    res = run_cfg(SMALL + ["scheduler=constant", "optimizer.lr=0.02", "trainer.epochs=2",
                           "trainer.resume_overrides=[optimizer.lr,trainer.epochs]"], tmp_path)
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [0.05, 0.02]
    assert res["meta"]["resume_changes"] == [{"global_step": 4, "changes": {"optimizer.lr": [0.05, 0.02],
                                                                            "trainer.epochs": [1, 2]}}]
    with pytest.raises(ValueError, match="optimizer.lrr is not a config key"):
        run_cfg(args + ["trainer.epochs=2", "trainer.resume_overrides=[optimizer.lrr]"], tmp_path)


def test_resume_override_of_the_schedule_shape_continues_this_configs_schedule_at_the_restored_step(tmp_path):
    """Cosine, 4 steps/epoch: a 1-epoch run resumed with trainer.epochs=3 and another final_factor must go on with
    the lr a fresh 3-epoch run of the new config has at steps 8 and 12 (the old 1-epoch schedule has decayed to
    0 there; a schedule rebuilt one step off gives other values)."""
    new = ["trainer.epochs=3", "scheduler.final_factor=0.5"]
    run_cfg(SMALL + ["trainer.epochs=1"], tmp_path / "resumed")
    run_cfg(SMALL + new + ["trainer.resume_overrides=[trainer.epochs,scheduler.final_factor]"], tmp_path / "resumed")
    run_cfg(SMALL + new, tmp_path / "fresh")
    resumed, fresh = ([json.loads(x)["lr"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                      for d in ("resumed", "fresh"))
    assert resumed[0] == 0.0 and fresh[0] > 0  # epoch 1 of the 1-epoch run ends at its final lr
    assert resumed[1:] == fresh[1:] == [pytest.approx(0.05 * (0.5 + 0.25 * (1 + math.cos(2 * math.pi / 3)))), 0.025]


# ------------------------------------------------------------------ 3. one process per run dir
def _holder(run_dir, host_override=None):
    """A live process holding the run dir's lock (prints once it holds it)."""
    code = ("import sys, time, socket; from flatbnn.engine.lock import RunDirLock; "
            "l = RunDirLock(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_process_is_refused_while_the_holder_lives_and_a_dead_holder_is_stale(tmp_path):
    from flatbnn.engine.lock import RunDirLocked
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunDirLocked, match=f"in use by pid {holder.pid} on host {socket.gethostname()}"):
            run_cfg(SMALL + ["trainer.epochs=1"], tmp_path)
        assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    res = run_cfg(SMALL + ["trainer.epochs=1"], tmp_path)  # killed holder: its lock is stale, taken over
    assert res["metrics"]["accuracy"] > 0 and not (tmp_path / ".flatbnn" / "lock").exists()


def test_stale_lock_rules(tmp_path):
    from flatbnn.engine.lock import RunDirLock, RunDirLocked, _process_start
    lock = RunDirLock(tmp_path)
    lock.path.parent.mkdir(parents=True)
    me = dict(lock.me)

    def write(**kw):
        lock.path.write_text(json.dumps({**me, "since": "x", **kw}))

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write(host="some-other-node", pid=dead.pid)  # no such pid here, but it may live there: refused
    with pytest.raises(RunDirLocked, match="some-other-node.*delete"):
        lock.acquire()
    if _process_start(os.getpid()) is not None:  # a recycled pid (another start time) is stale
        write(start="1")
        lock.acquire().release()
        assert not lock.path.exists()
    write(pid=dead.pid, start=None)  # same host, dead pid: stale
    lock.acquire()
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.slow
def test_two_train_processes_on_one_run_dir(tmp_path):
    """A real second train.py on a live run dir: exit 2, one line; the first goes on undisturbed (then is
    stopped by SIGTERM: it never ends on its own, so a slow machine cannot finish it first)."""
    run = tmp_path / "run"
    args = SMALL + ["trainer.epochs=100000", "trainer.eval_every=1"]
    cmd = [sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run}", "trainer.progress=false"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.05)
        hydra_config = (run / ".hydra" / "config.yaml").read_bytes()
        second = train_cli(args + ["seed=5"], run, check=False)
        assert first.poll() is None
        assert second.returncode == 2 and "in use by pid" in second.stderr, second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert (run / ".hydra" / "config.yaml").read_bytes() == hydra_config  # the holder's, put back
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=300)
    assert first.returncode == 75, err
    epochs = [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) >= 1
    assert not (run / ".flatbnn" / "lock").exists()


# ------------------------------------------------------------------ 6. divergence recovery as advised
def test_diverged_run_resumes_with_a_lower_lr_as_advised_and_finishes_finite(tmp_path):
    """4 steps/epoch; the lr jumps by 1e30 for the last update of epoch 2, so the checkpoint after epoch 2
    holds weights whose next loss is NaN. The run must rewind to epoch 1's checkpoint, and the advised rerun
    (lower optimizer.lr via trainer.resume_overrides) must train to the end with finite metrics."""
    from flatbnn.engine.trainer import Diverged
    args = SMALL + ["trainer.epochs=4", "scheduler=multistep", "scheduler.milestones=[0.4375]", "scheduler.gamma=1e30"]
    with pytest.raises(Diverged) as exc:
        run_cfg(args, tmp_path)
    msg = str(exc.value)
    assert "at epoch 3, step 1" in msg and "trainer.resume_overrides=[optimizer.lr]" in msg, msg
    ckpts = tmp_path / "checkpoints"
    assert torch.load(ckpts / "last.pt", weights_only=False)["epoch"] == 1          # rewound
    assert torch.load(ckpts / "diverged.pt", weights_only=False)["epoch"] == 2      # kept for a look
    res = run_cfg(args + ["optimizer.lr=1e-31", "trainer.resume_overrides=[optimizer.lr]"], tmp_path)
    m = res["metrics"]
    assert all(torch.isfinite(torch.tensor(m[k])) for k in ("accuracy", "nll", "ece", "brier"))
    assert res["meta"]["budget"]["steps"] == 16 and m["accuracy"] > 0.3
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.pt"]  # a finished run keeps only last.pt


# ------------------------------------------------------------------ 7. temp files of checkpoint writes
def test_failed_checkpoint_write_leaves_no_temp_file_and_keeps_the_previous(tmp_path, monkeypatch):
    from flatbnn.engine import checkpoint as C
    path = tmp_path / "checkpoints" / "last.pt"
    C.save_checkpoint(path, {"format": 1, "epoch": 1})

    def full_disk(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    import torch  # checkpoint.py imports torch where it saves (a scheduler takes its locks without torch)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(C.CheckpointError, match="No space left on device.*previous checkpoint is intact"):
        C.save_checkpoint(path, {"format": 1, "epoch": 2})
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]
    assert C.load_checkpoint(path)["epoch"] == 1


def test_stale_temp_files_of_killed_writers_are_removed_on_start(tmp_path):
    run_cfg(SMALL + ["trainer.epochs=1"], tmp_path)
    ckpts = tmp_path / "checkpoints"
    # results.json's temp file too (issue 36: it was left for good); notes.tmp.txt is not ours
    stale = [ckpts / ".last.pt.tmp.4194301", ckpts / ".good.pt.tmp.12", tmp_path / ".results.json.tmp.12"]
    kept = [ckpts / "notes.tmp.txt"]
    for p in stale + kept:
        p.write_bytes(b"x" * 100)
    run_cfg(SMALL + ["trainer.epochs=1"], tmp_path)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)


def test_results_name_the_commit_each_process_started_with_not_the_one_at_the_end(tmp_path, monkeypatch):
    """A commit made while a run trains must not relabel it (found 2026-11-24: a 3-hour row run started on a
    dirty tree was labelled with the clean commit made an hour into it); a resume on another commit keeps both."""
    import flatbnn.engine.run as R

    first = iter([{"commit": "aaa", "dirty": False}] + [{"commit": "bbb", "dirty": True}] * 100)
    monkeypatch.setattr(R, "git_commit", lambda *a, **k: next(first))
    res = run_cfg(SMALL + ["trainer.epochs=1"], tmp_path)
    assert res["meta"]["git"] == {"commit": "aaa", "dirty": False} and "git_segments" not in res["meta"]
    monkeypatch.setattr(R, "git_commit", lambda *a, **k: {"commit": "ccc", "dirty": False})
    res = run_cfg(SMALL + ["trainer.epochs=2", "trainer.resume_overrides=[trainer.epochs]"], tmp_path)
    assert res["meta"]["git"] == {"commit": "aaa", "dirty": False}
    assert [(g["global_step"], g["commit"]) for g in res["meta"]["git_segments"]] == [(0, "aaa"), (4, "ccc")]


def test_rebuilt_schedule_is_a_fresh_runs_also_for_a_scheduler_whose_next_lr_depends_on_the_last():
    """engine/run_dir.py rebuilds through the method's attach_scheduler and steps it to the restored step: the lr
    is a fresh run's for torch's recursive schedulers too (CosineAnnealingLR), not only for LambdaLR."""
    from types import SimpleNamespace

    from flatbnn.engine.run_dir import rebuild_schedule

    def trained(total_steps, steps):  # a method's optimiser and schedule (total_steps: its config) after `steps`
        m = SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1),
                            total_steps=total_steps)
        m.attach_scheduler = lambda: setattr(m, "scheduler", torch.optim.lr_scheduler.CosineAnnealingLR(
            m.optimizer, T_max=m.total_steps))
        m.attach_scheduler()
        for _ in range(steps):
            m.optimizer.step()
            m.scheduler.step()
        return m

    resumed, fresh = trained(total_steps=4, steps=3), trained(total_steps=12, steps=3)
    resumed.total_steps = 12  # resumed under the new config
    rebuild_schedule(resumed, resumed.scheduler.last_epoch)
    assert resumed.scheduler.last_epoch == 3
    assert resumed.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"] != 0.1
    for _ in range(5):  # and it goes on as the fresh one
        for m in (resumed, fresh):
            m.optimizer.step()
            m.scheduler.step()
    assert resumed.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"]


def test_an_override_of_a_method_owned_schedule_key_rebuilds_the_schedule():
    """HWA's lr_cycles / SGLD's lr_schedule shape the schedule from the method group, not the scheduler group:
    a resume overriding one (and nothing the engine knows as schedule-shaping) must still continue with this
    config's schedule at the restored step; a new lr gives a fresh run's lr also for an absolute schedule."""
    from types import SimpleNamespace

    from flatbnn.engine.run_dir import apply_resume_overrides, optimizer_snapshot
    from flatbnn.optim.schedulers import cyclical, inverse_power

    def trained(factory, lr, steps):
        m = SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr), factory=factory)
        m.attach_scheduler = lambda: setattr(m, "scheduler", m.factory(m.optimizer))
        m.attach_scheduler()
        for _ in range(steps):
            m.optimizer.step()
            m.scheduler.step()
        return m

    def cycles(n):
        return lambda opt: cyclical(opt, total_steps=24, steps_per_epoch=4, cycles=n)

    resumed, fresh = trained(cycles(2), 0.1, 7), trained(cycles(3), 0.1, 7)
    snapshot = optimizer_snapshot(trained(cycles(3), 0.1, 0))
    resumed.factory = cycles(3)  # the method rebuilt from the new config (method.lr_cycles=3)
    apply_resume_overrides(resumed, snapshot, ["method.lr_cycles"])
    assert resumed.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"]
    assert fresh.optimizer.param_groups[0]["lr"] != trained(cycles(2), 0.1, 7).optimizer.param_groups[0]["lr"]

    def power(opt):
        return inverse_power(opt, total_steps=24, steps_per_epoch=4, a=1.0, b=1.0, gamma=0.55,
                             max_lr=None, unit="step")

    resumed, fresh = trained(power, 0.1, 9), trained(power, 0.02, 9)
    apply_resume_overrides(resumed, optimizer_snapshot(trained(power, 0.02, 0)), ["optimizer.lr"])
    assert resumed.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"]


# ------------------------------------------------------------------ 8. the data a run trained on
def _swap_train_images(root):
    """The fake MNIST's training images replaced by others: same file names, sizes and count, other pixels."""
    from flatbnn.data.mnist import idx_bytes, read_idx
    f = root / "MNIST" / "raw" / "train-images-idx3-ubyte"
    x = read_idx(f)
    f.write_bytes(idx_bytes(255 - x))


def test_a_resume_on_swapped_training_images_is_refused_in_one_line_unless_allowed_and_then_recorded(tmp_path):
    """Issue 54: a resumed run whose data files changed (same names and count, other images) went on silently with
    other results; nothing recorded what data a run trained on. Now every checkpoint and results.json hold a data
    fingerprint; a resume on other data is refused (exit 2, one line naming the split) unless
    trainer.resume_data_changed=ok, which results.json records. A checkpoint from before fingerprints resumes."""
    from flatbnn.data.fake import write_mnist
    from test_stop_and_way_back import _stopped_in_process

    root = write_mnist(tmp_path / "data", gz=False)
    args = ["dataset=mnist", f"dataset.root={root}", "model=mlp", "model.hidden=[16]", "method=map",
            "trainer.batch_size=8", "trainer.epochs=2", "trainer.eval_every=0"]
    run = tmp_path / "run"
    _stopped_in_process(args, run, 5)  # 4 steps an epoch: last.pt at epoch 2, step 2
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert set(state["data"]["splits"]) == {"train", "test"} and state["data"]["splits"]["train"]["n"] == 30
    before = (run / "checkpoints" / "last.pt").read_bytes()
    _swap_train_images(root)
    p = train_cli(args, run, check=False)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run}/checkpoints/last.pt: the data differ" in err and "train: the images" in err, err
    assert "test:" not in err and "trainer.resume_data_changed=ok" in err, err
    assert (run / "checkpoints" / "last.pt").read_bytes() == before and not (run / "results.json").exists()
    res = run_cfg(args + ["trainer.resume_data_changed=ok"], run)
    [change] = res["meta"]["resume_changes"]
    assert change["global_step"] == 6 and change["data_changed"][0].startswith("train: the images"), change
    assert res["meta"]["data"]["splits"]["train"] != state["data"]["splits"]["train"]  # what it ended on
    # a checkpoint written before data fingerprints: resumed, and the log says the data were not compared
    old = tmp_path / "old"
    _stopped_in_process(args, old, 5)
    state = torch.load(old / "checkpoints" / "last.pt", weights_only=False)
    del state["data"]
    torch.save(state, old / "checkpoints" / "last.pt")
    run_cfg(args, old)
    assert "predates data fingerprints: the data were not compared" in (old / "train.log").read_text()
