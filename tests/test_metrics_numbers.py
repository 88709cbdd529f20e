"""Numbers that can be wrong (issue 15): log-mean-exp above 0, NaN predictions, the reliability
diagram's ECE label, the bSAM threshold AUROC as an option, and Brier / NLL against scikit-learn."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flatbnn.metrics import classification_metrics, predictive_log_probs
from flatbnn.metrics.classification import auroc, auroc_thresholds, brier, ece, nll
from flatbnn.metrics.evaluate import EvalConfig, evaluate

# K at which K float32 samples with p = 1 summed by logaddexp give log-mean-exp > 0 (found by search)
K_ABOVE_ZERO = (7, 37, 38, 39, 40, 41, 47, 49)


class _Samples:
    """A stand-in method whose ``predict`` yields given per-sample log-probs for the test set."""

    name = "fixed"

    def __init__(self, samples):
        self.samples = samples

    def predict(self, loaders, num_samples=None):
        for lp in self.samples:
            yield {"test": lp}


def _confident(n: int, c: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log-probs with p = 1 exactly on the target class (log p = 0, others -inf... finite -1e4)."""
    targets = torch.arange(n) % c
    lp = torch.full((n, c), -1e4, dtype=torch.float32)
    lp[torch.arange(n), targets] = 0.0
    return lp, targets


@pytest.mark.parametrize("k", K_ABOVE_ZERO)
def test_log_mean_exp_of_certain_samples_is_a_probability(k):
    lp, targets = _confident(40)
    out = evaluate(_Samples([lp] * k), {"test": None}, targets,
                   EvalConfig(ece_bins=20, ece_edges="both", single_sample_metrics=False), keep_predictive=True)
    pred = out["_predictive"]["test"]
    assert pred.dtype == torch.float32
    assert float(pred.max()) == 0.0  # p = 1 exactly, not above
    # every point has confidence 1 and is correct: in the last bin, ECE 0 (off by 1 - p in bins otherwise)
    assert out["ece"] == 0.0 and out["accuracy"] == 1.0 and out["nll"] == 0.0
    stacked = predictive_log_probs(torch.stack([lp] * k))
    assert float(stacked.max()) <= 0.0 and stacked.dtype == torch.float32


@pytest.mark.parametrize("k", K_ABOVE_ZERO)
def test_certain_but_wrong_points_stay_in_the_last_bin(k):
    """40 points with p = 1, a quarter on a wrong class: ECE = |0.75 - 1| = 0.25 (20 bins, both edges).
    With p a hair above 1 every point fell out of every bin and ECE read 0."""
    lp, targets = _confident(40)
    targets = targets.clone()
    targets[::4] = (targets[::4] + 1) % 10
    out = evaluate(_Samples([lp] * k), {"test": None}, targets,
                   EvalConfig(ece_bins=20, ece_edges="both", single_sample_metrics=False))
    assert out["accuracy"] == 0.75
    assert out["ece"] == pytest.approx(0.25, abs=1e-12)


def test_nan_prediction_gives_null_metrics_not_an_exception(capsys):
    lp, targets = _confident(30)
    lp = lp.log_softmax(1)
    lp[3] = float("nan")
    out = evaluate(_Samples([lp, lp]), {"test": None}, targets, EvalConfig(), keep_predictive=True)
    assert out["nonfinite_predictions"] == 1
    for k in ("accuracy", "nll", "ece", "brier", "auroc_misclassification"):
        assert out[k] is None
    assert out["single_sample"]["nll"] is None and out["num_samples"] == 2
    out.pop("_predictive")
    text = json.dumps(out)  # results.json can be written: nulls, no NaN
    assert "NaN" not in text and '"accuracy": null' in text
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flatbnn: warning: 1 of 30 predictions are non-finite")


def test_reliability_label_is_the_results_ece(tmp_path, monkeypatch):
    """The run's diagram (engine/results.py) is drawn with results.json's binning: its legend ECE is results' ece."""
    pytest.importorskip("matplotlib")
    import flatbnn.metrics.reliability as rel
    from flatbnn.engine.results import save_reliability_diagram

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 10, generator=g) * 3
    targets = torch.randint(0, 10, (300,), generator=g)
    lp = logits.log_softmax(1)
    lp[:40] = torch.full((10,), -1e4).index_fill(0, torch.tensor([0]), 0.0)  # confidences exactly 1.0
    targets[:40] = 0
    figures = []
    monkeypatch.setattr(rel, "save_png", lambda fig, path: figures.append(fig) or str(path))
    for cfg in (EvalConfig(ece_bins=20, ece_edges="both"), EvalConfig(ece_bins=15, ece_binning="mass",
                                                                      ece_edges="strict")):
        results_ece = classification_metrics(lp, targets, ece_bins=cfg.ece_bins, ece_binning=cfg.ece_binning,
                                             ece_edges=cfg.ece_edges)["ece"]
        save_reliability_diagram(lp.exp(), targets, tmp_path / "r.png", cfg)
        title = figures[-1].axes[0].get_legend().get_title().get_text()
        assert title.startswith(f"ECE = {results_ece:.4f} ({cfg.ece_bins} {cfg.ece_binning} bins, "
                                f"edges={cfg.ece_edges})"), title
    # a diagram ignoring binning / edges (width, right) would have printed another number here
    assert f"{ece(lp.exp(), targets, 15, 'width', 'right'):.4f}" != f"{results_ece:.4f}"


def test_auroc_thresholds_is_a_metrics_option():
    from tests.helpers import compose_cfg

    root = compose_cfg([])
    assert root.metrics.auroc == "exact" and root.metrics.auroc_thresholds == 2500
    # scores on a coarse grid: the 4-threshold AUROC differs from the exact one by a known amount
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.62, 0.38], [0.65, 0.35], [0.55, 0.45], [0.95, 0.05]])
    targets = torch.tensor([0, 0, 1, 0, 1, 0])
    lp = probs.log()
    exact = evaluate(_Samples([lp]), {"test": None}, targets, EvalConfig())["auroc_misclassification"]
    grid = evaluate(_Samples([lp]), {"test": None}, targets,
                    EvalConfig(auroc="thresholds", auroc_thresholds=4))["auroc_misclassification"]
    correct = (probs.argmax(1) == targets).long()
    s = probs.max(1).values.double()
    assert exact == auroc(s, correct)
    assert grid == auroc_thresholds(s, correct, 4) and grid != exact
    fine = evaluate(_Samples([lp]), {"test": None}, targets, EvalConfig(auroc="thresholds"))
    assert fine["auroc_misclassification"] == pytest.approx(exact, abs=1e-3)


@pytest.mark.parametrize("c", [2, 10])
def test_brier_and_nll_match_scikit_learn(c):
    """NLL = sklearn log_loss. Brier = the multi-class sum over classes (Brier 1950; range [0, 2]) =
    sklearn's multiclass brier_score_loss without halving = the sum of sklearn's per-class (one-vs-rest)
    binary Brier scores; for C = 2 it is twice sklearn's binary Brier score of the positive class."""
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(c)
    p = rng.dirichlet(np.ones(c) * 0.7, size=200)
    y = rng.integers(0, c, 200)
    probs = torch.tensor(p)
    assert nll(probs.log(), torch.tensor(y)) == pytest.approx(sk.log_loss(y, p, labels=list(range(c))), rel=1e-12)
    ours = brier(probs, torch.tensor(y))
    per_class = sum(sk.brier_score_loss((y == k).astype(int), p[:, k]) for k in range(c))
    assert ours == pytest.approx(per_class, rel=1e-12)
    assert ours == pytest.approx(sk.brier_score_loss(y, p, labels=list(range(c)), scale_by_half=False), rel=1e-12)
    if c == 2:
        assert ours == pytest.approx(2 * sk.brier_score_loss(y, p[:, 1]), rel=1e-12)
    assert 0.0 <= ours <= 2.0 and not math.isnan(ours)
