"""Turning known failures into one actionable line (exit codes are documented in the README)."""

from __future__ import annotations

import difflib
import errno
import functools
import re

EXIT_CONFIG = 2      # bad config, missing data set, unreadable checkpoint, diverged run
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1/SIGUSR2/SIGHUP: checkpointed; rerun (or requeue) to resume
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): checkpointed like SIGTERM (a second Ctrl-C: at once); rerun to resume


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
    if isinstance(inner, OSError) and inner.errno in _FS_ERRNOS:
        return _fs_line(inner)
    if _from_torch_compiler(inner):
        # e.g. torch 2.11's Inductor on CUDA, resnet20_frn under bf16 + channels_last: "AssertionError: 32 v.s.
        # 6400" at the first step (docs/cluster.md). Not the run's fault, and eager mode trains the same model.
        cause = " ".join(str(inner).split()).split(" Set TORCHDYNAMO_VERBOSE")[0][:200]
        return (f"torch.compile failed ({type(inner).__name__}: {cause}); rerun with trainer.compile=false "
                "(eager: the same model, slower; HYDRA_FULL_ERROR=1 shows the compiler's traceback)")
    return None


def _from_torch_compiler(exc: BaseException) -> bool:
    """An error raised by torch.compile's tracer or backend (Dynamo / Inductor), which only a compiled model
    raises."""
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # a torch without Dynamo never compiles
        return False
    return isinstance(exc, TorchDynamoException)


# file-system refusals a user fixes (run dir under a file, read-only or full disk, no permission)
_FS_ERRNOS = {getattr(errno, n) for n in ("ENOTDIR", "EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EEXIST",
                                          "EISDIR", "ENAMETOOLONG") if hasattr(errno, n)}


def _in_data_cache(filename) -> bool:
    """A file of the decoded-data cache ($FLATBNN_CACHE, ~/.cache/flatbnn): moving the run does not help there."""
    import os
    from pathlib import Path
    if not filename:
        return False
    env = os.environ.get("FLATBNN_CACHE")
    root = Path(os.path.expanduser(env)) if env else Path.home() / ".cache" / "flatbnn"
    path = Path(str(filename))
    return path == root or root in path.parents or path.name.endswith((".images.npy", ".labels.npy"))


def _fs_line(e: OSError) -> str:
    where = f" {e.filename}" if e.filename else ""
    if _in_data_cache(e.filename):
        return (f"cannot write the decoded-data cache{where}: {e.strerror or type(e).__name__}; point $FLATBNN_CACHE "
                f"(or dataset.cache_dir=<dir>) at a writable folder with space, or dataset.cache_dir=false")
    if e.errno in {getattr(errno, "ENOSPC", -1), getattr(errno, "EDQUOT", -1)}:
        hint = "free space, then rerun (a run resumes from its last checkpoint)"
    elif e.errno == errno.ENOTDIR:
        hint = "part of that path is a file, not a directory; put the run elsewhere with hydra.run.dir=<dir>"
    else:
        hint = "make it writable or put the run elsewhere with hydra.run.dir=<dir>"
    return f"cannot write{where}: {e.strerror or type(e).__name__}; {hint}"


# ---------------------------------------------------------------------------------------------- stop signals
def exit_on_stop_signals(when: str = "while no job was running") -> None:
    """Whenever no job runs -- the entry point's imports, Hydra composing, between a sweep's jobs (a job installs
    its own handlers, engine/preemption.py, and puts these back) -- a stop signal (SIGTERM / SIGUSR1 / SIGUSR2 /
    SIGHUP: 75; Ctrl-C: 130) ends the process at once with one line: nothing of a job is running, so nothing is
    lost. Without this a Ctrl-C during the imports is a traceback (exit 1), and SIGTERM between jobs kills the
    sweep (exit -15, which a caller takes for a failure)."""
    import signal
    import sys

    def stopped(signum, frame):
        # a sweep between jobs (Hydra holds no job config then): the command its last job gave, sweep dir pinned
        sweep = f"; finished jobs are kept; to go on: {_SWEEP_COMMAND}" if _SWEEP_COMMAND else ""
        print(f"flatbnn: stopped by {signal.Signals(signum).name} {when}" + sweep,
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT):
        try:
            signal.signal(sig, stopped)
        except ValueError:  # not the main thread: the caller's signals stay its own
            return


# ---------------------------------------------------------------------------------------------- the way back
_COMMAND: list[str] | None = None  # sys.argv as the entry point got it (before train.py adds rank > 0 overrides)
_SWEEP_COMMAND: str | None = None  # a --multirun's command with its sweep dir pinned, once a job has started


def remember_sweep(run_dir) -> None:
    """In a sweep's job: keep the command that goes on with the sweep, for a stop between its jobs."""
    global _SWEEP_COMMAND
    _SWEEP_COMMAND = resume_command(run_dir)


def remember_command() -> None:
    """Keep this process's command line for :func:`resume_command` (entry points call it first)."""
    import sys
    global _COMMAND
    _COMMAND = list(sys.argv)


def _program(argv0: str) -> list[str]:
    """How the user started this program: ``python train.py``, ``python -m flatbnn.train``, ``flatbnn-train``;
    under torchrun its launcher in front (one node: the same command; several: the rendezvous flags are theirs)."""
    import os
    import shutil
    import sys
    python = "python" if shutil.which("python") == sys.executable else sys.executable
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        prog = [python, "-m", spec.name.removesuffix(".__main__")]
    elif argv0.endswith(".py"):
        prog = [python, argv0]
    else:  # an installed console script
        prog = [os.path.basename(argv0) if shutil.which(os.path.basename(argv0)) == argv0 else argv0]
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if world > 1:
        local = local or world
        nodes = [f"--nnodes={world // local}", "<the same rendezvous flags>"] if world > local else ["--standalone"]
        prog = ["torchrun", *nodes, f"--nproc_per_node={local}", *(prog[1:] if prog[0] == python else prog)]
    return prog


def _hydra_value(value: str) -> str:
    """``value`` as a Hydra override value: quoted where the override grammar would read it otherwise (``,``
    makes a sweep, ``$``, spaces, brackets, quotes)."""
    if re.fullmatch(r"[\w./:@~+-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def _replaced(args, pinned: list[str]) -> list[str]:
    """``args`` without the overrides of the keys ``pinned`` sets, then ``pinned`` (each key once, as pinned)."""
    keys = {_override_key(o) for o in pinned}
    return [a for a in args if _override_key(a) not in keys] + pinned


def split_after_double_dash(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments before ``--``, the overrides after it): how flatbnn's commands take Hydra overrides."""
    if "--" not in argv:
        return list(argv), []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def resume_command(run_dir, extra: list[str] | tuple = ()) -> str | None:
    """The command that resumes the run in ``run_dir``, to paste into a shell: this process's command line with
    its run dir pinned -- a plain run's dir is timestamped (``hydra.run.dir``; a sweep's: ``hydra.sweep.dir``),
    so the very same command would start a new run at epoch 1 -- and ``extra`` overrides (each replaces the
    same key). None outside a Hydra job (``run()`` called from Python)."""
    import shlex
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if _COMMAND is None or not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # the sweep, pinned: its finished members say so, the others resume
        key, where = "hydra.sweep.dir", Path(run_dir).resolve()
        for _ in Path(str(hc.sweep.subdir)).parts:  # a member's dir is <sweep dir>/<subdir>
            where = where.parent
    else:
        key, where = "hydra.run.dir", Path(run_dir).resolve()
    args = _continuing(_COMMAND[1:], run_dir, sweep=hc.mode == RunMode.MULTIRUN)
    return shlex.join(_program(_COMMAND[0]) + _replaced(args, [f"{key}={_hydra_value(str(where))}", *extra]))


_RESUME_KEY = "trainer.resume"


def _continuing(args, run_dir, *, sweep: bool = False) -> list[str]:
    """``args`` with a ``trainer.resume`` override that would not continue the run in ``run_dir`` replaced by
    ``trainer.resume=true`` (its own ``checkpoints/last.pt``): ``false`` would start it over, and a path -- another
    run's checkpoint, or this dir's ``good.pt`` -- would go back to where it started, not to where it stopped. A path
    stays only where the run has no checkpoint of its own yet (stopped before its first one: it starts there again)."""
    from pathlib import Path

    own = (Path(run_dir) / "checkpoints" / "last.pt").exists()
    out = []
    for a in args:
        if _override_key(a) == _RESUME_KEY and "=" in a:
            value = a.split("=", 1)[1].strip("'\"")
            named_path = value.lower() not in ("true", "auto", "false", "none", "null", "")
            if value.lower() not in ("true", "auto") and (sweep or own or not named_path):
                a = f"{_RESUME_KEY}=true"
        out.append(a)
    return out


_VALUE_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")  # Hydra flags with a value


def member_command(run_dir, extra: list[str] | tuple = ()) -> str | None:
    """The command that resumes ONE member of a ``--multirun`` sweep, to paste into a shell: this program with the
    command line's Hydra flags (not ``--multirun``), the member's own overrides and its dir pinned
    (``hydra.run.dir``) -- a plain run in that dir, so it resumes there and leaves the sweep's other members
    alone (rerunning the sweep with ``extra`` would change them all). None outside a Hydra job."""
    import shlex
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    if _COMMAND is None or not HydraConfig.initialized():
        return None
    flags, rest = [], iter(_COMMAND[1:])
    for a in rest:
        if a in ("-m", "--multirun") or not a.startswith("-"):
            continue
        flags.append(a)
        if a in _VALUE_FLAGS:
            flags.append(next(rest, ""))
    pinned = [f"hydra.run.dir={_hydra_value(str(Path(run_dir).resolve()))}", *extra]
    args = _continuing(list(HydraConfig.get().overrides.task), run_dir)
    return shlex.join(_program(_COMMAND[0]) + flags + _replaced(args, pinned))


def _closest(word: str, options, n: int = 3) -> list[str]:
    return difflib.get_close_matches(str(word), [str(o) for o in options], n=n, cutoff=0.5)


def hydra_error_line(exc: BaseException) -> str | None:
    """One line for the errors Hydra raises while composing the config or creating the run dir (an
    unknown key or group option, a bad override, a run dir it cannot create), with the closest valid
    names; None for anything else."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ValidationError

    yaml_line = yaml_error_line(exc)
    if yaml_line is not None:
        return yaml_line
    if isinstance(exc, MissingConfigException):
        text = str(exc)
        m = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
        options = list(getattr(exc, "options", None) or [])
        if m and options:
            group, option = m.group(1).replace("/", "."), m.group(2)
            near = _closest(option, options)
            shown = (f"did you mean {' or '.join(near)}?" if near else f"options: {', '.join(options)}")
            return f"{group}={option}: no such option in config group {group}; {shown}"
        return " ".join(text.splitlines()[0].split())
    if isinstance(exc, OverrideParseException):
        return "bad override: " + " ".join(str(exc).splitlines()[0].split()) + " (see python train.py --help)"
    if isinstance(exc, HydraException):
        cause = exc.__cause__
        key = getattr(cause, "full_key", None)
        parent = getattr(cause, "parent_node", None)
        if key and isinstance(cause, ValidationError):  # a typed node (flatbnn/schema.py) refused a value
            return f"{key}: {str(cause).splitlines()[0].strip()}"
        if key and parent is not None and "Could not override" in str(exc):
            leaf = str(key).rpartition(".")[2]
            prefix = str(key)[: len(str(key)) - len(leaf)]
            near = [prefix + k for k in _closest(leaf, list(parent))]
            what = "key or config group" if not prefix else "key"
            hint = f"did you mean {' or '.join(near)}?" if near else "check the spelling"
            return f"unknown {what} {key}: {hint} (a deliberate new key: +{key}=...)"
        return " ".join(" ".join(line.split()) for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, OSError) and exc.errno in _FS_ERRNOS:
        return _fs_line(exc)
    return None


def yaml_error_line(exc: BaseException) -> str | None:
    """``file:line:column: <YAML message>`` for a YAML syntax error anywhere in ``exc``'s chain (a user's config
    file, ``--config-dir``, an ``experiment=`` file): Hydra prints ~100 lines with the file at the very end."""
    import yaml
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, yaml.MarkedYAMLError):
            mark = exc.problem_mark or exc.context_mark
            where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else "a config file"
            what = " ".join(f"{exc.context or ''} {exc.problem or ''}".split())
            return f"{where}: YAML syntax error: {what or type(exc).__name__}"
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def remove_stray_run_dir(run_dir, dated_parents: int = 0) -> bool:
    """A run refused before it trained leaves only what Hydra made for it (``.hydra/*.yaml``, an empty
    ``train.log``, and an empty ``.flatbnn/`` where the refusal came after the lock was taken and given back):
    remove that, and the dir if it is then empty, so nothing looks like a run there; then its ``dated_parents``
    nearest parents (``outputs/<date>``: made for this run by ``hydra.run.dir``'s ``${now:}`` parts) where they
    are empty. Never a dir that holds anything else."""
    import os
    from pathlib import Path
    run_dir = Path(run_dir)
    hydra_files = {"config.yaml", "hydra.yaml", "overrides.yaml"}
    try:
        entries = {p.name for p in run_dir.iterdir()}
        if not entries <= {".hydra", "train.log", ".flatbnn"}:
            return False
        log = run_dir / "train.log"
        if log.exists() and log.stat().st_size:
            return False
        hydra_dir = run_dir / ".hydra"
        if hydra_dir.exists() and not {p.name for p in hydra_dir.iterdir()} <= hydra_files:
            return False
        own = run_dir / ".flatbnn"
        if own.exists() and any(own.iterdir()):
            return False
        for name in hydra_files:
            (hydra_dir / name).unlink(missing_ok=True)
        for d in (hydra_dir, own):
            if d.exists():
                d.rmdir()
        log.unlink(missing_ok=True)
        run_dir.rmdir()
    except OSError:
        return False
    parent = run_dir.parent
    for _ in range(dated_parents):
        try:
            os.rmdir(parent)  # only an empty dir: anything else in it (another run) keeps it
        except OSError:
            break
        parent = parent.parent
    return True


def dated_run_dir_parents() -> int:
    """How many parents of this Hydra job's run dir are named by ``${now:...}`` (the default ``hydra.run.dir``
    ``outputs/${now:%Y-%m-%d}/${now:%H-%M-%S-%f}``: 1, the date), i.e. were made for runs, not by the user."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf
        raw = str(OmegaConf.to_container(HydraConfig.get().run, resolve=False)["dir"])
    except Exception:  # noqa: BLE001 -- no Hydra job: none
        return 0
    parts = raw.replace("\\", "/").split("/")[:-1]  # the run dir's own name is removed anyway
    n = 0
    while parts and "${now:" in parts[-1]:
        parts.pop()
        n += 1
    return n


def install_hydra_error_handler() -> None:
    """Make Hydra's own errors (composition, overrides, creating the run dir) one line on stderr and exit
    status 2, instead of its 6-40 lines and exit 1. ``HYDRA_FULL_ERROR=1`` keeps Hydra's behaviour.

    Hydra reports them in ``hydra._internal.utils.run_and_report`` (around ``_run_hydra``'s steps); we
    wrap that function. Errors it does not know stay Hydra's."""
    import os
    import sys

    try:
        import hydra._internal.utils as hydra_utils
    except ImportError:  # another Hydra layout: keep its reporting
        return
    original = getattr(hydra_utils, "run_and_report", None)
    if original is None or getattr(original, "_flatbnn", False):
        return

    def run_and_report(func):
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            return original(func)
        try:
            return func()
        except Exception as e:
            line = hydra_error_line(e)
            if line is None:
                return original(functools.partial(_reraise, e))  # `e` is unbound once the except ends
            if isinstance(e, OSError):  # e.g. a full disk while Hydra writes .hydra/: what it made goes again
                _remove_refused_run_dir()
            print(f"flatbnn: error: {line}", file=sys.stderr)
            sys.exit(EXIT_CONFIG)

    run_and_report._flatbnn = True
    hydra_utils.run_and_report = run_and_report
    _name_the_file_of_save_config()


def _name_the_file_of_save_config() -> None:
    """Hydra writes ``.hydra/*.yaml`` with ``open(...).write``: on a full disk the ``OSError`` comes from the write
    (the flush at close) and carries no file name, so the one line would say "cannot write: No space left" and not
    where. This names the file in it."""
    try:
        import hydra.core.utils as hydra_core_utils
    except ImportError:
        return
    original = getattr(hydra_core_utils, "_save_config", None)
    if original is None or getattr(original, "_flatbnn", False):
        return

    def save_config(cfg, filename, output_dir):
        try:
            return original(cfg, filename, output_dir)
        except OSError as e:
            if e.filename is None:
                e.filename = str(output_dir) + "/" + str(filename)
            _SETUP_FAILED.update(_job_dir())  # Hydra puts its pre-job config back before the error reaches us
            raise

    save_config._flatbnn = True
    hydra_core_utils._save_config = save_config


_SETUP_FAILED: dict = {}  # the plain run whose .hydra/ Hydra could not write: its dir and dated parents


def _job_dir() -> dict:
    """``{"dir", "dated"}`` of the job Hydra is setting up now (a plain run; a sweep member's dir is not removed)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.RUN:
            return {"dir": HydraConfig.get().runtime.output_dir, "dated": dated_run_dir_parents()}
    except Exception:  # noqa: BLE001 -- no job config: nothing to remove
        pass
    return {}


def _remove_refused_run_dir() -> None:
    """A plain run whose set-up failed in Hydra (its ``.hydra/*.yaml`` could not be written) leaves only what Hydra
    made for it -- empty config files, an empty train.log, ``outputs/<date>``: removed, as for any refused run."""
    if _SETUP_FAILED.get("dir"):
        remove_stray_run_dir(_SETUP_FAILED["dir"], _SETUP_FAILED.get("dated", 0))


def _reraise(e: BaseException):
    raise e


def exit_if_members_failed(failed: list[tuple[str, str]], what: str = "sweep member(s)") -> None:
    """End of a ``--multirun`` whose failing members wrote ``failed.txt`` and let the sweep go on (train.py,
    flatbnn.reproduce.eval_job): list them, one line each, and exit 1."""
    import sys

    if not failed:
        return
    print(f"flatbnn: {len(failed)} {what} failed (see failed.txt in each run dir):", file=sys.stderr)
    for run_dir, line in failed:
        print(f"  {run_dir}: {line}", file=sys.stderr)
    sys.exit(1)
