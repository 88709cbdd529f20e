"""Atomic checkpoints and results: write to a temp file in the same directory, fsync, os.replace.

The previous file stays intact until the new one is complete, so a crash mid-write loses nothing; a
failed write (ENOSPC) removes its temp file, and the temp files of a killed writer are removed by the
next process that owns the run dir (:func:`remove_stale_temp_files`). engine/lock.py's ``RunDirLock`` makes
that owner unique: one process per run dir.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# the atomic writers live in flatbnn.atomic_io (lowest layer); re-exported here for existing callers
from flatbnn.atomic_io import atomic_write as _atomic_write
from flatbnn.atomic_io import temp_name as _temp_name
from flatbnn.atomic_io import write_bytes, write_json, write_text  # noqa: F401


class CheckpointError(RuntimeError):
    pass


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, quota, EIO); the previous one is intact: the run resumes."""


def _os_error_in(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, or its cause / context (``torch.save`` reports a failed write
    as ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`` with the ENOSPC as context)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def save_checkpoint(path: Path, state: dict) -> None:
    import torch  # here: engine/lock.py's RunDirLocked is a CheckpointError, and a scheduler takes locks without torch

    try:
        _atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:  # ENOSPC, EDQUOT, EIO: the previous checkpoint is intact, say so in one line
        os_error = _os_error_in(e)
        if os_error is None:
            raise
        raise CheckpointWriteError(f"could not write checkpoint {path} ({os_error.strerror or os_error}); the "
                                   f"previous checkpoint is intact: free space / fix the file system, then resume"
                                   ) from None


def link_checkpoint(src: Path, dst: Path) -> None:
    """``dst`` becomes the same file as ``src`` (a hard link: no copy; ``src`` being replaced later by
    ``os.replace`` leaves ``dst`` intact), atomically; a copy where the file system has no hard links (or ``src``
    is on another one: a run resumed from another run's checkpoint, whose ``checkpoints/`` it also creates)."""
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(dst)
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        import shutil
        try:
            shutil.copyfile(src, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, dst)


_TEMP_FILE = re.compile(r"^\..+\.tmp\.(\d+)$")


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Remove the temp files ``_atomic_write`` left in ``directory`` (a writer killed mid-write, or one
    that ran out of space before this version cleaned up after itself). Call it only while holding the
    run dir's ``RunDirLock`` (engine/lock.py): then no live process writes there, except this one (whose own temp
    files are spared)."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for p in directory.iterdir():
        m = _TEMP_FILE.match(p.name)
        if m and int(m.group(1)) != os.getpid() and p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def load_checkpoint(path: Path) -> dict:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or foreign file
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            f"delete it to start over, or set trainer.resume=false") from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{path} is not a flatbnn checkpoint; delete it or set trainer.resume=false")
    return state


CHECKPOINT_FORMAT = 1  # the layout Trainer.state writes; another one is refused, not misread

# what every flatbnn checkpoint holds (trainer.Trainer.state); a missing one is a foreign or hand-edited file
CHECKPOINT_KEYS = {"epoch": int, "step_in_epoch": int, "global_step": int, "elapsed": (int, float), "method": dict,
                   "backprop": dict, "rng": list}


def checkpoint_problem(state: dict, world_size: int) -> str | None:
    """What is structurally wrong with a loaded checkpoint (None: nothing found), checked before any of it
    is restored. Tensor shapes are checked when the model loads (strictly) and reported in one line there."""
    if state.get("format") != CHECKPOINT_FORMAT:
        return (f"its format is {state.get('format')!r}, this flatbnn reads format {CHECKPOINT_FORMAT} (written by "
                f"another version of flatbnn, or edited)")
    for key, kind in CHECKPOINT_KEYS.items():
        if key not in state:
            return f"has no {key!r} entry (not a complete flatbnn checkpoint)"
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            return f"its {key!r} entry is a {type(state[key]).__name__}, not a {getattr(kind, '__name__', 'number')}"
    for key in ("epoch", "step_in_epoch", "global_step"):
        if state[key] < 0:
            return f"its {key!r} is negative ({state[key]})"
    rng = state["rng"]
    if len(rng) != world_size or not all(isinstance(r, dict) and "global" in r and "generator" in r for r in rng):
        return (f"its 'rng' entry holds {len(rng)} RNG state(s) of the expected form, one per process "
                f"({world_size}) expected")
    sums = state.get("epoch_sums")
    if sums is not None and (not isinstance(sums, list) or len(sums) != world_size):
        return f"its 'epoch_sums' entry is not a list of {world_size} per-process sums"
    return None
