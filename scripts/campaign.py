#!/usr/bin/env python
"""Paper-scale cells, cheapest verdicts first, until a time budget runs out (flatbnn/reproduce/campaign.py).

    python scripts/campaign.py --rows bsam_t6,hwa_fig1 --minutes 60 --dry-run     # the queue with time estimates
    python scripts/campaign.py --hours 8 --gpus 1 --data cifar10=/data/cifar10_jpeg.tar.gz,cifar100=/data/c100
    python scripts/campaign.py --minutes 8 --procs 2 --restore in.tgz --archive-out $OUT/campaign.tgz   # GPU window

Each job is the config `scripts/reproduce.py run <row> --scale paper` gives it (the campaign schedules, it never
changes a hyperparameter), in the row's usual run dir. Finished runs become records under
results/reproduce/<row>/paper/runs/ (device, torch and commit in record.json) and the rows' paper comparisons and
results/STATUS.md are rewritten. Everything after `--` reaches every job (e.g. trainer.num_workers=8).
Exit codes: 0 the queue is done, 75 the budget ran out (or a stop signal came) with jobs left: rerun to go on,
1 a job failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbnn.cli import split_after_double_dash  # noqa: E402
from flatbnn.reproduce.spec import SpecError  # noqa: E402


def _data(value: str) -> dict[str, str]:
    out = {}
    for item in (v for v in value.split(",") if v):
        name, sep, root = item.partition("=")
        if not sep or not name or not root:
            raise argparse.ArgumentTypeError(f"--data {item!r}: use NAME=ROOT, e.g. mnist=/data/mnist_root")
        out[name] = root
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--rows", default=None, help="comma-separated rows (default: every train row with a paper scale)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--hours", type=float, default=None)
    budget.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--procs", type=int, default=None,
                    help="jobs at once per GPU (default 2: docs/cluster.md) or on the CPU (default: cores / 2)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all this machine has)")
    ap.add_argument("--device", default=None,
                    help="device the estimates are for (a results/bench/ slug or cpu; default: this machine's)")
    ap.add_argument("--data", type=_data, default={}, help="data roots by data set: mnist=PATH,cifar10=PATH,...")
    ap.add_argument("--max-job-minutes", type=float, default=None,
                    help="leave out jobs estimated longer than this (default: the budget; raise it to chain a long "
                         "job over several calls with --archive-out / --restore)")
    ap.add_argument("--margin-s", type=float, default=None,
                    help="stop the jobs this long before the budget ends (default: 60 s, at most 10%% of the budget)")
    ap.add_argument("--archive-out", type=Path, default=None,
                    help="write the unfinished run dirs and the touched rows' records to this .tgz")
    ap.add_argument("--archive-limit-mb", type=float, default=16.0)
    ap.add_argument("--restore", type=Path, default=None, help="unpack a --archive-out file before starting")
    ap.add_argument("--selfcheck", type=Path, default=None,
                    help="a GPU window's self-check JSON (flatbnn/bench/selfcheck.py): each cell runs the step path "
                         "(graph, batched chunks, compile) that passed there for it, else eagerly")
    ap.add_argument("--out", type=Path, default=None, help="runs root (default outputs/reproduce: the rows' run dirs)")
    ap.add_argument("--results", type=Path, default=None, help="records root (default results/reproduce)")
    ap.add_argument("--dry-run", action="store_true", help="print the queue with time estimates; run nothing")
    argv, extra = split_after_double_dash(list(sys.argv[1:] if argv is None else argv))
    args = ap.parse_args(argv)

    import signal

    # a stop signal outside the jobs' run (campaign.run has its own: it stops the jobs, which checkpoint): one line,
    # 75 (130 for Ctrl-C), no traceback -- nothing of a job is lost, the rerun goes on where this call stood
    phase = {"now": "while planning (no job was started)"}
    exit_stopped = 75  # flatbnn.reproduce.campaign.EXIT_STOPPED (imported in _main: it takes seconds)

    def stopped(signum, frame):
        print(f"campaign: stopped by {signal.Signals(signum).name} {phase['now']}; rerun the same command",
              file=sys.stderr, flush=True)
        raise SystemExit(130 if signum == signal.SIGINT else exit_stopped)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        try:
            previous[sig] = signal.signal(sig, stopped)
        except ValueError:  # main() called from another thread: its caller's signals stay its own
            pass
    try:
        return _main(args, extra, phase)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _main(args, extra: list[str], phase: dict) -> int:
    import os
    import time

    started = time.monotonic()  # the budget counts from here: planning and restoring spend it too
    from flatbnn.reproduce import campaign, cost
    from flatbnn.reproduce.spec import load_row

    try:
        budget_s = (args.hours * 3600 if args.hours is not None else
                    args.minutes * 60 if args.minutes is not None else None)
        if budget_s is None and not args.dry_run:
            raise SpecError("give the time budget: --hours H or --minutes M (make campaign HOURS=... / MINUTES=...)")
        if budget_s is not None and budget_s <= 0:
            raise SpecError(f"the budget must be > 0, got {budget_s:g} s")
        if args.restore is not None and not args.restore.is_file():
            raise FileNotFoundError(f"--restore {args.restore}: no such file")
        import torch

        gpus = args.gpus if args.gpus is not None else torch.cuda.device_count()
        device = args.device or cost.this_device()
        procs = args.procs or (2 if gpus else max(1, (os.cpu_count() or 1) // 2))
        margin = args.margin_s if args.margin_s is not None else min(60.0, 0.1 * (budget_s or 600))
        max_job = args.max_job_minutes * 60 if args.max_job_minutes is not None else (
            budget_s - margin if budget_s is not None else None)
        if args.restore is not None:
            got = campaign.restore(args.restore, out_root=args.out, results_root=args.results)
            print(f"campaign: restored {len(got)} unfinished run(s) from {args.restore}", file=sys.stderr)
        rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else None
        for name in rows or []:
            load_row(name)  # an unknown row: one line, exit 2, before minutes of planning
        extra_for = None
        if args.selfcheck is None and not gpus:  # the CPU's measured step rule (SAM m > 1 on an all-Linear net)
            from flatbnn.bench.selfcheck import cpu_step_overrides
            extra_for = cpu_step_overrides
        if args.selfcheck is not None:
            import json

            from flatbnn.bench.selfcheck import step_overrides
            try:
                report = json.loads(args.selfcheck.read_text())  # a missing file: OSError, one line, exit 2
            except ValueError as e:
                raise SpecError(f"--selfcheck {args.selfcheck}: not a self-check JSON ({e})") from None
            cache = str(Path(args.out or "outputs").resolve() / ".compile_cache")
            extra_for = lambda cfg: step_overrides(cfg, report, cuda=bool(gpus), compile_cache=cache)  # noqa: E731
        p = campaign.plan(rows, device=device, data=args.data, extra=extra, max_job_s=max_job, out_root=args.out,
                          results_root=args.results, extra_for=extra_for)
        if args.dry_run:
            campaign.reusable(p)  # shown as 'to link', not linked
            print(campaign.describe(p, budget_s, procs * max(1, gpus)))
            return 0
        linked = campaign.link_reused(p, args.results)
        if linked:
            print(f"campaign: {len(linked)} job(s) linked to other rows' identical finished runs", file=sys.stderr)
        print(campaign.describe(p, budget_s, procs * max(1, gpus)), file=sys.stderr)
        phase["now"] = "while starting the jobs"
        res = campaign.run(p, budget_s=budget_s, procs=procs, gpus=gpus, margin_s=margin, results_root=args.results,
                           started=started)
        phase["now"] = ("while writing the comparisons (every job had ended: finished ones are recorded, the others "
                        "resume on the rerun)")
        touched = list({j.row.row: j.row for j in p.jobs + [t for t, _ in p.follow.values()]}.values()) + \
            [load_row(n) for n in dict.fromkeys(x.split("/", 1)[0] for x in linked)]
        touched = list({r.row: r for r in touched}.values())
        for path in campaign.write_comparisons(touched, args.out, args.results):
            print(f"comparison: {path}", file=sys.stderr)
        if args.results is None and touched:
            from flatbnn.reproduce.status import write_status
            print(f"status board: {write_status()}", file=sys.stderr)
        if args.archive_out is not None:
            a = campaign.write_archive(args.archive_out, p.jobs, touched, limit_mb=args.archive_limit_mb,
                                       results_root=args.results)
            print(f"campaign: {args.archive_out}: {len(a['runs'])} unfinished run(s) + records, "
                  f"{a['bytes'] / 2**20:.1f} MB", file=sys.stderr)
            for name, why in a["left_out"].items():
                print(f"campaign: left out of the archive: {name}: {why}", file=sys.stderr)
        print(f"campaign: {len(res['finished'])} finished, "
              + (f"{len(res['linked'])} linked to an identical run that finished, " if res["linked"] else "")
              + (f"{len(res['taken'])} left to another process, " if res["taken"] else "")
              + f"{len(res['interrupted'])} interrupted (resumable), "
              f"{len(res['failed'])} failed, {len(res['not_started'])} not started", file=sys.stderr)
        if res["failed"]:
            return 1
        return campaign.EXIT_STOPPED if res["interrupted"] or res["not_started"] else 0
    except (SpecError, FileNotFoundError, OSError, cost.CostError, tarfile.TarError) as e:  # tarfile: --restore
        print(f"campaign: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
