"""The one evaluation routine: every method's predictions become every metric here.

``method.predict(loaders)`` yields, per posterior sample, log-probabilities for each set. We keep a
running logsumexp (predictive = log of the MEAN probability over samples, never the mean of
log-probs or logits), gather shards from all DDP ranks before computing anything, and report
the predictive metrics plus, for multi-sample methods, the mean single-sample metrics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from flatbnn.metrics.classification import classification_metrics, ood_metrics


@dataclass
class EvalConfig:
    ece_bins: int = 15
    ece_binning: str = "width"      # width | mass
    ece_edges: str = "right"        # right: (lo, hi]  | left: [lo, hi) | both: [lo, hi]
    misclass_score: str = "max_prob"  # max_prob | entropy
    ood_score: str = "max_prob"       # max_prob | entropy
    single_sample_metrics: bool = True


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
    for sample in samples:
        count += 1
        for name, lp in sample.items():
            lp = _gather(lp, sizes[name], gather)
            running[name] = lp if name not in running else torch.logaddexp(running[name], lp)
            if name == "test" and cfg.single_sample_metrics:
                singles.append(_metrics(lp, targets, cfg))
    if count == 0:
        raise RuntimeError(f"method {method.name} produced no predictive samples")
    pred = {name: lp - math.log(count) for name, lp in running.items()}
    out = _metrics(pred["test"], targets, cfg)
    out["num_samples"] = count
    out["eval_seconds"] = time.perf_counter() - t0
    if count > 1 and singles:
        out["single_sample"] = {k: sum(s[k] for s in singles) / len(singles) for k in singles[0]}
    ood_names = [n for n in pred if n.startswith("ood/")]
    if ood_names:
        probs_in = pred["test"].exp()
        out["ood"] = {}
        for i, name in enumerate(ood_names):
            res = ood_metrics(probs_in, pred[name].exp(), score=cfg.ood_score)
            out["ood"][name[4:]] = res
            if i == 0:  # the data set's primary OOD pairing gets the flat keys
                out.update(res)
    shift_names = [n for n in pred if n.startswith("shift/")]
    if shift_names:
        out["shift"] = shift_summary({n[6:]: _metrics(pred[n], shift_targets[n], cfg) for n in shift_names})
    if keep_predictive:
        out["_predictive"] = pred
    return out


SHIFT_KEYS = ("accuracy", "nll", "ece", "brier")


def shift_summary(per_set: dict[str, dict]) -> dict:
    """``{"<corruption>/<severity>": metrics}`` -> per set, per corruption, per severity, per group
    (flat_seeking_bnn Table 5: noise / blur / weather / digital) and the mean over all sets."""
    from flatbnn.data.cifar10_c import GROUP_OF

    def mean(rows):
        return {k: sum(r[k] for r in rows) / len(rows) for k in SHIFT_KEYS}

    by: dict[str, dict[str, list]] = {"corruption": {}, "severity": {}, "group": {}}
    for key, m in per_set.items():
        corruption, _, severity = key.rpartition("/")
        by["corruption"].setdefault(corruption, []).append(m)
        by["severity"].setdefault(severity, []).append(m)
        by["group"].setdefault(GROUP_OF.get(corruption, "other"), []).append(m)
    return {"sets": {k: {m: v[m] for m in SHIFT_KEYS} for k, v in per_set.items()},
            **{f"per_{axis}": {k: mean(v) for k, v in sorted(groups.items())} for axis, groups in by.items()},
            "mean": mean(list(per_set.values()))}


def _metrics(log_probs: torch.Tensor, targets: torch.Tensor, cfg: EvalConfig) -> dict:
    return classification_metrics(log_probs, targets, ece_bins=cfg.ece_bins, ece_binning=cfg.ece_binning,
                                  ece_edges=cfg.ece_edges, misclass_score=cfg.misclass_score)
