"""Classification and uncertainty metrics: pure functions on tensors.

Conventions shared by every function here (see also docs/ARCHITECTURE.md):

* ``probs`` / ``log_probs`` have shape ``[N, C]`` and are the *predictive* distribution, i.e.
  already averaged over posterior samples (use :func:`predictive_log_probs` to form it);
  ``targets`` are integer class indices of shape ``[N]``.
* Every metric returns a Python ``float`` and is a *fraction* (never percent).
* Reductions are done in float64 whatever the input dtype.
* Undefined values (AUROC with a single class present, ECE of an empty set, ...) are returned
  as ``float('nan')``; nothing raises for degenerate but valid inputs.

Calibration: ``confidence = max_c p_c`` and ``correct = argmax_c p_c == target`` (ties in the
argmax resolve to the first maximal class, as ``torch.argmax`` does).
``ECE = sum_b (n_b / N) |acc_b - conf_b|`` with ``N`` the number of examples.

Ranking metrics declare their positive class and score sign in each docstring.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "accuracy",
    "top_k_accuracy",
    "nll",
    "predictive_log_probs",
    "brier",
    "calibration_bins",
    "ece",
    "auroc",
    "aupr",
    "fpr_at_tpr",
    "auroc_thresholds",
    "confidence_score",
    "misclassification_metrics",
    "ood_metrics",
    "classification_metrics",
]

Binning = Literal["width", "mass"]
Edges = Literal["right", "left", "both", "strict"]
ScoreKind = Literal["max_prob", "entropy"]

_BINNINGS = ("width", "mass")
_EDGES = ("right", "left", "both", "strict")
_SCORES = ("max_prob", "entropy")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _check_2d(x: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape [N, C], got {tuple(x.shape)}")
    return x.detach()


def _check_targets(targets: Tensor, n: int) -> Tensor:
    if not isinstance(targets, Tensor):
        targets = torch.as_tensor(targets)
    targets = targets.detach().reshape(-1).long()
    if targets.numel() != n:
        raise ValueError(f"targets has {targets.numel()} entries, predictions have {n} rows")
    return targets


def _float_dtype(x: Tensor) -> Tensor:
    """Keep float32/float64 as they are; promote half types and integers to float32."""
    if x.dtype in (torch.float32, torch.float64):
        return x
    return x.float()


def _binary_inputs(scores: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    if not isinstance(scores, Tensor):
        scores = torch.as_tensor(scores)
    if not isinstance(labels, Tensor):
        labels = torch.as_tensor(labels)
    scores = scores.detach().reshape(-1).to(torch.float64)
    labels = labels.detach().reshape(-1)
    if scores.numel() != labels.numel():
        raise ValueError(f"scores ({scores.numel()}) and labels ({labels.numel()}) differ in length")
    if labels.dtype == torch.bool:
        labels = labels.long()
    labels = labels.long()
    if labels.numel() and not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError("labels must be 0/1 (1 = positive)")
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN")
    return scores, labels


def _both_classes(labels: Tensor) -> bool:
    n_pos = int(labels.sum())
    return 0 < n_pos < labels.numel()


# --------------------------------------------------------------------------------------------
# basic metrics
# --------------------------------------------------------------------------------------------
def accuracy(probs: Tensor, targets: Tensor) -> float:
    """Fraction of examples whose argmax class equals the target.

    Works on probabilities, log-probabilities or logits alike (argmax is invariant).
    """
    probs = _check_2d(probs, "probs")
    targets = _check_targets(targets, probs.shape[0])
    if probs.shape[0] == 0:
        return float("nan")
    return float((probs.argmax(dim=1) == targets).to(torch.float64).mean())


def top_k_accuracy(probs: Tensor, targets: Tensor, k: int = 5) -> float:
    """Fraction of examples whose target is among the ``k`` highest-scoring classes (probabilities,
    log-probabilities or logits alike). An example counts when fewer than ``k`` classes score
    strictly higher than its target, so ties never depend on the sort order (top-k >= top-1 always).
    """
    probs = _check_2d(probs, "probs")
    targets = _check_targets(targets, probs.shape[0])
    if probs.shape[0] == 0:
        return float("nan")
    target_score = probs.gather(1, targets.view(-1, 1))
    higher = (probs > target_score).sum(dim=1)
    return float((higher < k).to(torch.float64).mean())


def predictive_log_probs(log_probs_samples: Tensor) -> Tensor:
    """Log of the Bayesian-model-average predictive: ``log (1/S) sum_s p_s(y|x)``.

    ``log_probs_samples`` has shape ``[S, N, C]`` (per-sample log-softmax outputs); the result
    ``[N, C]`` is ``logsumexp_s(log p_s) - log S``, computed stably (works for log-probs such
    as -1000). This is the log of the *mean probability*: the predictive NLL is the NLL of this
    averaged distribution -- never the mean of per-sample NLLs, and never the softmax of the
    mean of logits or of log-probs. A 2-D input ``[N, C]`` is treated as a single sample and
    returned unchanged.
    """
    x = log_probs_samples
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    x = x.detach()
    if x.ndim == 2:
        return x
    if x.ndim != 3:
        raise ValueError(f"log_probs_samples must have shape [S, N, C], got {tuple(x.shape)}")
    s = x.shape[0]
    if s == 0:
        raise ValueError("need at least one sample")
    # float64 and clamped to <= 0: in float32, S samples with p = 1 give log(S) - log(S) > 0 (p > 1)
    dtype = x.dtype if x.dtype.is_floating_point else torch.float32
    return (torch.logsumexp(x.to(torch.float64), dim=0) - math.log(s)).clamp(max=0.0).to(dtype)


def nll(log_probs: Tensor, targets: Tensor) -> float:
    """Mean negative log-likelihood ``-(1/N) sum_i log p(y_i | x_i)``.

    ``log_probs`` are *predictive log-probabilities* ``[N, C]`` (for a posterior: the output of
    :func:`predictive_log_probs`, i.e. the log of the mean probability over samples). Reading
    log-probabilities directly keeps it finite and exact where ``p(y)`` underflows in float32.
    """
    log_probs = _check_2d(log_probs, "log_probs")
    targets = _check_targets(targets, log_probs.shape[0])
    if log_probs.shape[0] == 0:
        return float("nan")
    picked = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1).to(torch.float64)
    return float(0.0 - picked.mean())  # 0.0 - x: no '-0.0'


def nll_batch_means(log_probs: Tensor, targets: Tensor, batch_size: int) -> float:
    """The bSAM code's test NLL (team-approx-bayes/bayesian-sam test.py): the test set, in order, cut into batches
    of ``batch_size``, the SUM of the batch means divided by the number of batches - 1 (its loop index after the
    loop), i.e. :func:`nll` x n / (n - 1) for equal batches: +2.04 % for 10,000 test points in batches of 200."""
    log_probs = _check_2d(log_probs, "log_probs")
    targets = _check_targets(targets, log_probs.shape[0])
    picked = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1).to(torch.float64)
    means = [0.0 - b.mean() for b in picked.split(int(batch_size))]
    if len(means) < 2:
        raise ValueError(f"metrics.nll_batches={batch_size}: the bSAM code's NLL divides by the number of batches - 1 "
                         f"and {picked.shape[0]} test points make {len(means)} batch; use a smaller batch or null")
    return float(sum(means) / (len(means) - 1))


def brier(probs: Tensor, targets: Tensor) -> float:
    """Multi-class Brier score: ``(1/N) sum_i sum_c (p_ic - 1[y_i = c])^2``.

    Summed over classes and *not* divided by ``C`` (range [0, 2]; Brier 1950's original
    multi-class form, as in Ovadia et al. 2019 / uncertainty-baselines). torchmetrics 1.9 has no
    classification Brier score to compare with (only CRPS for regression); sklearn's
    ``brier_score_loss`` is the binary, per-class form.
    """
    probs = _check_2d(probs, "probs")
    targets = _check_targets(targets, probs.shape[0])
    if probs.shape[0] == 0:
        return float("nan")
    p = probs.to(torch.float64)
    onehot = torch.zeros_like(p)
    onehot.scatter_(1, targets.unsqueeze(1), 1.0)
    return float(((p - onehot) ** 2).sum(dim=1).mean())


# --------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------
def _bin_edges(conf: Tensor, n_bins: int, binning: str) -> Tensor:
    """Bin boundaries, ``n_bins + 1`` of them, non-decreasing."""
    if binning == "width":
        # Computed in the confidences' dtype (float32 for float32 inputs), exactly as
        # torchmetrics does, so that points near an edge are binned identically.
        return torch.linspace(0.0, 1.0, n_bins + 1, dtype=conf.dtype, device=conf.device)
    # "mass": quantiles of the confidences (linear interpolation), first edge = min,
    # last = max. Without ties every bin gets floor or ceil of N / n_bins points.
    # (same as torch.quantile's default "linear", which refuses inputs of more than 2**24 points)
    srt = torch.sort(conf.to(torch.float64)).values
    pos = torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64, device=conf.device) * (srt.numel() - 1)
    lo = pos.floor().long().clamp_(0, srt.numel() - 1)
    hi = pos.ceil().long().clamp_(0, srt.numel() - 1)
    frac = pos - lo.to(torch.float64)
    e = srt[lo] + frac * (srt[hi] - srt[lo])
    e[0], e[-1] = srt[0], srt[-1]
    return torch.maximum(e, e.cummax(0).values)  # guard monotonicity against rounding


def _calibration_bins(
    conf: Tensor,
    correct: Tensor,
    n_bins: int = 15,
    binning: str = "width",
    edges: str = "right",
) -> dict:
    """Binning of given confidences ``[N]`` and 0/1 correctness ``[N]`` (see calibration_bins)."""
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive int, got {n_bins!r}")
    if binning not in _BINNINGS:
        raise ValueError(f"binning must be one of {_BINNINGS}, got {binning!r}")
    if edges not in _EDGES:
        raise ValueError(f"edges must be one of {_EDGES}, got {edges!r}")
    conf = _float_dtype(conf.detach().reshape(-1))
    correct = correct.detach().reshape(-1).to(torch.float64)
    n = conf.numel()
    dev = conf.device
    if n == 0:
        e = torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64, device=dev)
        zeros = torch.zeros(n_bins, dtype=torch.float64, device=dev)
        return {
            "edges": e, "confidence": zeros, "accuracy": zeros.clone(),
            "count": torch.zeros(n_bins, dtype=torch.long, device=dev), "n_total": 0,
            "binning": binning, "edges_mode": edges,
        }

    e = _bin_edges(conf, n_bins, binning).to(torch.float64)
    c = conf.to(torch.float64)  # exact conversion: comparisons are those of the input dtype

    if edges in ("right", "left"):
        # exactly one bin per point
        # right: bins (lo, hi]; a point <= e[0] (confidence 0) goes to the first bin.
        # left:  bins [lo, hi); a point >= e[-1] (confidence 1) goes to the last bin.
        idx = torch.searchsorted(e, c, right=(edges == "left")) - 1
        idx = idx.clamp_(0, n_bins - 1)
        count = torch.zeros(n_bins, dtype=torch.float64, device=dev).scatter_add_(0, idx, torch.ones_like(c))
        conf_sum = torch.zeros(n_bins, dtype=torch.float64, device=dev).scatter_add_(0, idx, c)
        acc_sum = torch.zeros(n_bins, dtype=torch.float64, device=dev).scatter_add_(0, idx, correct)
    else:
        # both:   [lo, hi]  -- a point on an interior edge is counted in *both* adjacent bins
        #                      (the literal reading of bSAM's ``lo <= c <= hi``).
        # strict: (lo, hi)  -- a point on any edge is counted in *no* bin (SWAG's ``lo < c < hi``).
        count = torch.zeros(n_bins, dtype=torch.float64, device=dev)
        conf_sum = torch.zeros_like(count)
        acc_sum = torch.zeros_like(count)
        for b in range(n_bins):
            lo, hi = e[b], e[b + 1]
            m = (c >= lo) & (c <= hi) if edges == "both" else (c > lo) & (c < hi)
            m = m.to(torch.float64)
            count[b] = m.sum()
            conf_sum[b] = (m * c).sum()
            acc_sum[b] = (m * correct).sum()

    safe = count.clamp(min=1.0)
    nonempty = count > 0
    conf_bin = torch.where(nonempty, conf_sum / safe, torch.zeros_like(count))
    acc_bin = torch.where(nonempty, acc_sum / safe, torch.zeros_like(count))
    return {
        "edges": e,
        "confidence": conf_bin,
        "accuracy": acc_bin,
        "count": count.round().long(),
        "n_total": n,
        "binning": binning,
        "edges_mode": edges,
    }


def _conf_correct(probs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    probs = _float_dtype(_check_2d(probs, "probs"))
    targets = _check_targets(targets, probs.shape[0])
    conf, pred = probs.max(dim=1)
    return conf, (pred == targets)


def calibration_bins(
    probs: Tensor,
    targets: Tensor,
    n_bins: int = 15,
    binning: Binning = "width",
    edges: Edges = "right",
) -> dict:
    """Per-bin statistics of top-1 confidence vs accuracy (for ECE and reliability diagrams).

    Args:
        probs: predictive probabilities ``[N, C]``; confidence = max prob, correct = argmax == target.
        n_bins: number of bins.
        binning: ``"width"`` -- ``n_bins`` equal-width bins on [0, 1], edges ``linspace(0, 1)`` in
            the probabilities' dtype (as torchmetrics); ``"mass"`` -- equal-mass (adaptive) bins
            whose edges are the ``k / n_bins`` quantiles of the confidences (linear interpolation;
            first edge = min, last edge = max), the SWAG paper's convention. (SWAG's own code takes
            every ``ceil(N/n_bins)``-th sorted confidence as an edge instead; with ``"strict"`` it
            therefore drops those points -- we interpolate, so edges usually fall between points.)
        edges: what a confidence on a bin edge does:
            ``"right"``  -- bins ``(lo, hi]``, confidence 0 (or the min, for "mass") in the first bin
            (flat_seeking_bnn official code);
            ``"left"``   -- bins ``[lo, hi)``, confidence 1.0 (or the max) in the last bin. This is
            torchmetrics' rule *except* that torchmetrics 1.9 gives exactly-1.0 confidences an
            extra (n_bins+1)-th bin of their own; results agree whenever no confidence is exactly 1;
            ``"both"``   -- bins ``[lo, hi]`` (bSAM official code): literal reading, a point on an
            interior edge is counted in **both** adjacent bins (so counts can sum to more than N);
            ``"strict"`` -- bins ``(lo, hi)`` (SWAG code): a point on an edge is counted in no bin.

    Returns:
        dict with ``edges`` [n_bins+1], ``confidence`` [n_bins] (mean confidence per bin),
        ``accuracy`` [n_bins] (fraction correct per bin), ``count`` [n_bins] (long) -- bins with
        count 0 have confidence = accuracy = 0 -- plus ``n_total`` (N), ``binning``, ``edges_mode``.
        Tensors are float64.
    """
    conf, correct = _conf_correct(probs, targets)
    return _calibration_bins(conf, correct, n_bins=n_bins, binning=binning, edges=edges)


def _ece_from_bins(bins: dict) -> float:
    n = bins["n_total"]
    if n == 0:
        return float("nan")
    w = bins["count"].to(torch.float64) / n  # n_b / N with N = number of examples
    return float((w * (bins["accuracy"] - bins["confidence"]).abs()).sum())


def ece(
    probs: Tensor,
    targets: Tensor,
    n_bins: int = 15,
    binning: Binning = "width",
    edges: Edges = "right",
) -> float:
    """Expected calibration error ``sum_b (n_b / N) |acc_b - conf_b|`` (L1, top-1 confidence).

    ``N`` is the number of examples (so with ``edges="both"`` a doubly counted point weighs twice,
    with ``"strict"`` an edge point weighs nothing -- the literal readings of bSAM's and SWAG's
    code). See :func:`calibration_bins` for ``binning`` and ``edges``. Report the number of bins,
    the binning and the edge rule with every ECE. Paper conventions: bSAM 20 width bins "both";
    flat_seeking_bnn 20 width bins "right"; torchmetrics / uncertainty-baselines 15 width bins
    "left"; SWAG 20 "mass" bins "strict".
    """
    return _ece_from_bins(calibration_bins(probs, targets, n_bins=n_bins, binning=binning, edges=edges))


# --------------------------------------------------------------------------------------------
# ranking metrics (binary)
# --------------------------------------------------------------------------------------------
def auroc(scores: Tensor, labels: Tensor) -> float:
    """Exact area under the ROC curve; ``labels == 1`` are positives, higher score = more positive.

    One ROC point per distinct score (ties count one half), framed by (0, 0), trapezoid rule: the
    Mann-Whitney U with mid-ranks, as sklearn's ``roc_auc_score`` and torchmetrics' ``binary_auroc``
    (tests/test_metrics.py compares all three). From the integer TP / FP counts of
    :func:`_roc_counts` rather than torchmetrics: importing torchmetrics (and the scipy.signal it
    pulls in) cost every run ~2.5 s of start-up, +45 % over torch + torchvision + hydra, measured.
    Returns NaN if only one class is present.
    """
    scores, labels = _binary_inputs(scores, labels)
    if not _both_classes(labels):
        return float("nan")
    tp, fp, _ = _roc_counts(scores, labels)
    zero = tp.new_zeros(1)
    tp, fp = torch.cat([zero, tp]).to(torch.float64), torch.cat([zero, fp]).to(torch.float64)
    return float(torch.trapezoid(tp, fp) / (tp[-1] * fp[-1]))  # the area in counts, divided once by n_pos * n_neg


def aupr(scores: Tensor, labels: Tensor) -> float:
    """Average precision (area under the precision-recall curve, step-wise, no interpolation):
    ``sum_k (R_k - R_k-1) P_k`` over the distinct scores, descending.

    ``labels == 1`` are positives, higher score = more positive; identical to sklearn's
    ``average_precision_score`` and torchmetrics' ``binary_average_precision`` (tests/test_metrics.py).
    Returns NaN if only one class is present.
    """
    scores, labels = _binary_inputs(scores, labels)
    if not _both_classes(labels):
        return float("nan")
    tp, fp, _ = _roc_counts(scores, labels)
    tp, fp = tp.to(torch.float64), fp.to(torch.float64)
    gained = torch.diff(tp, prepend=tp.new_zeros(1))  # positives gained at each threshold: (R_k - R_k-1) * n_pos
    return float((gained * tp / (tp + fp)).sum() / tp[-1])


def _roc_counts(scores: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Integer TP/FP counts at every distinct threshold (predict positive iff score >= t),
    thresholds descending, without the (0, 0) start point."""
    order = torch.argsort(scores, descending=True, stable=True)
    s = scores[order]
    y = labels[order]
    tp = torch.cumsum(y, 0)
    fp = torch.cumsum(1 - y, 0)
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]  # last index of each group of tied scores
    return tp[last], fp[last], s[last]


def fpr_at_tpr(scores: Tensor, labels: Tensor, tpr: float = 0.95) -> float:
    """False-positive rate at the first ROC operating point whose TPR >= ``tpr``.

    Positives are ``labels == 1``, predicted positive iff ``score >= threshold``; the threshold
    is the largest distinct score for which at least ``tpr`` of the positives are kept (no
    interpolation between ROC points), i.e. the minimum FPR over operating points with
    TPR >= ``tpr``. Counts are exact integers (float32 TPRs like 19/20 < 0.95 do not occur).
    Returns NaN if only one class is present.
    """
    if not 0.0 <= tpr <= 1.0:
        raise ValueError(f"tpr must be in [0, 1], got {tpr}")
    scores, labels = _binary_inputs(scores, labels)
    if not _both_classes(labels):
        return float("nan")
    tp, fp, _ = _roc_counts(scores, labels)
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    tpr_curve = tp.to(torch.float64) / n_pos
    ok = tpr_curve >= tpr - 1e-12
    first = int(torch.nonzero(ok)[0])  # exists: the last point has TPR = 1
    return float(fp[first].to(torch.float64) / n_neg)


def auroc_thresholds(scores: Tensor, labels: Tensor, n_thresholds: int = 2500) -> float:
    """AUROC on a fixed threshold grid -- the bSAM / VOGN convention (Osawa et al. 2019, App. H).

    Thresholds ``t_k = k / n_thresholds`` for ``k = n_thresholds - 1, ..., 1`` (the interior of
    ``linspace(1, 0, n_thresholds + 1)``, in the scores' dtype), predict positive iff
    ``score >= t``; the ROC points are framed by (0, 0) and (1, 1) and integrated with the
    trapezoid rule. Assumes scores in [0, 1] (e.g. max probability); ``labels == 1`` positive.
    Approximates :func:`auroc` to O(1 / n_thresholds) plus the effect of ties within a grid cell.
    Returns NaN if only one class is present.
    """
    if not isinstance(n_thresholds, int) or n_thresholds < 1:
        raise ValueError(f"n_thresholds must be a positive int, got {n_thresholds!r}")
    if not isinstance(scores, Tensor):
        scores = torch.as_tensor(scores)
    dtype = scores.dtype if scores.dtype in (torch.float32, torch.float64) else torch.float32
    thr = torch.linspace(1.0, 0.0, n_thresholds + 1, dtype=dtype)[1:-1].to(torch.float64)
    scores, labels = _binary_inputs(scores.to(dtype), labels)
    if not _both_classes(labels):
        return float("nan")
    pos = torch.sort(scores[labels == 1]).values
    neg = torch.sort(scores[labels == 0]).values
    # number of scores >= t  =  len - (number of scores < t)
    tp = pos.numel() - torch.searchsorted(pos, thr, right=False)
    fp = neg.numel() - torch.searchsorted(neg, thr, right=False)
    zero = torch.zeros(1, dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    tprs = torch.cat([zero, tp.to(torch.float64) / pos.numel(), one])
    fprs = torch.cat([zero, fp.to(torch.float64) / neg.numel(), one])
    return float(torch.trapezoid(tprs, fprs))


# --------------------------------------------------------------------------------------------
# uncertainty scores and composite metrics
# --------------------------------------------------------------------------------------------
def confidence_score(probs: Tensor, kind: ScoreKind = "max_prob") -> Tensor:
    """Per-example confidence score ``[N]`` (float64); higher = more confident.

    ``"max_prob"``: ``max_c p_c``. ``"entropy"``: negative predictive entropy
    ``sum_c p_c log p_c`` (with ``0 log 0 = 0``), in ``[-log C, 0]``.
    """
    probs = _check_2d(probs, "probs").to(torch.float64)
    if kind == "max_prob":
        return probs.max(dim=1).values
    if kind == "entropy":
        return torch.special.xlogy(probs, probs).sum(dim=1)
    raise ValueError(f"kind must be one of {_SCORES}, got {kind!r}")


AurocMethod = Literal["exact", "thresholds"]
_AUROC_METHODS = ("exact", "thresholds")


def misclassification_metrics(probs: Tensor, targets: Tensor, score: ScoreKind = "max_prob",
                              auroc_method: AurocMethod = "exact", n_thresholds: int = 2500) -> dict:
    """Misclassification detection (bSAM / VOGN "AUROC"): can the confidence score separate
    correct from wrong predictions?

    Positives = **correctly classified** examples; score = :func:`confidence_score` (higher =
    more confident = predicted correct). Keys ``auroc_misclassification`` and
    ``aupr_misclassification`` (AP with correct as positives); NaN when all or no predictions
    are correct. ``auroc_method="thresholds"``: the AUROC of :func:`auroc_thresholds` on a grid of
    ``n_thresholds`` thresholds (the bSAM / VOGN code's 2,500; needs ``score="max_prob"``, a score in
    [0, 1]); ``"exact"``: :func:`auroc`.
    """
    if auroc_method not in _AUROC_METHODS:
        raise ValueError(f"metrics.auroc must be one of {_AUROC_METHODS}, got {auroc_method!r}")
    if auroc_method == "thresholds" and score != "max_prob":
        raise ValueError(f"metrics.auroc=thresholds needs a score in [0, 1] (misclass_score=max_prob), got {score!r}")
    probs = _check_2d(probs, "probs")
    targets = _check_targets(targets, probs.shape[0])
    s = confidence_score(probs, score)
    correct = (probs.argmax(dim=1) == targets).long()
    return {
        "auroc_misclassification": (auroc(s, correct) if auroc_method == "exact"
                                    else auroc_thresholds(s, correct, int(n_thresholds))),
        "aupr_misclassification": aupr(s, correct),
    }


def ood_metrics(probs_in: Tensor, probs_out: Tensor, score: ScoreKind = "max_prob") -> dict:
    """Out-of-distribution detection from the predictive distributions on an in-distribution
    test set (``probs_in``) and an OOD set (``probs_out``).

    Score = :func:`confidence_score` (higher = more confident = judged in-distribution).

    * ``auroc_ood``: positives = **in-distribution**, score as is. Equal to the AUROC with OOD as
      positives and score ``1 - max prob`` / entropy (the torchmetrics / TorchUncertainty form).
    * ``aupr_in``: average precision, in-distribution positive, score as is.
    * ``aupr_out``: average precision, **OOD positive**, negated score.
    * ``fpr95``: fraction of OOD examples accepted as in-distribution at the threshold that keeps
      95% of the in-distribution examples (FPR at 95% TPR, in-distribution positive).
    """
    s_in = confidence_score(probs_in, score)
    s_out = confidence_score(probs_out, score)
    scores = torch.cat([s_in, s_out])
    labels = torch.cat([torch.ones_like(s_in, dtype=torch.long), torch.zeros_like(s_out, dtype=torch.long)])
    return {
        "auroc_ood": auroc(scores, labels),
        "aupr_in": aupr(scores, labels),
        "aupr_out": aupr(-scores, 1 - labels),
        "fpr95": fpr_at_tpr(scores, labels, 0.95),
    }


def classification_metrics(
    log_probs: Tensor,
    targets: Tensor,
    ece_bins: int = 15,
    ece_binning: Binning = "width",
    ece_edges: Edges = "right",
    misclass_score: ScoreKind = "max_prob",
    auroc_method: AurocMethod = "exact",
    n_thresholds: int = 2500,
    nll_batches: int | None = None,
) -> dict:
    """All standard metrics of a predictive distribution.

    ``log_probs``: predictive log-probabilities ``[N, C]`` (log of the mean probability over
    posterior samples); a ``[S, N, C]`` stack of per-sample log-probs is reduced with
    :func:`predictive_log_probs` first. Returns floats: ``accuracy`` (and ``top5_accuracy`` when
    there are more than 5 classes), ``nll``, ``ece``
    (``ece_bins`` bins, ``ece_binning``, ``ece_edges``; see :func:`ece`), ``brier``,
    ``auroc_misclassification``, ``aupr_misclassification`` (positives = correctly classified;
    NaN if every or no prediction is correct). ``nll_batches``: the bSAM code's NLL
    (:func:`nll_batch_means`) instead of the exact mean.
    """
    if not isinstance(log_probs, Tensor):
        log_probs = torch.as_tensor(log_probs)
    if log_probs.ndim == 3:
        log_probs = predictive_log_probs(log_probs)
    log_probs = _check_2d(log_probs, "log_probs")
    targets = _check_targets(targets, log_probs.shape[0])
    probs = log_probs.to(torch.float64).exp()
    if log_probs.dtype == torch.float32:
        # keep the ECE binning in float32, bit-compatible with torchmetrics on float32 inputs
        probs_ece = log_probs.exp()
    else:
        probs_ece = probs
    out = {
        "accuracy": accuracy(log_probs, targets),
        "nll": nll(log_probs, targets) if nll_batches is None else nll_batch_means(log_probs, targets, nll_batches),
        "ece": ece(probs_ece, targets, n_bins=ece_bins, binning=ece_binning, edges=ece_edges),
        "brier": brier(probs, targets),
    }
    if log_probs.shape[1] > 5:  # top-5 is trivially 1 with <= 5 classes (FSAM Table 2 prints it for ImageNet)
        out["top5_accuracy"] = top_k_accuracy(log_probs, targets, 5)
    out.update(misclassification_metrics(probs, targets, score=misclass_score, auroc_method=auroc_method,
                                         n_thresholds=n_thresholds))
    return out
