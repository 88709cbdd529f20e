"""The GPU window (issue 41): the self-check's paths, what the campaign takes from it, and the whole chain dry on the
CPU (flatbnn/bench/selfcheck.py, flatbnn/reproduce/window.py, window_host.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from flatbnn.bench import selfcheck
from flatbnn.reproduce import window, window_host

REPO = Path(__file__).resolve().parents[1]
ALL_OK = {"usable": [p.name for p in selfcheck.PATHS],
          "paths": {"eager": {"ok": True, "img_s": 100.0}, "cuda_graph": {"ok": True, "img_s": 300.0},
                    "compiled": {"ok": True, "img_s": 310.0}}}


@pytest.fixture(scope="module")
def cells():
    """The composed configs of bsam_t6's MNIST cells (the real config keys the rules read)."""
    from flatbnn.reproduce import launch
    from flatbnn.reproduce.spec import load_row

    row = load_row("bsam_t6")
    return {c.id.split("/")[-1]: launch.compose_cell(list(c.overrides)) for c in row.cells_for("paper")
            if c.id.startswith("mnist/")}


def test_step_overrides_use_only_passing_paths(cells):
    sam, bsam, adam, swag, sgd = (cells[k] for k in ("sam_sgd", "bsam", "adam", "swag", "sgd"))
    assert selfcheck.step_overrides(sam, ALL_OK, cuda=True) == ["flatness.batched_chunks=true",
                                                                "trainer.cuda_graph=true"]
    assert selfcheck.step_overrides(bsam, ALL_OK, cuda=True) == ["trainer.cuda_graph=true"]
    assert selfcheck.step_overrides(adam, ALL_OK, cuda=True) == ["trainer.cuda_graph=true"]
    assert selfcheck.step_overrides(sgd, ALL_OK, cuda=True) == ["trainer.cuda_graph=true"]
    assert selfcheck.step_overrides(swag, ALL_OK, cuda=True) == []  # no path covers SWAG: eager
    assert selfcheck.step_overrides(sam, ALL_OK, cuda=False) == ["flatness.batched_chunks=true"]  # no graph on a CPU

    def without(name):
        return {**ALL_OK, "usable": [n for n in ALL_OK["usable"] if n != name]}
    # a failed path is never used: its cells fall back to what did pass, else to eager
    assert selfcheck.step_overrides(sam, without("sam_m8_batched"), cuda=True) == []
    assert selfcheck.step_overrides(bsam, without("bsam_m8"), cuda=True) == []
    assert selfcheck.step_overrides(adam, without("adam_capturable"), cuda=True) == []
    assert selfcheck.step_overrides(sgd, without("cuda_graph"), cuda=True) == []
    # a graph slower than eager is not the fastest path; compile only where it beat the graph by COMPILE_GAIN
    slow = {**ALL_OK, "paths": {**ALL_OK["paths"], "cuda_graph": {"ok": True, "img_s": 90.0}}}
    assert selfcheck.step_overrides(sgd, slow, cuda=True) == []
    fast = {**ALL_OK, "paths": {**ALL_OK["paths"], "compiled": {"ok": True, "img_s": 400.0}}}
    assert selfcheck.step_overrides(sgd, fast, cuda=True, compile_cache="/c") == [
        "trainer.cuda_graph=true", "trainer.compile=true", "trainer.compile_cache=/c"]


def test_selfcheck_writes_each_section_and_keeps_the_reason(tmp_path):
    """The JSON holds each path as soon as it is done; a path past its cap is unused with its one line."""
    out = tmp_path / "sc.json"
    seen = []

    def log(msg):
        seen.append(len(json.loads(out.read_text())["paths"]))

    rep = selfcheck.run_selfcheck(out, dry=True, budget_s=600, names=["eager", "cuda_graph"],
                                  caps={"cuda_graph": 0.0}, log=log)
    assert seen == [1, 2]
    eager = rep["paths"]["eager"]
    assert eager["ok"] and eager["img_s"] > 0 and eager["drift"] == 0.0 and eager["floor"] > 0
    lrs = eager["lr_per_step"]  # the real cosine schedule moves the lr every step
    assert len(lrs) == selfcheck.CHECK_STEPS and all(a > b for a, b in zip(lrs, lrs[1:]))
    assert rep["paths"]["cuda_graph"] == {**rep["paths"]["cuda_graph"], "ok": False}
    assert "cap" in rep["paths"]["cuda_graph"]["reason"]
    assert rep["usable"] == ["eager"]


def test_a_frozen_lr_fails_the_check(monkeypatch):
    """What the real scheduler is there for: a graphed step whose lr stays put disagrees with eager."""
    import torch

    from flatbnn.engine import graphed

    real_call = graphed.GraphedStep.__call__

    def frozen(self, batch, flatness=None, backprop=None):
        sched, self.method.scheduler = self.method.scheduler, None
        try:
            return real_call(self, batch, flatness, backprop)
        finally:
            self.method.scheduler = sched

    monkeypatch.setattr(graphed.GraphedStep, "__call__", frozen)
    rec = selfcheck.check_path(selfcheck.BY_NAME["cuda_graph"], torch.device("cpu"), dry=True)
    assert not rec["ok"] and "drifted from eager" in rec["reason"]
    assert rec["drift"] > selfcheck.FLOOR_FACTOR * rec["floor"]


def _repo_results_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "results", ".device"], cwd=REPO,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def dry_window(tmp_path_factory):
    """The whole chain on the CPU, one path forced past its cap (sam_m8_batched), then restored."""
    base = tmp_path_factory.mktemp("window")
    out = base / "OUT"
    before = _repo_results_state()
    r = subprocess.run([sys.executable, "-m", "flatbnn.reproduce.window", "--dry-run", "--minutes", "4", "--out",
                        str(out), "--work", str(base / "work"), "--cap", "sam_m8_batched=0"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rr = subprocess.run([sys.executable, "-m", "flatbnn.reproduce.window_host", "restore", str(out)], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
    assert rr.returncode == 0, rr.stderr[-2000:]
    assert _repo_results_state() == before  # a dry window never writes the repository's results/ or .device/
    return out, base / "work"


def test_make_gpu_window_dry_and_restore_run_the_chain_the_fixture_runs():
    """CI no longer runs `make gpu-window DRY=1 && make gpu-restore` besides this file's dry_window fixture: the make
    recipes must stay the fixture's two commands, or the chain a user types would go untested."""
    def recipe(*args):
        return subprocess.run(["make", "-n", *args, "PY=python", "VENV=/nonexistent"], cwd=REPO, capture_output=True,
                              text=True, timeout=60, check=True).stdout
    dry = recipe("gpu-window", "DRY=1")
    assert "python -m flatbnn.reproduce.window --dry-run --minutes 2.5 --out " in dry, dry
    assert "-m flatbnn.reproduce.window_host restore " in recipe("gpu-restore"), recipe("gpu-restore")


def test_dry_window_output_within_the_device_limits(dry_window):
    out, _ = dry_window
    files = {f.name: f.stat().st_size for f in out.iterdir() if f.is_file()}
    assert set(window.OUT_FILES) <= set(files) and len(files) <= window.MAX_FILES
    assert all(0 < b <= window.FILE_LIMIT for b in files.values())
    summary = json.loads((out / "window.json").read_text())
    # what the summary saw is what came back (the log grows by its last line after it)
    assert {k: v for k, v in summary["files"].items() if k != "window.log"} == \
        {k: v for k, v in files.items() if k not in ("window.json", "window.log")}
    t = summary["timeline"]
    assert t["data"] <= t["selfcheck"] <= t["procs"] <= t["campaign"] <= t["packed"]
    assert summary["campaign_exit"] in (0, 75), (out / "window.log").read_text()[-3000:]
    with tarfile.open(out / "campaign.tgz") as tar:
        names = tar.getnames()
    assert any(n.startswith("results/bsam_t6/paper/runs/") and n.endswith("results.json") for n in names)


def test_dry_window_never_uses_the_failed_path(dry_window):
    out, work = dry_window
    sc = json.loads((out / "selfcheck.json").read_text())
    assert not sc["paths"]["sam_m8_batched"]["ok"] and "cap" in sc["paths"]["sam_m8_batched"]["reason"]
    assert "sam_m8_batched" not in sc["usable"] and "eager" in sc["usable"]
    assert sc["procs"]["chosen"] in (1, 2) and set(sc["procs"]["aggregate_img_s"]) == {"1", "2"}
    log = (out / "window.log").read_text()
    assert "campaign on cpu:" in log and "bsam_t6/" in log
    assert "flatness.batched_chunks=true" not in log  # the queue's per-job step paths
    cfgs = list((work / "outputs").glob("bsam_t6/paper/*/*/*/seed*/config_resolved.yaml"))
    assert cfgs and not any("batched_chunks: true" in c.read_text() for c in cfgs)


def test_dry_restore_puts_records_where_compare_reads_them(dry_window):
    from flatbnn.reproduce import archive

    out, _ = dry_window
    restored = out / "restored"
    sc = list((restored / "bench").glob("cpu-*-selfcheck-*.json"))
    assert len(sc) == 1 and json.loads(sc[0].read_text())["window"]["dry_run"] is True
    recs = list((restored / "results").glob("bsam_t6/paper/runs/*/*/*/seed*/results.json"))
    assert recs
    rec = recs[0].parent
    cell, seed = "/".join(rec.relative_to(restored / "results" / "bsam_t6" / "paper" / "runs").parts[:-1]), \
        int(rec.name[4:])
    assert archive.archived(restored / "results", "bsam_t6", "paper", cell, seed) == rec
    assert (restored / "results" / "bsam_t6" / "paper.md").is_file()  # the comparison, regenerated



def test_bad_input_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flatbnn.reproduce.window_host", "restore", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "selfcheck.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "flatbnn.reproduce.window", "--minutes", "12", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "10 minutes" in r.stderr


def test_the_printed_command_fits_the_device_tool():
    cmd = window_host.command(9.5, "bsam_t6,hwa_fig1,bsam_t3")
    assert len(cmd) <= window_host.COMMAND_LIMIT
    assert cmd.startswith("python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/wheels/*.whl "
                          "&& export PYTHONPATH=/tmp/site:$PWD")
    assert "--data-dir .device --out $OUT" in cmd


def test_restore_queues_unfinished_runs_for_the_next_window(tmp_path):
    """An archive holding an unfinished run dir: the run goes back into its row's run dir and the archive becomes
    .device/resume.tgz (the next window's --restore); an output without unfinished runs removes the stale one."""
    import io

    src = tmp_path / "OUT"
    src.mkdir()
    window_json = {"dry_run": False, "files": {}}
    (src / "window.json").write_text(json.dumps(window_json))
    (src / "selfcheck.json").write_text(json.dumps({"versions": {"device": "NVIDIA H100 80GB HBM3",
                                                                  "date": "2026-11-27 16:00:00", "commit": "abc1234"},
                                                     "paths": {}, "usable": []}))
    ckpt = b"checkpoint bytes"
    with tarfile.open(src / "campaign.tgz", "w:gz") as tar:
        info = tarfile.TarInfo("runs/bsam_t6/mnist/mlp/sgd/seed0/checkpoints/last.pt")
        info.size = len(ckpt)
        tar.addfile(info, io.BytesIO(ckpt))
    roots = dict(results_root=tmp_path / "results", runs_root=tmp_path / "outputs", bench_dir=tmp_path / "bench",
                 device_dir=tmp_path / "device")
    got = window_host.restore(src, **roots, log=lambda s: None)
    run = tmp_path / "outputs" / "bsam_t6" / "paper" / "mnist" / "mlp" / "sgd" / "seed0"
    assert got["restored_runs"] == [str(run)] and (run / "checkpoints" / "last.pt").read_bytes() == ckpt
    resume = tmp_path / "device" / "resume.tgz"
    assert got["resume"] == str(resume) and resume.read_bytes() == (src / "campaign.tgz").read_bytes()
    assert (tmp_path / "bench" / "nvidia-h100-80gb-hbm3-2026-11-27-selfcheck-abc1234.json").is_file()
    with tarfile.open(src / "campaign.tgz", "w:gz"):
        pass  # the next window finished everything: no runs/ left
    assert window_host.restore(src, **roots, log=lambda s: None)["resume"] is None and not resume.exists()


def test_exact_math_is_what_the_comparison_runs_under(monkeypatch):
    """On an H100 eager disagreed with eager by 4.4e-2 under the defaults (TF32, atomics): the 1e-4 check needs TF32
    off and deterministic kernels, set before either run (red if exact_math loses a line or check_path skips it)."""
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = True, True
        selfcheck.exact_math(torch.device("cuda"))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
         torch.backends.cudnn.deterministic) = saved[:4]
        torch.use_deterministic_algorithms(saved[4], warn_only=saved[5])
    seen = []
    monkeypatch.setattr(selfcheck, "exact_math", lambda device: seen.append(device.type))
    rec = selfcheck.check_path(selfcheck.BY_NAME["eager"], torch.device("cpu"), dry=True)
    assert seen == ["cpu"] and rec["ok"] and rec["worst_tensor"]


def test_the_limit_is_what_rounding_alone_produced():
    """Full-size ResNet-20-FRN on a CPU, 5 steps (2026-11-27): eager from weights one ulp off drifted 2.3e-3 (the
    floor); SAM's batched chunks, which only reorder sums, 1.2e-3; a graph whose lr stays put 0.177. A fixed 1e-4
    (the first H100 window's rule) refuses the batched chunks; the floor-relative limit passes them and still
    refuses the frozen lr. Red if the floor term or its factor goes."""
    floor = 2.3e-3
    assert selfcheck.judge_limit("fp32", floor) >= 1.2e-3 > selfcheck.TOLERANCE["fp32"]
    assert selfcheck.judge_limit("fp32", floor) < 0.177 / 4  # a 4x margin below the frozen-lr drift
    assert selfcheck.judge_limit("fp32", 0.0) == selfcheck.TOLERANCE["fp32"]  # bit-identical eager: the fixed floor


def test_a_carried_selfcheck_stands_only_on_the_device_torch_and_cuda_it_ran_on(tmp_path):
    here = {"torch": "2.11.0+cu130", "cuda": "13.0", "device": "NVIDIA H100 80GB HBM3", "commit": "new", "date": "d2"}
    old = {"versions": {**here, "commit": "old", "date": "d1"}, "usable": ["eager", "bsam_m8"],
           "paths": {"eager": {"ok": True}, "bsam_m8": {"ok": True}, "compiled": {"ok": False, "reason": "x"}},
           "procs": {"chosen": 2}, "window": {"minutes": 9.5}}
    assert window.reused_selfcheck(tmp_path, here) == (None, "none carried")
    (tmp_path / window.REUSED_SELFCHECK).write_text(json.dumps(old))
    report, why = window.reused_selfcheck(tmp_path, here)
    assert why == "" and report["usable"] == ["eager", "bsam_m8"] and report["procs"]["chosen"] == 2
    assert report["versions"] == here and report["reused"]["commit"] == "old" and "window" not in report
    for key, other in (("device", "NVIDIA H200"), ("torch", "2.12.0"), ("cuda", "12.8")):
        report, why = window.reused_selfcheck(tmp_path, {**here, key: other})
        assert report is None and why.startswith("it ran elsewhere: ") and f"here {other!r}" in why


def test_prepare_carries_a_selfcheck_only_while_the_step_code_is_the_one_it_checked(tmp_path):
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    head = git("rev-parse", "HEAD")
    before = git("rev-list", "-1", "HEAD", "--", "flatbnn/bench/selfcheck.py") + "^"  # the check's code differs
    gpu = {"versions": {"device": "NVIDIA H100 80GB HBM3", "commit": head, "dry_run": False}, "paths": {},
           "usable": []}
    for name, report in (("ok", gpu), ("dry", {**gpu, "versions": {**gpu["versions"], "dry_run": True,
                                                                   "device": "cpu"}}),
                         ("old", {**gpu, "versions": {**gpu["versions"], "commit": git("rev-parse", before)}})):
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    assert window_host.reusable_selfcheck(tmp_path / "ok.json")["versions"]["commit"] == head
    with pytest.raises(window_host.WindowError, match="not a GPU self-check"):
        window_host.reusable_selfcheck(tmp_path / "dry.json")
    with pytest.raises(window_host.WindowError, match=r"step code changed since .*flatbnn/bench/selfcheck.py"):
        window_host.reusable_selfcheck(tmp_path / "old.json")


def test_a_job_log_keeps_its_start_and_its_end():
    """The window returned a bSAM job's last 64 KiB of progress bars: its start-up lines (device, the step's
    capture) were gone. Now the first JOBLOG_HEAD and the last JOBLOG_TAIL bytes, the cut marked."""
    start, end = b"flatbnn: mnist | mlp | cuda:0\ntrainer.cuda_graph: step captured\n", b"flatbnn: stopped\n"
    log = start + b"x" * (window.JOBLOG_HEAD + window.JOBLOG_TAIL) + end
    got = window.log_excerpt(log)
    assert got.startswith(start) and got.endswith(end) and len(got) < window.JOBLOG_HEAD + window.JOBLOG_TAIL + 64
    cut = len(log) - window.JOBLOG_HEAD - window.JOBLOG_TAIL
    assert f"[... {cut} bytes left out ...]".encode() in got
    assert window.log_excerpt(start + end) == start + end


def _tree(pid: int) -> list[int]:
    """The processes below ``pid`` (/proc)."""
    import os
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return []
    return kids + [k for kid in kids for k in _tree(kid)]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 75)])
def test_a_stopped_dry_window_is_one_line_its_code_and_leaves_no_child_work_dir_or_temp_file(tmp_path, sig, code):
    """Issue 54: ``make gpu-window DRY=1`` interrupted showed a traceback and left its $TMPDIR/flatbnn-window-* dir.
    Stopped while its self-check children run: one line on stderr, 130 (Ctrl-C) / 75, every child process gone, the
    scratch folder it made removed, no half-written file in $OUT (its log stays)."""
    import os
    import signal
    import time

    tmpdir, out = tmp_path / "tmpdir", tmp_path / "out"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "flatbnn.reproduce.window", "--dry-run", "--minutes", "2.5", "--out",
                          str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        t0 = time.monotonic()
        while not _tree(p.pid) or not list(tmpdir.glob("flatbnn-window-*/data")):
            assert p.poll() is None and time.monotonic() - t0 < 120, "the window ended before its self-check"
            time.sleep(0.1)
        time.sleep(1.0)  # the self-check's children at work
        kids = _tree(p.pid)
        p.send_signal(getattr(signal, sig))
        err = p.communicate(timeout=120)[1]
    finally:
        if p.poll() is None:
            p.kill()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == code and len(lines) == 1 and lines[0].startswith(f"window: stopped by {sig}"), err[-3000:]
    assert not [k for k in kids if _running(k)], "a child of the window outlived it"
    assert list(tmpdir.iterdir()) == [], list(tmpdir.rglob("*"))[:5]
    assert sorted(f.name for f in out.iterdir() if f.name.startswith(".")) == []
    assert lines[0] in (out / "window.log").read_text()


def test_an_eager_window_checks_no_path_and_its_campaign_runs_every_job_eagerly(tmp_path, monkeypatch):
    """EAGER=1 (window 6): no self-check child starts, every path says why it is unused, so the campaign's
    step overrides for every cell are the eager ones; the printed command carries the choice."""
    cmd = window_host.command(7.3, "posterior_flatness_grid", procs=4, eager=True)
    assert cmd.endswith("--rows posterior_flatness_grid --procs 4 --eager") and len(cmd) <= window_host.COMMAND_LIMIT
    monkeypatch.setattr(selfcheck, "_timed_child", lambda *a, **k: pytest.fail("a self-check child started"))
    seen = {}

    def campaign(out, **kw):
        seen.update(kw, report=json.loads((out / "selfcheck.json").read_text()))
        return 0

    monkeypatch.setattr(window, "run_campaign", campaign)
    summary = window.run_window(tmp_path / "out", minutes=2.5, dry=True, data_dir=None, work=tmp_path / "work",
                                procs=2, eager=True)
    rep = seen["report"]
    assert summary["usable"] == rep["usable"] == [] and seen["procs"] == 2
    assert set(rep["paths"]) == {p.name for p in selfcheck.PATHS}
    assert {r["reason"] for r in rep["paths"].values()} == {"eager window (--eager): not checked"}
