"""Metrics: pure functions on tensors (``probs``/``log_probs`` [N, C], integer ``targets`` [N]).

All values are fractions (not percent) returned as Python floats. See
:mod:`flatbnn.metrics.classification` for the conventions (NLL of the mean probability, ECE bins
and edge rules, positive class and score sign of every AUROC).
"""

from flatbnn.metrics.classification import (
    accuracy,
    aupr,
    auroc,
    auroc_thresholds,
    brier,
    calibration_bins,
    classification_metrics,
    confidence_score,
    ece,
    fpr_at_tpr,
    misclassification_metrics,
    nll,
    ood_metrics,
    predictive_log_probs,
)
from flatbnn.metrics.reliability import reliability_diagram

__all__ = [
    "accuracy",
    "aupr",
    "auroc",
    "auroc_thresholds",
    "brier",
    "calibration_bins",
    "classification_metrics",
    "confidence_score",
    "ece",
    "fpr_at_tpr",
    "misclassification_metrics",
    "nll",
    "ood_metrics",
    "predictive_log_probs",
    "reliability_diagram",
]
