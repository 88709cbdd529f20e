"""Atomic file writes: a temp file in the same directory, fsync, ``os.replace``. The one implementation.

A reader sees the old file or the new one, never half of one; a failed write (ENOSPC, an exception mid-write)
removes its temp file. The temp name ``.NAME.tmp.PID`` is the pattern
:func:`flatbnn.engine.checkpoint.remove_stale_temp_files` knows. Imports nothing of flatbnn (lowest layer), so
data, metrics, engine and scripts can all use it (not named ``io``: ``python flatbnn/x.py`` would shadow the stdlib).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp.{os.getpid()}")


def atomic_write(path: Path, write) -> None:
    """``write(f)`` into a binary temp file beside ``path``, then replace ``path`` with it (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a partial file (ENOSPC, an exception mid-write) must not pile up
        raise


def write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def write_text(path: Path, text: str) -> None:
    """A text file written atomically (Markdown tables, the status board)."""
    write_bytes(path, text.encode())


def write_json(path: Path, obj) -> None:
    data = json.dumps(obj, indent=2, sort_keys=False, default=str).encode()
    atomic_write(path, lambda f: f.write(data))


def save_npy(path: Path, array) -> None:
    """``np.save`` of ``array`` to ``path``, atomically (decoded-data caches, generated CIFAR-10-C files)."""
    import numpy as np  # here: the rest of this module needs no numpy

    atomic_write(path, lambda f: np.save(f, array))
