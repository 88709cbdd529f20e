"""What a stop signal (SIGTERM / SIGUSR1 / SIGUSR2) does to a whole job, and the exit code it leaves.

Inside the training loop the trainer finishes the step and checkpoints (``trainer.Preempted``). Outside it
(building, the final evaluation, writing results) :class:`JobSignals` raises ``Preempted`` at once. Then:

* ``results.json`` was written by this run -> the run is complete: exit 0 (nothing to requeue);
* otherwise -> exit 75 (EX_TEMPFAIL): rerun / requeue the same command and it resumes from the checkpoint;
* inside a submitit job, a signal whose handler submitit installed (SIGUSR2: time limit or
  ``job._interrupt()``) is handed to that handler after the checkpoint: submitit resubmits the same Hydra
  job (same overrides, same run dir), which resumes -- on SLURM via ``scontrol requeue``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from flatbnn.engine.trainer import STOP_SIGNALS, Preempted


class JobSignals:
    """For the whole of ``train.py``'s job: a stop signal raises ``Preempted`` (once; repeats are ignored so
    the exit path runs to its end). Remembers the handlers found on entry (submitit's)."""

    def __init__(self):
        self.previous: dict = {}
        self.fired = False

    def __enter__(self):
        for sig in STOP_SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.fired:
            return
        self.fired = True
        raise Preempted(f"stopped by {signal.Signals(signum).name} outside the training loop", signum)

    def __exit__(self, *exc):
        for sig, old in self.previous.items():
            signal.signal(sig, old)

    def submitit_handler(self, signum: int | None):
        """submitit's own handler for ``signum`` (its requeue), or None outside a submitit job."""
        old = self.previous.get(signum)
        if not os.environ.get("SUBMITIT_EXECUTOR") or not callable(old):
            return None
        return old


def mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def finished_by_this_run(results: Path | None, mtime_before: int | None) -> bool:
    """results.json exists and was (re)written after the job started (not a stale one of an earlier run)."""
    now = None if results is None else mtime(results)
    return now is not None and now != mtime_before


def stop(exc: Preempted, guard: JobSignals, *, results: Path | None, mtime_before: int | None, exit_preempted: int):
    """Leave the job after a stop signal: return (exit 0) if the results are written, else requeue through
    submitit or exit ``exit_preempted``."""
    guard.fired = True  # from here on, more signals change nothing
    if finished_by_this_run(results, mtime_before):
        print(f"flatbnn: {exc}; {results} is already written: the run is complete", file=sys.stderr)
        return
    print(f"flatbnn: {exc}", file=sys.stderr)
    handler = guard.submitit_handler(exc.signum)
    if handler is not None:
        # submitit checkpoints the launcher (= the same Hydra job) and requeues; on rank > 0 it returns
        handler(exc.signum, None)
    sys.exit(exit_preempted)
