"""Test hooks for subprocess runs (tests/test_stop_and_way_back.py): with this folder on PYTHONPATH, the variable
``FLATBNN_TEST_HOOK=<name>[:<n>]`` makes one thing happen inside the child at a chosen moment -- a stop signal
at a given step, between a sweep's jobs, during the imports; a full disk at the n-th checkpoint; another
process's Hydra files in the run dir before the lock. Without the variable nothing is changed, so the
command a run prints can be pasted and run as it is."""

import os
import sys

_HOOK = os.environ.get("FLATBNN_TEST_HOOK", "")
_NAME, _, _ARG = _HOOK.partition(":")


def _stop_at_step(n: int) -> None:
    import signal

    from flatbnn.engine.trainer import Trainer
    to_device = Trainer.to_device

    def patched(self, batch):
        if self.global_step == n:
            signal.raise_signal(signal.SIGTERM)
        return to_device(self, batch)

    Trainer.to_device = patched


def _sigterm_after_first_job(to: str) -> None:
    """SIGTERM once the sweep's first job is done -- to the parent (``parent``: scripts/reproduce.py, which hands
    it on to this sweep) or to this sweep itself (``self``) --, then wait: it arrives between the jobs."""
    import signal
    import time

    import hydra.core.utils as utils  # Hydra's plugin scan re-executes basic_launcher, which imports it from here
    run_job, done = utils.run_job, []

    def patched(*args, **kwargs):
        ret = run_job(*args, **kwargs)
        if not done:
            done.append(1)
            os.kill(os.getpid() if to == "self" else os.getppid(), signal.SIGTERM)
            time.sleep(30)
        return ret

    utils.run_job = patched


def _sigint_group_while_importing(module: str) -> None:
    """Ctrl-C in a terminal: SIGINT to the whole process group while this process imports ``module``."""
    import importlib.abc
    import signal

    class Finder(importlib.abc.MetaPathFinder):
        fired = False

        def find_spec(self, name, path=None, target=None):
            if name == module and not Finder.fired:
                Finder.fired = True
                os.killpg(os.getpgid(0), signal.SIGINT)
            return None

    sys.meta_path.insert(0, Finder())


def _disk_full_at_save(n: int) -> None:
    import errno

    from flatbnn.engine import checkpoint
    write, calls = checkpoint._atomic_write, []

    def patched(path, writer):
        if path.name == "last.pt":
            calls.append(path)
            if len(calls) == n:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write(path, writer)

    checkpoint._atomic_write = patched


def _another_process_rewrites_hydra_files() -> None:
    """Another job's Hydra (same run dir, seed 5) writes .hydra/ after ours did, before this job takes the lock."""
    from flatbnn.engine import run
    claim = run.claim_run_dir

    def patched(b):
        for name in ("config.yaml", "overrides.yaml"):
            p = b.run_dir / ".hydra" / name
            p.write_text(p.read_text().replace("seed: 0", "seed: 5").replace("seed=0", "seed=5"))
        return claim(b)

    run.claim_run_dir = patched


def _slow_steps(seconds: float) -> None:
    """Each training step takes ``seconds`` longer (a big model on a slow device)."""
    import time

    from flatbnn.engine.trainer import Trainer
    to_device = Trainer.to_device

    def patched(self, batch):
        time.sleep(seconds)
        return to_device(self, batch)

    Trainer.to_device = patched


def _signal_while_writing(name: str, signum: str = "SIGTERM") -> None:
    """``signum`` to this process half-way through writing a file named ``name`` (its temp file holds a part)."""
    import signal

    from flatbnn import atomic_io
    write = atomic_io.atomic_write

    def patched(path, writer):
        if os.path.basename(str(path)) != name:
            return write(path, writer)

        def half(f):
            f.write(b'{"metrics": ')
            f.flush()
            signal.raise_signal(getattr(signal, signum))
            writer(f)
        return write(path, half)

    atomic_io.atomic_write = patched


def _disk_full_at_hydra_start() -> None:
    """A full disk when Hydra writes the run dir's ``.hydra/config.yaml``: the file is created, its write fails (as
    the flush of ``open(...).write`` does: an ENOSPC without a file name)."""
    import errno

    import hydra.core.utils as utils  # Hydra's run_job looks _save_config up here

    def patched(cfg, filename, output_dir):
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / filename).touch()
        raise OSError(errno.ENOSPC, "No space left on device")

    utils._save_config = patched


def _signal_in(dotted: str, signum: str = "SIGTERM") -> None:
    """``signum`` to this process when ``module.function`` is called (e.g. while a campaign plans), then wait."""
    import importlib
    import signal
    import time

    module, _, func = dotted.rpartition(".")
    mod = importlib.import_module(module)

    def patched(*args, **kwargs):
        signal.raise_signal(getattr(signal, signum))
        time.sleep(30)

    setattr(mod, func, patched)


if _NAME == "slow_steps":
    _slow_steps(float(_ARG))
elif _NAME == "stop_at_step":
    _stop_at_step(int(_ARG))
elif _NAME == "sigterm_after_first_job" and "--multirun" in sys.argv:
    _sigterm_after_first_job(_ARG)
elif _NAME == "sigint_group_importing" and "--multirun" in sys.argv:
    _sigint_group_while_importing(_ARG or "hydra")
elif _NAME == "disk_full_at_save":
    _disk_full_at_save(int(_ARG))
elif _NAME == "signal_while_writing":
    _signal_while_writing(*_ARG.split(","))
elif _NAME == "disk_full_at_hydra_start":
    _disk_full_at_hydra_start()
elif _NAME == "signal_in":
    _signal_in(*_ARG.split(","))
elif _NAME == "hydra_files_rewritten":
    _another_process_rewrites_hydra_files()
