"""Train and evaluate one configuration: build -> claim the run dir -> (resume) -> fit -> final evaluation
-> results.json.

The parts, one module each: ``engine/build.py`` (config -> data, model, method, flatness), ``engine/warm_start.py``
(``trainer.init_from``), ``engine/run_dir.py`` (the run dir's lock and resume policy), ``engine/results.py``
(the final evaluation and results.json's meta); this module puts them in order.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from flatbnn import runlog
from flatbnn.engine import distributed as D
from flatbnn.engine import graphed
from flatbnn.engine.build import Built, build, run_dir_from_hydra
from flatbnn.engine.checkpoint import write_json
from flatbnn.engine.compiling import save_compile_cache
from flatbnn.engine.loggers import JsonlLogger
from flatbnn.engine.provenance import git_commit
from flatbnn.engine.report import RunReport, report_final, report_start
from flatbnn.engine.results import final_evaluate, results_meta, save_reliability_diagram
from flatbnn.engine.run_dir import (Claim, apply_resume_overrides, claim_run_dir, copy_source_metrics,
                                    finished_results, move_aside_earlier_outputs, optimizer_snapshot, steps_changed)
from flatbnn.engine.trainer import Trainer
from flatbnn.metrics.evaluate import evaluate


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict | None:
    """Train and evaluate one configuration. Returns the results dict on rank 0 (None elsewhere)."""
    t_start = time.perf_counter()
    git_start = git_commit()  # the code this process trains with (read now: the tree may change while it runs)
    from flatbnn.engine.validate import validate_config
    validate_config(cfg, run_dir or run_dir_from_hydra())  # types, ranges, device, writable run dir: before any data
    b = build(cfg, run_dir, training=True)
    claim = claim_run_dir(b)  # nothing in the run dir is written before this passed
    try:
        done = finished_results(b, claim)
        if done is not None:
            if b.info.is_main:
                print(f"{b.run_dir} is already finished ({b.total_epochs} epochs, results.json); nothing to do "
                      f"(evaluate.py re-evaluates it, trainer.resume=false trains it again)", file=sys.stderr)
            D.barrier(b.info)
            D.cleanup(b.info)
            return done if b.info.is_main else None
        return _train_and_evaluate(b, claim, t_start, git_start)
    finally:
        if claim.lock is not None:
            claim.lock.release()


def _same_path(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _train_and_evaluate(b: Built, claim: "Claim", t_start: float, git_start: dict | None = None) -> dict | None:
    cfg, tc = b.cfg, b.cfg.trainer
    info, run_dir, method = b.info, b.run_dir, b.method

    # ---------------------------------------------------------------- resume
    trainer = Trainer(epochs=b.total_epochs, run_dir=run_dir, info=info, device=b.device,
                      checkpoint_every=tc.checkpoint_every, eval_every=tc.eval_every, progress=tc.progress,
                      limit_train_batches=tc.limit_train_batches, channels_last=tc.channels_last)
    if tc.get("cuda_graph"):  # captured on the first step of this process: after any resume below
        trainer.train_step = graphed.GraphedStep(
            method, b.flatness, b.backprop, log=lambda line: info.is_main and runlog.note(line))
    ckpt = b.resume_ckpt
    if ckpt is not None:
        fresh = optimizer_snapshot(method)  # this config's hyperparameters, before the checkpoint's replace them
        trainer.restore(claim.state, method, b.backprop, b.generator, path=ckpt, steps_per_epoch=b.steps_per_epoch,
                        schedule_changed=steps_changed(claim.state, claim.changes))
        apply_resume_overrides(method, fresh, list(claim.changes))
        if info.is_main:  # the numbering of the stop line: epoch (1-based) in progress, steps done in it
            where = (f"after its {trainer.epoch} epochs (the final evaluation)" if trainer.epoch >= b.total_epochs
                     else f"at epoch {trainer.epoch + 1}, step {trainer.step_in_epoch} of {b.steps_per_epoch}"
                     if trainer.step_in_epoch <= b.steps_per_epoch else  # fewer steps an epoch now (resume_overrides)
                     f"at the end of epoch {trainer.epoch + 1} ({trainer.step_in_epoch} steps of it done, more than "
                     f"the {b.steps_per_epoch} an epoch has now: its end-of-epoch work, then epoch {trainer.epoch + 2})")
            RunReport(run_dir).note(
                f"resuming from {ckpt} {where}"
                + (f", with {', '.join(f'{k}={v[1]}' for k, v in claim.changes.items())} applied (was "
                   f"{', '.join(str(v[0]) for v in claim.changes.values())})" if claim.changes else "")
                + (f", on other data (trainer.resume_data_changed=ok): {'; '.join(claim.data_changes)}"
                   if claim.data_changes else "")
                + ("; the checkpoint predates data fingerprints: the data were not compared"
                   if claim.state.get("data") is None else ""))
    elif b.init_from is not None and info.is_main:
        RunReport(run_dir).note(f"initialised the model from {b.init_from['path']}")
    if info.is_main:  # the checkpoint restored (or none): from here on this run writes its outputs
        # any checkpoint of this run dir (last.pt, good.pt, diverged.pt) continues this run: its metrics stay
        own = ckpt is not None and _same_path(Path(ckpt).parent, run_dir / "checkpoints")
        move_aside_earlier_outputs(run_dir, resuming=own)
        run_dir.mkdir(parents=True, exist_ok=True)
        if ckpt is not None and not own:  # another run's checkpoint: its epochs so far, so metrics.jsonl is one run's
            copy_source_metrics(Path(ckpt), run_dir)
        trainer.loggers = [JsonlLogger(run_dir, resume_epoch=trainer.epoch)]
        container = OmegaConf.to_container(cfg, resolve=True)
        for lg_cfg in (cfg.logger or {}).values():
            if lg_cfg is not None and "_target_" in lg_cfg:
                trainer.loggers.append(instantiate(lg_cfg, _partial_=True)(run_dir=run_dir, run_config=container))
    report = RunReport(run_dir, enabled=info.is_main)  # start / final lines and warnings, also in train.log
    report_start(report, b, _model_name(cfg))

    def evaluate_epoch() -> dict:
        name, loader, targets = (("val", b.val_loader, b.val_targets) if b.val_loader is not None
                                 else ("test", b.eval_loaders["test"], b.test_targets))
        m = evaluate(method, {"test": loader}, targets, b.eval_cfg, gather=b.gather, predict=method.monitor)
        keys = ("accuracy", "nll", "ece")
        return {f"{name}/{k}": m[k] for k in keys}

    history = list((claim.state or {}).get("resume_changes") or [])
    if claim.changes or claim.data_changes:
        history.append({"global_step": trainer.global_step, "changes": {k: list(v) for k, v in claim.changes.items()},
                        **({"data_changed": claim.data_changes} if claim.data_changes else {})})
    git_segments = list((claim.state or {}).get("git_segments") or [])  # earlier processes of this run
    git_segments.append({"global_step": trainer.global_step, **(git_start or git_commit())})
    with report:  # training's warnings (flatbnn's and Python's) go to train.log too
        trainer.fit(method, b.flatness, b.backprop, b.train_loader, b.sampler, b.bundle.train,
                    evaluate_epoch=evaluate_epoch if tc.eval_every else None, generator=b.generator,
                    checkpoint_extra={"config": claim.config, "data": b.data, "resume_changes": history,
                                      "git_segments": git_segments})

    if tc.compile and info.is_main:
        save_compile_cache(b.device, tc.get("compile_cache"))

    # ---------------------------------------------------------------- final evaluation
    with report:  # the final evaluation's warnings too
        metrics, predictive = final_evaluate(b)
    results = None
    if info.is_main:
        meta = results_meta(b, steps=trainer.global_step, train_seconds=trainer.elapsed,
                            wall_seconds=time.perf_counter() - t_start, overrides=_overrides(),
                            model_name=_model_name(cfg), run_dir=run_dir, git_segments=git_segments)
        if history:  # values changed on a resume (trainer.resume_overrides): where and what
            meta["resume_changes"] = history
        if isinstance(trainer.train_step, graphed.GraphedStep):  # whether the graph really ran (this process)
            meta["cuda_graph"] = trainer.train_step.summary()
        results = {"metrics": metrics, "meta": meta}
        from flatbnn.engine.preemption import check_stop
        check_stop()  # a stop signal during the final evaluation whose Preempted was swallowed: exit 75, not 0
        write_json(run_dir / "results.json", results)
        report_final(report, b, results, run_dir / "results.json")
        for lg in trainer.loggers:
            lg.log_results(results)
            lg.finish()
        if tc.reliability_diagram:
            save_reliability_diagram(predictive["test"].exp(), b.test_targets, run_dir / "reliability.png", b.eval_cfg)
    D.barrier(info)
    D.cleanup(info)
    return results


def _model_name(cfg) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig
        return HydraConfig.get().runtime.choices.get("model", cfg.model.name)
    except Exception:
        return cfg.model.get("name", "unknown")


def _overrides() -> list:
    try:
        from hydra.core.hydra_config import HydraConfig
        return list(HydraConfig.get().overrides.task)
    except Exception:
        return []
