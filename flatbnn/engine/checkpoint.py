"""Atomic checkpoints and results: write to a temp file in the same directory, fsync, os.replace.

The previous file stays intact until the new one is complete, so a crash mid-write loses nothing; a
failed write (ENOSPC) removes its temp file, and the temp files of a killed writer are removed by the
next process that owns the run dir (:func:`remove_stale_temp_files`). :class:`RunDirLock` makes that
owner unique: one process per run dir.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

# the atomic writers live in flatbnn.atomic_io (lowest layer); re-exported here for existing callers
from flatbnn.atomic_io import atomic_write as _atomic_write
from flatbnn.atomic_io import temp_name as _temp_name
from flatbnn.atomic_io import write_bytes, write_json, write_text  # noqa: F401


class CheckpointError(RuntimeError):
    pass


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
    try:
        _atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:  # ENOSPC, EDQUOT, EIO: the previous checkpoint is intact, say so in one line
        os_error = _os_error_in(e)
        if os_error is None:
            raise
        raise CheckpointError(f"could not write checkpoint {path} ({os_error.strerror or os_error}); the previous "
                              f"checkpoint is intact: free space / fix the file system and rerun the same command "
                              f"to resume") from None


def link_checkpoint(src: Path, dst: Path) -> None:
    """``dst`` becomes the same file as ``src`` (a hard link: no copy; ``src`` being replaced later by
    ``os.replace`` leaves ``dst`` intact), atomically; a copy where the file system has no hard links."""
    src, dst = Path(src), Path(dst)
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
    run dir's :class:`RunDirLock`: then no live process writes there, except this one (whose own temp
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


class RunDirLocked(CheckpointError):  # a CheckpointError: train.py turns it into one line, exit 2
    pass


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` (clock ticks since boot, Linux): tells a recycled pid from the lock holder."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunDirLock:
    """At most one process trains in a run dir: ``<run dir>/.flatbnn/lock`` names its holder (pid, host,
    boot id, process start time). It is created atomically with a hard link (safe on NFS as well), removed
    on release; a lock whose holder is gone -- same host and the pid is dead, recycled (another start
    time) or from before a reboot -- is stale and taken over. A holder on another host cannot be checked
    from here: the refusal names it and says to delete the file if that process no longer runs."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".flatbnn" / "lock"
        self.held = False
        self.record: dict | None = None
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": _boot_id(),
                   "start": _process_start(os.getpid())}

    def _read(self, path: Path) -> dict | None:
        try:
            obj = json.loads(path.read_text())
            return obj if isinstance(obj, dict) and isinstance(obj.get("pid"), int) else None
        except (OSError, ValueError):
            return None

    def _is_held(self, holder: dict | None, path: Path) -> bool:
        """Is the process that wrote ``holder`` still running (as far as this host can tell)?"""
        if holder is None:  # unreadable: only the non-link fallback can leave it half-written, and only briefly
            try:
                return time.time() - path.stat().st_mtime < 30
            except OSError:
                return False
        if holder.get("host") != self.me["host"]:
            return True
        if holder.get("boot_id") and self.me["boot_id"] and holder["boot_id"] != self.me["boot_id"]:
            return False
        if not _pid_alive(holder["pid"]):
            return False
        start = _process_start(holder["pid"])
        return not (holder.get("start") and start and start != holder["start"])

    def _create(self) -> bool:
        """Create the lock file naming this process; False if one exists."""
        record = self.record = {**self.me, "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        tmp = self.path.with_name(f".lock.tmp.{os.getpid()}")
        tmp.write_text(json.dumps(record))
        try:
            os.link(tmp, self.path)  # atomic create-if-absent with the content already in place
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here: exclusive create
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record))
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if self._create():
                self.held = True
                return self
            holder = self._read(self.path)
            if self._is_held(holder, self.path):
                who = (f"pid {holder['pid']} on host {holder.get('host')} (since {holder.get('since')})"
                       if holder else "a process that is writing its lock file")
                other_host = holder is not None and holder.get("host") != self.me["host"]
                raise RunDirLocked(
                    f"run dir {self.path.parent.parent} is in use by {who}: two processes would interleave "
                    f"metrics.jsonl and overwrite each other's checkpoint and results; wait for it, or use "
                    f"another hydra.run.dir"
                    + (f" (if no such process runs on {holder.get('host')}, delete {self.path})" if other_host
                       else ""))
            # stale: move it aside under a name of our own, then make sure it was the stale one we judged
            aside = self.path.with_name(f"lock.stale.{os.getpid()}")
            try:
                os.replace(self.path, aside)
            except FileNotFoundError:
                continue
            if self._read(aside) != holder:  # another process took it over meanwhile: give it back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
            aside.unlink(missing_ok=True)
        raise RunDirLocked(f"could not lock run dir {self.path.parent.parent} (contended); retry, or use "
                           f"another hydra.run.dir")

    def release(self) -> None:
        if self.held and self._read(self.path) == self.record:  # never remove a lock taken over from us
            self.path.unlink(missing_ok=True)
        self.held = False


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


# what every flatbnn checkpoint holds (trainer.Trainer.state); a missing one is a foreign or hand-edited file
CHECKPOINT_KEYS = {"epoch": int, "step_in_epoch": int, "global_step": int, "elapsed": (int, float), "method": dict,
                   "backprop": dict, "rng": list}


def checkpoint_problem(state: dict, world_size: int) -> str | None:
    """What is structurally wrong with a loaded checkpoint (None: nothing found), checked before any of it
    is restored. Tensor shapes are checked when the model loads (strictly) and reported in one line there."""
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
