"""A lent GPU window in one command (issue 41; docs/cluster.md "The GPU window"): self-check, 1 vs 2 vs 4 processes,
the campaign for the minutes left, and the output packed for ``make gpu-restore``.

    python3 -m flatbnn.reproduce.window --minutes 9.5 --data-dir .device --out $OUT     # on the device machine
    python -m flatbnn.reproduce.window --dry-run --minutes 2.5 --out /tmp/w            # CPU, tiny sizes (CI)

Timeline, all counted from the start: unpack the carried data (``--data-dir``: wheels/, cifar10_jpeg.tar.gz,
mnist.tar.xz, fashion_mnist.tar.xz, resume.tgz, COMMIT, selfcheck_reused.json: flatbnn/reproduce/window_host.py writes
it), the self-check (flatbnn/bench/selfcheck.py, at most SELFCHECK_S; or an earlier window's, carried, when this
machine's device, torch and CUDA are the ones it ran on), the process count (aggregate images/s of 1, 2, 4 processes), then
scripts/campaign.py with the self-check's usable paths per cell (``--selfcheck``) until PACK_RESERVE_S before the
end; then the packing. ``$OUT`` gets OUT_FILES, flat, each within FILE_LIMIT: the self-check and the log are written
as they grow, so a window cut short still returns them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from flatbnn.bench import selfcheck
from flatbnn.cli import split_after_double_dash

REPO = selfcheck.REPO
SELFCHECK_S = 180.0
PACK_RESERVE_S = 40.0         # the campaign's budget ends this long before the window does: its stop, archive,
#                               packing (9 s in the H100 window of 2026-11-27, after the campaign's own 30 s margin)
FILE_LIMIT = 16 * 2**20       # the device tool returns files of at most 16 MiB ...
MAX_FILES = 8                 # ... at most 8 of them
OUT_FILES = {                 # name in $OUT -> what it holds (make gpu-restore reads them by these names)
    "selfcheck.json": "the self-check: versions, each path's max relative difference, images/s, usable, procs",
    "window.log": "this window's log, the campaign's included",
    "campaign.tgz": "the campaign's archive: touched rows' records + comparisons, unfinished run dirs (checkpoints)",
    "joblogs.tgz": "each campaign job's train.py log (its first JOBLOG_HEAD and last JOBLOG_TAIL bytes)",
    "window.json": "the summary: timeline, chosen processes and paths, the campaign's result, these files' sizes",
}
JOBLOG_HEAD = 16 * 1024     # the start-up lines (data, network, device, the step's capture) ...
JOBLOG_TAIL = 48 * 1024     # ... and the end (one line per epoch fills the middle)
DRY_SELFCHECK_S = 300.0      # the dry run's self-check: its cap (CI's CPU takes ~30 s, a loaded 2-core box minutes)
DRY_CAMPAIGN_S = 120.0       # the dry run's campaign: a few tiny jobs (CI minutes; on a CPU a job that cannot finish
#                               in what is left is not started, so the resume path has its own test)
DRY_ROWS = ["bsam_t6"]        # MNIST-scale cells: train.py jobs of a few seconds on fake idx files
# 4 epochs of one step each: SWAG's swa_start=0.75 collects from epoch round(0.75 * epochs) + 1 on, so 1 or 2 epochs
# collect nothing and its final predictive fails ("no weights were collected")
DRY_EXTRA = ["trainer.epochs=4", "trainer.progress=false", "trainer.reliability_diagram=false", "trainer.num_workers=0"]
DATA_FILES = {"cifar10": "cifar10_jpeg.tar.gz", "mnist": "mnist.tar.xz", "fashion_mnist": "fashion_mnist.tar.xz"}
MNIST_FOLDERS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}


REUSED_SELFCHECK = "selfcheck_reused.json"  # in --data-dir: an earlier window's self-check (window_host prepare
#                                          --selfcheck-from checked its step code is this commit's)
MATCH_KEYS = ("device", "torch", "cuda")    # what must equal this machine's for that verdict to stand here


def reused_selfcheck(data_dir: Path | None, here: dict) -> tuple[dict | None, str]:
    """(the carried self-check made this machine's, '') when its device, torch and CUDA are ``here``'s; else
    (None, why). Its paths, verdicts and images/s stand; ``versions`` become this run's, ``reused`` says whence."""
    f = data_dir / REUSED_SELFCHECK if data_dir is not None else None
    if f is None or not f.is_file():
        return None, "none carried"
    old = json.loads(f.read_text())
    was = old.get("versions") or {}
    differ = [f"{k} {was.get(k)!r} here {here.get(k)!r}" for k in MATCH_KEYS if was.get(k) != here.get(k)]
    if differ:
        return None, "it ran elsewhere: " + ", ".join(differ)
    report = {**old, "versions": here,
              "reused": {k: was.get(k) for k in ("commit", "date", "device", "torch", "cuda")}}
    report.pop("window", None)
    return report, ""


def _versions_here(dry: bool) -> dict:
    """selfcheck.versions in a child: CUDA is never started in this process (it would hold the GPU all window)."""
    code = f"import json; from flatbnn.bench.selfcheck import versions; print(json.dumps(versions({dry})))"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    return json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 and res.stdout.strip() else {}


class Log:
    """Lines to stdout and to ``$OUT/window.log`` at once, each with the seconds since the window began."""

    def __init__(self, path: Path, t0: float):
        self.path, self.t0 = path, t0
        self.lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, msg: str, stamp: bool = True) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}" if stamp else msg
        with self.lock, open(self.path, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)


def fake_mnist(root: Path, n_train: int = 160, n_test: int = 40) -> Path:
    """Tiny random MNIST / Fashion-MNIST idx files in the torchvision layout (the dry run's data), balanced labels."""
    import numpy as np

    from flatbnn.data.mnist import FILES, idx_bytes

    rng = np.random.default_rng(0)
    for folder in MNIST_FOLDERS.values():
        raw = root / folder / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for split, n in (("train", n_train), ("test", n_test)):
            images, labels = FILES[split]
            (raw / images).write_bytes(idx_bytes(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)))
            (raw / labels).write_bytes(idx_bytes(np.arange(n, dtype=np.uint8) % 10))
    return root


def unpack_data(data_dir: Path, dest: Path, log) -> dict[str, str]:
    """data set name -> root for the campaign's ``--data``, from what ``data_dir`` carries (xz tars unpacked)."""
    data = {}
    for name, fname in DATA_FILES.items():
        f = data_dir / fname
        if not f.is_file():
            log(f"data: {name}: not carried ({f} missing): its cells are skipped")
            continue
        if fname.endswith(".tar.xz"):
            with tarfile.open(f, "r:xz") as tar:
                tar.extractall(dest, filter="data")
            data[name] = str(dest)
        else:
            data[name] = str(f.resolve())
        log(f"data: {name} -> {data[name]}")
    return data


def _tee(pr: subprocess.Popen, log) -> threading.Thread:
    def pump():
        for line in pr.stdout:
            log(line.rstrip("\n"), stamp=False)
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def run_campaign(out: Path, *, budget_s: float, procs: int, data: dict[str, str], rows: list[str] | None,
                 restore: Path | None, runs: Path | None, results: Path | None, extra: list[str], margin_s: float,
                 log) -> int:
    """scripts/campaign.py for ``budget_s``; SIGTERM past the budget plus half the pack reserve, a kill 20 s later."""
    cmd = [sys.executable, str(REPO / "scripts" / "campaign.py"), "--minutes", f"{budget_s / 60:.3f}",
           "--procs", str(procs), "--margin-s", str(margin_s), "--selfcheck", str(out / "selfcheck.json"),
           "--archive-out", str(out / "campaign.tgz"), "--archive-limit-mb", f"{FILE_LIMIT / 2**20 * 0.99:.2f}"]
    if data:
        cmd += ["--data", ",".join(f"{k}={v}" for k, v in data.items())]
    if rows:
        cmd += ["--rows", ",".join(rows)]
    if restore is not None:
        cmd += ["--restore", str(restore)]
    if runs is not None:
        cmd += ["--out", str(runs)]
    if results is not None:
        cmd += ["--results", str(results)]
    cmd += ["--", *extra]
    log("campaign: " + " ".join(cmd[1:]))
    pr = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    pump = _tee(pr, log)
    try:
        rc = pr.wait(timeout=budget_s + PACK_RESERVE_S / 2)
    except subprocess.TimeoutExpired:
        log("campaign: past its budget: SIGTERM")
        pr.send_signal(signal.SIGTERM)
        try:
            rc = pr.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pr.kill()
            rc = pr.wait()
    pump.join(timeout=5)
    return rc


def log_excerpt(data: bytes) -> bytes:
    """A job log's first JOBLOG_HEAD and last JOBLOG_TAIL bytes, the cut marked; a shorter log whole."""
    if len(data) <= JOBLOG_HEAD + JOBLOG_TAIL:
        return data
    cut = len(data) - JOBLOG_HEAD - JOBLOG_TAIL
    return data[:JOBLOG_HEAD] + f"\n[... {cut} bytes left out ...]\n".encode() + data[-JOBLOG_TAIL:]


def pack_joblogs(runs_root: Path, dest: Path) -> int:
    """The campaign jobs' logs (``<runs>/<row>/paper/.campaign/*.log``), each as ``log_excerpt``."""
    import io

    tmp = dest.with_name(f".{dest.name}.tmp")
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for f in sorted(runs_root.glob("*/paper/.campaign/*.log")):
                data = log_excerpt(f.read_bytes())
                info = tarfile.TarInfo(f"{f.parent.parent.parent.name}/{f.name}")
                info.size, info.mtime = len(data), int(f.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, dest)
    except BaseException:  # a stop signal mid-write (main): no half archive in $OUT
        tmp.unlink(missing_ok=True)
        raise
    return dest.stat().st_size


def check_out(out: Path) -> dict[str, int]:
    """The sizes of what ``out`` returns; raises if it breaks the device tool's limits (count, size, depth)."""
    files = {str(f.relative_to(out)): f.stat().st_size for f in out.rglob("*") if f.is_file()}
    big = {k: v for k, v in files.items() if v > FILE_LIMIT}
    deep = [k for k in files if k.count("/") > 1]
    if len(files) > MAX_FILES or big or deep:
        raise RuntimeError(f"{out}: {len(files)} files (at most {MAX_FILES}), over {FILE_LIMIT >> 20} MiB: "
                           f"{sorted(big)}, too deep: {deep}")
    return files


def run_window(out: Path, *, minutes: float, dry: bool, data_dir: Path | None, rows: list[str] | None = None,
               work: Path | None = None, extra: list[str] = (), caps: dict[str, float] | None = None,
               procs: int | None = None, selfcheck_s: float | None = None, eager: bool = False) -> dict:
    t0 = time.monotonic()
    end = t0 + minutes * 60
    out.mkdir(parents=True, exist_ok=True)
    stray = sorted(f.name for f in out.iterdir())
    if stray:
        raise FileExistsError(f"{out} is not empty ({', '.join(stray[:4])}): the window writes a fresh $OUT")
    log = Log(out / "window.log", t0)
    work = Path(work) if work is not None else default_work()
    summary: dict = {"minutes": minutes, "dry_run": dry, "timeline": {}, "files": {}}

    def mark(what: str) -> None:
        summary["timeline"][what] = round(time.monotonic() - t0, 1)

    if data_dir is not None and (data_dir / "COMMIT").is_file() and not os.environ.get("FLATBNN_COMMIT"):
        os.environ["FLATBNN_COMMIT"] = (data_dir / "COMMIT").read_text().strip()  # the device copy has no .git
    os.environ.setdefault("FLATBNN_CACHE", str(work / "cache"))
    log(f"window: {minutes:g} min, {'dry run (CPU, tiny sizes)' if dry else 'GPU'}; commit "
        f"{os.environ.get('FLATBNN_COMMIT', '(from .git)')}")
    if dry:
        root = fake_mnist(work / "data")
        data = {name: str(root) for name in MNIST_FOLDERS}
        rows = rows or DRY_ROWS
        extra = [*DRY_EXTRA, *extra]
        runs, results = work / "outputs", work / "results"
    else:
        data = unpack_data(data_dir, work / "data", log) if data_dir is not None else {}
        runs = results = None
    mark("data")

    reserve = PACK_RESERVE_S if not dry else 20.0
    sc_budget = selfcheck_s or min(SELFCHECK_S, 0.35 * (end - time.monotonic() - reserve))
    if dry:  # the children side by side, mostly Python start-up: the dry run's clock is a slow shared CPU's, so
        # MINUTES bounds only the campaign there (DRY_CAMPAIGN_S at most), not the self-check
        sc_budget = DRY_SELFCHECK_S
        caps = {p.name: sc_budget for p in selfcheck.PATHS} | dict(caps or {})
    carried = data_dir is not None and (data_dir / REUSED_SELFCHECK).is_file()  # the versions child costs seconds
    report, why = reused_selfcheck(data_dir, _versions_here(dry)) if carried and not eager else (None, "")
    if eager:  # asked for: no path is checked, so none is used
        report = selfcheck.run_selfcheck(out / "selfcheck.json", dry=dry, budget_s=0.0, log=log,
                                         skip_reason="eager window (--eager): not checked")
    elif report is not None:
        selfcheck.write_json(out / "selfcheck.json", report)
        log(f"self-check: reused from commit {str(report['reused']['commit'])[:8]} of {report['reused']['date']} "
            f"(same device, torch, CUDA; same step code): usable {', '.join(report['usable'])}")
        if procs is None and (report.get("procs") or {}).get("chosen"):
            procs = int(report["procs"]["chosen"])
            log(f"procs: {procs} at once, as that window measured")
    else:
        if why:
            log(f"self-check: the carried one is not reused ({why}): checking here")
        report = selfcheck.run_selfcheck(out / "selfcheck.json", dry=dry, budget_s=sc_budget, caps=caps,
                                         parallel=dry, log=log)
    summary["usable"] = report["usable"]
    summary["not_used"] = {n: r["reason"] for n, r in report["paths"].items() if not r.get("ok")}
    mark("selfcheck")

    if procs is None:
        procs = selfcheck.measure_procs(report, out / "selfcheck.json", dry=dry, seconds=2.0 if dry else 6.0,
                                        counts=(1, 2) if dry else (1, 2, 4), log=log)
    summary["procs"] = procs
    mark("procs")

    budget = end - time.monotonic() - reserve
    if dry:
        budget = min(minutes * 60 - reserve, DRY_CAMPAIGN_S)
    resume = data_dir / "resume.tgz" if data_dir is not None and (data_dir / "resume.tgz").is_file() else None
    if budget < 30:
        log(f"campaign: not started: {budget:.0f} s left before the packing reserve")
        rc = None
    else:
        rc = run_campaign(out, budget_s=budget, procs=procs, data=data, rows=rows, restore=resume, runs=runs,
                          results=results, extra=list(extra), margin_s=5.0 if dry else 30.0, log=log)
    summary["campaign_exit"] = rc
    mark("campaign")

    from flatbnn.reproduce import launch
    pack_joblogs(Path(runs or launch.OUTPUT_ROOT), out / "joblogs.tgz")
    summary["work"] = str(work)
    mark("packed")
    summary["files"] = {k: v for k, v in check_out(out).items() if k != "window.json"}
    selfcheck.write_json(out / "window.json", summary)
    log(f"window: done in {time.monotonic() - t0:.0f} s; $OUT: " + ", ".join(
        f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(check_out(out).items())))
    return summary


def default_work() -> Path:
    """The window's scratch folder when ``--work`` names none: data, caches, a dry run's outputs."""
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"flatbnn-window-{os.getpid()}"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
EXIT_STOPPED, EXIT_INTERRUPTED = 75, 130  # as train.py and scripts/campaign.py: a stop (rerun), Ctrl-C


class Stopped(BaseException):  # not an Exception: no `except Exception` on the way swallows it
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; [] elsewhere), children first."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        kids = []
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                kids += [int(x) for x in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            continue
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def stop_children(grace_s: float = 30.0) -> int:
    """SIGTERM to every process this one started (the self-check's children, the campaign and its train.py jobs,
    which checkpoint and exit 75), up to ``grace_s`` for them to end, then SIGKILL; returns how many there were."""
    kids = _descendants(os.getpid())
    for pid in kids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    end = time.monotonic() + grace_s
    while any(_alive(p) for p in kids) and time.monotonic() < end:
        time.sleep(0.1)
    for pid in kids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return len(kids)


def _stopped(e: Stopped, out: Path, work: Path, own_work: bool) -> int:
    """After a stop signal: the children stopped, the scratch folder this window made and the half-written files of
    ``$OUT`` removed; one line (also in window.log); 75, or 130 for Ctrl-C."""
    import shutil

    for sig in STOP_SIGNALS:  # the way out runs to its end
        signal.signal(sig, signal.SIG_IGN)
    n = stop_children()
    for f in list(out.glob(".*.tmp")) + list(out.glob(".procs.*.json")) if out.is_dir() else []:
        f.unlink(missing_ok=True)
    removed = own_work and work.exists()
    if removed:
        shutil.rmtree(work, ignore_errors=True)
    line = (f"window: stopped by {e}: {n} child process(es) stopped" + (f", {work} removed" if removed else "")
            + f"; {out} keeps what was written (window.log, selfcheck.json); rerun to try again")
    if (out / "window.log").is_file():
        with open(out / "window.log", "a") as f:
            f.write(line + "\n")
    print(line, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED if e.signum == signal.SIGINT else EXIT_STOPPED


def _caps(value: str) -> dict[str, float]:
    out = {}
    for item in (v for v in value.split(",") if v):
        name, _, sec = item.partition("=")
        if name not in selfcheck.BY_NAME:
            raise argparse.ArgumentTypeError(f"--cap {name!r}: not a path ({', '.join(selfcheck.BY_NAME)})")
        out[name] = float(sec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="$OUT: the folder the device tool returns")
    ap.add_argument("--minutes", type=float, required=True, help="the whole window, packing included (<= 9.5)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, fake MNIST, temp outputs (CI)")
    ap.add_argument("--data-dir", type=Path, default=None, help="the carried folder (make gpu-window-prepare)")
    ap.add_argument("--rows", default=None, help="comma-separated rows (default: every train row; dry: bsam_t6)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: under $TMPDIR)")
    ap.add_argument("--procs", type=int, default=None, help="skip the process-count test and use this many")
    ap.add_argument("--cap", type=_caps, default={}, help="per-path time caps, e.g. compiled=60 (seconds)")
    ap.add_argument("--eager", action="store_true",
                    help="no self-check: every job runs its eager step (small nets, where start-up rules)")
    ap.add_argument("--selfcheck-s", type=float, default=None,
                    help=f"seconds for the whole self-check (default: 35%% of the window, at most {SELFCHECK_S:.0f})")
    argv, extra = split_after_double_dash(list(sys.argv[1:] if argv is None else argv))
    args = ap.parse_args(argv)
    if not 0 < args.minutes <= 9.5:
        print(f"window: --minutes {args.minutes:g}: one device command runs at most 10 minutes; give 0 < M <= 9.5",
              file=sys.stderr)
        return 2
    if args.data_dir is not None and not args.data_dir.is_dir():
        print(f"window: --data-dir {args.data_dir}: no such folder (make gpu-window-prepare builds it)", file=sys.stderr)
        return 2
    work = args.work or default_work()

    def stop(signum, frame):
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        run_window(args.out, minutes=args.minutes, dry=args.dry_run, data_dir=args.data_dir,
                   rows=[r for r in args.rows.split(",") if r] if args.rows else None, work=work,
                   extra=extra, caps=args.cap, procs=args.procs, selfcheck_s=args.selfcheck_s, eager=args.eager)
    except FileExistsError as e:
        print(f"window: {e}", file=sys.stderr)
        return 2
    except Stopped as e:  # Ctrl-C, a timeout's SIGTERM: one line, 75 / 130, nothing of this window left running
        return _stopped(e, args.out, work, own_work=args.work is None)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
