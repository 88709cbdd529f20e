"""Atomic checkpoints and results: write to a temp file in the same directory, fsync, os.replace.

The previous file stays intact until the new one is complete, so a crash mid-write loses nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class CheckpointError(RuntimeError):
    pass


def _atomic_write(path: Path, write) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(path: Path, state: dict) -> None:
    _atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or foreign file
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            f"delete it to start over, or set trainer.resume=false") from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{path} is not a flatbnn checkpoint; delete it or set trainer.resume=false")
    return state


def write_json(path: Path, obj) -> None:
    data = json.dumps(obj, indent=2, sort_keys=False, default=str).encode()
    _atomic_write(path, lambda f: f.write(data))
