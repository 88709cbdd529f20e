"""The GPU window's two ends on this machine (issue 41): ``prepare`` builds the carried folder and prints the device
call; ``restore`` merges what the window returned (flatbnn/reproduce/window.py) into results/.

    python -m flatbnn.reproduce.window_host prepare [--minutes 9.5] [--cifar10 F] [--mnist-root D] [--print]
    python -m flatbnn.reproduce.window_host restore FROM

``prepare`` fills ``.device/`` (git-ignored): the hydra / omegaconf / antlr wheels the device lacks, the CIFAR-10
archive, MNIST and Fashion-MNIST as xz tars of their idx files (gzip leaves 42 MB, xz ~35), COMMIT (the device copy
has no .git), with ``--selfcheck-from`` an earlier window's self-check whose step code is HEAD's (selfcheck_reused.json:
the window skips its own where device, torch and CUDA match), and keeps ``resume.tgz`` (the last window's unfinished runs, put there by ``restore``). It refuses,
naming what to drop, when the working tree plus ``.device/`` would pass the device tool's 64 MiB.
``restore`` unpacks ``FROM/campaign.tgz`` (records and comparisons into results/reproduce, unfinished run dirs into
outputs/reproduce), copies the self-check to results/bench/<device>-<date>-selfcheck-<commit>.json, regenerates the
touched rows' comparisons and results/STATUS.md, and keeps the archive as ``.device/resume.tgz`` when it holds
unfinished runs: the next window resumes them. A dry window's output restores into ``FROM/restored/`` only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from flatbnn.reproduce.window import DATA_FILES, MNIST_FOLDERS, OUT_FILES, REUSED_SELFCHECK
from flatbnn.reproduce.spec import SpecError

REPO = Path(__file__).resolve().parents[2]
CARRY_LIMIT = 64 * 2**20           # the device tool: working tree + carried paths
COMMAND_LIMIT = 2000               # the device tool: characters of one command
DEVICE_DIR = REPO / ".device"
SHARED = REPO.parent / "shared"


class WindowError(Exception):
    """Bad input for prepare / restore: one line, exit 2."""


# ------------------------------------------------------------------------------------------ prepare
def _xz_tar(src_root: Path, folder: str, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        tar.add(src_root / folder / "raw", arcname=f"{folder}/raw")
    os.replace(tmp, dest)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def _tar_size(f: Path) -> int:
    """A file's size as a tar holds it: a 512-byte header, the data padded to 512. The device tool refused 62.79 MiB
    of file bytes (2026-11-27): its ~1,650 files' headers and padding add ~1.2 MiB."""
    return 512 + -(-f.stat().st_size // 512) * 512


def tree_bytes() -> int:
    """What the device tool sends besides the carried paths: tracked files and untracked files git does not ignore."""
    names = _git("ls-files", "-z").split("\0") + _git("ls-files", "-z", "--others", "--exclude-standard").split("\0")
    return sum(_tar_size(REPO / n) for n in set(names) if n and (REPO / n).is_file())


def folder_bytes(d: Path) -> int:
    return sum(_tar_size(f) for f in d.rglob("*") if f.is_file())


# what a self-check verdict depends on: the step code (engine, methods, flatness, models, the check itself); not
# the campaign, the reproduction runner or the window around it (flatbnn/reproduce/, the window included; the two
# bench/ paths are where the window lived before it moved up beside the campaign, which a diff against an older
# self-check's commit still names)
STEP_CODE_EXCLUDED = ("flatbnn/reproduce", "flatbnn/bench/window.py", "flatbnn/bench/window_host.py")


def reusable_selfcheck(f: Path) -> dict:
    """An earlier window's self-check that this commit may carry instead of checking again: a GPU one (not a dry
    run) with a commit whose step code equals HEAD's. Raises WindowError naming why not."""
    try:
        report = json.loads(Path(f).read_text())
    except (OSError, ValueError) as e:
        raise WindowError(f"--selfcheck-from {f}: not a self-check JSON ({e})") from None
    v = report.get("versions") or {}
    if v.get("dry_run") or v.get("device") in (None, "cpu") or not isinstance(report.get("paths"), dict):
        raise WindowError(f"--selfcheck-from {f}: not a GPU self-check (device {v.get('device')!r})")
    commit = str(v.get("commit") or "")
    try:
        _git("cat-file", "-e", f"{commit}^{{commit}}")
    except subprocess.CalledProcessError:
        raise WindowError(f"--selfcheck-from {f}: its commit {commit[:8] or '(none)'} is not in this clone") from None
    changed = _git("diff", "--name-only", commit, "HEAD", "--", "flatbnn",
                   *(f":(exclude){x}" for x in STEP_CODE_EXCLUDED)).split()
    if changed:
        raise WindowError(f"--selfcheck-from {f}: the step code changed since {commit[:8]} ({', '.join(changed[:3])}"
                          f"{', ...' if len(changed) > 3 else ''}): the window must check again")
    return report


def command(minutes: float, rows: str | None = None, procs: int | None = None, eager: bool = False) -> str:
    """The device call's command line: install the carried wheels, then the window."""
    cmd = ("python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/wheels/*.whl && "
           "export PYTHONPATH=/tmp/site:$PWD && python3 -m flatbnn.reproduce.window "
           f"--minutes {minutes:g} --data-dir .device --out $OUT" + (f" --rows {rows}" if rows else "")
           + (f" --procs {procs}" if procs else "") + (" --eager" if eager else ""))
    if len(cmd) > COMMAND_LIMIT:
        raise WindowError(f"the command is {len(cmd)} characters, over the device tool's {COMMAND_LIMIT}")
    return cmd


def prepare(dest: Path = DEVICE_DIR, *, cifar10: Path | None, mnist_root: Path | None, wheels: Path,
            data: list[str], selfcheck_from: Path | None = None, log=print) -> dict:
    """Fill ``dest`` (see the module docstring); returns {"bytes": {...}, "total": n}."""
    if selfcheck_from is not None:
        reused = reusable_selfcheck(selfcheck_from)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / REUSED_SELFCHECK).write_text(json.dumps(reused, indent=1))
    else:
        (dest / REUSED_SELFCHECK).unlink(missing_ok=True)  # never a stale one: each window checks unless told
    unknown = [d for d in data if d not in DATA_FILES]
    if unknown:
        raise WindowError(f"data {unknown}: known are {', '.join(DATA_FILES)}")
    whl = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not whl:
        raise WindowError(f"{wheels}: no wheels (hydra-core, omegaconf, antlr4: the device has none); "
                          f"give WHEELS=<folder>")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "wheels").mkdir(exist_ok=True)
    for old in (dest / "wheels").glob("*.whl"):
        if old.name not in {w.name for w in whl}:
            old.unlink()
    for w in whl:
        shutil.copyfile(w, dest / "wheels" / w.name)
    for name, fname in DATA_FILES.items():
        target = dest / fname
        if name not in data:
            target.unlink(missing_ok=True)
            continue
        if name == "cifar10":
            if cifar10 is None or not Path(cifar10).is_file():
                raise WindowError(f"CIFAR-10: {cifar10}: no such file; give CIFAR10=<cifar10_jpeg.tar.gz> or leave "
                                  f"cifar10 out of DATA")
            if not target.is_file() or target.stat().st_size != Path(cifar10).stat().st_size:
                shutil.copyfile(cifar10, target)
        else:
            folder = MNIST_FOLDERS[name]
            if mnist_root is None or not (Path(mnist_root) / folder / "raw").is_dir():
                raise WindowError(f"{name}: {mnist_root}/{folder}/raw: no such folder; give MNIST_ROOT=<folder "
                                  f"holding {folder}/raw> or leave {name} out of DATA")
            if not target.is_file():
                log(f"prepare: compressing {folder} (xz -9, a few minutes once)")
                _xz_tar(Path(mnist_root), folder, target)
    sha = _git("rev-parse", "HEAD").strip()
    if _git("status", "--porcelain", "--untracked-files=no").strip():
        log("prepare: WARNING: the tree has uncommitted changes; the runs will name commit "
            f"{sha[:8]} although they ran other code: commit first")
    (dest / "COMMIT").write_text(sha + "\n")
    sizes = {f.name: f.stat().st_size for f in sorted(dest.iterdir()) if f.is_file()}
    sizes["wheels/"] = folder_bytes(dest / "wheels")
    tree = tree_bytes()
    total = tree + folder_bytes(dest)
    res = {"bytes": sizes, "tree": tree, "total": total}
    if total > CARRY_LIMIT:
        raise WindowError(f"the tree ({tree / 2**20:.1f} MiB) + {dest.name}/ ({folder_bytes(dest) / 2**20:.1f} MiB) = "
                          f"{total / 2**20:.1f} MiB, over the device tool's 64 MiB: drop a data set whose cells are "
                          f"done (make gpu-window WINDOW_DATA=mnist,fashion_mnist, ...) or {dest.name}/resume.tgz (its runs "
                          f"start over)")
    return res


# ------------------------------------------------------------------------------------------ restore
def _rows_in(archive: Path) -> list[str]:
    with tarfile.open(archive, "r:gz") as tar:
        return sorted({Path(m.name).parts[1] for m in tar.getmembers() if len(Path(m.name).parts) > 1})


def _has_runs(archive: Path) -> bool:
    with tarfile.open(archive, "r:gz") as tar:
        return any(Path(m.name).parts[0] == "runs" and len(Path(m.name).parts) > 2 for m in tar.getmembers())


def restore(src: Path, *, results_root: Path | None = None, runs_root: Path | None = None,
            bench_dir: Path | None = None, device_dir: Path | None = None, log=print) -> dict:
    """Merge a window's ``$OUT`` (see the module docstring). Returns what went where."""
    from flatbnn.reproduce import archive, campaign, cost, launch
    from flatbnn.reproduce.spec import load_row

    src = Path(src)
    missing = [n for n in ("selfcheck.json", "window.json") if not (src / n).is_file()]
    if missing:
        raise WindowError(f"{src}: no {', '.join(missing)}: not a GPU window's output (expected {', '.join(OUT_FILES)})")
    summary = json.loads((src / "window.json").read_text())
    report = json.loads((src / "selfcheck.json").read_text())
    if summary.get("dry_run"):  # fake data, tiny sizes: never into the repository's results
        base = src / "restored"
        results_root, runs_root = results_root or base / "results", runs_root or base / "outputs"
        bench_dir, device_dir = bench_dir or base / "bench", device_dir or base / "device"
    default_results = results_root is None
    results_root = Path(results_root or archive.ARCHIVE_ROOT)
    runs_root = Path(runs_root or launch.OUTPUT_ROOT)
    bench_dir = Path(bench_dir or REPO / "results" / "bench")
    device_dir = Path(device_dir or DEVICE_DIR)
    v = report.get("versions") or {}
    name = (f"{cost.device_slug(v.get('device'))}-{str(v.get('date', 'undated'))[:10]}-selfcheck-"
            f"{str(v.get('commit') or 'unknown')[:7]}.json")
    bench_dir.mkdir(parents=True, exist_ok=True)
    from flatbnn.bench.selfcheck import write_json
    write_json(bench_dir / name, {**report, "window": summary})
    out = {"selfcheck": str(bench_dir / name), "restored_runs": [], "rows": [], "comparisons": [], "resume": None}
    log(f"restore: self-check -> {bench_dir / name}")
    arc = src / "campaign.tgz"
    if arc.is_file():
        out["restored_runs"] = campaign.restore(arc, out_root=runs_root, results_root=results_root)
        out["rows"] = _rows_in(arc)
        rows = [load_row(r) for r in out["rows"]]
        out["comparisons"] = [str(p) for p in campaign.write_comparisons(rows, runs_root, results_root)]
        if default_results and rows:
            from flatbnn.reproduce.status import write_status
            out["status"] = str(write_status())
        device_dir.mkdir(parents=True, exist_ok=True)
        if _has_runs(arc):
            shutil.copyfile(arc, device_dir / ".resume.tgz.tmp")
            os.replace(device_dir / ".resume.tgz.tmp", device_dir / "resume.tgz")
            out["resume"] = str(device_dir / "resume.tgz")
        else:
            (device_dir / "resume.tgz").unlink(missing_ok=True)  # its runs finished or went into this archive
        log(f"restore: {len(out['restored_runs'])} unfinished run(s) into {runs_root}; rows {', '.join(out['rows'])}")
    else:
        log(f"restore: {arc}: none (the campaign did not run or wrote no archive; see window.log)")
    logs = src / "joblogs.tgz"
    if logs.is_file():
        dest = runs_root / ".gpu-window-logs" / str(v.get("date", "undated")).replace(" ", "_").replace(":", "")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(logs, "r:gz") as tar:
            tar.extractall(dest, filter="data")
        if (src / "window.log").is_file():
            shutil.copyfile(src / "window.log", dest / "window.log")
        out["logs"] = str(dest)
    if out["resume"]:
        log(f"restore: the unfinished runs go to the next window: {out['resume']} (make gpu-window-prepare keeps it)")
    return out


# ------------------------------------------------------------------------------------------ CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="build .device/ and print the device call")
    p.add_argument("--minutes", type=float, default=9.5)
    p.add_argument("--rows", default=None)
    p.add_argument("--cifar10", type=Path, default=SHARED / "data" / "cifar10_jpeg.tar.gz")
    p.add_argument("--mnist-root", type=Path, default=Path(os.environ.get("FLATBNN_DATA_ROOT", REPO / "data")))
    p.add_argument("--wheels", type=Path, default=SHARED / "wheels")
    p.add_argument("--data", default=",".join(DATA_FILES), help="data sets to carry (default: all three)")
    p.add_argument("--print", action="store_true", help="print the carry list and the command (after preparing)")
    p.add_argument("--procs", type=int, default=None, help="jobs at once (default: the window measures 1 / 2 / 4)")
    p.add_argument("--eager", action="store_true",
                   help="no self-check: every job eager (window 6: the grid's 30-epoch MLP runs, ~25-50 s each)")
    p.add_argument("--selfcheck-from", type=Path, default=None,
                   help="an earlier window's self-check (results/bench/*-selfcheck-*.json) to carry: the window skips "
                        "its own when device, torch and CUDA match and the step code is unchanged since")
    r = sub.add_parser("restore", help="merge a window's output into results/")
    r.add_argument("src", type=Path, metavar="FROM")
    r.add_argument("--results", type=Path, default=None)
    r.add_argument("--runs", type=Path, default=None)
    r.add_argument("--bench", type=Path, default=None)
    r.add_argument("--device-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        if args.verb == "prepare":
            if not 0 < args.minutes <= 9.5:
                raise WindowError(f"--minutes {args.minutes:g}: one device command runs at most 10 minutes")
            res = prepare(cifar10=args.cifar10, mnist_root=args.mnist_root, wheels=args.wheels,
                          data=[d for d in args.data.split(",") if d], selfcheck_from=args.selfcheck_from)
            for k, b in res["bytes"].items():
                print(f"prepare: .device/{k}: {b / 2**20:.2f} MiB")
            print(f"prepare: the tree {res['tree'] / 2**20:.2f} MiB; all that travels {res['total'] / 2**20:.2f} MiB "
                  f"of 64 MiB")
            if args.print:
                cmd = command(args.minutes, args.rows, args.procs, args.eager)
                print(f"carry: {json.dumps(['.device'])}")
                print(f"timeout_s: {min(600, math.ceil(args.minutes * 60) + 25)}")
                print(f"command ({len(cmd)} characters):\n{cmd}")
        else:
            if not args.src.is_dir():
                raise WindowError(f"FROM={args.src}: no such folder (the device call's files_at)")
            restore(args.src, results_root=args.results, runs_root=args.runs, bench_dir=args.bench,
                    device_dir=args.device_dir)
    except (WindowError, SpecError, OSError, tarfile.TarError, subprocess.CalledProcessError) as e:
        print(f"gpu-window: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
