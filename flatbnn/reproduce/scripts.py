"""Rows that are a reproduction script rather than a grid of train.py cells (2-D toys, benchmarks, analyses).

The spec's ``script: {<scale>: "<shell command with {out}, {python} and {runs} (the reproduction output root,
where other rows' runs are)>"}``; the command runs from the repository
root and writes into ``{out}`` = ``outputs/reproduce/<row>/<scale>/`` or ``run --out``'s dir (committed figures live where the
spec's ``results:`` note says: ``make reproduce-<toy>`` writes them into ``results/``).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from flatbnn import resources
from flatbnn.reproduce.launch import OUTPUT_ROOT, runs_root_of
from flatbnn.reproduce.spec import REPO, Row


def run_script_row(row: Row, scale: str, dry_run: bool = False, out: Path | None = None) -> int:
    """Run the row's ``scale`` script into ``out`` (``run --out``; default ``outputs/reproduce/<row>/<scale>``): where
    the comparison then reads it. ``{runs}``, the root of the other rows' runs: launch.runs_root_of(out), else the
    default output root."""
    template = (row.script or {}).get(scale)
    if template is None:
        print(f"reproduce {row.row}: no {scale} script", file=sys.stderr)
        return 0
    out = Path(out) if out is not None else OUTPUT_ROOT / row.row / scale
    runs = runs_root_of(out, row.row, scale) or OUTPUT_ROOT
    cmd = template.format(out=shlex.quote(str(out)), python=shlex.quote(sys.executable),
                          runs=shlex.quote(str(runs)))
    print(f"reproduce {row.row} ({scale}): {cmd}", file=sys.stderr)
    if dry_run:
        return 0
    if resources.CHECKOUT is None:  # scripts/ is not in the wheel
        print(f"reproduce {row.row}: a script row runs the checkout's scripts/, which an installed package does not "
              "ship; run it from a clone of the repository", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, shell=True, cwd=REPO)
    from flatbnn.engine.checkpoint import write_json
    from flatbnn.engine.provenance import git_commit
    write_json(out / "launch.json", {"row": row.row, "scale": scale, "command": cmd, "returncode": rc,
                                     "seconds": round(time.perf_counter() - t0, 1), "git": git_commit(untracked=True)})
    return rc
