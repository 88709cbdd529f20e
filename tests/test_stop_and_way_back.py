"""Concurrent and interrupted runs (issue 43): every stop, full disk, divergence or DDP failure prints a command that
resumes the run when pasted; a stop while no job runs (imports, between a sweep's jobs) is one line and 75 / 130;
two processes sharing a dir keep their own labels; refusals leave nothing behind. Tiny digits/MLP runs; every
subprocess has a timeout. ``tests/hooks/sitecustomize.py`` makes things happen inside a child at a chosen moment
(``FLATBNN_TEST_HOOK``); the pasted commands run without it."""

import json
import math
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO, run_cfg, train_cli

SMALL = ["dataset=digits", "model=mlp", "model.hidden=[16]", "method=map", "dataset.train_subset=256",
         "dataset.test_subset=50", "trainer.batch_size=64", "trainer.reliability_diagram=false",
         "trainer.progress=false"]  # 4 steps an epoch
WALL_FIELDS = ("train/seconds", "train/images_per_s")
HOOKS = Path(__file__).parent / "hooks"


def _env(hook: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FLATBNN_TEST_HOOK"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HOOKS)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if hook:
        env["FLATBNN_TEST_HOOK"] = hook
    return env


def _train(args, cwd, hook=None, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_env(hook))


def _pasted(line: str, marker: str) -> str:
    """The command after ``marker`` in a printed line."""
    assert marker in line, line
    return line.split(marker, 1)[1].strip()


def _paste(command: str, cwd, timeout=300):
    """Run a printed command as a user pasting it into a shell would."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=_env())


def _lines(run):
    return [{k: v for k, v in json.loads(x).items() if k not in WALL_FIELDS}
            for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def _flatbnn_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("flatbnn: stopped") or ln.startswith("flatbnn: error")
            or ln.startswith("flatbnn: interrupted")]


def _run_dirs(work: Path) -> list[Path]:
    return sorted(p.parent for p in (work / "outputs").rglob(".hydra"))


# ------------------------------------------------------------------ the stop line of a plain run, pasted
def test_the_stop_line_of_a_plain_run_resumes_it_when_pasted_and_ends_with_the_uninterrupted_metrics(tmp_path):
    args = SMALL + ["trainer.epochs=3"]
    straight = tmp_path / "straight"
    train_cli(args, straight)
    work = tmp_path / "work"
    work.mkdir()
    p = _train(args, work, hook="stop_at_step:6")  # a plain run: its dir is outputs/<date>/<time>
    assert p.returncode == 75, p.stderr[-3000:]
    [line] = _flatbnn_lines(p.stderr)
    [run] = _run_dirs(work)
    assert "Traceback" not in p.stderr and f"hydra.run.dir={run}" in line, line
    assert line in (run / "train.log").read_text()  # the line is in the run's log too
    again = _paste(_pasted(line, "; to resume: "), work)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at epoch 2, step 3 of 4" in again.stderr  # resumed where it stopped (global step 6 of 4 a epoch)
    assert _run_dirs(work) == [run]  # no new run at epoch 1
    done, ref = (json.loads((d / "results.json").read_text())["metrics"] for d in (run, straight))
    assert done["nll"] == ref["nll"] and done["accuracy"] == ref["accuracy"]
    assert _lines(run) == _lines(straight)


def test_the_disk_full_line_resumes_the_run_from_its_last_good_checkpoint_when_pasted(tmp_path):
    args = SMALL + ["trainer.epochs=2"]
    straight = tmp_path / "straight"
    train_cli(args, straight)
    work = tmp_path / "work"
    work.mkdir()
    p = _train(args, work, hook="disk_full_at_save:2")  # epoch 1's checkpoint written, epoch 2's not
    assert p.returncode == 2, p.stderr[-3000:]
    [line] = _flatbnn_lines(p.stderr)
    [run] = _run_dirs(work)
    assert "No space left" in line and line in (run / "train.log").read_text()
    again = _paste(_pasted(line, "; to resume: "), work)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr and _run_dirs(work) == [run]
    done, ref = (json.loads((d / "results.json").read_text())["metrics"] for d in (run, straight))
    assert done["nll"] == ref["nll"] and done["accuracy"] == ref["accuracy"]


def test_a_sweep_members_disk_full_line_resumes_that_member_alone_when_pasted(tmp_path):
    """A --multirun member that fails after training (here: a full disk at its 2nd checkpoint) prints a command for
    itself alone -- its own overrides, its dir pinned, no --multirun -- that resumes it to the uninterrupted run's
    metrics and leaves the other members as they are."""
    args = SMALL + ["trainer.epochs=2"]
    straight = tmp_path / "straight"
    train_cli(args + ["seed=0"], straight)
    work = tmp_path / "work"
    work.mkdir()
    p = _train(["--multirun", *args, "seed=0,1", f"hydra.sweep.dir={work / 'sweep'}"], work,
               hook="disk_full_at_save:2")  # member 0's epoch-2 checkpoint; member 1 trains on
    assert p.returncode != 0, p.stderr[-3000:]
    [line] = [ln for ln in p.stderr.splitlines() if ln.startswith("flatbnn: error in") and "No space left" in ln]
    command = _pasted(line, "to resume (this member alone): ")
    member = Path(shlex.split(command)[-1].split("=", 1)[1])
    assert "--multirun" not in command and "seed=0" in shlex.split(command) and "seed=0,1" not in command
    other = [d for d in (work / "sweep").iterdir() if d.is_dir() and d != member and (d / "results.json").exists()]
    assert len(other) == 1
    before = (other[0] / "results.json").read_bytes()
    again = _paste(command, work)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    done, ref = (json.loads((d / "results.json").read_text())["metrics"] for d in (member, straight))
    assert done["nll"] == ref["nll"] and done["accuracy"] == ref["accuracy"]
    assert (other[0] / "results.json").read_bytes() == before


def test_the_divergence_line_names_this_run_dir_and_a_lower_lr_and_goes_to_train_log(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    p = _train(SMALL + ["trainer.epochs=1", "optimizer.lr=1e30"], work)
    assert p.returncode == 2, p.stderr[-3000:]
    [line] = _flatbnn_lines(p.stderr)
    [run] = _run_dirs(work)
    command = _pasted(line, "at a tenth of the lr: ")
    assert shlex.split(command)[-3:] == [f"hydra.run.dir={run}", "optimizer.lr=1e+29",
                                         "trainer.resume_overrides=[optimizer.lr]"], command
    assert "optimizer.lr=1e30" not in command  # replaced, not repeated
    assert line in (run / "train.log").read_text()


def test_resume_command_pins_a_sweeps_dir_and_names_torchrun_under_ddp(tmp_path, monkeypatch):
    """The DDP failure line and a sweep member's stop line print the same command builder's output."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from flatbnn import cli
    from flatbnn.resources import CONFIGS_DIR

    def hydra_job(mode):
        with initialize_config_dir(config_dir=str(CONFIGS_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["seed=1"], return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.mode = mode
            cfg.hydra.sweep.subdir = "a/b"
        HydraConfig.instance().set_config(cfg)

    hydra_job(RunMode.MULTIRUN)
    monkeypatch.setattr(sys, "argv", ["train.py", "--multirun", "seed=0,1", "optimizer.lr=0.1"])
    monkeypatch.setitem(sys.modules, "__main__", __import__("types").ModuleType("__main__"))  # python train.py
    cli.remember_command()
    sweep = tmp_path / "my sweep"
    cmd = shlex.split(cli.resume_command(sweep / "a" / "b"))
    assert cmd[1:] == ["train.py", "--multirun", "seed=0,1", "optimizer.lr=0.1", f"hydra.sweep.dir='{sweep}'"], cmd
    hydra_job(RunMode.RUN)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cmd = shlex.split(cli.resume_command(tmp_path / "r"))
    assert cmd[:3] == ["torchrun", "--standalone", "--nproc_per_node=2"] and cmd[3] == "train.py", cmd
    assert cmd[-1] == f"hydra.run.dir={tmp_path / 'r'}"
    line = __import__("flatbnn.engine.distributed", fromlist=["x"]).dist_failure_line(
        RuntimeError("Connection closed by peer"), 5)
    assert "rerun the same command" not in line  # the entry point adds the command (train.py's _failed)


# ------------------------------------------------------------------ stop signals while no job runs
def _row(tmp_path, seeds):
    rows, out = tmp_path / "rows", tmp_path / "out"
    rows.mkdir()
    (rows / "r.yaml").write_text(yaml.safe_dump(
        {"row": "r", "paper": "none", "title": "r", "kind": "train", "axes": ["method"],
         "base": SMALL + ["trainer.epochs=1", "trainer.eval_every=0"],
         "values": {"method": {"sgd": ["flatness=none"]}}, "seeds": seeds,
         "scales": {"cpu": {"overrides": []}, "smoke": {"overrides": []}}}))
    return rows, out


def _reproduce(rows, out, hook, *extra_args):
    code = ("import runpy, sys; from pathlib import Path; from flatbnn.reproduce import spec; "
            f"spec.ROWS_DIR = Path({str(rows)!r}); sys.argv = ['reproduce.py', 'run', 'r', '--scale', 'cpu', "
            f"'--out', {str(out)!r}] + {list(extra_args)!r}; "
            f"runpy.run_path({str(REPO / 'scripts' / 'reproduce.py')!r}, run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=_env(hook))
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def test_sigterm_to_reproduce_between_sweep_jobs_exits_75_without_a_comparison_from_partial_runs(tmp_path):
    rows, out = _row(tmp_path, [0, 1])
    rc, err = _reproduce(rows, out, "sigterm_after_first_job:parent")
    assert rc == 75, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert (out / "sgd" / "seed0" / "results.json").exists() and not (out / "sgd" / "seed1" / "results.json").exists()
    assert not (out / "comparison").exists(), err[-2000:]  # no comparison built from 1 of 2 runs
    assert any(ln.startswith("flatbnn: stopped by SIGTERM while no job was running") for ln in err.splitlines())
    # issue 54 (cosmetic): it said "the running job checkpointed" though no job was running
    assert "reproduce r: stopped (exit 75); it stopped between jobs or before the first step" in err, err[-2000:]
    assert "checkpointed" not in err, err[-2000:]


def test_ctrl_c_during_a_sweep_childs_imports_is_one_line_exit_130_and_no_comparison(tmp_path):
    rows, out = _row(tmp_path, [0])
    rc, err = _reproduce(rows, out, "sigint_group_importing:hydra")
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "flatbnn: stopped by SIGINT while no job was running" in err, err[-3000:]
    assert not (out / "comparison").exists()


def test_ctrl_c_during_the_imports_of_the_installed_flatbnn_train_is_one_line_and_exit_130(tmp_path):
    """The console script calls pyproject's flatbnn-train target as the first thing: a Ctrl-C while that target's
    module imports Hydra / torch must be one line and 130 (it was a KeyboardInterrupt traceback, exit 1, when the
    target was flatbnn.train:cli, whose module imports everything before cli() installs the handlers)."""
    import tomllib
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["flatbnn-train"]
    module, func = target.split(":")
    code = ("import importlib, importlib.abc, os, signal, sys\n"
            "class F(importlib.abc.MetaPathFinder):\n"
            "    fired = False\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'hydra' and not F.fired:\n"
            "            F.fired = True; os.kill(os.getpid(), signal.SIGINT)\n"
            "        return None\n"
            "sys.meta_path.insert(0, F())\n"
            "sys.argv = ['flatbnn-train', 'dataset=digits']\n"
            f"getattr(importlib.import_module({module!r}), {func!r})()\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=_env())
    assert p.returncode == 130 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert _flatbnn_lines(p.stderr) == ["flatbnn: stopped by SIGINT while no job was running"], p.stderr[-3000:]


def test_sigterm_between_jobs_of_a_plain_sweep_is_one_line_75_and_its_command_finishes_the_sweep(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    proc = _train(["--multirun", *SMALL, "trainer.epochs=1", "seed=0,1"], work, hook="sigterm_after_first_job:self")
    [sweep] = [p.parent for p in (work / "multirun").glob("*/*/0")]  # multirun/<date>/<time>: timestamped
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("flatbnn: stopped by SIGTERM")]
    assert (sweep / "0" / "results.json").exists() and not (sweep / "1" / "results.json").exists()
    again = _paste(_pasted(line, "; to go on: "), work)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((sweep / "1" / "results.json").read_text())["meta"]["seed"] == 1
    assert "already finished" in again.stderr  # seed 0 was not trained again


# ------------------------------------------------------------------ two processes, one dir: their own labels
def test_a_runs_hydra_files_are_its_own_when_another_process_rewrote_them_before_the_lock(tmp_path):
    run = tmp_path / "run"
    p = _train(SMALL + ["trainer.epochs=1", "seed=0", f"hydra.run.dir={run}"], tmp_path,
               hook="hydra_files_rewritten")
    assert p.returncode == 0, p.stderr[-3000:]
    for d in (run / ".hydra", run / ".flatbnn" / "hydra"):
        assert yaml.safe_load((d / "config.yaml").read_text())["seed"] == 0, d
        assert "seed=0" in yaml.safe_load((d / "overrides.yaml").read_text()), d
    # evaluate.py reads the run's config from .hydra/config.yaml: its re-evaluation is labelled seed 0
    from flatbnn.evaluate import evaluate_run
    assert evaluate_run(run, [])["meta"]["seed"] == 0


# ------------------------------------------------------------------ resume from the run dir's own good.pt
def test_resuming_from_the_run_dirs_own_good_pt_keeps_its_metrics_and_does_not_start_over(tmp_path, capsys):
    from flatbnn.engine.trainer import Preempted
    args = SMALL + ["trainer.epochs=2"]
    run_cfg(args, tmp_path / "straight")
    run = tmp_path / "run"
    import flatbnn.engine.trainer as T
    to_device = T.Trainer.to_device

    def stop_at_6(self, batch):
        if self.global_step == 6:
            signal.raise_signal(signal.SIGTERM)
        return to_device(self, batch)

    T.Trainer.to_device = stop_at_6
    try:
        with pytest.raises(Preempted):
            run_cfg(args, run)
    finally:
        T.Trainer.to_device = to_device
    good = run / "checkpoints" / "good.pt"
    assert good.exists()
    capsys.readouterr()
    run_cfg(args + [f"trainer.resume={good}"], run)
    err = capsys.readouterr().err
    assert "starts over" not in err and not (run / ".flatbnn" / "replaced").exists(), err
    assert "at epoch 2, step 0 of 4" in err, err
    assert _lines(run) == _lines(tmp_path / "straight")


# ------------------------------------------------------------------ the refusal names the dir that holds the run
def test_a_refused_resume_of_another_runs_checkpoint_names_that_run_and_leaves_no_run_dir(tmp_path):
    src = tmp_path / "src"
    train_cli(SMALL + ["trainer.epochs=1"], src)
    work = tmp_path / "work"
    work.mkdir()
    p = _train(SMALL + ["trainer.epochs=1", "optimizer.lr=0.5", f"trainer.resume={src}/checkpoints/last.pt"], work)
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"flatbnn: error: {src} holds a run with another config"), line
    # a refused run leaves no run dir, and no empty outputs/<date> (Hydra made both before the job ran)
    assert list((work / "outputs").iterdir()) == [], list((work / "outputs").rglob("*"))


def test_a_refused_plain_run_leaves_no_empty_dated_dir_but_keeps_one_that_holds_another_run(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    p = _train(SMALL + ["seed=-1"], work)
    assert p.returncode == 2 and "seed=-1" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    assert list((work / "outputs").iterdir()) == []
    # a date dir that holds another run stays (only empty dirs are removed)
    from datetime import datetime
    today = work / "outputs" / datetime.now().strftime("%Y-%m-%d")  # Hydra's ${now:%Y-%m-%d}, local time
    (today / "other").mkdir(parents=True)
    p = _train(SMALL + ["seed=-1"], work)
    assert p.returncode == 2 and [x.name for x in today.iterdir()] == ["other"], list(today.rglob("*"))


# ------------------------------------------------------------------ non-numeric metrics are said so
def test_a_non_numeric_metric_is_counted_as_non_numeric_not_non_finite():
    from flatbnn.reproduce.aggregate import fmt_cell, metric_stats
    from flatbnn.reproduce.stats import seed_stats
    st = seed_stats([0.5, "0.7", float("nan"), 0.6, None, [1]])
    assert (st.n, st.n_nonfinite, st.n_nonnumeric) == (2, 2, 2) and math.isclose(st.mean, 0.55)
    cell = fmt_cell(metric_stats([0.5, "abc", 0.7]), "nll")
    assert cell.endswith("[1/3 non-numeric]") and "non-finite" not in cell, cell


# ------------------------------------------------------------------ reproduce: concurrent launchers, bad overrides
def test_a_reproduce_run_whose_jobs_another_launcher_finished_exits_0(tmp_path, monkeypatch):
    """Two launchers of one row: this one's members were refused by the run dirs' locks (its sweep exits 1)
    while the other finished every job. Every job is done: 0, not 1."""
    from flatbnn.reproduce import cli, launch, spec
    rows, out = _row(tmp_path, [0, 1])
    monkeypatch.setattr(spec, "ROWS_DIR", rows)

    def other_launcher_finished_them(cmd):
        for s in (0, 1):
            d = out / "sgd" / f"seed{s}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "results.json").write_text(json.dumps({"metrics": {"nll": 1.0}, "meta": {"seed": s}}))
        return 1

    monkeypatch.setattr(launch, "run_sweep", other_launcher_finished_them)
    assert cli.main(["run", "r", "--scale", "cpu", "--out", str(out), "--no-compare"]) == 0

    (out / "sgd" / "seed1" / "results.json").unlink()  # the other launcher still runs it: this one was refused
    monkeypatch.setattr(launch, "run_sweep", lambda cmd: 1)
    assert cli.main(["run", "r", "--scale", "cpu", "--out", str(out), "--no-compare"]) == 1  # a job is not done


def test_a_job_another_launcher_trains_now_is_left_to_it_not_failed(tmp_path, monkeypatch, capsys):
    """Issue 54: two launchers overlapping on one running job -- the second exited 1 listing that job as failed,
    though it was training in the first. A job whose run-dir lock a live process holds is 'left to pid N', whether
    its lock was taken before this launcher planned (skipped) or while its sweep ran (its member refused)."""
    from flatbnn.engine.lock import RunDirLock
    from flatbnn.reproduce import cli, launch, spec
    rows, out = _row(tmp_path, [0, 1])
    monkeypatch.setattr(spec, "ROWS_DIR", rows)
    d0 = out / "sgd" / "seed0"
    d0.mkdir(parents=True)
    (d0 / "results.json").write_text(json.dumps({"metrics": {"nll": 1.0}, "meta": {"seed": 0}}))
    held, swept = [], []

    def the_other_launcher_took_it_first(cmd):  # both started seed 1; the other's member got the lock
        swept.append(cmd)
        held.append(RunDirLock(out / "sgd" / "seed1").acquire())
        return 1  # this sweep's member was refused the run dir
    monkeypatch.setattr(launch, "run_sweep", the_other_launcher_took_it_first)
    try:
        assert cli.main(["run", "r", "--scale", "cpu", "--out", str(out), "--no-compare"]) == 0
        err = capsys.readouterr().err
        assert f"sgd/seed1: left to pid {os.getpid()} on host " in err and "FAILED" not in err, err
        # planned while the other one trains it: not even started
        assert cli.main(["run", "r", "--scale", "cpu", "--out", str(out), "--no-compare"]) == 0
        err = capsys.readouterr().err
        assert len(swept) == 1 and "1 left to other processes, 0 to run" in err, err
        assert f"sgd/seed1: left to pid {os.getpid()} on host " in err and "FAILED" not in err, err
    finally:
        for lock in held:
            lock.release()


def test_a_sweep_member_another_process_trains_is_left_to_it_and_the_sweep_exits_0(tmp_path):
    """A --multirun member refused its run dir because a live process trains there is 'left to pid N', not a failed
    member: the other members train and the sweep exits 0."""
    from flatbnn.engine.lock import RunDirLock
    sweep = tmp_path / "sweep"
    lock = RunDirLock(sweep / "seed0").acquire()
    try:
        p = _train(["--multirun", *SMALL, "trainer.epochs=1", "trainer.eval_every=0", "seed=0,1",
                    f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=seed${seed}"], tmp_path)
    finally:
        lock.release()
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{sweep}/seed0: left to pid {os.getpid()} on host " in p.stderr and "failed" not in p.stderr, p.stderr[-2000:]
    assert (sweep / "seed1" / "results.json").exists() and not (sweep / "seed0" / "results.json").exists()


def test_a_bad_override_after_the_double_dash_is_refused_once_before_anything_is_launched(tmp_path, monkeypatch,
                                                                                          capsys):
    from flatbnn.reproduce import cli, launch, spec
    rows, out = _row(tmp_path, [0, 1])
    monkeypatch.setattr(spec, "ROWS_DIR", rows)
    launched = []
    monkeypatch.setattr(launch, "run_sweep", lambda cmd: launched.append(cmd) or 1)
    rc = cli.main(["run", "r", "--scale", "cpu", "--out", str(out), "--", "trainer.epochz=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and launched == [], err
    assert len(err) == 1 and "trainer.epochz" in err[0] and "trainer.epochs" in err[0], err  # the closest key
    assert not (out / "sgd").exists() and not (out / ".hydra_cells").exists()
    # a bad VALUE of a known key (issue 54: every job failed, and a comparison of 0 runs was written)
    for bad, why in (("optimizer.lr=fast", "optimizer.lr='fast': must be a number"),
                     ("trainer.epochs=-1", "trainer.epochs=-1: must be >= 0")):
        rc = cli.main(["run", "r", "--scale", "cpu", "--out", str(out), "--", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and launched == [] and len(err) == 1 and why in err[0], (bad, err)
        assert not (out / "sgd").exists() and not (out / "comparison").exists()


# ------------------------------------------------------------------ DDP: workers end with their launcher, in time
def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        kids += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_ddp_workers_checkpoint_and_end_within_30_s_when_their_launcher_is_killed_even_with_slow_steps(tmp_path):
    """torchrun starts its workers in sessions of their own: a Ctrl-C or a signal to the job's process group
    reaches only the launcher. Killed (SIGKILL, OOM), it can no longer stop them: they must stop by themselves
    (SIGTERM on their parent's death), checkpoint and end -- within torchrun's own 30 s grace, although 50 steps
    (the agreement interval of a fast run) take 40 s here."""
    import time
    run, log = tmp_path / "run", tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "train.py"),
           *SMALL, "trainer.device=cpu", "trainer.epochs=500", "trainer.eval_every=0", f"hydra.run.dir={run}"]
    with open(log, "w") as out:
        agent = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=_env("slow_steps:0.8"))
    workers = []
    try:
        t0 = time.monotonic()
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert agent.poll() is None and time.monotonic() - t0 < 240, log.read_text()[-3000:]
            time.sleep(0.2)
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        agent.kill()
        agent.wait(timeout=10)
        killed = time.monotonic()
        while any(_alive(w) for w in workers) and time.monotonic() - killed < 60:
            time.sleep(0.2)
        took = time.monotonic() - killed
    finally:
        for pid in workers + ([agent.pid] if agent.poll() is None else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text()
    assert took < 30, (took, text[-3000:])
    assert text.count("flatbnn: stopped by SIGTERM at epoch") == 2, text[-3000:]  # each rank: one line
    import torch
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert state["step_in_epoch"] > 0 and state["world_size"] == 2  # the stop's mid-epoch checkpoint


# ------------------------------------------------------------------ resume from any checkpoint into any run dir
@pytest.fixture(scope="module")
def straight3(tmp_path_factory):
    """The uninterrupted 3-epoch run the resumed ones must end like (metrics.jsonl lines and results)."""
    run = tmp_path_factory.mktemp("straight3") / "run"
    run_cfg(SMALL + ["trainer.epochs=3"], run)
    return run


def _stopped_in_process(args, run, at: int):
    """``run_cfg(args, run)`` stopped by SIGTERM once ``at`` steps are done (the checkpoint: global step at + 1)."""
    from flatbnn.engine.trainer import Preempted
    import flatbnn.engine.trainer as T
    to_device = T.Trainer.to_device

    def stop(self, batch):
        if self.global_step == at:
            signal.raise_signal(signal.SIGTERM)
        return to_device(self, batch)

    T.Trainer.to_device = stop
    try:
        with pytest.raises(Preempted):
            run_cfg(args, run)
    finally:
        T.Trainer.to_device = to_device


def _same_ending(run, straight):
    done, ref = (json.loads((Path(d) / "results.json").read_text())["metrics"] for d in (run, straight))
    assert done["nll"] == ref["nll"] and done["accuracy"] == ref["accuracy"] and done["ece"] == ref["ece"]
    assert _lines(run) == _lines(straight)


def test_another_runs_last_pt_and_good_pt_resume_into_a_new_dir_to_the_uninterrupted_metrics(tmp_path, straight3,
                                                                                              capsys):
    """Issue 54: ``trainer.resume=<another run>/checkpoints/last.pt hydra.run.dir=<new>`` died after one step
    (``[Errno 2] ... <new>/checkpoints/.good.pt.tmp.<pid>``: good.pt was linked into a checkpoints/ not made yet)."""
    args = SMALL + ["trainer.epochs=3"]
    src = tmp_path / "src"
    _stopped_in_process(args, src, 6)  # last.pt: epoch 2, step 3; good.pt: the end of epoch 1
    before = {f.name: f.read_bytes() for f in (src / "checkpoints").iterdir()}
    assert set(before) == {"last.pt", "good.pt"}
    for name, where in (("last.pt", "at epoch 2, step 3 of 4"), ("good.pt", "at epoch 2, step 0 of 4")):
        new = tmp_path / f"from_{name}"
        capsys.readouterr()
        run_cfg(args + [f"trainer.resume={src}/checkpoints/{name}"], new)
        assert where in capsys.readouterr().err
        _same_ending(new, straight3)
        assert (new / "checkpoints" / "last.pt").is_file()
    assert {f.name: f.read_bytes() for f in (src / "checkpoints").iterdir()} == before  # the source is only read


def test_every_stop_line_continues_the_stopped_run_whatever_trainer_resume_it_was_started_with(tmp_path, straight3):
    """Issue 54: a run started with ``trainer.resume=false`` kept the flag in its stop line (pasted: the run moved
    aside, epoch 1 again); one resumed from its own good.pt, or from another run's last.pt, printed a command going
    back to that checkpoint instead of the stop's last.pt."""
    args = SMALL + ["trainer.epochs=3"]
    work = tmp_path / "work"
    work.mkdir()
    src = tmp_path / "src"
    _stopped_in_process(args, src, 6)
    for start, run, stop_at in [("false", tmp_path / "fresh", 6),                        # stops at epoch 2, step 3
                                (f"{src}/checkpoints/last.pt", tmp_path / "new", 9),     # epoch 3, step 2
                                (f"{src}/checkpoints/good.pt", src, 9)]:
        p = _train(args + [f"trainer.resume={start}", f"hydra.run.dir={run}"], work, hook=f"stop_at_step:{stop_at}")
        assert p.returncode == 75, p.stderr[-3000:]
        [line] = _flatbnn_lines(p.stderr)
        command = _pasted(line, "; to resume: ")
        assert f"trainer.resume={start}" not in command, command
        again = _paste(command, work)
        assert again.returncode == 0, again.stderr[-3000:]
        where = "at epoch 2, step 3 of 4" if stop_at == 6 else "at epoch 3, step 2 of 4"
        assert f"resuming from {run}/checkpoints/last.pt {where}" in again.stderr, (start, again.stderr[-2000:])
        assert not (run / ".flatbnn" / "replaced").exists()  # nothing of the stopped run was moved aside
        _same_ending(run, straight3)


def test_a_full_disk_at_start_is_one_line_naming_the_file_and_leaves_no_run_dir(tmp_path):
    """Issue 54: a full disk when Hydra wrote .hydra/config.yaml left an empty config.yaml, an empty train.log and
    outputs/<date>, and its line named no file. A refused run leaves no run dir; the line names what it could not write."""
    work = tmp_path / "work"
    work.mkdir()
    p = _train(SMALL + ["trainer.epochs=1"], work, hook="disk_full_at_hydra_start")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("flatbnn: error: cannot write ") and "/.hydra/config.yaml: No space left" in lines[0]
    assert list((work / "outputs").iterdir()) == [], list((work / "outputs").rglob("*"))
