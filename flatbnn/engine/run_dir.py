"""A training run's claim on its run directory, and what a rerun in it may change.

:func:`claim_run_dir` locks the run dir and checks that the run it resumes was started with this config (up to
:data:`RESUME_EXEMPT` and ``trainer.resume_overrides``); :func:`finished_results` says when a rerun has nothing
to do; :func:`move_aside_earlier_outputs` keeps an earlier run's outputs from standing beside a new run's;
:func:`apply_resume_overrides` writes the deliberately changed values into the restored optimiser / schedule.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import warnings
import dataclasses
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from flatbnn import keyroles
from flatbnn.data.fingerprint import differences
from flatbnn.engine import distributed as D
from flatbnn.engine.build import Built
from flatbnn.engine.checkpoint import (CheckpointError, checkpoint_problem, load_checkpoint, remove_stale_temp_files,
                                      write_bytes)
from flatbnn.engine.lock import RunDirLock, RunDirLocked
from flatbnn.engine.trainer import position_problem
from flatbnn.utils import canonical_target, flatten  # {'a': {'b': 1}} -> {'a.b': 1}


# ---------------------------------------------------------------------------------------------- run dir
# Keys a resume may change without being asked (how a run is watched, where its data are read from, how fast it
# goes -- not what it computes): their roles are declared in flatbnn/keyroles.py. Any other difference between the
# config a run dir was started with and the rerun's is refused (the rerun would continue the old run under the new
# label); listing the key in trainer.resume_overrides applies the change deliberately instead.
RESUME_EXEMPT = keyroles.declared("resume_may_change")
_HYDRA_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")
# keys whose change alters the steps per epoch (a checkpoint's position is then checked against epochs only)
_STEP_KEYS = ("trainer.limit_train_batches", "trainer.batch_size", "dataset")


class ResumeConfigMismatch(CheckpointError):
    pass


class ResumeDataChanged(ResumeConfigMismatch):
    """The checkpoint's data fingerprint is not this run's data (flatbnn/data/fingerprint.py)."""


@dataclass
class Claim:
    """What :func:`claim_run_dir` established: the lock, the checkpoint to resume (loaded once), this
    run's resolved config and the values a resume changes deliberately ``{key: (old, new)}``."""

    lock: RunDirLock | None
    state: dict | None
    config: dict
    changes: dict
    data_changes: list = dataclasses.field(default_factory=list)  # trainer.resume_data_changed=ok: how the data differ


def _covered(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def config_changes(reference: dict, current: dict) -> dict:
    """``{dotted key: (reference value, current value)}`` for every key both configs have that differs,
    exempt keys left out. A key only one side has (a config key added or removed by a code update) is not
    a change: group switches also change ``_target_`` / ``name``, which both sides have."""
    ref, cur = flatten(reference or {}), flatten(current or {})
    return {k: (ref[k], cur[k]) for k in cur if k in ref
            and not _same(canonical_target(k, ref[k]), canonical_target(k, cur[k]))  # _target_: by the object
            and not keyroles.resume_may_change(k)}


def claim_run_dir(b: Built) -> Claim:
    """Before a training run writes anything into its run dir: lock it (rank 0; one process per run dir),
    then make sure the run it resumes -- the checkpoint, or a finished run's ``config_resolved.yaml`` -- was
    started with this config (up to :data:`RESUME_EXEMPT` and ``trainer.resume_overrides``). A refusal
    puts back the ``.hydra/*.yaml`` that Hydra rewrote before this code ran. Once claimed: the run dir's
    ``config_resolved.yaml`` and the kept copy of the Hydra files become this run's, and temp files of
    killed checkpoint writers are removed."""
    cfg, info, run_dir = b.cfg, b.info, b.run_dir
    lock = RunDirLock(run_dir) if info.is_main else None
    error = None
    if lock is not None:
        try:
            lock.acquire()
        except RunDirLocked as e:
            error = (str(e), e.holder)
    error = D.broadcast_object(error, info)  # every rank stops, not only the one that tried
    if error is not None:
        if info.is_main:
            _restore_hydra_files(run_dir)
        raise RunDirLocked(*error)
    try:
        current = OmegaConf.to_container(cfg, resolve=True)
        allowed = list(cfg.trainer.get("resume_overrides") or [])
        keys = flatten(current or {})
        for k in allowed:
            if not any(_covered(key, [k]) for key in keys):
                raise ValueError(f"trainer.resume_overrides: {k} is not a config key (e.g. optimizer.lr)")
        state = load_checkpoint(b.resume_ckpt) if b.resume_ckpt is not None else None
        if state is not None:  # structure and position, before anything is written or moved
            problem = checkpoint_problem(state, info.world_size) or position_problem(
                state, b.total_epochs, b.steps_per_epoch, steps_changed(state, config_changes(
                    state.get("config"), OmegaConf.to_container(cfg, resolve=True)) if state.get("config") else {}))
            if problem is not None:
                raise CheckpointError(f"{b.resume_ckpt}: {problem}; delete it to start over, or set "
                                      f"trainer.resume=false")
        reference, source = None, None
        resolved = run_dir / "config_resolved.yaml"
        if state is not None:
            reference, source = state.get("config"), f"checkpoint {b.resume_ckpt}"
            if reference is None and info.is_main:
                print(f"note: {b.resume_ckpt} predates config checks; resuming it without comparing configs",
                      file=sys.stderr)
        elif (cfg.trainer.resume not in (False, None, "false", "none") and (run_dir / "results.json").exists()
              and resolved.exists()):  # a finished run without a checkpoint (trainer.checkpoint_every=0)
            reference, source = yaml.safe_load(resolved.read_text()), f"finished run, {resolved.name}"
        changes = config_changes(reference, current) if reference is not None else {}
        refused = {k: v for k, v in changes.items() if not _covered(k, allowed)}
        if refused:
            shown = ", ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in list(refused.items())[:6])
            more = f" (+{len(refused) - 6} more)" if len(refused) > 6 else ""
            holder = _holder(run_dir, b.resume_ckpt if state is not None else None)
            ways = ("Start the new run elsewhere (hydra.run.dir=...), or start this dir over (trainer.resume=false)"
                    if holder == run_dir else  # trainer.resume=<another run's checkpoint>
                    f"Resume it with its own config, or start from its weights only (trainer.resume=false "
                    f"trainer.init_from={b.resume_ckpt})")
            raise ResumeConfigMismatch(
                f"{holder} holds a run with another config ({source}): {shown}{more}; nothing was overwritten. "
                f"{ways}, or continue that run with the change applied "
                f"(trainer.resume_overrides=[{','.join(refused)}])")
        data_changes = _data_changes(b, state)
        if info.is_main:
            _keep_run_dir_config(run_dir, current, cfg)
            for d in (run_dir, run_dir / "checkpoints"):  # results.json's and the checkpoints' temp files
                for p in remove_stale_temp_files(d):
                    print(f"removed {p} (left by a killed write)", file=sys.stderr)
    except BaseException:
        if lock is not None:
            _restore_hydra_files(run_dir)
            lock.release()
        raise
    return Claim(lock=lock, state=state, config=current, changes=changes, data_changes=data_changes)


def _data_changes(b: Built, state: dict | None) -> list[str]:
    """How this run's data differ from those the checkpoint's run trained on ([]: the same, or a checkpoint from
    before data fingerprints, which run.py's resume line says); refused unless ``trainer.resume_data_changed=ok``."""
    if state is None or state.get("data") is None:
        return []
    changed = differences(state["data"], b.data)
    if changed and b.cfg.trainer.get("resume_data_changed") != "ok":
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        raise ResumeDataChanged(
            f"{b.resume_ckpt}: the data differ from those its run trained on: {'; '.join(changed[:3])}{more}; "
            f"nothing was overwritten. Point dataset.root at the data it trained on, start over "
            f"(trainer.resume=false), or go on with these data (trainer.resume_data_changed=ok, recorded in "
            f"results.json)")
    return changed


def _holder(run_dir: Path, ckpt: Path | None) -> Path:
    """The run dir whose run ``ckpt`` continues: its own ``<dir>/checkpoints/`` parent (``trainer.resume=<path>``
    may name another run's checkpoint), else ``run_dir``."""
    if ckpt is None:
        return run_dir
    ckpt = Path(ckpt).resolve()
    holder = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir if holder == Path(run_dir).resolve() else holder


def _hydra_output(run_dir: Path) -> Path | None:
    """``<run dir>/.hydra`` when Hydra wrote it for this process (so it may have replaced another run's)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        if not HydraConfig.initialized():
            return None
        hc = HydraConfig.get()
        if hc.output_subdir is None or Path(hc.runtime.output_dir).resolve() != Path(run_dir).resolve():
            return None
        return Path(run_dir) / hc.output_subdir
    except Exception:
        return None


def _own_hydra_files(cfg) -> dict[str, bytes]:
    """``.hydra/*.yaml`` as Hydra writes them for this job (hydra.core.utils.run_job), from this process's memory:
    the files on disk may be another process's, whose Hydra wrote into the same dir before either took the lock."""
    from hydra.core.hydra_config import HydraConfig
    hc = HydraConfig.instance().cfg
    return {"config.yaml": OmegaConf.to_yaml(cfg).encode(), "hydra.yaml": OmegaConf.to_yaml(hc).encode(),
            "overrides.yaml": OmegaConf.to_yaml(hc.hydra.overrides.task).encode()}


def _keep_run_dir_config(run_dir: Path, container: dict, cfg) -> None:
    """This run's config in its run dir: ``config_resolved.yaml``, and Hydra's files (``.hydra/``, and the copy
    in ``.flatbnn/hydra/`` that a refused rerun puts back) written again from this job's own config."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(container, sort_keys=False).encode()
    write_bytes(run_dir / "config_resolved.yaml", text)
    hydra_dir = _hydra_output(run_dir)
    if hydra_dir is not None:
        for name, data in _own_hydra_files(cfg).items():
            write_bytes(hydra_dir / name, data)
            write_bytes(run_dir / ".flatbnn" / "hydra" / name, data)


def _restore_hydra_files(run_dir: Path) -> None:
    """Put back the Hydra files of the run that owns ``run_dir`` (a refused rerun's Hydra replaced them)."""
    hydra_dir, kept = _hydra_output(run_dir), Path(run_dir) / ".flatbnn" / "hydra"
    if hydra_dir is None or not kept.is_dir():
        return
    for name in _HYDRA_FILES:
        if (kept / name).exists():
            write_bytes(hydra_dir / name, (kept / name).read_bytes())


def steps_changed(state: dict, changes: dict) -> bool:
    """Did this resume, or an earlier one of the run, change the steps per epoch (resume_overrides)?"""
    changed = list(changes) + [k for h in (state.get("resume_changes") or []) for k in h.get("changes", {})]
    return any(_covered(k, _STEP_KEYS) for k in changed)


def finished_results(b: Built, claim: Claim) -> dict | None:
    """results.json of a run this rerun would only repeat: it resumes (``trainer.resume`` true) a run dir
    whose checkpoint stands at the end of this config's epochs -- or that has results.json and no checkpoint
    (``trainer.checkpoint_every=0``, or one removed after the run finished) and nothing changed."""
    results = b.run_dir / "results.json"
    if b.cfg.trainer.resume not in (True, "auto") or not results.exists():
        return None
    if claim.state is not None:
        finished = claim.state.get("epoch") == b.total_epochs and not claim.state.get("step_in_epoch")
    else:
        finished = not claim.changes
    return json.loads(results.read_text()) if finished else None


# what a run writes into its run dir: an earlier run's copy must not stand beside a new run (aggregate.py would
# show its numbers under the new config, reproduce would take the dir for done)
FINAL_OUTPUTS = ("results.json", "reliability.png", "failed.txt")
RUN_STATE = ("metrics.jsonl", "checkpoints", "wandb_id.txt")  # also an earlier run's, unless this one resumes it


def move_aside_earlier_outputs(run_dir: Path, *, resuming: bool) -> Path | None:
    """Before the first step: move the outputs of an earlier run in ``run_dir`` (a finished run restarted with
    ``trainer.resume=false``, one whose epochs were extended) to ``.flatbnn/replaced/<UTC time>/`` and say so;
    ``results.json`` becomes ``results.json.replaced`` there, so no tool reads it as a run."""
    names = FINAL_OUTPUTS + (() if resuming else RUN_STATE)
    found = [n for n in names if (run_dir / n).exists()]
    if not found:
        return None
    aside = run_dir / ".flatbnn" / "replaced" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside.mkdir(parents=True, exist_ok=True)
    for n in found:
        os.replace(run_dir / n, aside / (f"{n}.replaced" if n == "results.json" else n))
    print(f"moved the earlier run's {', '.join(found)} to {aside} (this run starts "
          f"{'from its checkpoint' if resuming else 'over'}; they are not this run's)", file=sys.stderr)
    return aside


def copy_source_metrics(ckpt: Path, run_dir: Path) -> Path | None:
    """A run resumed from another run's checkpoint (``trainer.resume=<dir>/checkpoints/last.pt`` into a new dir)
    starts its ``metrics.jsonl`` with that run's lines (engine/loggers.py keeps those of the epochs the checkpoint
    holds), so the new dir's file reads as the uninterrupted run's; the source dir is only read."""
    source = _holder(run_dir, ckpt) / "metrics.jsonl"
    dest = Path(run_dir) / "metrics.jsonl"
    if dest.exists() or not source.is_file() or source.resolve() == dest.resolve():
        return None
    write_bytes(dest, source.read_bytes())
    return source


def optimizer_snapshot(method) -> list[dict] | None:
    """The freshly built optimiser's hyperparameters per param group (this run's config), before a checkpoint's
    replace them."""
    opt = getattr(method, "optimizer", None)
    if opt is None:
        return None
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


def apply_resume_overrides(method, fresh: list[dict] | None, keys: list[str]) -> None:
    """Write the values of ``trainer.resume_overrides`` that live in the restored optimiser / schedule
    into them: ``optimizer.<field>`` or ``method.<field>`` sets that param-group field (lr: the schedule's
    base lr; without a schedule the current lr rescaled to it); then the restored schedule is replaced by this
    config's at the restored step (:func:`rebuild_schedule`). Other keys take effect where the run reads them
    from the config (flatness.*, ...)."""
    opt, sched = getattr(method, "optimizer", None), getattr(method, "scheduler", None)
    if not keys or fresh is None or opt is None or len(fresh) != len(opt.param_groups):
        return
    fields = {k.rsplit(".", 1)[-1] for k in keys if k.startswith(("optimizer.", "method."))}
    for group, new in zip(opt.param_groups, fresh):
        for field in fields - {"lr"}:
            if field in group and field in new:
                group[field] = new[field]
        if "lr" in fields:
            new0, old0 = new.get("initial_lr", new["lr"]), group.get("initial_lr", group["lr"])
            group["lr"] = group["lr"] * new0 / old0 if old0 else new0
            if "initial_lr" in group:
                group["initial_lr"] = new0
    if sched is None or not hasattr(sched, "last_epoch"):
        return
    # Any override rebuilds the schedule: which keys shape it is the method's business (HWA's lr_cycles, SGLD's
    # lr_schedule, the scheduler group, the step count), and a schedule is a function of config and step, so
    # rebuilding an unchanged one gives the same lrs. A new lr thus also gives a fresh run's lr for an absolute
    # schedule (inverse_power), where rescaling the current lr would not.
    rebuild_schedule(method, sched.last_epoch)


def rebuild_schedule(method, step: int) -> None:
    """Replace ``method``'s restored lr schedule (the shape of the config the run was started with) by this
    config's, at ``step`` steps: the method builds it as in a fresh run (``attach_scheduler``: the ``scheduler``
    group, or the method's own), from each group's base lr (``initial_lr``), and it is stepped ``step`` times. A
    schedule is a function of the step, so the lr is then the one a fresh run of this config has at ``step``
    -- for any torch scheduler, also one whose next lr is computed from the last."""
    for g in method.optimizer.param_groups:
        g["lr"] = g.get("initial_lr", g["lr"])  # where a fresh optimiser starts
    method.attach_scheduler()
    with warnings.catch_warnings():  # torch's "stepped before optimizer.step()": a replay, no training step is skipped
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        for _ in range(step):
            method.scheduler.step()
