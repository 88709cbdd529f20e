"""Committed run records: each finished (cell, seed) of a ``cpu`` / ``paper`` row, kept under ``results/``.

Run dirs live under ``outputs/`` (git-ignored: checkpoints are GBs), so a comparison drawn from them cannot be
redrawn, nor extended by more seeds, once that tree is gone -- a fresh clone, another cluster, a new session
on a 2-core machine that fits one seed of a row per sitting. So whenever a comparison is written, every
finished run's small files are copied to ``results/reproduce/<row>/<scale>/runs/<cell>/seed<k>/``:
``results.json`` (metrics + meta: budget, hardware, commits), ``config_resolved.yaml`` and ``metrics.jsonl``
(one line per epoch: the curves), plus ``record.json`` (where the run was, and the run it was linked from). The comparison then reads a job from its run dir when that holds
``results.json`` and from the record otherwise (state ``done``, detail ``archived: ...``), so
``reproduce.py run ROW --scale cpu --seeds 1,2`` today plus the seed-0 record of last week is a 3-seed table.

The launcher does not read a row's own records: a job without a finished run dir is trained (rerunning a row
reproduces it); pass ``--missing`` (launch.recorded_jobs) to train only what no record holds. Other rows' records it reads to
link an identical run instead of training it (launch.reusable_runs). A live run always wins over its record,
and writing the comparison refreshes the record from it. Never at ``smoke`` scale (fake data, no numbers).
"""

from __future__ import annotations

from pathlib import Path

from flatbnn.engine.checkpoint import write_bytes, write_json
from flatbnn.reproduce.spec import REPO, load_json

ARCHIVE_ROOT = REPO / "results" / "reproduce"
ARCHIVED_FILES = ("results.json", "config_resolved.yaml", "metrics.jsonl")  # ~20 KB a run
SCALES = ("cpu", "paper")


def record_dir(root: Path, row: str, scale: str, cell_id: str, seed: int) -> Path:
    """``<root>/<row>/<scale>/runs/<cell>/seed<k>`` (``root``: the comparisons' folder, results/reproduce)."""
    return Path(root) / row / scale / "runs" / cell_id / f"seed{seed}"


def archive_run(run: Path, dest: Path, reused_from: str | None = None) -> bool:
    """Copy a finished run's small files into ``dest`` (atomically, each file). Returns True if anything
    changed. A run without results.json is not archived."""
    run = Path(run)
    if not (run / "results.json").is_file():
        return False
    changed = False
    for name in ARCHIVED_FILES:
        src = run / name
        if not src.is_file():
            continue
        data = src.read_bytes()
        target = dest / name
        if target.is_file() and target.read_bytes() == data:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        write_bytes(target, data)
        changed = True
    record = {"run_dir": str(run), "reused_from": reused_from,
              "trained_on": trained_on(load_json(run / "results.json").get("meta") or {})}
    rec_file = dest / "record.json"
    old = load_json(rec_file) if rec_file.is_file() else None
    if changed or old is None or old.get("reused_from") != reused_from:
        write_json(rec_file, record)
        changed = True
    return changed


def trained_on(meta: dict) -> str:
    """Where a run was trained, from its results.json meta: device, torch version and commit, e.g.
    ``NVIDIA H200, torch 2.11.0+cu130, commit efcd95f3`` (``+dirty``: uncommitted changes in the tree)."""
    hw, git = meta.get("hardware") or {}, meta.get("git") or {}
    device = hw.get("gpu") or f"cpu ({hw.get('cpu_count', '?')} cores)"
    dirty = "+dirty" if git.get("dirty") else ""
    return f"{device}, torch {hw.get('torch', '?')}, commit {str(git.get('commit', '?'))[:8]}{dirty}"


def archived(root: Path | None, row: str, scale: str, cell_id: str, seed: int) -> Path | None:
    """The record dir of (cell, seed) if it holds a results.json, else None (never at smoke scale)."""
    if scale not in SCALES:
        return None
    d = record_dir(Path(root or ARCHIVE_ROOT), row, scale, cell_id, seed)
    return d if (d / "results.json").is_file() else None


def run_or_record(run: Path, root: Path | None, row: str, scale: str, cell_id: str, seed: int) -> Path:
    """Where (cell, seed)'s results are read: the run dir ``run`` when it holds results.json, else its record
    under ``root`` when there is one (``root`` None: no records), else ``run`` (unfinished or missing)."""
    if (Path(run) / "results.json").exists() or root is None:
        return Path(run)
    return archived(root, row, scale, cell_id, seed) or Path(run)


def archived_detail(d: Path) -> str:
    """The job-state detail of an archived job: ``reused: <link>`` for a linked run (so the comparison still
    lists it under reused), else ``archived: <record dir>``."""
    rec_file = d / "record.json"
    rec = load_json(rec_file) if rec_file.is_file() else {}
    try:
        where = str(d.relative_to(REPO))
    except ValueError:
        where = str(d)
    if rec.get("reused_from"):
        return f"reused: {rec['reused_from']} (archived: {where})"
    return f"archived: {where}"
