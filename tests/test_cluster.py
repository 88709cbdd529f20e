"""Cluster life cycle: launchers as config, exit codes a requeue script relies on, a submitit requeue that
resumes, multi-node DDP over a c10d rendezvous, and DDP deadlines (docs/cluster.md)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, results, train_cli

TINY = ["dataset=digits", "model=mlp", "method=map", "flatness=none", "trainer.device=cpu",
        "trainer.reliability_diagram=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 240) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"exited {proc.returncode} before {path} appeared"
        assert time.time() - t0 < limit, f"{path} did not appear within {limit} s"
        time.sleep(0.1)


def _epochs_done(run_dir: Path) -> int:
    m = run_dir / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


# ---------------------------------------------------------------------------------------------- launchers


def _hydra_cfg(overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_launchers_compose_and_the_default_stays_basic():
    from omegaconf import OmegaConf

    assert _hydra_cfg([]).hydra.launcher._target_.endswith("BasicLauncher")  # a laptop needs nothing new
    slurm = _hydra_cfg(["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4", "hydra.launcher.nodes=2"])
    launcher = OmegaConf.to_container(slurm.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert launcher["tasks_per_node"] == 4 and launcher["nodes"] == 2  # one task (DDP rank) per GPU
    assert launcher["max_num_timeout"] > 0 and launcher["signal_delay_s"] >= 60  # requeues; time to checkpoint
    local = _hydra_cfg(["hydra/launcher=local"]).hydra.launcher
    assert local._target_.endswith("submitit_launcher.LocalLauncher")
    assert _hydra_cfg(["hydra/launcher=cpu_parallel"]).hydra.launcher._target_.endswith("JoblibLauncher")
    shared = _hydra_cfg(["hydra/launcher=gpu_shared"]).hydra.launcher  # many processes on one GPU
    assert shared._target_.endswith("JoblibLauncher") and shared.n_jobs > 2


def test_train_py_shows_the_slurm_launcher():
    p = subprocess.run([sys.executable, "train.py", "hydra/launcher=slurm", "--cfg", "hydra"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 0, p.stderr
    assert "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in p.stdout


def test_a_paper_row_is_one_slurm_array_of_every_cell(tmp_path):
    from flatbnn.reproduce import launch, spec

    row = spec.load_row("flatbnn_t2")
    s = launch.launch(row, "paper", out=tmp_path / "out", launcher="slurm", dry_run=True)
    # two arrays: the SGLD cells fine-tune the SWAG runs (scales.paper.init_from), so they run after them
    assert len(s["commands"]) == 2 and s["command"] == s["commands"][0]
    arrays = []
    for cmd in s["commands"]:
        assert "hydra/launcher=slurm" in cmd and "--multirun" in cmd
        arrays.append(next(a for a in cmd if a.startswith("+cell=")).split("=", 1)[1].split(","))
    for cells, dependent in zip(arrays, (False, True)):
        expected = {launch.cell_config_name(c.id, seed) for c in row.cells_for("paper") if not c.blocked
                    and bool(c.init_from) == dependent for seed in c.seeds}
        assert set(cells) == expected and len(cells) == len(expected)
    assert sum(map(len, arrays)) == len(s["jobs"])
    cmd = s["command"]
    cells = arrays[0]
    # what the array would run composes, with the SLURM launcher
    one = [a for a in cmd[cmd.index("--multirun") + 1:] if not a.startswith("+cell=")] + [f"+cell={cells[0]}"]
    p = subprocess.run([sys.executable, "train.py", *one, "--cfg", "hydra"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=ENV)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "SlurmLauncher" in p.stdout


def test_compare_on_partial_results_shows_finished_and_marks_pending(tmp_path):
    from flatbnn.reproduce import compare, compare_markdown, spec
    from test_reproduce import _fake_run

    row = spec.load_row("flatbnn_t2")
    out = tmp_path / "out"
    _fake_run(out, "wrn28x10/f_swag", 0, 0.95, 0.2)                 # 1 of 3 seeds finished
    ckpt = out / "wrn28x10" / "swag" / "seed0" / "checkpoints"        # a preempted job waiting for its requeue
    ckpt.mkdir(parents=True)
    (ckpt / "last.pt").write_bytes(b"x")
    c = compare.build(row, "paper", out)
    state = {r["cell"]: r["state"] for r in c["table"] if r["metric"] == "accuracy"}
    assert state["wrn28x10/f_swag"] == "1/3 seeds"
    assert "interrupted" in state["wrn28x10/swag"] and "pending" in state["wrn28x10/swag"]
    assert state["preresnet164/swag"] == "pending"
    assert "1/3 seeds" in compare_markdown.to_markdown(c)


# ---------------------------------------------------------------------------------------------- exit codes


def test_torchrun_wrapper_exit_code_rules():
    from flatbnn.torchrun import job_exit_code

    assert job_exit_code({}) == 0
    assert job_exit_code({0: 75, 1: 75}) == 75
    assert job_exit_code({0: 75, 1: -signal.SIGTERM}, 0) == 75   # the agent stopped the peer after the 75
    assert job_exit_code({1: -signal.SIGTERM, 0: 75}, 1) == 75
    assert job_exit_code({0: 2, 1: -signal.SIGTERM}, 1) == 2      # the root cause, not the kill it caused
    assert job_exit_code({0: 75, 1: 1}, 0) == 1                   # a real failure beside a stop is a failure
    assert job_exit_code({0: -signal.SIGKILL}, 0) == 137


def test_job_signals_raise_outside_the_loop_and_results_decide_the_code(tmp_path):
    from flatbnn.engine import preemption
    from flatbnn.engine.trainer import Preempted

    res = tmp_path / "results.json"
    with preemption.JobSignals() as guard:
        with pytest.raises(Preempted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert e.value.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat during the exit path changes nothing
        with pytest.raises(SystemExit) as ex:
            preemption.stop(e.value, guard, results=res, mtime_before=None, exit_preempted=75)
        assert ex.value.code == 75
        res.write_text("{}")  # an old results.json is not this run's
        with pytest.raises(SystemExit):
            preemption.stop(e.value, guard, results=res, mtime_before=preemption.mtime(res), exit_preempted=75)
        assert preemption.stop(e.value, guard, results=res, mtime_before=None, exit_preempted=75) is None
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.slow
def test_sigterm_during_final_evaluation_exits_75_and_after_results_exits_0(tmp_path):
    # SWAG with many predictive samples: the final evaluation lasts seconds, so the signal lands inside it
    args = TINY[:2] + ["method=swag", "method.swa_start=0", "method.num_samples=400", "trainer.epochs=2",
                       "trainer.device=cpu", "trainer.reliability_diagram=false", "trainer.progress=false"]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    p = subprocess.Popen(cmd, cwd=REPO, env=ENV, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while _epochs_done(run_dir) < 2:
        assert p.poll() is None and time.time() - t0 < 240
        time.sleep(0.05)
    time.sleep(1.0)  # past the final checkpoint, inside the final evaluation
    assert not (run_dir / "results.json").exists()
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 75, err[-2000:]
    assert "outside the training loop" in err and not (run_dir / "results.json").exists()
    # rerun: resumes at the end, evaluates only; a SIGTERM once results.json exists is a finished run: 0
    p = subprocess.Popen(cmd + ["trainer.reliability_diagram=true"], cwd=REPO, env=ENV, stderr=subprocess.PIPE,
                         text=True)
    _wait_for(run_dir / "results.json", p)
    alive = p.poll() is None
    if alive:
        p.send_signal(signal.SIGTERM)  # while the reliability diagram is drawn
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 0, err[-2000:]
    assert "resuming from" in err
    if alive:
        assert "the run is complete" in err


@pytest.mark.slow
def test_torchrun_wrapper_exits_75_when_every_worker_checkpointed(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "flatbnn.torchrun", "--standalone", "--nproc_per_node=2", str(REPO / "train.py"),
           *TINY, "trainer.epochs=200", "trainer.batch_size=32", "trainer.progress=false", f"hydra.run.dir={run_dir}"]
    p = subprocess.Popen(cmd, cwd=REPO, env=ENV, stderr=subprocess.PIPE, text=True)
    _wait_for(run_dir / "metrics.jsonl", p)
    p.send_signal(signal.SIGTERM)  # what SLURM sends the job step
    err = p.communicate(timeout=180)[1]
    assert p.returncode == 75, err[-3000:]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    assert state["world_size"] == 2 and state["global_step"] > 0
    assert "-> exit 75" in err.splitlines()[-1]


# ---------------------------------------------------------------------------------------------- submitit requeue


def _submitit_tasks(sweep_dir: Path) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        if "submitit.core._submit" in cmd and any(str(sweep_dir) in c for c in cmd):
            pids.append(int(pid))
    return pids


@pytest.mark.slow
def test_submitit_local_preemption_requeues_resumes_and_finishes_identically(tmp_path):
    """A real submitit job (hydra/launcher=local), a real SIGUSR2 (what SLURM sends signal_delay_s before the
    time limit), a real resubmission by submitit: the requeued job resumes the same run dir mid-epoch and ends
    with the uninterrupted run's metrics, bit for bit."""
    args = [*TINY, "trainer.epochs=30", "trainer.batch_size=32", "trainer.progress=false", "seed=0"]
    sweep = tmp_path / "sweep"
    p = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--multirun", "hydra/launcher=local",
                          f"hydra.sweep.dir={sweep}", *args], cwd=REPO, env=ENV, stderr=subprocess.PIPE, text=True)
    member = sweep / "0"
    _wait_for(member / "metrics.jsonl", p)
    tasks = _submitit_tasks(sweep)
    assert len(tasks) == 1, tasks
    os.kill(tasks[0], signal.SIGUSR2)
    err = p.communicate(timeout=400)[1]
    assert p.returncode == 0, err[-3000:]
    logs = "".join(f.read_text() for f in sorted((sweep / ".submitit").rglob("*_log.*")))
    assert "Caught signal SIGUSR2" in logs and "Requeued job" in logs
    resumed = [ln for ln in logs.splitlines() if ln.startswith("resuming from")]
    assert len(resumed) == 1 and ", step 0" not in resumed[0], resumed  # resumed mid-epoch, not restarted
    train_cli(args, tmp_path / "plain")
    ours, plain = results(member), results(tmp_path / "plain")
    assert ours["meta"]["budget"]["steps"] == plain["meta"]["budget"]["steps"]
    for k in ("accuracy", "nll", "ece", "brier", "auroc_misclassification"):
        assert ours["metrics"][k] == plain["metrics"][k], k


# ---------------------------------------------------------------------------------------------- multi-node DDP


@pytest.mark.slow
def test_two_nodes_over_c10d_rendezvous_match_two_processes_on_one_node(tmp_path):
    args = [*TINY, "dataset.train_subset=1400", "trainer.batch_size=56", "trainer.epochs=2",
            "trainer.progress=false"]
    train_cli(args, tmp_path / "one_node", torchrun=2)
    port = _free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two_nodes",
            "--rdzv-conf", "join_timeout=120", str(REPO / "train.py"), *args, f"hydra.run.dir={tmp_path / 'two'}"]
    nodes = [subprocess.Popen(node, cwd=REPO, env=ENV, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [n.communicate(timeout=600)[1] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    one, two = results(tmp_path / "one_node"), results(tmp_path / "two")
    assert two["meta"]["budget"]["world_size"] == 2
    for k in ("accuracy", "nll", "ece", "brier", "auroc_misclassification"):
        assert two["metrics"][k] == one["metrics"][k], k  # same gloo all-reduce, same shards: bit for bit


@pytest.mark.slow
def test_a_node_that_never_arrives_ends_with_one_line_within_the_timeout(tmp_path):
    # torchrun's c10d rendezvous: --rdzv-conf join_timeout
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "flatbnn.torchrun", "--nnodes=2", "--nproc_per_node=1",
                        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--rdzv-id=alone",
                        "--rdzv-conf", "join_timeout=5", str(REPO / "train.py"), *TINY,
                        f"hydra.run.dir={tmp_path / 'a'}"], cwd=REPO, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and time.time() - t0 < 60
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("flatbnn-torchrun: error: rendezvous failed")
    # static rendezvous (the environment a multi-task submitit job exports): trainer.dist_timeout_s
    t0 = time.time()
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, "trainer.dist_timeout_s=3",
                        f"hydra.run.dir={tmp_path / 'b'}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(_free_port())})
    assert p.returncode == 1 and time.time() - t0 < 60, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert "trainer.dist_timeout_s = 3 s" in p.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_stalled_rank_fails_the_others_with_one_line_within_dist_timeout(tmp_path):
    run_dir, port = tmp_path / "run", _free_port()
    procs = []
    for rank in range(2):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY, "trainer.epochs=500",
                                       "trainer.batch_size=32", "trainer.progress=false", "trainer.dist_timeout_s=3",
                                       f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, stderr=subprocess.PIPE,
                                      text=True))
    try:
        _wait_for(run_dir / "checkpoints" / "last.pt", procs[0])  # an epoch is done and checkpointed
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.time()
        err = procs[0].communicate(timeout=120)[1]
        waited = time.time() - t0
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, err[-2000:]
    assert waited < 3 + 30, waited  # the deadline plus the rest of an epoch on a loaded CPU, not for ever
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("flatbnn: error: rank 0:") and "trainer.dist_timeout_s = 3 s" in last
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["epoch"] >= 1  # intact, resumable
