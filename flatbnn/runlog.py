"""The run in progress's console lines and ``<run dir>/train.log`` (:class:`RunReport`), and :func:`warn` / :func:`note`,
which any layer may call (metrics warn about non-finite predictions): they also write into the running run's
train.log.
What the engine says (start-up line, config tree, final line) is in flatbnn/engine/report.py. Imports nothing of
flatbnn."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

LOG_NAME = "train.log"

_active: "RunReport | None" = None  # the report of the run in progress: where ``warn`` also writes


def warn(line: str) -> None:
    """``flatbnn: warning: <line>`` on stderr, and in the running run's train.log (if one is running)."""
    if _active is not None:
        _active.warn(line)
    else:
        print(f"flatbnn: warning: {line}", file=sys.stderr, flush=True)


def note(line: str) -> None:
    """``line`` on stderr, and in the running run's train.log (if one is running): a fact about how it ran."""
    if _active is not None:
        _active.note(line)
    else:
        print(line, file=sys.stderr, flush=True)


class RunReport:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path = Path(run_dir) / LOG_NAME
        self.enabled = enabled

    def __enter__(self) -> "RunReport":
        """While active, :func:`warn` and Python's ``warnings`` (torch's, a method's) also go to train.log."""
        global _active
        self._previous, _active = _active, self
        self._showwarning = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if self.enabled:
                self._append(warnings.formatwarning(message, category, filename, lineno, line).rstrip())
            self._showwarning(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._previous
        warnings.showwarning = self._showwarning

    def _append(self, text: str) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(text if text.endswith("\n") else text + "\n")
        except OSError:  # the log is a copy of what the console shows; a full disk fails elsewhere, in one line
            pass

    def info(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)
            self._append(line)

    def note(self, line: str) -> None:
        """A line about the run's life (resuming, initialised from): stderr and train.log."""
        if self.enabled:
            print(line, file=sys.stderr, flush=True)
            self._append(line)

    def warn(self, line: str) -> None:
        if self.enabled:
            text = f"flatbnn: warning: {line}"
            print(text, file=sys.stderr, flush=True)
            self._append(text)
