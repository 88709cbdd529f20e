"""Where a number came from: the git commit (and whether the tree was dirty) and the hardware.

Written into every results.json / summary.json, by the engine and by the scripts alike."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from flatbnn import build_info, resources

#: the checkout whose commit a result records; None for an installed wheel (no history: git must not answer for
#: whatever repository happens to enclose site-packages, e.g. a .venv inside another checkout)
REPO_DIR: Path | None = resources.CHECKOUT


def git_commit(untracked: bool = False) -> dict:
    """``{"commit": sha, "dirty": bool}`` of this checkout (flatbnn/build_info.py: ``untracked``, and why
    ``results/`` never counts as dirty).

    ``untracked=True`` also counts untracked files as dirty (the toy reproductions: a run made before new code is
    committed must say so). Outside a git checkout -- an installed wheel, code copied to a cluster or a GPU box
    without its history -- the commit is the one the wheel was built from (recorded at build time), else
    ``$FLATBNN_COMMIT`` if set (whoever copies the code names the commit), else ``"unknown"``; an empty
    `git status` there must not read as "clean", so ``dirty`` is what the build recorded, or None (unknown).

    A checkout that is dirty at a HEAD other than a named ``$FLATBNN_COMMIT`` carries a .git that is not its tree's
    history -- the GPU device's copy of the working tree comes with the session's first commit, so window 6's records
    said "427456b2+dirty" for code at 822dc4a (.device/COMMIT, which the window names): the named commit wins there,
    dirty unknown. A clean checkout is its HEAD's code whatever is named."""
    named = os.environ.get("FLATBNN_COMMIT", "").strip()
    if REPO_DIR is not None:
        state = build_info.git_state(REPO_DIR, untracked)
        if state is not None:
            if named and state["dirty"] and not state["commit"].startswith(named):
                return {"commit": named, "dirty": None}
            return state
    built = build_info.read()
    if built is not None and built["commit"] != "unknown":
        return built
    return {"commit": named or "unknown", "dirty": None}


def hardware(device: torch.device, world_size: int) -> dict:
    hw = {"device": device.type, "world_size": world_size, "cpu": platform.processor() or platform.machine(),
          "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(device)
    return hw
