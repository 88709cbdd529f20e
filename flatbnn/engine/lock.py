"""One process per run dir: ``<run dir>/.flatbnn/lock`` (:class:`RunDirLock`).

Only a training run takes it (engine/run_dir.py claims the run dir); a re-evaluation or an analysis reads the
run dir's checkpoint without it, so they do not import this module.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from flatbnn.engine.checkpoint import CheckpointError


class RunDirLocked(CheckpointError):  # a CheckpointError: train.py turns it into one line, exit 2
    def __init__(self, message: str, holder: str | None = None):
        super().__init__(message)
        self.holder = holder  # 'pid N on host H (since T)' of the live process that holds the run dir, if known


# A scheduler (scripts/campaign.py) takes a job's run-dir lock BEFORE it starts the job's train.py, so that of two
# schedulers only one starts it (the check and the claim are one atomic step), and hands the lock to that child:
# the child finds the lock held by its parent, whose pid this variable names, and takes it over.
HANDOVER_ENV = "FLATBNN_RUN_DIR_LOCK_FROM"


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


def _who(holder: dict | None) -> str:
    return (f"pid {holder['pid']} on host {holder.get('host')} (since {holder.get('since')})" if holder
            else "a process that is writing its lock file")


def live_holder(run_dir: Path) -> str | None:
    """Who trains in ``run_dir`` now ('pid N on host H (since T)'), as far as this host can tell; None when no
    live process holds its lock. Takes nothing: a scheduler asks before it starts a job there."""
    lock = RunDirLock(run_dir)
    if not lock.path.is_file():
        return None
    holder = lock._read(lock.path)
    return _who(holder) if lock._is_held(holder, lock.path) else None


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

    def _take_over_from_parent(self, holder: dict | None) -> bool:
        """The lock is our parent's, which handed it to us (:data:`HANDOVER_ENV`): it becomes ours, atomically (the
        parent is alive, so no third process can take it meanwhile). The parent's ``release`` then leaves it."""
        given = os.environ.get(HANDOVER_ENV)
        if holder is None or given != str(holder.get("pid")) or holder["pid"] != os.getppid() \
                or holder.get("host") != self.me["host"]:
            return False
        record = {**self.me, "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "from_pid": holder["pid"]}
        tmp = self.path.with_name(f".lock.tmp.{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)
        self.record, self.held = record, True
        return True

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if self._create():
                self.held = True
                return self
            holder = self._read(self.path)
            if self._take_over_from_parent(holder):
                return self
            if self._is_held(holder, self.path):
                who = _who(holder)
                other_host = holder is not None and holder.get("host") != self.me["host"]
                raise RunDirLocked(
                    f"run dir {self.path.parent.parent} is in use by {who}: two processes would interleave "
                    f"metrics.jsonl and overwrite each other's checkpoint and results; wait for it, or use "
                    f"another hydra.run.dir"
                    + (f" (if no such process runs on {holder.get('host')}, delete {self.path})" if other_host
                       else ""), holder=who)
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
