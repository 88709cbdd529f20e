"""A run's final evaluation and what results.json holds besides the metrics: train.py's run and
evaluate.py's re-evaluation write the same structure."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from flatbnn.build_info import VERSION
from flatbnn.engine.build import Built
from flatbnn.engine.provenance import git_commit, hardware
from flatbnn.metrics.evaluate import EvalConfig, evaluate


def final_evaluate(b: Built) -> tuple[dict, dict]:
    """The run's final evaluation: ``(metrics, predictive log-probs per set)``.

    The training data stand at the last epoch (augmentation and order), whether the run just trained
    it or resumed / was re-evaluated from the final checkpoint: BatchNorm refreshes of sampled weights
    (SWAG, HWA) see the same batches either way."""
    last = b.total_epochs - 1
    if last >= 0:
        if hasattr(b.bundle.train, "set_epoch"):
            b.bundle.train.set_epoch(last)
        b.sampler.set_epoch(last)
    metrics = evaluate(b.method, b.eval_loaders, b.test_targets, b.eval_cfg, gather=b.gather,
                       keep_predictive=True, shift_targets=b.shift_targets)
    predictive = metrics.pop("_predictive")
    return metrics, predictive


def results_meta(b: Built, *, steps: int, train_seconds: float, wall_seconds: float, overrides: list,
                 model_name: str, run_dir: Path, world_size: int | None = None,
                 git_segments: list[dict] | None = None) -> dict:
    """results.json's ``meta`` (train.py and evaluate.py write the same structure).

    ``git_segments``: the commit of each process that trained this run (``{"global_step", "commit", "dirty"}``,
    read when that process started, not when it wrote results -- a commit made during a 3-hour run must not
    relabel it). ``meta.git`` is the first; all of them are kept under ``git_segments`` when they differ."""
    cfg, tc, eval_cfg = b.cfg, b.cfg.trainer, b.eval_cfg
    return {
        "dataset": cfg.dataset.name, "model": model_name, "method": b.method.describe(),
        "flatness": b.flatness.describe(), "seed": cfg.seed, "epochs": b.total_epochs,
        "budget": {"epochs": b.total_epochs, "steps": steps, "steps_per_epoch": b.steps_per_epoch,
                   "train_size": len(b.bundle.train), "test_size": len(b.bundle.test),
                   # what a step trained on: the configured batch, or the whole train set where that is smaller
                   "global_batch": min(tc.batch_size, len(b.bundle.train)),
                   "world_size": b.info.world_size if world_size is None else world_size,
                   "precision": tc.precision},
        "metric_conventions": {"ece_bins": eval_cfg.ece_bins, "ece_binning": eval_cfg.ece_binning,
                               "ece_edges": eval_cfg.ece_edges, "auroc_misclassification":
                               f"positives = correct, score = {eval_cfg.misclass_score}"
                               + (f", {eval_cfg.auroc_thresholds}-threshold grid" if eval_cfg.auroc == "thresholds"
                                  else ""),
                               "auroc_ood": f"positives = in-distribution, score = {eval_cfg.ood_score}",
                               "nll": "-log mean_k p_k(y|x), mean over examples"},
        "hardware": hardware(b.device, b.info.world_size),
        "git": ({k: git_segments[0][k] for k in ("commit", "dirty")} if git_segments else git_commit()),
        "flatbnn_version": VERSION,
        "train_seconds": train_seconds, "wall_seconds": wall_seconds,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "overrides": overrides, "run_dir": str(run_dir),
        "init_from": b.init_from,
        "data": b.data,  # what it trained / was evaluated on: per split, files or contents (data/fingerprint.py)
        # the CIFAR-10-C read: the official release or scripts/make_cifar10_c.py's (data/cifar10_c.py)
        **({"shift_data": b.bundle.meta["shift_data"]} if "shift_data" in b.bundle.meta else {}),
        "paper_reproduction": False,
        **({"git_segments": git_segments} if git_segments and len({(g["commit"], g["dirty"]) for g in git_segments}) > 1
           else {}),
    }


def save_reliability_diagram(probs, targets, path, eval_cfg: EvalConfig):
    """The run's reliability.png (train.py's and evaluate.py's), binned as results.json's ece."""
    # matplotlib is a declared dependency: a run asked for the diagram (trainer.reliability_diagram) gets it or fails
    from flatbnn.metrics.reliability import reliability_diagram
    # the binning of results.json's ece, so the diagram's ECE label is that number
    reliability_diagram(probs, targets, path, n_bins=eval_cfg.ece_bins, binning=eval_cfg.ece_binning,
                        edges=eval_cfg.ece_edges)
