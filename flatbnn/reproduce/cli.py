"""A paper row -> its spec -> a Hydra multirun -> a comparison beside the paper's numbers -> the status board.

``scripts/reproduce.py`` in a checkout, ``flatbnn-reproduce`` once installed (same arguments; an installed package
writes ``outputs/`` and ``results/`` under the current directory).

    python scripts/reproduce.py list                                  # every row, its kind and scales
    python scripts/reproduce.py check                                 # every spec and paper file loads; every cell
                                                                      # composes; the paper scale = the paper's protocol
    python scripts/reproduce.py run flatbnn_t2 --scale cpu -- dataset.root=../shared/data/cifar10_jpeg.tar.gz
    python scripts/reproduce.py run vsam_t3 --scale cpu --seeds 0 -- dataset.root=...   # every cell's first seed now
    python scripts/reproduce.py run flatbnn_t2 --scale paper --launcher slurm -- dataset.root=/data/cifar10
    python scripts/reproduce.py compare flatbnn_t2 --scale cpu        # outputs/reproduce/comparison/flatbnn_t2/cpu.md
    python scripts/reproduce.py compare flatbnn_t2 --scale cpu --results results/reproduce   # the committed one
    python scripts/reproduce.py status                                # results/STATUS.md
    python scripts/reproduce.py all --scale smoke                     # every row (CI: make reproduce-all SCALE=smoke)

Everything after ``--`` is passed to every job as a Hydra override (data roots, trainer=gpu_fast, ...).
``--out DIR`` sweeps somewhere else (``run``: the row's sweep dir; ``all``: a root, one ``DIR/<row>/<scale>`` per
row); the comparison then goes to ``DIR/comparison/<row>/``, not into the committed ``results/reproduce/``, unless
``--results results/reproduce`` says so (e.g. paper-scale runs on a cluster's scratch disk, tables into the repo).
Rerunning ``run`` skips finished (cell, seed) jobs and resumes interrupted ones from their checkpoints;
``--missing`` also skips the jobs the row's committed records hold (a fresh clone: only what no record has).
Exit codes: 0 all jobs done (blocked cells are reported, not failures), 1 a job failed, 2 bad spec / missing data,
75 stopped by SIGTERM / SIGUSR1 / SIGUSR2 (handed on to the sweep, whose running job checkpointed; rerun to resume),
130 Ctrl-C (likewise).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from flatbnn import resources
from flatbnn.cli import split_after_double_dash
from flatbnn.reproduce.spec import SCALES, SpecError, check_all, list_rows, load_row


def _sweep_dir(args, name: str) -> Path | None:
    """``--out``: the row's sweep dir for ``run``, a root for ``all`` (rows would share one dir and collide)."""
    if args.out is None:
        return None
    return Path(args.out) / name / args.scale if args.cmd == "all" else Path(args.out)


def _results_root(args) -> Path | None:
    """Where comparisons and run records go: ``--results``; else beside a ``--out`` sweep (a scratch sweep must not
    overwrite the committed tables); else, for ``compare`` and for ``run`` at the smoke scale,
    outputs/reproduce/comparison (redrawing a table, or a smoke run of one row in a fresh clone, must not rewrite
    committed files; ``--results results/reproduce`` asks for it); else None = the repo's results/reproduce/."""
    if args.results is not None:
        return Path(args.results)
    if args.out is not None:
        return Path(args.out) / "comparison"
    if args.cmd == "compare" or (args.cmd == "run" and args.scale == "smoke"):
        from flatbnn.reproduce.launch import OUTPUT_ROOT
        return OUTPUT_ROOT / "comparison"
    return None


def _run_row(name: str, args, extra: list[str]) -> int:
    from flatbnn.reproduce import launch, preflight, scripts as row_scripts
    from flatbnn.reproduce.compare_markdown import write_comparison

    row = load_row(name)
    if not args.no_compare and not args.dry_run:
        row.paper_data()  # a bad paper file: one line now (UnreadableFile, exit 2), not after every job has trained
    out = _sweep_dir(args, name)
    if row.kind != "script" and row.scale(args.scale) is None:
        print(f"reproduce {name}: no {args.scale} scale ({row.blocked or row.scale_missing_reason(args.scale)})",
              file=sys.stderr)
        return 0
    if row.kind == "script" and row.blocked:
        print(f"reproduce {name}: blocked: {row.blocked}", file=sys.stderr)
        rc = 0
    elif row.kind == "script":
        rc = row_scripts.run_script_row(row, args.scale, dry_run=args.dry_run, out=out)
    else:
        if row.kind == "train":  # a bad override after --: one line now, not a failure in every job
            launch.check_extra([c for c in row.cells_for(args.scale) if not c.blocked], extra)
        if args.scale != "smoke" and not args.dry_run:  # eval rows: their own files (check_data)
            preflight.check_data(row, args.scale, extra, cells_glob=args.cells)
        elif args.scale != "smoke":  # a dry run: the files (weights) the real run would be refused without
            try:
                preflight.check_files(row, args.scale, extra)
            except FileNotFoundError as e:
                print(f"reproduce {name}: dry run: the real run would be refused: {' '.join(str(e).split())}",
                      file=sys.stderr)
                return 2
        launch_row = launch.launch_eval if row.kind == "eval" else launch.launch
        summary = launch_row(row, args.scale, out=out, extra=extra, launcher=args.launcher, force=args.force,
                             dry_run=args.dry_run, cells_glob=args.cells, seeds=args.seeds, missing=args.missing,
                             records=_results_root(args))
        if args.dry_run and row.kind == "train" and args.scale != "smoke":
            _print_estimates(row, args, extra, summary.get("command") or [])
        failed = [f"{k}: {v['detail']}" for k, v in summary["jobs"].items() if v["state"] == "failed"]
        for line in failed:
            print(f"  FAILED {line}", file=sys.stderr)
        left = [f"{k}: {v['detail']}" for k, v in summary["jobs"].items() if v["state"] == "running"]
        for line in left:
            print(f"  {line}", file=sys.stderr)
        # every job done is success, whoever ran it: a second launcher of the row (another terminal, a duplicate
        # CI job, a campaign) had its members refused by the run dirs' locks while the first finished them -- or
        # trains them still: left to it, not failed (its comparison counts them when it ends)
        unfinished = [k for k, v in summary["jobs"].items() if v["state"] not in ("done", "running")]
        rc = 1 if failed or (summary["returncode"] != 0 and unfinished) else 0
        if summary["returncode"] in (75, 130):  # stopped (signal / Ctrl-C): checkpointed, rerun to resume
            done = summary.get("checkpointed") or []
            what = (f"the running job ({', '.join(done)}) checkpointed" if done else
                    "it stopped between jobs or before the first step (no job had a step to checkpoint)")
            print(f"reproduce {name}: stopped (exit {summary['returncode']}); {what}: rerun the same command to go on",
                  file=sys.stderr)
            return summary["returncode"]
    if not args.dry_run and not args.no_compare:
        root = _results_root(args)
        path = write_comparison(row, args.scale, out=out, dest=root / name if root else None, force=args.force)
        print(f"comparison: {path}", file=sys.stderr)
    return rc


def _print_estimates(row, args, extra: list[str], command: list[str]) -> None:
    """The dry run's time per job to run: measured throughput where one matches, else assumed (it says which)."""
    from flatbnn.reproduce.cost import fmt_duration, job_estimates, this_device

    names = next((c.split("=", 1)[1].split(",") for c in command if c.startswith("+cell=")), [])
    if not names or names == [""]:
        return
    device = args.estimate_on or this_device()
    est = job_estimates(row, args.scale, names, extra, device)
    for job, e in est:
        print(f"  {job}: {e.describe()}", file=sys.stderr)
    measured = sum(e.rate.measured for _, e in est)
    print(f"  {len(est)} jobs: ~{fmt_duration(sum(e.seconds for _, e in est))} of training on {device} one after "
          f"another ({measured} at a measured rate, {len(est) - measured} assumed; flatbnn/reproduce/cost.py)",
          file=sys.stderr)


CHILDREN: list = []  # the `run <row>` processes of `all --jobs N`


def _run_rows_in_parallel(names: list[str], args, extra: list[str]) -> list[int]:
    """``run <row>`` for each row as its own process, ``args.jobs`` at a time; each row's output is printed
    whole when it ends (not interleaved). Smoke jobs are mostly Python start-up, so this scales with cores."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    flags = ["--scale", args.scale] + (["--launcher", args.launcher] if args.launcher else []) + \
        (["--cells", args.cells] if args.cells else []) + (["--force"] if args.force else []) + \
        (["--missing"] if args.missing else []) + \
        (["--no-compare"] if args.no_compare else [])
    root = _results_root(args)
    # each row's process imports this very package (a checkout run without installing it included)
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(resources.PACKAGE.parent), os.environ.get("PYTHONPATH")) if p)}

    def row_flags(name: str) -> list[str]:
        return (["--out", str(_sweep_dir(args, name))] if args.out is not None else []) + \
            (["--results", str(root)] if root is not None else [])

    def one(name: str) -> int:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "flatbnn.reproduce.cli", "run", name, *flags, *row_flags(name),
                              "--", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env)
        CHILDREN.append(p)  # a stop signal is handed on to each row (see main)
        stdout = p.communicate()[0]
        sys.stderr.write(f"===== {name} (exit {p.returncode}, {time.monotonic() - t0:.0f} s)\n{stdout}")
        sys.stderr.flush()
        return p.returncode

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(one, names))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    chk = sub.add_parser("check")
    chk.add_argument("--no-compose", action="store_true", help="only load the YAML files")
    for name in ("run", "all"):
        p = sub.add_parser(name)
        if name == "run":
            p.add_argument("row")
        p.add_argument("--scale", choices=SCALES, default="smoke")
        p.add_argument("--out", type=Path, default=None,
                       help="run: the sweep dir (default outputs/reproduce/<row>/<scale>); all: a root, OUT/<row>/<scale>"
                            "; the comparison then goes to OUT/comparison/<row>/ unless --results says otherwise")
        p.add_argument("--results", type=Path, default=None,
                       help="where comparisons and run records go (default results/reproduce, or OUT/comparison)")
        p.add_argument("--launcher", default=None,
                       help="configs/hydra/launcher/: slurm, local, cpu_parallel, gpu_shared")
        p.add_argument("--cells", default=None, help="only the cells whose id matches this glob")
        p.add_argument("--seeds", default=None, type=lambda v: [int(x) for x in v.split(",")],
                       help="only these of the scale's seeds, e.g. 0 (every cell's first seed now, the rest later)")
        again = p.add_mutually_exclusive_group()
        again.add_argument("--force", action="store_true", help="rerun finished jobs from scratch")
        again.add_argument("--missing", action="store_true",
                           help="skip the jobs this row's committed records hold (results/reproduce/<row>/<scale>/"
                                "runs/, or --results): finish a row begun on another machine or in a fresh clone")
        p.add_argument("--dry-run", action="store_true",
                       help="print the command and each job's time estimate, run nothing")
        p.add_argument("--estimate-on", default=None,
                       help="the device of the dry run's estimates (a results/bench/ slug, cpu; default: this machine)")
        p.add_argument("--no-compare", action="store_true")
        if name == "all":
            p.add_argument("--jobs", type=int, default=1,
                           help="rows run at once, each in its own process (CI's smoke stage: the core count)")
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("row")
    cmp_.add_argument("--scale", choices=SCALES, default="cpu")
    cmp_.add_argument("--out", type=Path, default=None, help="the sweep dir the runs are in")
    cmp_.add_argument("--results", type=Path, default=None,
                      help="where the comparison goes (default outputs/reproduce/comparison, or OUT/comparison; "
                           "--results results/reproduce rewrites the committed one)")
    cmp_.add_argument("--force", action="store_true",
                      help="replace an existing comparison built from more finished runs than this one")
    sub.add_parser("status")
    cl = sub.add_parser("claims", help="the claims rule: --calibrate (its error rates, simulated) or --paper-numbers")
    what = cl.add_mutually_exclusive_group(required=True)
    what.add_argument("--calibrate", action="store_true",
                      help="simulate every claim at its shape: false-reversal / false-holds rates and power; exit 1 "
                           "when a rate exceeds 5 %% beyond Monte Carlo error")
    what.add_argument("--paper-numbers", action="store_true",
                      help="every claim judged on the paper's own printed numbers by the same rule")
    what.add_argument("--rejudge", action="store_true",
                      help="judge every committed comparison's claims again (after a rule or paper-file change)")
    cl.add_argument("--reps", type=int, default=2000, help="simulated replicates per claim and scenario")
    cl.add_argument("--seed", type=int, default=0)

    argv, extra = split_after_double_dash(list(sys.argv[1:] if argv is None else argv))
    args = ap.parse_args(argv)

    def stopped(signum, frame):  # outside a sweep (run_sweep hands it on to the sweep while one runs)
        running = [p for p in CHILDREN if p.poll() is None]
        for p in running:  # `all --jobs N`: each row's process hands it on to its sweep and waits for it
            p.send_signal(signum)
        for p in running:
            p.wait()
        print(f"reproduce: stopped by {signal.Signals(signum).name}"
              + (f" ({len(running)} row processes stopped with it)" if running else " (no job was running)")
              + "; rerun the same command to go on", file=sys.stderr)
        sys.exit(75)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, stopped)
        except ValueError:  # main() called from another thread: its caller's signals stay its own
            pass
    try:
        if args.cmd == "list":
            for name in list_rows():
                row = load_row(name)
                scales = ",".join(s for s in SCALES if (row.scale(s) if row.kind == "train" else row.script.get(s)))
                state = f"blocked: {row.blocked}" if row.blocked else f"{len(row.cell_ids())} cells"
                print(f"{name:18s} {row.kind:6s} {scales:17s} {state}  -- {row.title}")
            return 0
        if args.cmd == "check":
            from flatbnn.reproduce.preflight import compose_all
            problems = check_all()
            if not args.no_compose and not problems:
                problems += compose_all()
                from flatbnn.reproduce.protocol import check_all as check_protocols
                problems += check_protocols()  # the paper scale against the papers' protocols (results/paper/)
            for p in problems:
                print(p, file=sys.stderr)
            print(f"{len(list_rows())} rows checked, {len(problems)} problems", file=sys.stderr)
            return 2 if problems else 0
        if args.cmd == "run":
            return _run_row(args.row, args, extra)
        if args.cmd == "all":
            worst = 0
            # trained rows first: eval rows and the analysis scripts read their runs
            order = {"train": 0, "eval": 1, "script": 2}
            names = sorted(list_rows(), key=lambda n: (order[load_row(n).kind], n))
            if args.jobs > 1 and not args.dry_run:
                for kind in order:  # one stage at a time: a stage reads the runs of the one before
                    stage = [n for n in names if load_row(n).kind == kind]
                    for rc in _run_rows_in_parallel(stage, args, extra):
                        worst = rc if worst == 0 else worst
            else:
                for name in names:
                    rc = _run_row(name, args, extra)
                    worst = rc if worst == 0 else worst
            from flatbnn.reproduce.compare import RESULTS_ROOT  # here, not at the top: it imports torch (~5 s)

            root = _results_root(args)
            if not args.dry_run and (root is None or root.resolve() == RESULTS_ROOT.resolve()):
                from flatbnn.reproduce.status import write_status  # the board reads results/reproduce/ only
                print(f"status board: {write_status()}", file=sys.stderr)
            return worst
        if args.cmd == "compare":
            from flatbnn.reproduce.archive import ARCHIVE_ROOT
            from flatbnn.reproduce.compare_markdown import write_comparison
            root = _results_root(args)
            scratch = args.results is None and args.out is None  # the default: the committed records, read only
            page = write_comparison(load_row(args.row), args.scale, out=args.out, dest=root / args.row,
                                    force=args.force, records=ARCHIVE_ROOT if scratch else None)
            print(page)
            if scratch:
                print(f"compare: {ARCHIVE_ROOT / args.row} is left as it is (--results {ARCHIVE_ROOT} rewrites "
                      f"the committed comparison and records)", file=sys.stderr)
            return 0
        if args.cmd == "status":
            from flatbnn.reproduce.status import write_status
            print(write_status())
            return 0
        if args.cmd == "claims":
            from flatbnn.reproduce import calibrate
            if args.reps < 10:
                raise SpecError(f"--reps {args.reps}: at least 10 replicates")
            if args.rejudge:
                from flatbnn.reproduce.compare_markdown import rejudge_all
                for f in rejudge_all():
                    print(f"claims judged again: {f}")
                return 0
            return calibrate.calibrate(args.reps, args.seed) if args.calibrate else calibrate.paper_numbers()
    except (SpecError, FileNotFoundError) as e:
        print(f"reproduce: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a sweep (composing cells, writing a comparison): nothing to save
        print("reproduce: interrupted (Ctrl-C); rerun the same command to go on", file=sys.stderr)
        return 130
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
