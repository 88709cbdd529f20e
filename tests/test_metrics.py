"""Tests for flatbnn.metrics: hand-computed values, edge conventions, agreement with
torchmetrics / sklearn, and degenerate cases."""

import math
import warnings

import pytest
import torch

from flatbnn.metrics import (
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
    reliability_diagram,
)
from flatbnn.metrics.classification import _calibration_bins

F64 = torch.float64


# ------------------------------------------------------------------ basic metrics
def test_accuracy_hand():
    probs = torch.tensor([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4], [0.1, 0.9]])
    targets = torch.tensor([0, 1, 1, 0])
    assert accuracy(probs, targets) == pytest.approx(0.5)
    # argmax is invariant to log: works on log-probs too
    assert accuracy(probs.log(), targets) == pytest.approx(0.5)


def test_nll_of_mean_probability_not_mean_nll():
    # one example, 2 classes, target 0, two posterior samples with p(y) = 0.9 and 0.1
    samples = torch.tensor([[[0.9, 0.1]], [[0.1, 0.9]]], dtype=F64).log()  # [S=2, N=1, C=2]
    targets = torch.tensor([0])
    lp = predictive_log_probs(samples)
    # mean probability = 0.5  =>  NLL = log 2 = 0.693147...
    assert nll(lp, targets) == pytest.approx(math.log(2.0), abs=1e-12)
    # mean of per-sample NLLs = (-log 0.9 - log 0.1) / 2 = 1.203973...  (different!)
    mean_of_nlls = (nll(samples[0], targets) + nll(samples[1], targets)) / 2
    assert mean_of_nlls == pytest.approx((-math.log(0.9) - math.log(0.1)) / 2, abs=1e-12)
    assert abs(mean_of_nlls - nll(lp, targets)) > 0.5
    # and not the softmax of the mean log-probs either (that would give p(y) = 0.5 here only by
    # symmetry; use an asymmetric case): samples p(y) = 0.99 and 0.5
    s2 = torch.tensor([[[0.99, 0.01]], [[0.5, 0.5]]], dtype=F64).log()
    expected = -math.log((0.99 + 0.5) / 2)  # 0.293761...
    assert nll(predictive_log_probs(s2), targets) == pytest.approx(expected, abs=1e-12)
    wrong = -torch.log_softmax(s2.mean(0), dim=1)[0, 0].item()
    assert abs(wrong - expected) > 1e-2


def test_nll_mean_over_examples():
    lp = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=F64).log()
    # (-log 0.5 - log 0.75) / 2
    assert nll(lp, torch.tensor([0, 1])) == pytest.approx((math.log(2) - math.log(0.75)) / 2)


def test_nll_batch_means_is_the_bsam_codes_sum_of_batch_means_over_batches_minus_one():
    """team-approx-bayes/bayesian-sam test.py: nll += batch mean; nll /= batch_idx (= batches - 1), in test order.
    5 points in batches of 2: means over {0,1}, {2,3}, {4}, summed, / 2 -- a short last batch counts as a whole."""
    from flatbnn.metrics.classification import nll_batch_means
    p = torch.tensor([0.9, 0.5, 0.25, 0.8, 0.6], dtype=F64)
    lp = torch.stack([p, 1 - p], 1).log()
    y = torch.zeros(5, dtype=torch.long)
    e = -p.log()
    want = ((e[0] + e[1]) / 2 + (e[2] + e[3]) / 2 + e[4]) / 2
    assert nll_batch_means(lp, y, 2) == pytest.approx(float(want), rel=1e-12)
    # equal batches: the exact mean x n / (n - 1) -- the bSAM rows' declared +2.04 % (50 batches of 200)
    lp50 = torch.rand(10_000, 3, generator=torch.Generator().manual_seed(0), dtype=F64).log_softmax(1)
    y50 = torch.randint(0, 3, (10_000,), generator=torch.Generator().manual_seed(1))
    assert nll_batch_means(lp50, y50, 200) == pytest.approx(nll(lp50, y50) * 50 / 49, rel=1e-12)
    got = classification_metrics(lp50, y50, nll_batches=200)["nll"]
    assert got / classification_metrics(lp50, y50)["nll"] == pytest.approx(1.0204, abs=1e-4)
    with pytest.raises(ValueError, match="make 1 batch"):
        nll_batch_means(lp, y, 5)


def test_predictive_log_probs_stable_for_very_negative_log_probs():
    # log-probs around -1000 underflow to 0 if exponentiated naively
    samples = torch.tensor([[[-1000.0, 0.0]], [[-1001.0, 0.0]]])  # [2, 1, 2], float32
    lp = predictive_log_probs(samples)
    assert torch.isfinite(lp).all()
    # log((e^-1000 + e^-1001) / 2) = -1000 + log((1 + e^-1) / 2)
    expected = -1000.0 + math.log((1.0 + math.exp(-1.0)) / 2.0)
    assert lp[0, 0].item() == pytest.approx(expected, abs=1e-3)
    assert lp[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    assert nll(lp, torch.tensor([0])) == pytest.approx(-expected, abs=1e-3)
    # S = 1 and a plain [N, C] input are the identity
    x = torch.randn(3, 4).log_softmax(1)
    assert torch.equal(predictive_log_probs(x), x)
    assert torch.allclose(predictive_log_probs(x[None]), x)


def test_brier_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]], dtype=F64)
    targets = torch.tensor([0, 2])
    # ex. 1: 0.3^2 + 0.2^2 + 0.1^2 = 0.14 ; ex. 2: 0.5^2 + 0.5^2 + 1^2 = 1.5 ; mean = 0.82
    assert brier(probs, targets) == pytest.approx(0.82, abs=1e-12)
    # summed over classes, not divided by C: a one-hot wrong prediction scores 2
    assert brier(torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([1])) == pytest.approx(2.0)


# ------------------------------------------------------------------ calibration
# Six examples, 3 classes. Confidence (max prob) / correct:
#   1: 0.9 correct   2: 0.6 wrong   3: 0.7 correct
#   4: 0.4 correct   5: 0.4 wrong (argmax = class 2)   6: 0.5 wrong  (exactly on the 2-bin edge)
HAND_PROBS = torch.tensor(
    [
        [0.9, 0.05, 0.05],
        [0.6, 0.3, 0.1],
        [0.2, 0.7, 0.1],
        [0.4, 0.35, 0.25],
        [0.3, 0.3, 0.4],
        [0.5, 0.25, 0.25],
    ],
    dtype=F64,
)
HAND_TARGETS = torch.tensor([0, 1, 1, 0, 0, 1])


def test_ece_hand_two_bins_each_edge_mode():
    # 2 equal-width bins, edge at 0.5
    # right (lo, hi]:  bin0 = {4,5,6}: conf 1.3/3, acc 1/3 -> gap 0.1 ; bin1 = {1,2,3}: conf 2.2/3,
    #                  acc 2/3 -> gap 0.2/3.   ECE = 3/6*0.1 + 3/6*0.0667 = 0.083333
    # left [lo, hi):   bin0 = {4,5}: conf 0.4, acc 0.5 -> 0.1 ; bin1 = {1,2,3,6}: conf 2.7/4 = 0.675,
    #                  acc 0.5 -> 0.175.       ECE = 2/6*0.1 + 4/6*0.175 = 0.15
    # both [lo, hi]:   point 6 in both bins: bin0 = {4,5,6} gap 0.1, bin1 = {1,2,3,6} gap 0.175,
    #                  weights n_b / N:        ECE = 3/6*0.1 + 4/6*0.175 = 0.166667
    # strict (lo, hi): point 6 in no bin: bin0 = {4,5} gap 0.1, bin1 = {1,2,3} gap 0.2/3
    #                                          ECE = 2/6*0.1 + 3/6*0.0667 = 0.066667
    expected = {"right": 1 / 12, "left": 0.15, "both": 1 / 6, "strict": 1 / 15}
    counts = {"right": [3, 3], "left": [2, 4], "both": [3, 4], "strict": [2, 3]}
    for mode, value in expected.items():
        assert ece(HAND_PROBS, HAND_TARGETS, n_bins=2, edges=mode) == pytest.approx(value, abs=1e-12), mode
        b = calibration_bins(HAND_PROBS, HAND_TARGETS, n_bins=2, edges=mode)
        assert b["count"].tolist() == counts[mode], mode
    b = calibration_bins(HAND_PROBS, HAND_TARGETS, n_bins=2, edges="right")
    assert b["edges"].tolist() == [0.0, 0.5, 1.0]
    assert b["confidence"].tolist() == pytest.approx([1.3 / 3, 2.2 / 3])
    assert b["accuracy"].tolist() == pytest.approx([1 / 3, 2 / 3])
    assert b["n_total"] == 6


def test_ece_hand_three_bins():
    # 3 equal-width bins (0,1/3], (1/3,2/3], (2/3,1]; no confidence on an edge
    # bin0: empty ; bin1 = {2: 0.6 wrong, 4: 0.4 ok, 5: 0.4 wrong, 6: 0.5 wrong}: conf 1.9/4 = 0.475,
    # acc 0.25 -> gap 0.225 ; bin2 = {1: 0.9 ok, 3: 0.7 ok}: conf 0.8, acc 1 -> gap 0.2
    # ECE = 4/6*0.225 + 2/6*0.2 = 0.15 + 0.066667 = 0.216667
    for mode in ("right", "left", "both", "strict"):
        assert ece(HAND_PROBS, HAND_TARGETS, n_bins=3, edges=mode) == pytest.approx(0.15 + 0.2 / 3, abs=1e-12)
    b = calibration_bins(HAND_PROBS, HAND_TARGETS, n_bins=3)
    assert b["count"].tolist() == [0, 4, 2]
    assert b["confidence"][0].item() == 0.0 and b["accuracy"][0].item() == 0.0  # empty bin


def test_confidence_exactly_one_goes_to_last_bin():
    # conf 1.0 (wrong) and 0.75 (correct), 2 bins
    probs = torch.tensor([[1.0, 0.0], [0.75, 0.25]])
    targets = torch.tensor([1, 0])
    # right: (0.5, 1] holds both ; left: [0.5, 1) holds 0.75 and 1.0 is put in the last bin too
    # bin1: conf 0.875, acc 0.5 -> ECE = 0.375
    for mode in ("right", "left", "both"):
        b = calibration_bins(probs, targets, n_bins=2, edges=mode)
        assert b["count"].tolist() == [0, 2], mode
        assert ece(probs, targets, n_bins=2, edges=mode) == pytest.approx(0.375), mode
    # strict drops the point on the outer edge 1.0: bin1 = {0.75 ok}: 1/2 * 0.25
    assert calibration_bins(probs, targets, n_bins=2, edges="strict")["count"].tolist() == [0, 1]
    assert ece(probs, targets, n_bins=2, edges="strict") == pytest.approx(0.125)


def test_confidence_zero_goes_to_first_bin():
    conf = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=F64)
    correct = torch.tensor([1, 0, 1, 1])
    assert _calibration_bins(conf, correct, 2, "width", "right")["count"].tolist() == [3, 1]
    assert _calibration_bins(conf, correct, 2, "width", "left")["count"].tolist() == [2, 2]
    assert _calibration_bins(conf, correct, 2, "width", "both")["count"].tolist() == [3, 2]
    assert _calibration_bins(conf, correct, 2, "width", "strict")["count"].tolist() == [1, 0]


def test_equal_mass_bins_hand():
    # confidences 0.2, 0.3, 0.6, 0.7, 0.8, 0.9 ; correct 1,0,1,1,0,1 ; 3 equal-mass bins
    # edges = quantiles at 0, 1/3, 2/3, 1 (linear interpolation on sorted positions 0, 5/3, 10/3, 5):
    #   0.2, 0.3 + 2/3*0.3 = 0.5, 0.7 + 1/3*0.1 = 0.7333, 0.9
    # bins {0.2 ok, 0.3 x}: conf .25 acc .5 gap .25 ; {0.6 ok, 0.7 ok}: .65 vs 1 gap .35 ;
    #      {0.8 x, 0.9 ok}: .85 vs .5 gap .35          ECE = (.25 + .35 + .35) / 3 = 0.316667
    conf = torch.tensor([0.7, 0.2, 0.9, 0.3, 0.6, 0.8], dtype=F64)
    correct = torch.tensor([1, 1, 1, 0, 1, 0])
    for mode in ("right", "left", "both"):
        b = _calibration_bins(conf, correct, 3, "mass", mode)
        assert b["edges"].tolist() == pytest.approx([0.2, 0.5, 0.7 + 0.1 / 3, 0.9])
        assert b["count"].tolist() == [2, 2, 2]
        ece_b = float((b["count"].double() / 6 * (b["accuracy"] - b["confidence"]).abs()).sum())
        assert ece_b == pytest.approx(0.95 / 3, abs=1e-12)
    # via probabilities: 2-class probs with the same confidences in [0.5, 1] split evenly
    torch.manual_seed(0)
    p = torch.rand(300, dtype=F64) * 0.5 + 0.5
    probs = torch.stack([p, 1 - p], 1)
    b = calibration_bins(probs, torch.zeros(300, dtype=torch.long), n_bins=20, binning="mass")
    assert b["count"].tolist() == [15] * 20
    assert ece(probs, torch.zeros(300, dtype=torch.long), n_bins=20, binning="mass") == pytest.approx(
        1 - p.mean().item(), abs=1e-12
    )  # all correct: every bin's gap is 1 - conf_b, weights equal


def test_ece_matches_torchmetrics_random():
    from torchmetrics.functional.classification import multiclass_calibration_error

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4000, 10, generator=g) * 3
    probs = logits.softmax(dim=1)  # float32, as torchmetrics would see it
    targets = torch.randint(0, 10, (4000,), generator=g)
    ref = multiclass_calibration_error(probs, targets, num_classes=10, n_bins=15, norm="l1").item()
    # torchmetrics bins are [lo, hi) (torch.bucketize(right=True)) -> our "left"
    assert ece(probs, targets, n_bins=15, edges="left") == pytest.approx(ref, abs=1e-6)
    # continuous random data has no point on an edge: every rule gives the same value
    for mode in ("right", "both", "strict"):
        assert ece(probs, targets, n_bins=15, edges=mode) == pytest.approx(ref, abs=1e-6)
    # classification_metrics on float32 log-probs agrees too
    m = classification_metrics(logits.log_softmax(1), targets, ece_bins=15, ece_edges="left")
    assert m["ece"] == pytest.approx(ref, abs=1e-6)


def test_ece_left_matches_torchmetrics_on_float32_edges():
    # confidences exactly on the float32 edges of 15 bins (excluding 1.0): "left" = torchmetrics
    from torchmetrics.functional.classification import multiclass_calibration_error

    e = torch.linspace(0, 1, 16)  # float32, as torchmetrics builds them
    c = e[(e > 0.5) & (e < 1.0)].repeat(3)
    probs = torch.stack([c, 1 - c], 1)
    targets = torch.tensor([0, 1, 0] * (c.numel() // 3))
    ref = multiclass_calibration_error(probs, targets, num_classes=2, n_bins=15).item()
    assert ece(probs, targets, n_bins=15, edges="left") == pytest.approx(ref, abs=1e-6)
    # each point sits on the lower edge of its "left" bin and the upper edge of its "right" bin
    left = calibration_bins(probs, targets, n_bins=15, edges="left")["count"]
    right = calibration_bins(probs, targets, n_bins=15, edges="right")["count"]
    assert left[8:].tolist() == [3] * 7 and right[7:14].tolist() == [3] * 7
    assert left[7].item() == 0 and right[14].item() == 0


# ------------------------------------------------------------------ ranking metrics
def test_auroc_aupr_hand():
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    labels = torch.tensor([0, 0, 1, 1])
    # pairs (pos, neg): (0.35,0.1) ok, (0.35,0.4) wrong, (0.8,*) ok -> 3/4
    assert auroc(scores, labels) == pytest.approx(0.75)
    # ranked: 0.8 (+) P=1 R=.5 ; 0.4 (-) ; 0.35 (+) P=2/3 R=1 -> AP = .5*1 + .5*2/3 = 0.8333
    assert aupr(scores, labels) == pytest.approx(5 / 6)
    # ties count one half: pos {0.5}, neg {0.5} -> 0.5
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == pytest.approx(0.5)


def test_auroc_matches_torchmetrics_and_sklearn_with_ties():
    from sklearn.metrics import average_precision_score, roc_auc_score
    from torchmetrics.functional.classification import binary_auroc

    g = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 2, (1500,), generator=g)
    scores = ((torch.rand(1500, generator=g) + 0.3 * labels) / 1.3).mul(10).round() / 10  # in [0, 1], many ties
    a = auroc(scores, labels)
    assert a == pytest.approx(binary_auroc(scores, labels).item(), abs=1e-6)
    assert a == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-6)
    assert aupr(scores, labels) == pytest.approx(average_precision_score(labels.numpy(), scores.numpy()), abs=1e-6)
    # scores outside [0, 1] (torchmetrics would apply a sigmoid): still exact
    neg_big = -1000.0 * scores.double() - 5000.0
    assert auroc(neg_big, 1 - labels) == pytest.approx(roc_auc_score(1 - labels.numpy(), neg_big.numpy()), abs=1e-6)
    # bool labels accepted
    assert auroc(scores, labels.bool()) == pytest.approx(a)


def test_auroc_and_ap_match_torchmetrics_and_sklearn_on_many_random_cases():
    """The exact rank statistics against the field's two implementations: sizes 2-300, class balance from one positive
    to one negative, few distinct scores (heavy ties) to all distinct, integer and float scores."""
    from sklearn.metrics import average_precision_score, roc_auc_score
    from torchmetrics.functional.classification import binary_auroc, binary_average_precision

    g = torch.Generator().manual_seed(7)
    for case in range(60):
        n = int(torch.randint(2, 300, (1,), generator=g))
        labels = (torch.rand(n, generator=g) < float(torch.rand(1, generator=g))).long()
        labels[0], labels[-1] = 1, 0  # both classes
        levels = [2, 5, 50, 10**6][case % 4]
        # integer levels shifted up for positives (by a fifth of the range), then scaled: exact ties across classes
        scores = (torch.randint(0, levels, (n,), generator=g) + labels * max(1, levels // 5)).double() / levels
        ref_auc, ref_ap = roc_auc_score(labels.numpy(), scores.numpy()), average_precision_score(labels.numpy(), scores.numpy())
        assert auroc(scores, labels) == pytest.approx(ref_auc, abs=1e-12), case
        assert aupr(scores, labels) == pytest.approx(ref_ap, abs=1e-12), case
        s01 = scores / scores.max()  # torchmetrics reads scores in [0, 1] as probabilities
        assert auroc(s01, labels) == pytest.approx(binary_auroc(s01, labels).item(), abs=1e-6), case
        assert aupr(s01, labels) == pytest.approx(binary_average_precision(s01, labels).item(), abs=1e-6), case


def test_auroc_thresholds_bsam_convention():
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    labels = torch.tensor([0, 0, 1, 1])
    # n = 4: thresholds 0.75, 0.5, 0.25 (score >= t):
    #   t=.75, .5: TPR 1/2, FPR 0 ; t=.25: TPR 1, FPR 1/2 ; framed by (0,0) and (1,1)
    #   trapezoid: 0 + 0 + 0.5*(0.5+1)/2 + 0.5*1 = 0.875   (exact AUROC: 0.75)
    assert auroc_thresholds(scores, labels, n_thresholds=4) == pytest.approx(0.875)
    # n = 2: threshold 0.5 only -> points (0,0), (0, .5), (1,1): area 0.75
    assert auroc_thresholds(scores, labels, n_thresholds=2) == pytest.approx(0.75)
    # with 2500 thresholds it approximates the exact AUROC on continuous scores
    g = torch.Generator().manual_seed(3)
    lab = torch.randint(0, 2, (3000,), generator=g)
    s = torch.sigmoid(torch.randn(3000, generator=g) + lab)
    assert auroc_thresholds(s, lab) == pytest.approx(auroc(s, lab), abs=2e-3)


def test_fpr95_hand():
    # 20 in-distribution scores 0.81, 0.82, ..., 0.99 and 0.10 ; 4 OOD scores
    s_in = torch.cat([torch.arange(81, 100, dtype=F64) / 100, torch.tensor([0.10], dtype=F64)])
    s_out = torch.tensor([0.5, 0.95, 0.2, 0.3], dtype=F64)
    scores = torch.cat([s_in, s_out])
    labels = torch.cat([torch.ones(20), torch.zeros(4)]).long()
    # TPR >= 0.95 needs 19 of 20 in-dist kept: threshold 0.81 ; OOD >= 0.81: {0.95} -> FPR = 1/4
    assert fpr_at_tpr(scores, labels, 0.95) == pytest.approx(0.25)
    # TPR = 1 needs threshold 0.10: all OOD accepted
    assert fpr_at_tpr(scores, labels, 1.0) == pytest.approx(1.0)
    # TPR = 0.5 (10 of 20): threshold 0.90 -> still only 0.95 -> 1/4 ; TPR 0.05: threshold 0.99 -> 0
    assert fpr_at_tpr(scores, labels, 0.5) == pytest.approx(0.25)
    assert fpr_at_tpr(scores, labels, 0.05) == pytest.approx(0.0)
    # same in float32 (19/20 in float32 < 0.95: counts are integer so no off-by-one)
    assert fpr_at_tpr(scores.float(), labels, 0.95) == pytest.approx(0.25)


def test_confidence_score():
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]])
    mp = confidence_score(probs, "max_prob")
    assert mp.tolist() == pytest.approx([0.25, 1.0, 0.7])
    ne = confidence_score(probs, "entropy")
    assert ne[0].item() == pytest.approx(-math.log(4))
    assert ne[1].item() == 0.0  # 0 log 0 = 0, no NaN
    assert ne[2].item() == pytest.approx(0.7 * math.log(0.7) + 0.3 * math.log(0.1))
    with pytest.raises(ValueError):
        confidence_score(probs, "bogus")


def test_misclassification_metrics_hand():
    # correct = positives. conf / correct: 0.9 ok, 0.6 x, 0.7 ok, 0.4 ok, 0.4 x, 0.5 x
    # pairs (ok, x): 0.9 beats all 3 ; 0.7 beats all 3 ; 0.4 vs {0.6: lose, 0.4: tie 1/2, 0.5: lose}
    # AUROC = (3 + 3 + 0.5) / 9 = 0.722222
    m = misclassification_metrics(HAND_PROBS, HAND_TARGETS)
    assert m["auroc_misclassification"] == pytest.approx(6.5 / 9)
    from sklearn.metrics import average_precision_score

    conf = HAND_PROBS.max(1).values.numpy()
    correct = (HAND_PROBS.argmax(1) == HAND_TARGETS).numpy()
    assert m["aupr_misclassification"] == pytest.approx(average_precision_score(correct, conf))


def test_ood_sign_and_values():
    g = torch.Generator().manual_seed(4)
    n, c = 500, 10
    # in-distribution: confident ; OOD: near uniform
    probs_in = (torch.randn(n, c, generator=g) + 8 * torch.nn.functional.one_hot(torch.randint(0, c, (n,), generator=g), c)).softmax(1)
    probs_out = (0.1 * torch.randn(n, c, generator=g)).softmax(1)
    for score in ("max_prob", "entropy"):
        m = ood_metrics(probs_in, probs_out, score=score)
        assert set(m) == {"auroc_ood", "aupr_in", "aupr_out", "fpr95"}
        assert m["auroc_ood"] > 0.99, score
        assert m["aupr_in"] > 0.99 and m["aupr_out"] > 0.99, score
        assert m["fpr95"] < 0.01, score
        # swapping the roles flips the AUROC
        assert ood_metrics(probs_out, probs_in, score=score)["auroc_ood"] < 0.01
    # same as torchmetrics' form: OOD positive with score 1 - max prob
    from torchmetrics.functional.classification import binary_auroc

    mixed_in = torch.cat([probs_in[:250], probs_out[:250]])  # a harder, non-trivial case
    m = ood_metrics(mixed_in, probs_out[250:])
    s = 1 - torch.cat([mixed_in, probs_out[250:]]).max(1).values
    lab = torch.cat([torch.zeros(500), torch.ones(250)]).long()
    assert m["auroc_ood"] == pytest.approx(binary_auroc(s, lab).item(), abs=1e-6)


# ------------------------------------------------------------------ composite + degenerate
def test_classification_metrics_keys_and_values():
    lp = HAND_PROBS.log()
    m = classification_metrics(lp, HAND_TARGETS, ece_bins=2)
    assert set(m) == {"accuracy", "nll", "ece", "brier", "auroc_misclassification", "aupr_misclassification"}
    assert all(isinstance(v, float) for v in m.values())
    assert m["accuracy"] == pytest.approx(0.5)
    assert m["ece"] == pytest.approx(1 / 12)
    assert m["nll"] == pytest.approx(-(math.log(0.9) + math.log(0.3) + math.log(0.7) + math.log(0.4) + math.log(0.3) + math.log(0.25)) / 6)
    assert m["brier"] == pytest.approx(brier(HAND_PROBS, HAND_TARGETS))
    assert m["auroc_misclassification"] == pytest.approx(6.5 / 9)
    # a [S, N, C] stack is averaged in probability space first
    m2 = classification_metrics(torch.stack([lp, lp]), HAND_TARGETS, ece_bins=2)
    assert m2["nll"] == pytest.approx(m["nll"])


def test_degenerate_cases_return_nan_not_crash():
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    targets = torch.tensor([0, 1])  # all correct
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torchmetrics warnings either
        m = classification_metrics(probs.log(), targets)
    assert m["accuracy"] == 1.0
    assert math.isnan(m["auroc_misclassification"]) and math.isnan(m["aupr_misclassification"])
    assert math.isfinite(m["ece"]) and math.isfinite(m["nll"])
    # all wrong
    m = classification_metrics(probs.log(), 1 - targets)
    assert math.isnan(m["auroc_misclassification"])
    assert math.isnan(auroc(torch.tensor([0.3, 0.4]), torch.tensor([1, 1])))
    assert math.isnan(fpr_at_tpr(torch.tensor([0.3, 0.4]), torch.tensor([0, 0])))
    assert math.isnan(auroc_thresholds(torch.tensor([0.3, 0.4]), torch.tensor([0, 0])))
    # empty input
    assert math.isnan(ece(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)))
    # all scores equal: AUROC 0.5
    assert auroc(torch.ones(4), torch.tensor([0, 1, 0, 1])) == pytest.approx(0.5)


def test_bad_arguments():
    with pytest.raises(ValueError):
        ece(HAND_PROBS, HAND_TARGETS, binning="quantile")
    with pytest.raises(ValueError):
        ece(HAND_PROBS, HAND_TARGETS, edges="middle")
    with pytest.raises(ValueError):
        auroc(torch.rand(3), torch.tensor([0, 1, 2]))


# ------------------------------------------------------------------ reliability diagram
def test_reliability_diagram_writes_png(tmp_path):
    g = torch.Generator().manual_seed(5)
    probs = (2 * torch.randn(300, 5, generator=g)).softmax(1)
    targets = torch.randint(0, 5, (300,), generator=g)
    out = reliability_diagram(probs, targets, tmp_path / "sub" / "rel.png", n_bins=20, title="test")
    with open(out, "rb") as f:
        data = f.read()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
