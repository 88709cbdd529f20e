"""Where a number came from: the git commit (and whether the tree was dirty) and the hardware.

Written into every results.json / summary.json, by the engine and by the scripts alike."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from flatbnn import resources

#: the checkout whose commit a result records; None for an installed wheel (no history: git must not answer for
#: whatever repository happens to enclose site-packages, e.g. a .venv inside another checkout)
REPO_DIR: Path | None = resources.CHECKOUT


def git_commit(untracked: bool = False) -> dict:
    """``{"commit": sha, "dirty": bool}`` of this checkout.

    ``untracked=True`` also counts untracked files as dirty (the toy reproductions: a run made before
    new code is committed must say so). ``results/`` does not count: no run reads it, and its generated
    files (the status board, comparisons) change while runs train -- a regenerated board must not mark a
    run made with committed code "dirty". Outside a git checkout (no ``.git``, no git) the commit is
    ``$FLATBNN_COMMIT`` if set -- code copied to a cluster or a GPU box without its history, or an installed wheel;
    whoever copies or installs it names the commit -- with ``dirty`` None (unknown), else ``"unknown"``."""
    if REPO_DIR is not None:
        try:
            head = subprocess.run(["git", "-C", str(REPO_DIR), "rev-parse", "HEAD"], capture_output=True,
                                  text=True, timeout=10)
            sha = head.stdout.strip()
            if head.returncode == 0 and sha:
                status = ["git", "-C", str(REPO_DIR), "status", "--porcelain"]
                if not untracked:
                    status.append("--untracked-files=no")
                status += ["--", ".", ":(exclude)results"]
                dirty = subprocess.run(status, capture_output=True, text=True, timeout=10).stdout.strip() != ""
                return {"commit": sha, "dirty": dirty}
        except (OSError, subprocess.SubprocessError):
            pass
    # Not a checkout: an empty `git status` there must not read as "clean".
    named = os.environ.get("FLATBNN_COMMIT", "").strip()
    return {"commit": named or "unknown", "dirty": None}


def hardware(device: torch.device, world_size: int) -> dict:
    hw = {"device": device.type, "world_size": world_size, "cpu": platform.processor() or platform.machine(),
          "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(device)
    return hw
