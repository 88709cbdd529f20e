"""What code this is: flatbnn's version (declared here once: pyproject.toml and ``flatbnn.__version__`` read it),
and the commit -- asked of git in a checkout, recorded at build time in a wheel.

An installed wheel has no history, so setup.py's build step writes ``flatbnn/_build_info.json`` (``{"commit",
"dirty"}``: the checkout it was built from) into the wheel -- never into the checkout -- and
:func:`flatbnn.engine.provenance.git_commit` reads it there. Imports nothing of flatbnn (setup.py loads it by path,
before flatbnn or its dependencies are installed): the standard library only."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

VERSION = "0.1.0"
FILE = "_build_info.json"
PACKAGE = Path(__file__).resolve().parent


def git_state(repo_dir: Path, untracked: bool = False) -> dict | None:
    """``{"commit": sha, "dirty": bool}`` of the git checkout at ``repo_dir``, None where git cannot say.

    ``untracked=True`` also counts untracked files as dirty. ``results/`` does not count: no run reads it, and its
    generated files (the status board, comparisons) change while runs train."""
    try:
        head = subprocess.run(["git", "-C", str(repo_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        sha = head.stdout.strip()
        if head.returncode != 0 or not sha:
            return None
        status = ["git", "-C", str(repo_dir), "status", "--porcelain"]
        if not untracked:
            status.append("--untracked-files=no")
        status += ["--", ".", ":(exclude)results"]
        dirty = subprocess.run(status, capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return {"commit": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return None


def at_build(source_dir: Path) -> dict:
    """What a wheel built from ``source_dir`` records: that checkout's commit (only when ``source_dir`` is the
    repository's root: an enclosing repository is not its history); else ``$FLATBNN_COMMIT`` (a copy of the tree
    built elsewhere, as .ci/wheel_check.sh does), dirty unknown; else ``unknown``."""
    source_dir = Path(source_dir)
    state = git_state(source_dir) if (source_dir / ".git").exists() else None
    if state is not None:
        return state
    return {"commit": os.environ.get("FLATBNN_COMMIT", "").strip() or "unknown", "dirty": None}


def write(package_dir: Path, info: dict) -> Path:
    """``<package_dir>/_build_info.json`` (the build's copy of the package, not the checkout's)."""
    path = Path(package_dir) / FILE
    path.write_text(json.dumps({"commit": str(info["commit"]), "dirty": info["dirty"]}) + "\n")
    return path


def read(package_dir: Path | None = None) -> dict | None:
    """The recorded ``{"commit", "dirty"}`` of an installed wheel (this package's, by default); None in a checkout
    (or an unreadable file)."""
    try:
        info = json.loads((Path(package_dir or PACKAGE) / FILE).read_text())
        return {"commit": str(info["commit"]), "dirty": info["dirty"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
