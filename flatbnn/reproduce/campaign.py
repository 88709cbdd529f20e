"""A campaign: paper-scale (cell, seed) jobs, cheapest verdicts first, until a time budget runs out.

Scheduling only: every job runs the config ``scripts/reproduce.py run <row> --scale paper`` composes for it (the
same generated cell config, launch.write_cells, plus the same command-line extras), as its own ``train.py``
process in the row's usual run dir ``<outputs>/<row>/paper/<cell>/seed<k>`` -- so ``reproduce.py compare`` and
``run`` see the campaign's runs as their own. Several jobs share a device as separate processes (``procs``).

* Queue: rows by cost per cell (a cell = one verdict, or one ranked cell of a table whose numbers are lost), cheapest
  first; in a row, cells by cost, each cell's seeds together (a verdict needs all of them). Cost = the estimated
  wall time of a run on this device (flatbnn/reproduce/cost.py: measured throughput where one matches, else assumed,
  and it says which). Jobs that a record already holds, or another row's identical run provides (linked, as the
  launcher does), are not run. A job whose estimate exceeds ``max_job_s`` is left out with that reason.
* Data: a cell whose data set or weights this machine lacks is skipped with the preflight's one line.
* Budget: at ``deadline - margin`` every running job gets SIGTERM (train.py: finish the step, checkpoint, exit 75);
  a job that has not exited ``margin / 2`` later is killed (its last epoch checkpoint stays). The next call resumes
  interrupted jobs from their checkpoints; finished ones are archived as records (archive.py) at once.
* Chaining (``archive_out``): one .tgz of the unfinished run dirs (checkpoints included) and the touched rows' records
  and comparisons, within a size limit; ``restore`` unpacks such a file before planning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from flatbnn.bench.mps import start_mps, stop_mps
from flatbnn.engine.validate import ConfigError, check_values
from flatbnn.reproduce import archive, cost, launch, preflight
from flatbnn.reproduce.compare import archive_row
from flatbnn.reproduce.compare_markdown import write_comparison
from flatbnn.reproduce.spec import REPO, Cell, Row, SpecError, list_rows, load_row

PAPER = "paper"
EXIT_STOPPED = 75          # the budget ran out (or a stop signal came) with jobs left: rerun to go on
DEFAULT_LIMIT_MB = 16      # the device tool returns files of at most 16 MB
STEP_PATH_KEYS = ("trainer.cuda_graph=", "trainer.compile=", "flatness.batched_chunks=")  # shown per job


@dataclass
class Job:
    row: Row
    cell: Cell
    seed: int
    estimate: cost.Estimate
    out: Path              # the row's paper sweep dir
    overrides: list[str]   # the command-line extras of this cell (data root included)
    epochs: int = 0        # the run's epochs; with epochs_done, what is left of an interrupted run
    epochs_done: int = 0   # epochs its run dir's metrics.jsonl holds (it resumes from its last checkpoint there)
    key: tuple = ()        # launch.training_key: equal keys = the same training run (in another row, maybe)

    @property
    def name(self) -> str:
        return f"{self.row.row}/{self.cell.id}/seed{self.seed}"

    @property
    def run(self) -> Path:
        return launch.run_dir(self.out, self.cell.id, self.seed)

    @property
    def seconds_left(self) -> float:
        """The estimate of what is left: an interrupted run resumes at its last checkpoint, so a run 84 epochs into
        120 costs 36/120 of a run (the schedule, the budget check and the window's fit all read this)."""
        if 0 < self.epochs_done < self.epochs:
            return self.estimate.seconds * (self.epochs - self.epochs_done) / self.epochs
        return self.estimate.seconds

    def describe(self) -> str:
        if 0 < self.epochs_done < self.epochs:
            return (f"~{cost.fmt_duration(self.seconds_left)} left: resumes after epoch {self.epochs_done} of "
                    f"{self.epochs} ({self.estimate.describe()} a run)")
        return self.estimate.describe()


@dataclass
class Plan:
    device: str
    jobs: list[Job] = field(default_factory=list)          # the queue, in order
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (what, one-line reason, estimate or "")
    done: list[str] = field(default_factory=list)           # jobs already finished (run dir, record, or linked)
    linked: dict[str, tuple[Job, Path]] = field(default_factory=dict)  # name -> (job, another row's identical run)
    follow: dict[str, tuple[Job, Job]] = field(default_factory=dict)  # name -> (job, the queued job it will link to)
    per_cell: dict[str, float] = field(default_factory=dict)  # row -> estimated seconds per cell (its ordering key)


def data_overrides(cfg, data: dict[str, str]) -> list[str]:
    """``dataset.root=<root>`` for the cell's data set when ``data`` (data set name -> root) names it."""
    root = data.get(str(cfg.dataset.name))
    return [f"dataset.root={root}"] if root else []


def _data_problem(row: Row, cell: Cell, dataset: str, extra: list[str], seen: dict) -> str | None:
    """The preflight's one line if this cell's data set or weights are missing here, else None (cached per data)."""
    key = (dataset, tuple(extra))
    if key not in seen:
        try:
            preflight.check_data(row, PAPER, extra, cells_glob=cell.id)
            seen[key] = None
        except (FileNotFoundError, SpecError) as e:
            seen[key] = " ".join(str(e).split())
    return seen[key]


def plan(rows: list[str] | None, *, device: str, data: dict[str, str] | None = None, extra: list[str] = (),
         max_job_s: float | None = None, out_root: Path | None = None, results_root: Path | None = None,
         check_data: bool = True, extra_for=None) -> Plan:
    """The queue of paper-scale jobs of ``rows`` (None: every train row with a paper scale) on ``device``.
    ``extra_for(cfg) -> [override, ...]``: per-cell extras from the composed cell config (the GPU window's step
    paths, flatbnn/bench/selfcheck.py: step_overrides)."""
    out_root = Path(out_root or launch.OUTPUT_ROOT)
    results_root = Path(results_root or archive.ARCHIVE_ROOT)
    p = Plan(device)
    busy = busy_runs(out_root)
    by_row: list[tuple[float, list[list[Job]]]] = []
    names = rows or [n for n in list_rows() if load_row(n).kind == "train"]
    for name in names:
        row = load_row(name)
        if row.kind != "train":
            p.skipped.append((name, f"a {row.kind} row (it trains nothing; run it with scripts/reproduce.py)", ""))
            continue
        if row.scale(PAPER) is None:
            p.skipped.append((name, f"no paper scale ({row.blocked or row.scale_missing_reason(PAPER)})", ""))
            continue
        out = out_root / name / PAPER
        seen: dict = {}
        cells: list[list[Job]] = []
        for cell in row.cells_for(PAPER):
            what = f"{name}/{cell.id}"
            if cell.blocked:
                p.skipped.append((what, f"blocked: {cell.blocked}", ""))
                continue
            cfg = launch.compose_cell(list(cell.overrides) + list(extra))
            cell_extra = list(extra) + data_overrides(cfg, data or {})
            if cell_extra != list(extra):
                cfg = launch.compose_cell(list(cell.overrides) + cell_extra)
            more = list(extra_for(cfg)) if extra_for is not None else []
            if more:
                cell_extra += more
                cfg = launch.compose_cell(list(cell.overrides) + cell_extra)
            try:  # a bad value after -- (optimizer.lr=fast): one line now, not a failure of every job
                check_values(cfg)
            except ConfigError as e:
                raise SpecError(f"{what}: {e} (with the overrides after --: {' '.join(cell_extra) or 'none'})") from None
            est = cost.estimate(cfg, device)
            problem = _data_problem(row, cell, str(cfg.dataset.name), cell_extra, seen) if check_data else None
            if problem:
                p.skipped.append((what, problem, est.describe()))
                continue
            todo = []
            for seed in cell.seeds:
                if launch.job_state(out, cell.id, seed)[0] == "done" or launch.recorded_jobs(
                        row, PAPER, [(cell, seed)], results_root):
                    p.done.append(f"{what}/seed{seed}")
                    continue
                job = Job(row, cell, seed, est, out, cell_extra, int(cfg.trainer.epochs),
                          key=launch.training_key(cfg, seed))
                job.epochs_done = epochs_done(job.run)
                if job.key in busy:  # another campaign (or a user's train.py) trains this run now: leave it to it
                    run, who = busy[job.key]
                    why = (f"left to {who}, which trains it now" if run.resolve() == job.run.resolve() else
                           f"the same training run as {run}, which {who} trains now (rerun: then it is linked)")
                    p.skipped.append((job.name, f"{why}; rerun the campaign after that ends", job.describe()))
                    continue
                todo.append(job)
            if max_job_s is not None:  # what is left of each run must fit (a chained run's remainder may)
                too_long = [j for j in todo if j.seconds_left > max_job_s]
                if too_long:  # another row's finished twin is linked, not trained: no time limit applies to it
                    twins = launch.reusable_runs([(j.cell, j.seed) for j in too_long], PAPER, out, cell_extra, name)
                    too_long = [j for j in too_long if (j.cell.id, j.seed) not in twins]
                why = f"a run needs more than the {cost.fmt_duration(max_job_s)} a job may take here"
                if too_long and len(too_long) == len(todo) and not any(j.epochs_done for j in todo):
                    p.skipped.append((what, why, est.describe()))  # the usual case: one line for the cell
                else:
                    p.skipped += [(j.name, why, j.describe()) for j in too_long]
                todo = [j for j in todo if j not in too_long]
            if todo:
                cells.append(todo)
        if cells:
            per_cell = sum(sum(j.seconds_left for j in c) for c in cells) / len(cells)  # what a verdict still costs
            p.per_cell[name] = per_cell
            by_row.append((per_cell, sorted(cells, key=lambda c: sum(j.seconds_left for j in c))))
    for _, cells in sorted(by_row, key=lambda rc: rc[0]):
        p.jobs += [j for c in cells for j in c]
    p.jobs, p.follow = one_run_per_config(p.jobs)
    return p


def busy_runs(out_root: Path) -> dict[tuple, tuple[Path, str]]:
    """{training key: (run dir, who)} of the paper-scale runs under ``out_root`` that a live process trains now
    (their run-dir lock is held, engine/lock.py). Two campaigns on one machine -- the second started for other rows
    while the first trains -- once both started the same run: the second's train.py was refused the run dir
    (exit 2, the job 'failed'), or, for a run two rows share, trained it a second time in its own row's dir."""
    import yaml

    from flatbnn.engine.lock import live_holder
    from flatbnn.reproduce.aggregate import _canon, config_key

    found = {}
    for lock in sorted(Path(out_root).glob(f"*/{PAPER}/**/.flatbnn/lock")):
        run = lock.parent.parent
        who = live_holder(run)
        if who is None or run.is_symlink() or not (run / "config_resolved.yaml").is_file():
            continue
        cfg = yaml.safe_load((run / "config_resolved.yaml").read_text()) or {}
        found.setdefault((_canon(cfg.get("seed")), _canon(config_key(cfg))), (run, who))
    return found


def one_run_per_config(jobs: list[Job]) -> tuple[list[Job], dict[str, tuple[Job, Job]]]:
    """One job per training run: rows share cells (bsam_t6's MNIST bSAM is bsam_t3's, vsam_t4's are vsam_t3's), and
    the queue held each such run once per row -- GPU-days at paper scale, trained twice. The run that trains is the
    one furthest along (else one whose run dir exists, else the first queued), at the first position of its group;
    each other job waits for it and is linked to it once it finishes (as launch.reusable_runs links a finished one).
    A job whose own run dir exists (it has a checkpoint to resume) keeps it: a link cannot replace a folder."""
    groups: dict[tuple, list[Job]] = {}
    for j in jobs:
        groups.setdefault(j.key, []).append(j)
    queue, follow = [], {}
    for j in jobs:
        group = groups[j.key]
        lead = max(group, key=lambda g: (g.epochs_done, g.run.exists()))  # the first of equals
        if j is group[0]:
            queue.append(lead)
        if j is not lead:
            if j.run.exists() or j.run.is_symlink():
                queue.append(j)
            else:
                follow[j.name] = (j, lead)
    return queue, follow


def describe(p: Plan, budget_s: float | None, procs: int) -> str:
    """The dry run: the queue with an estimate per job, what the budget reaches, and what is skipped and why."""
    linked = [n for n in p.linked if n not in p.done]  # a dry run: found, not linked yet
    lines = [f"campaign on {p.device}: {len(p.jobs)} jobs queued, {len(p.done)} already done, "
             + (f"{len(linked)} to link to other rows' identical finished runs, " if linked else "")
             + (f"{len(p.follow)} to link to a queued identical run when it finishes, " if p.follow else "")
             + f"{len(p.skipped)} skipped; {procs} process(es) at once"]
    t = [0.0] * max(1, procs)  # a greedy list schedule: each job on the slot that frees first
    for j in p.jobs:
        i = t.index(min(t))
        t[i] += j.seconds_left
        fits = "" if budget_s is None else ("" if t[i] <= budget_s else "  [beyond the budget]")
        paths = " ".join(o for o in j.overrides if o.startswith(STEP_PATH_KEYS))
        lines.append(f"  {j.name}: {j.describe()}{fits}" + (f"  [{paths}]" if paths else ""))
    if budget_s is not None:
        lines.append(f"budget {cost.fmt_duration(budget_s)}; the queue needs ~{cost.fmt_duration(max(t))} "
                     f"of wall time at {procs} at once (estimates, not a promise)")
    for name in linked:
        lines.append(f"  {name}: linked to {p.linked[name][1]} (trained by another row with the same config)")
    for name, (_, lead) in p.follow.items():
        lines.append(f"  {name}: the same training run as {lead.name}: linked to it when it finishes")
    by_reason: dict[str, list[str]] = {}
    for what, why, est in p.skipped:
        by_reason.setdefault(why, []).append(what + (f" {est}" if est else ""))
    for why, whats in by_reason.items():  # one line per reason (a missing data set skips many cells)
        lines.append(f"  skipped ({why}):")
        lines += [f"    {w}" for w in whats]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- running
def _command(job: Job, search: Path) -> list[str]:
    """train.py for one job (the launcher's entry): its generated cell config (launch.write_cells), the row's run dir."""
    return [sys.executable, "-m", "flatbnn.train", f"hydra.searchpath=[file://{search.resolve()}]",
            f"+cell={launch.cell_config_name(job.cell.id, job.seed)}", f"hydra.run.dir={job.run}",
            *job.overrides]


def _log(msg: str) -> None:
    print(f"campaign: {msg}", file=sys.stderr, flush=True)


def run(p: Plan, *, budget_s: float, procs: int = 1, gpus: int = 0, margin_s: float = 60.0,
        results_root: Path | None = None, poll_s: float = 0.5, clock=time.monotonic,
        started: float | None = None) -> dict:
    """Work through ``p.jobs`` until the queue is empty or ``budget_s`` (minus ``margin_s``) is spent, counted from
    ``started`` (a ``clock()`` reading: the command's start, so planning counts too; default now). Returns
    ``{"finished": [...], "linked": [...], "taken": [...], "interrupted": [...], "failed": {...},
    "not_started": [...], "stopped": bool}`` (linked: the jobs of ``p.follow`` whose lead finished, linked to it;
    taken: jobs another process trained or trains since the plan was made, left to it)."""
    results_root = Path(results_root or archive.ARCHIVE_ROOT)
    t0 = clock() if started is None else started
    deadline = t0 + budget_s - margin_s
    queue = list(p.jobs)
    slots = max(1, procs) * max(1, gpus or 1)
    running: dict[int, tuple[Job, subprocess.Popen, object]] = {}
    res = {"finished": [], "linked": [], "taken": [], "interrupted": [], "failed": {}, "not_started": [],
           "stopped": False}
    stop = {"signal": None}
    old = {s: signal.signal(s, lambda signum, _f: stop.update(signal=signum))
           for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)}
    sent_at = None
    searches: dict[str, Path] = {}
    mps = start_mps() if gpus and procs > 1 else False
    try:
        while queue or running:
            now = clock()
            if (now >= deadline or stop["signal"]) and sent_at is None:
                res["stopped"] = True
                sent_at = now
                for _, pr, _, _ in running.values():
                    pr.send_signal(signal.SIGTERM)  # train.py: finish the step, checkpoint, exit 75
                _log(f"{'budget spent' if not stop['signal'] else 'stop signal'}: stopping {len(running)} job(s)")
            if sent_at is not None and now - sent_at > max(margin_s / 2, 5):
                for _, pr, _, _ in running.values():
                    pr.kill()  # its last epoch checkpoint stays; the next call resumes from there
            while sent_at is None and queue and len(running) < slots:
                job = queue.pop(0)
                left = deadline - clock()
                if p.device == "cpu" and job.seconds_left > left and not (job.run / "checkpoints").is_dir():
                    res["not_started"].append(job.name)  # a CPU cannot finish it in what is left: leave it
                    continue
                lock, taken = _claim(job)
                if taken:  # another campaign / launcher got to it after this one planned: never two trainers
                    res["taken"].append(job.name)
                    _log(f"skip {job.name}: {taken}")
                    continue
                slot = next(i for i in range(slots) if i not in running)
                try:
                    if job.row.row not in searches:
                        searches[job.row.row] = launch.write_cells(job.row, [c for c in job.row.cells_for(PAPER)
                                                                             if not c.blocked], PAPER, job.out,
                                                                   list(job.overrides))[0]
                    running[slot] = (job, *_start(job, searches[job.row.row], slot, procs, gpus), lock)
                except BaseException:
                    lock.release()
                    raise
                _log(f"start {job.name} ({job.describe()})")
            for slot in list(running):
                job, pr, logf, lock = running[slot]
                rc = pr.poll()
                if rc is None:
                    continue
                logf.close()
                lock.release()  # the lock train.py took over stays its (released at its exit); ours is removed
                del running[slot]
                if rc == 0 and (job.run / "results.json").is_file():
                    res["finished"].append(job.name)
                    archive_row(job.row, PAPER, job.out, results_root)  # the record, at once
                    meta = json.loads((job.run / "results.json").read_text()).get("meta") or {}
                    _log(f"done {job.name}: {archive.trained_on(meta)}")
                    for twin, lead in p.follow.values():
                        if lead is job and not (twin.run.exists() or twin.run.is_symlink()):
                            launch.link_reused(twin.out, twin.cell.id, twin.seed, job.run)
                            archive_row(twin.row, PAPER, twin.out, results_root)
                            res["linked"].append(twin.name)
                            _log(f"linked {twin.name} to {job.name} (the same training run)")
                elif rc == EXIT_STOPPED or (sent_at is not None and rc < 0):
                    res["interrupted"].append(job.name)
                    _log(f"interrupted {job.name} (exit {rc}): the next call resumes it")
                else:
                    res["failed"][job.name] = f"exit {rc}; log {_log_path(job)}"
                    _log(f"FAILED {job.name} (exit {rc}): see {_log_path(job)}")
            if sent_at is not None and not running:
                break  # stopped: what is left in the queue waits for the next call
            if queue or running:
                time.sleep(poll_s)
        res["not_started"] += [j.name for j in queue] + [n for n in p.follow if n not in res["linked"]]
    finally:
        for _, _, _, lock in running.values():  # an error of this process: no lock of a job it started stays its
            lock.release()
        for s, h in old.items():
            signal.signal(s, h)
        if mps:
            stop_mps()
    return res


def _claim(job: Job):
    """``(lock, None)``: ``job``'s run-dir lock, taken by this process to start the job's train.py (which takes it
    over: engine/lock.py HANDOVER_ENV) -- checking and claiming are one atomic step, so of two campaigns or launchers
    that planned the same job only one starts it. ``(None, why)``: its run finished meanwhile, or another live
    process holds the lock (``left to pid N on host H (since T)``): skipped, never failed."""
    from flatbnn.engine.lock import RunDirLock, RunDirLocked

    finished = "finished meanwhile by another process"
    if (job.run / "results.json").is_file():
        return None, finished
    lock = RunDirLock(job.run)
    try:
        lock.acquire()
    except RunDirLocked as e:
        return None, f"left to {e.holder}, which trains it now" if e.holder else " ".join(str(e).split())
    if (job.run / "results.json").is_file():  # finished between the check and the lock
        lock.release()
        return None, finished
    return lock, None


def _log_path(job: Job) -> Path:
    """This process's log of ``job`` (per process: two campaigns never append to one file)."""
    return job.out / ".campaign" / f"{launch.cell_config_name(job.cell.id, job.seed)}.pid{os.getpid()}.log"


def job_env(slot: int, procs: int, gpus: int) -> dict[str, str]:
    """What a job in ``slot`` adds to the environment: its GPU (``procs`` jobs per GPU), and its share of the cores
    unless OMP_NUM_THREADS is set -- on a GPU too. Window 6 (one H200, 16 cores, 2026-11-28) ran two graphed bSAM
    m = 8 MLP jobs side by side, each with torch's default threads (every core) and the host loader: 25 ms a step
    each, the 24.9 ms of windows 4 and 5; the same pair with the data on the device ran 3.0 ms, one job alone 0.9-3.2
    ms (results/bench/nvidia-h200-2026-11-28-probe-822dc4a.json)."""
    env = {}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(slot // max(1, procs))
    if "OMP_NUM_THREADS" not in os.environ:  # jobs side by side: split the cores, no oversubscription
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (max(1, procs) * max(1, gpus))))
    return env


def _start(job: Job, search: Path, slot: int, procs: int, gpus: int):
    from flatbnn.engine.lock import HANDOVER_ENV

    env = dict(os.environ, PYTHONUNBUFFERED="1", **{HANDOVER_ENV: str(os.getpid())},  # the run-dir lock (_claim)
               **job_env(slot, procs, gpus))
    log = _log_path(job)
    log.parent.mkdir(parents=True, exist_ok=True)
    logf = open(log, "ab")
    return subprocess.Popen(_command(job, search), cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT), logf


def reusable(p: Plan) -> list[str]:
    """Jobs that another row's finished identical run provides (launch.reusable_runs), taken off the queue into
    ``p.linked`` -- nothing is linked yet, so a dry run shows them (link_reused links them)."""
    found_all: dict[str, tuple[Job, Path]] = {}
    # by row AND extras: a GPU window's step overrides differ per cell (flatness.batched_chunks only where the
    # flatness has it), so one cell's extras composed onto another cell fail (H100 window of 2026-11-27, bedcb58)
    every = p.jobs + [twin for twin, _ in p.follow.values()]  # a queued run's twins too (a third row may have it)
    for row_name, extras in dict.fromkeys((j.row.row, tuple(j.overrides)) for j in every):
        jobs = [j for j in every if j.row.row == row_name and tuple(j.overrides) == extras]
        found = launch.reusable_runs([(j.cell, j.seed) for j in jobs], PAPER, jobs[0].out, list(extras), row_name)
        found_all.update({j.name: (j, found[(j.cell.id, j.seed)]) for j in jobs if (j.cell.id, j.seed) in found})
    p.jobs = [j for j in p.jobs if j.name not in found_all]
    p.follow = {n: f for n, f in p.follow.items() if n not in found_all}
    p.linked.update(found_all)
    return list(found_all)


def link_reused(p: Plan, results_root: Path | None = None) -> list[str]:
    """Jobs that another row's finished identical run provides: linked into their run dirs, not trained, and
    recorded at once (as a finished job is: a budget spent before any job of their row finishes left them unrecorded)."""
    names = reusable(p)
    rows = {}
    for name in names:
        job, src = p.linked[name]
        launch.link_reused(job.out, job.cell.id, job.seed, src)
        rows[job.row.row] = job
    for job in rows.values():
        archive_row(job.row, PAPER, job.out, Path(results_root or archive.ARCHIVE_ROOT))
    p.done += names
    return names


def write_comparisons(rows: list[Row], out_root: Path | None = None, results_root: Path | None = None) -> list[Path]:
    """Each row's paper comparison (verdicts for the cells whose seeds are all in) beside its records; a row with no
    finished record yet gets none (a queued row is not a page of empty cells)."""
    out_root = Path(out_root or launch.OUTPUT_ROOT)
    results_root = Path(results_root or archive.ARCHIVE_ROOT)
    return [write_comparison(row, PAPER, out=out_root / row.row / PAPER, dest=results_root / row.row) for row in rows
            if any((results_root / row.row / PAPER / "runs").rglob("results.json"))
            or any((out_root / row.row / PAPER).rglob("results.json"))]


# ---------------------------------------------------------------------------------------------- chaining
def unfinished_runs(jobs: list[Job]) -> list[Job]:
    """The jobs with a run dir that holds a checkpoint but no results.json, most trained first."""
    left = [j for j in jobs if not (j.run / "results.json").exists() and (j.run / "checkpoints").is_dir()
            and not j.run.is_symlink()]
    return sorted(left, key=lambda j: -_lines(j.run / "metrics.jsonl"))


def epochs_done(run: Path) -> int:
    """The last finished epoch in ``run``'s metrics.jsonl (0: none, or no run dir)."""
    f = run / "metrics.jsonl"
    if not f.is_file() or run.is_symlink():
        return 0
    done = 0
    for line in f.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill: the epochs before it still count
        if isinstance(rec, dict) and "train/loss" in rec and isinstance(rec.get("epoch"), int):
            done = max(done, rec["epoch"])
    return done


def _lines(f: Path) -> int:
    return len(f.read_text().splitlines()) if f.is_file() else 0


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def write_archive(path: Path, jobs: list[Job], rows: list[Row], *, limit_mb: float = DEFAULT_LIMIT_MB,
                  results_root: Path | None = None) -> dict:
    """One .tgz: ``results/<row>/paper*`` (the touched rows' records and comparisons: small, always in) and
    ``runs/<row>/<cell>/seed<k>/`` (unfinished run dirs, checkpoints included, most trained first, while the file
    stays within ``limit_mb``). A run dir that does not fit is left out and said so: the next call starts it over.
    Returns {"runs": [...], "left_out": {job: why}, "bytes": n}."""
    results_root = Path(results_root or archive.ARCHIVE_ROOT)
    limit = int(limit_mb * 1024 * 1024)
    members: list[tuple[Path, str]] = []
    for row in rows:
        for f in sorted((results_root / row.row).glob(f"{PAPER}*")):
            members.append((f, f"results/{row.row}/{f.name}"))
    chosen, left_out = [], {}
    runs = unfinished_runs(jobs)
    for job in runs:
        chosen.append(job)
        size = _write_tgz(path, members + [(j.run, f"runs/{j.row.row}/{j.cell.id}/seed{j.seed}") for j in chosen])
        if size > limit:
            chosen.pop()
            left_out[job.name] = (f"{_size(job.run) / 2**20:.1f} MB uncompressed does not fit the {limit_mb:g} MB "
                                  f"archive: it starts over on the next machine")
    size = _write_tgz(path, members + [(j.run, f"runs/{j.row.row}/{j.cell.id}/seed{j.seed}") for j in chosen])
    if size > limit:
        raise OSError(f"{path}: the records and comparisons alone take {size / 2**20:.1f} MB, over the "
                      f"{limit_mb:g} MB limit: raise --archive-limit-mb or name fewer rows")
    return {"runs": [j.name for j in chosen], "left_out": left_out, "bytes": size}


def _write_tgz(path: Path, members: list[tuple[Path, str]]) -> int:
    tmp = path.with_name(f".{path.name}.tmp")
    with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        for src, arc in members:
            tar.add(src, arcname=arc)
    os.replace(tmp, path)
    return path.stat().st_size


def restore(path: Path, *, out_root: Path | None = None, results_root: Path | None = None) -> list[str]:
    """Unpack a campaign archive: ``runs/<row>/...`` into ``<out_root>/<row>/paper/...`` (never over a run dir
    that already finished), ``results/<row>/...`` into ``<results_root>/<row>/``. Returns the run dirs restored."""
    out_root = Path(out_root or launch.OUTPUT_ROOT)
    results_root = Path(results_root or archive.ARCHIVE_ROOT)
    restored = []
    with tarfile.open(path, "r:gz") as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if m.name.startswith("/") or ".." in parts or len(parts) < 2 or parts[0] not in ("runs", "results") \
                    or not (m.isfile() or m.isdir()):
                raise SpecError(f"{path}: unexpected member {m.name!r}: not a campaign archive")
            if parts[0] == "runs":
                if len(parts) < 3:
                    continue
                dest = out_root / parts[1] / PAPER / Path(*parts[2:])
                run = _run_of(out_root / parts[1] / PAPER, dest)
                if run is not None and (run / "results.json").exists():
                    continue  # finished here already: a live run wins
                if run is not None and str(run) not in restored:
                    restored.append(str(run))
            else:
                dest = results_root / Path(*parts[1:])
            if m.isdir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(m).read()
            from flatbnn.engine.checkpoint import write_bytes
            write_bytes(dest, data)
    return restored


def _run_of(sweep: Path, path: Path) -> Path | None:
    """The ``.../seed<k>`` folder ``path`` is in (or is), under ``sweep``."""
    for d in [path, *path.parents]:
        if d.name.startswith("seed") and d.name[4:].isdigit():
            return d
        if d == sweep:
            return None
    return None


__all__ = ["Job", "Plan", "plan", "describe", "run", "reusable", "link_reused", "epochs_done", "busy_runs", "one_run_per_config", "write_comparisons",
           "write_archive", "restore", "unfinished_runs", "EXIT_STOPPED"]
