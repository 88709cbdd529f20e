"""What a stop signal (SIGTERM / SIGUSR1 / SIGUSR2 / SIGHUP / SIGINT) does to a whole job, and the exit code it leaves.

Inside the training loop the trainer finishes the step and checkpoints (``trainer.Preempted``). Outside it
(building, the final evaluation, writing results) :class:`JobSignals` raises ``Preempted`` at once. Then:

* ``results.json`` was written by this run -> the run is complete: exit 0 (nothing to requeue);
* otherwise -> exit 75 (EX_TEMPFAIL): the line gives the command that resumes from the checkpoint (the run dir
  pinned); a requeue (submitit, SLURM) reruns the job in its own dir;
  Ctrl-C (SIGINT) -> exit 130, the same checkpoint; a second Ctrl-C stops at once (``KeyboardInterrupt``);
* inside a submitit job, a signal whose handler submitit installed (SIGUSR2: time limit or
  ``job._interrupt()``) is handed to that handler after the checkpoint: submitit resubmits the same Hydra
  job (same overrides, same run dir), which resumes -- on SLURM via ``scontrol requeue``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from flatbnn.engine.trainer import INTERRUPTED_EXIT_CODE, STOP_SIGNALS, Preempted


_active: "JobSignals | None" = None  # the job's guard (check_stop)


class JobSignals:
    """For the whole of ``train.py``'s job: a stop signal raises ``Preempted`` (once; repeats are ignored so
    the exit path runs to its end). Remembers the handlers found on entry (submitit's)."""

    def __init__(self):
        self.previous: dict = {}
        self.fired = False
        self.signum: int | None = None

    def __enter__(self):
        global _active
        _active = self
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._unraisable_hook
        for sig in STOP_SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.fired:
            if signum == signal.SIGINT:  # a second Ctrl-C: stop at once
                raise KeyboardInterrupt
            return
        self.fired, self.signum = True, signum
        raise self.preempted()

    def preempted(self) -> Preempted | None:
        """The ``Preempted`` of the stop signal that arrived (None before one did): raised by the handler, and again
        by ``check_stop`` / train.py where a library swallowed it."""
        if self.signum is None:
            return None
        return Preempted(f"stopped by {signal.Signals(self.signum).name} outside the training loop", self.signum)

    def _unraisable_hook(self, unraisable):
        # our Preempted raised where Python ignores exceptions (a fork hook, __del__): check_stop raises it again
        # later; no "Exception ignored in ..." traceback for it
        if not isinstance(unraisable.exc_value, Preempted):
            self._unraisable(unraisable)

    def __exit__(self, *exc):
        global _active
        _active = None
        sys.unraisablehook = self._unraisable
        for sig, old in self.previous.items():
            signal.signal(sig, old)

    def submitit_handler(self, signum: int | None):
        """submitit's own handler for ``signum`` (its requeue), or None outside a submitit job."""
        old = self.previous.get(signum)
        if not os.environ.get("SUBMITIT_EXECUTOR") or not callable(old):
            return None
        return old


def check_stop() -> None:
    """Raise the ``Preempted`` of a stop signal that arrived outside the training loop but was swallowed where
    it was raised (Python ignores exceptions in fork hooks -- a DataLoader starting its workers -- and in
    ``__del__``; a library may catch ``Exception``): called before results.json is written, so a stopped run
    exits 75 instead of finishing as if never asked to stop."""
    stopped = _active.preempted() if _active is not None else None
    if stopped is not None:
        raise stopped


def mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def finished_by_this_run(results: Path | None, mtime_before: int | None) -> bool:
    """results.json exists and was (re)written after the job started (not a stale one of an earlier run)."""
    now = None if results is None else mtime(results)
    return now is not None and now != mtime_before


def stop(exc: Preempted, guard: JobSignals, *, results: Path | None, mtime_before: int | None, exit_preempted: int,
         say=None):
    """Leave the job after a stop signal: return (exit 0) if the results are written, else requeue through
    submitit or exit ``exit_preempted``. ``say(line)`` prints the stop line (train.py: also into train.log, with
    the command that resumes the run)."""
    guard.fired = True  # from here on, more signals change nothing
    if finished_by_this_run(results, mtime_before):
        print(f"flatbnn: {exc}; {results} is already written: the run is complete", file=sys.stderr)
        return
    (say or (lambda line: print(line, file=sys.stderr)))(f"flatbnn: {exc}")
    if exc.signum == signal.SIGINT:  # a person stopped it: not a requeue
        sys.exit(INTERRUPTED_EXIT_CODE)
    handler = guard.submitit_handler(exc.signum)
    if handler is not None:
        # submitit checkpoints the launcher (= the same Hydra job) and requeues; on rank > 0 it returns
        handler(exc.signum, None)
    sys.exit(exit_preempted)
