"""Turning known failures into one actionable line (exit codes are documented in the README)."""

from __future__ import annotations

EXIT_CONFIG = 2      # bad config, missing data set, unreadable checkpoint, diverged run
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1: checkpointed; rerun (or requeue) to resume


def one_line_error(exc: BaseException) -> str | None:
    """The message for errors a user can act on, or None for bugs (which keep their traceback).
    ``HYDRA_FULL_ERROR=1`` keeps the traceback for everything."""
    import os

    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return None
    from hydra.errors import InstantiationException

    from flatbnn.engine.checkpoint import CheckpointError
    from flatbnn.engine.trainer import Diverged

    inner = exc
    while isinstance(inner, InstantiationException) and inner.__cause__ is not None:
        inner = inner.__cause__
        if isinstance(inner, TypeError):  # a config key the target does not take
            return f"{' '.join(str(inner).split())} (check the keys of this config group)"
    if isinstance(inner, (FileNotFoundError, CheckpointError, Diverged, KeyError, ValueError, ImportError)):
        text = inner.args[0] if isinstance(inner, KeyError) and inner.args else str(inner)
        return " ".join(str(text).split())
    return None
