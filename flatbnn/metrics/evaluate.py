"""The one evaluation routine: every method's predictions become every metric here.

``method.predict(loaders)`` yields, per posterior sample, log-probabilities for each set. We keep a
running logsumexp (predictive = log of the MEAN probability over samples, never the mean of
log-probs or logits), gather shards from all DDP ranks before computing anything, and report
the predictive metrics plus, for multi-sample methods, the mean single-sample metrics.
"""

from __future__ import annotations

import math
import time

import torch

from flatbnn.metrics.classification import classification_metrics, ood_metrics
from flatbnn.schema import EvalConfig  # the `metrics` options and their defaults (declared there, once)


def dataset_targets(dataset) -> torch.Tensor:
    t = getattr(dataset, "targets", None)
    if t is not None:
        return torch.as_tensor(t, dtype=torch.long)
    return torch.tensor([int(dataset[i][1]) for i in range(len(dataset))], dtype=torch.long)


def _gather(lp: torch.Tensor, n: int, gather) -> torch.Tensor:
    return gather(lp, n) if gather is not None else lp


def evaluate(method, loaders: dict, targets: torch.Tensor, cfg: EvalConfig | None = None,
             num_samples: int | None = None, gather=None, keep_predictive: bool = False,
             predict=None, shift_targets: dict | None = None) -> dict:
    """Metrics of the posterior predictive on ``loaders['test']``, OOD metrics for every loader
    named ``ood/<name>`` and shift metrics (per set, corruption, severity, group and mean) for every
    loader named ``shift/<corruption>/<severity>`` (targets in ``shift_targets[name]``).
    ``gather(local, n_total)`` reassembles DDP shards. ``predict(loaders)`` replaces
    ``method.predict`` (e.g. ``method.monitor`` during training)."""
    cfg = cfg or EvalConfig()
    sizes = {name: (len(targets) if name == "test" else len(loader.dataset))
             for name, loader in loaders.items()}
    t0 = time.perf_counter()
    running: dict[str, torch.Tensor] = {}
    singles: list[dict] = []
    count = 0
    samples = predict(loaders) if predict is not None else method.predict(loaders, num_samples)
    dtypes: dict[str, torch.dtype] = {}
    for sample in samples:
        count += 1
        for name, lp in sample.items():
            lp = _gather(lp, sizes[name], gather)
            dtypes[name] = lp.dtype
            # float64: in float32, K samples with p = 1 sum to a log-mean-exp above 0 (p > 1; K = 7, 37-41, ...)
            lp64 = lp.to(torch.float64)
            running[name] = lp64 if name not in running else torch.logaddexp(running[name], lp64)
            if name == "test" and cfg.single_sample_metrics:
                singles.append(_metrics(lp, targets, cfg, warn=False))
    if count == 0:
        raise RuntimeError(f"method {method.name} produced no predictive samples")
    # clamped to <= 0 (a probability), back in the samples' dtype (ECE bins float32 as torchmetrics does)
    pred = {name: (lp - math.log(count)).clamp(max=0.0).to(dtypes[name]) for name, lp in running.items()}
    # non-finite predictions warn in the final evaluation; during training the next step's loss names the step
    out = _metrics(pred["test"], targets, cfg, warn=keep_predictive)
    out["num_samples"] = count
    out["eval_seconds"] = time.perf_counter() - t0
    if count > 1 and singles:
        keys = dict.fromkeys(k for s in singles for k in s if k != "nonfinite_predictions")
        out["single_sample"] = {k: _mean([s.get(k) for s in singles]) for k in keys}
    ood_names = [n for n in pred if n.startswith("ood/")]
    if ood_names:
        probs_in = pred["test"].exp()
        out["ood"] = {}
        for i, name in enumerate(ood_names):
            bad = _nonfinite_rows(probs_in) + _nonfinite_rows(pred[name])
            if bad:  # the scores would contain NaN: nothing of this pairing can be ranked
                if keep_predictive:
                    _warn(f"{bad} non-finite predictions on the test / OOD set {name[4:]}: its OOD metrics are null")
                res = {k: None for k in ("auroc_ood", "aupr_in", "aupr_out", "fpr95")}
                res["nonfinite_predictions"] = bad
            else:
                res = ood_metrics(probs_in, pred[name].exp(), score=cfg.ood_score)
            out["ood"][name[4:]] = res
            if i == 0:  # the data set's primary OOD pairing gets the flat keys (the test set's count stays)
                out.update({k: v for k, v in res.items() if k != "nonfinite_predictions"})
    shift_names = [n for n in pred if n.startswith("shift/")]
    if shift_names:
        out["shift"] = shift_summary({n[6:]: _metrics(pred[n], shift_targets[n], cfg) for n in shift_names})
    if keep_predictive:
        out["_predictive"] = pred
    return out


SHIFT_KEYS = ("accuracy", "nll", "ece", "brier")


def shift_summary(per_set: dict[str, dict]) -> dict:
    """``{"<corruption>/<severity>": metrics}`` -> per set, per corruption, per severity, per group
    (flat_seeking_bnn Table 5: noise / blur / weather / digital), the mean over all sets (``mean``: the 15
    corruptions weight the groups 3:4:4:4) and the unweighted mean of the four groups' means (``group_mean``:
    what Table 5 prints as Average; corruptions outside the four groups do not enter it)."""
    from flatbnn.data.cifar10_c import GROUP_OF

    def mean(rows):
        return {k: _mean([r[k] for r in rows]) for k in SHIFT_KEYS}

    by: dict[str, dict[str, list]] = {"corruption": {}, "severity": {}, "group": {}}
    for key, m in per_set.items():
        corruption, _, severity = key.rpartition("/")
        by["corruption"].setdefault(corruption, []).append(m)
        by["severity"].setdefault(severity, []).append(m)
        by["group"].setdefault(GROUP_OF.get(corruption, "other"), []).append(m)
    per_group = {g: mean(v) for g, v in by["group"].items() if g != "other"}
    return {"sets": {k: {m: v[m] for m in SHIFT_KEYS} for k, v in per_set.items()},
            **{f"per_{axis}": {k: mean(v) for k, v in sorted(groups.items())} for axis, groups in by.items()},
            "mean": mean(list(per_set.values())),
            "group_mean": mean(list(per_group.values())) if per_group else None}


def _mean(values: list):
    """Mean of metric values; None (not computable) if any is None."""
    return None if any(v is None for v in values) else sum(values) / len(values)


def _nonfinite_rows(x: torch.Tensor) -> int:
    return int((~torch.isfinite(x)).any(dim=1).sum()) if x.numel() else 0


def _warn(line: str) -> None:
    from flatbnn.runlog import warn  # also into the running run's train.log
    warn(line)


def _metrics(log_probs: torch.Tensor, targets: torch.Tensor, cfg: EvalConfig, warn: bool = True) -> dict:
    """``classification_metrics`` under ``cfg``. Predictions with a NaN / inf (diverged weights) make
    every metric of the set null (None) -- a metric of the remaining examples would describe another test
    set -- with their number in ``nonfinite_predictions`` and a warning line, instead of raising before
    results.json is written."""
    bad = _nonfinite_rows(log_probs.detach().exp())  # -inf log-probs (p = 0) are fine
    if bad:
        if warn:
            _warn(f"{bad} of {log_probs.shape[0]} predictions are non-finite (diverged weights?): "
                  f"their set's metrics are null")
        keys = classification_metrics(torch.zeros(1, log_probs.shape[1]).log_softmax(1), torch.zeros(1),
                                      ece_bins=1)
        return {**{k: None for k in keys}, "nonfinite_predictions": bad}
    return classification_metrics(log_probs, targets, ece_bins=cfg.ece_bins, ece_binning=cfg.ece_binning,
                                  ece_edges=cfg.ece_edges, misclass_score=cfg.misclass_score,
                                  auroc_method=cfg.auroc, n_thresholds=cfg.auroc_thresholds,
                                  nll_batches=cfg.nll_batches)
