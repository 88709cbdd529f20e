"""flatbnn's one entry point: ``train.py`` in a checkout, ``flatbnn-train`` once installed (the same ``cli``).

    python train.py dataset=cifar10 model=resnet20_frn method=map flatness=sam flatness.rho=0.05
    python train.py --multirun flatness=sam flatness.rho=0.01,0.05,0.1 seed=0,1,2
    torchrun --nproc_per_node=2 train.py trainer.batch_size=128 ...   (DDP; batch_size is global)
    flatbnn-train --config-dir my_configs experiment=mine              (a config dir of one's own)
"""

from __future__ import annotations

# first, before the slow imports: a stop signal (Ctrl-C in a terminal, a sweep stopped) while they run ends the
# process with one line and 75 / 130, not a traceback from inside torch's import. Only as the program
# (``python -m flatbnn.train``): imported (a submitit job unpickling ``main``) the handlers stay the host's.
from flatbnn.cli import exit_on_stop_signals  # noqa: I001 (flatbnn.cli imports nothing heavy)
if __name__ == "__main__":
    exit_on_stop_signals()

import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from flatbnn import resources  # noqa: E402
from flatbnn.cli import (EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_PREEMPTED, exit_if_members_failed,  # noqa: E402
                         dated_run_dir_parents, install_hydra_error_handler, member_command, one_line_error,
                         remember_command, remember_sweep, remove_stray_run_dir, resume_command)


def _nonzero_rank_overrides() -> None:
    """Under torchrun only rank 0 owns a Hydra run dir; the others write nothing (a run dir
    resolved in each process, e.g. from ``${now:}``, makes one dir per rank: hydra#2070).
    The engine broadcasts rank 0's directory to every rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        return
    args = sys.argv[1:]
    extra = ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        extra.append(f"hydra.run.dir={tempfile.mkdtemp(prefix='flatbnn_rank')}")
    sys.argv += extra


EXIT_FAILED = 1  # a failed run or sweep member; a DDP peer that stalled, died or never arrived
FAILED_JOBS: list[tuple[str, str]] = []  # (run dir, one line) of the failed members of a --multirun sweep
LEFT_JOBS: list[tuple[str, str]] = []  # (run dir, holder) of the members another live process trains: not failures


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _join(cfg: DictConfig) -> Path:
    """Join the DDP process group (torchrun, or a multi-task submitit job) with the configured deadline;
    every rank gets rank 0's run dir (the others have none of their own)."""
    from flatbnn.engine import distributed as D
    from flatbnn.engine.build import run_dir_from_hydra

    D.export_submitit_env()
    D.end_with_launcher()
    info = D.init_distributed(D.resolve_device(cfg.trainer.device), cfg.trainer.get("dist_timeout_s"))
    return Path(D.broadcast_object(str(run_dir_from_hydra()), info))


def _check_composition(cfg: DictConfig) -> None:
    """What only the entry point sees, in Hydra's runtime: a reproduce job's ``+cell`` file carries its cell's keys,
    and no composed group option is a YAML list (Hydra would ignore it). Here, not in engine/run.py: the engine
    knows neither Hydra's choices nor reproduce's cells (tests/test_import_graph.py)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    from flatbnn.engine.validate import check_group_files

    rt = HydraConfig.get().runtime
    cell = rt.choices.get("cell")
    if cell:  # reproduce's modules (its statistics import scipy) only for a reproduce job
        from flatbnn.reproduce.launch import check_cell_choice
        check_cell_choice(cfg, cell)
    check_group_files(dict(rt.choices), rt.config_sources)


@hydra.main(version_base="1.3", config_path=str(resources.CONFIGS_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    from flatbnn.engine import preemption
    from flatbnn.engine.build import run_dir_from_hydra
    from flatbnn.engine.distributed import dist_failure_line
    from flatbnn.engine.run import run
    from flatbnn.engine.trainer import Preempted

    results_path, before = None, None

    def stop(exc: Preempted) -> None:
        preemption.stop(exc, guard, results=results_path, mtime_before=before, exit_preempted=EXIT_PREEMPTED,
                        say=lambda line: _say(line, results_path, way_back=True))

    # a stop signal anywhere in the job (not only in the training loop) ends in exit 0 or 75, never 143
    with preemption.JobSignals() as guard:
        try:
            run_dir = _join(cfg)
            if _in_multirun():
                remember_sweep(run_dir)  # what a stop between this job and the next prints
            results_path = run_dir / "results.json"
            before = preemption.mtime(results_path)
            _check_composition(cfg)
            results = run(cfg, run_dir=run_dir)
        except Preempted as e:
            stop(e)
            return None
        except KeyboardInterrupt:  # a second Ctrl-C (or one before the handlers were installed): at once
            _say("flatbnn: interrupted (Ctrl-C twice): stopped at once; the last checkpoint written is kept",
                 results_path, way_back=True)
            sys.exit(EXIT_INTERRUPTED)
        except Exception as e:  # known, actionable errors become one line; anything else keeps its traceback
            if guard.signum is not None:  # a library caught the stop signal's Preempted and raised its own error
                stop(guard.preempted())   # instead (matplotlib drawing the reliability diagram: 'Invalid bounding
                return None               # box'): the stop, not a failure
            guard.fired = True
            _failed(e, one_line_error(e), dist_failure_line(e, cfg.trainer.get("dist_timeout_s")),
                    run_dir_from_hydra, cfg)
            return None
    # the return value is what a Hydra sweeper (e.g. Optuna) would optimise
    return None if results is None else results["metrics"].get("nll")


def _say(line: str, results_path: Path | None, *, way_back: bool = False, extra: list[str] | tuple = (),
         example: str = "") -> None:
    """A line about how the run ended, on stderr and (rank 0) in its train.log; ``way_back``: followed by the
    command that resumes it (:func:`flatbnn.cli.resume_command`; ``extra`` overrides in it, ``example`` says
    what they are)."""
    run_dir = None if results_path is None else Path(results_path).parent
    command = resume_command(run_dir, extra) if way_back and run_dir is not None else None
    if command:
        line += f"; {example or 'to resume'}: {command}"
    if run_dir is not None and int(os.environ.get("RANK", "0")) == 0 and run_dir.is_dir():
        from flatbnn.engine.report import RunReport
        RunReport(run_dir).note(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _resumable(e: Exception, cfg: DictConfig) -> dict | None:
    """How a run that failed this way is resumed (``_say``'s keywords), or None for a refusal (nothing to resume)."""
    import errno

    from flatbnn.engine.checkpoint import CheckpointWriteError
    from flatbnn.engine.trainer import Diverged
    if isinstance(e, Diverged):
        from omegaconf import OmegaConf
        lr = OmegaConf.select(cfg, "optimizer.lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            return {"extra": [f"optimizer.lr={lr / 10:g}", "trainer.resume_overrides=[optimizer.lr]"],
                    "example": "e.g. at a tenth of the lr"}
        return {}
    if isinstance(e, CheckpointWriteError) or (isinstance(e, OSError) and e.errno in {
            getattr(errno, "ENOSPC", -1), getattr(errno, "EDQUOT", -1)}):
        return {}
    return None


def _failed(e: Exception, msg: str | None, dist_line: str | None, run_dir_from_hydra, cfg: DictConfig) -> None:
    """Called inside the ``except`` of ``main``."""
    results_path = run_dir_from_hydra() / "results.json"
    if dist_line is not None:  # a peer stalled / died / never arrived: not the config's fault; one line, exit 1
        _say(f"flatbnn: error: {dist_line}", results_path, way_back=True)
        sys.exit(EXIT_FAILED)
    if not _in_multirun():
        if msg is None:
            raise
        resume = _resumable(e, cfg)
        if resume is not None:  # trained, then failed: the run dir holds its checkpoint; say how to go on
            _say(f"flatbnn: error: {msg}", results_path, way_back=True, **resume)
            sys.exit(EXIT_CONFIG)
        if int(os.environ.get("RANK", "0")) == 0:  # refused before it trained: no stray run dir (nor outputs/<date>)
            remove_stray_run_dir(run_dir_from_hydra(), dated_run_dir_parents())
        print(f"flatbnn: error: {msg}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    # a sweep member fails alone: its run dir says why, the sweep goes on, the process exits non-zero at the end
    run_dir = run_dir_from_hydra()
    detail = traceback.format_exc()
    line = msg or f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    from flatbnn.engine.lock import RunDirLocked
    if isinstance(e, RunDirLocked) and e.holder:  # another launcher (or a user's run) trains it now: its job, not
        print(f"flatbnn: {run_dir}: left to {e.holder}, which trains it now", file=sys.stderr)  # a failure of ours
        LEFT_JOBS.append((str(run_dir), e.holder))
        return
    from flatbnn.engine.run_dir import ResumeConfigMismatch
    # a refused member does not own its run dir (another process holds it, or it is another config's run):
    # it writes nothing there, the line below and the summary at the end say why
    owns_dir = not isinstance(e, (RunDirLocked, ResumeConfigMismatch))
    if int(os.environ.get("RANK", "0")) == 0 and owns_dir:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "failed.txt").write_text(detail + "\n" + line + "\n")
    resume = _resumable(e, cfg) if owns_dir else None
    if resume is not None:  # trained, then failed: this member alone goes on from its checkpoint
        command = member_command(run_dir, resume.get("extra", ()))
        if command:
            line += f"; {resume.get('example') or 'to resume'} (this member alone): {command}"
    print(f"flatbnn: error in {run_dir}: {line}", file=sys.stderr)
    FAILED_JOBS.append((str(run_dir), line))


def cli() -> None:
    """``train.py`` / ``flatbnn-train`` / ``python -m flatbnn.train``."""
    remember_command()  # as typed: the stop and failure lines print it back with the run dir pinned
    exit_on_stop_signals()  # (again: an installed flatbnn-train imported everything before this)
    _nonzero_rank_overrides()
    install_hydra_error_handler()  # an unknown key / group option, a bad override: one line, exit 2
    main()
    if LEFT_JOBS:
        print(f"flatbnn: {len(LEFT_JOBS)} sweep member(s) left to the processes that train them now (rerun the sweep "
              f"after they end; finished members are skipped):", file=sys.stderr)
        for run_dir, holder in LEFT_JOBS:
            print(f"  {run_dir}: {holder}", file=sys.stderr)
    exit_if_members_failed(FAILED_JOBS)


if __name__ == "__main__":
    cli()
