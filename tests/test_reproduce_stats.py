"""flatbnn/reproduce/stats.py: seed summaries, the two t-tests of "beyond seed noise", and the one NaN policy that
aggregate.py's rows and compare.py's cells share. Hand-computed values; no training, no torch (well under a second)."""

from __future__ import annotations

import math
import random
import warnings

import pytest
from scipy import stats as sps

from flatbnn.reproduce import aggregate, compare, compare_markdown
from flatbnn.reproduce.stats import paired_ttest, seed_stats, welch_ttest


def test_welch_t_and_dof_match_a_hand_computation():
    # a = (19, 22, 16, 29, 24): mean 22, squared deviations 9+0+36+49+4 = 98, s^2 = 98/4 = 24.5, s^2/n = 4.9
    # b = (20, 11, 17, 12):     mean 15, squared deviations 25+16+4+9 = 54, s^2 = 54/3 = 18,   s^2/n = 4.5
    # se = sqrt(9.4); t = 7 / sqrt(9.4) = 2.2831; Welch-Satterthwaite dof = 9.4^2 / (4.9^2/4 + 4.5^2/3) = 6.9288
    a, b = seed_stats([19, 22, 16, 29, 24]), seed_stats([20, 11, 17, 12])
    assert (a.mean, a.std ** 2, b.mean, b.std ** 2) == pytest.approx((22, 24.5, 15, 18))
    test = welch_ttest(a, b)
    assert test.diff == pytest.approx(7.0) and test.se == pytest.approx(math.sqrt(9.4))
    assert test.t == pytest.approx(7 / math.sqrt(9.4), rel=1e-12)
    assert test.df == pytest.approx(9.4 ** 2 / (4.9 ** 2 / 4 + 4.5 ** 2 / 3), rel=1e-12)
    # p = 0.0568: NOT beyond noise at 5 %, although |t| = 2.28 > 2 (a fixed "2 se" rule would call it beyond)
    assert test.p == pytest.approx(0.05675, abs=1e-5) and not test.beyond(0.05) and test.beyond(0.10)


def test_paired_t_matches_the_closed_form_at_two_dof():
    # d = (0.9, 1.1, 1.0): mean 1.0, sd 0.1, se 0.1/sqrt(3), t = 10 sqrt(3). With 2 dof the t CDF is closed:
    # F(t) = 1/2 + t / (2 sqrt(2 + t^2)), so the two-sided p = 1 - t / sqrt(2 + t^2)
    test = paired_ttest([60.0, 62.0, 64.0], [59.1, 60.9, 63.0])
    t = 10 * math.sqrt(3)
    assert test.diff == pytest.approx(1.0) and test.se == pytest.approx(0.1 / math.sqrt(3))
    assert test.t == pytest.approx(t, rel=1e-9) and test.df == 2
    assert test.p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9) and test.beyond(0.05)
    # unpaired, the same numbers are inside the noise (the seed's shift is shared by both cells)
    assert not welch_ttest(seed_stats([60.0, 62.0, 64.0]), seed_stats([59.1, 60.9, 63.0])).beyond(0.05)


def test_welch_from_summaries_equals_scipy_on_the_values():
    """The comparison keeps only mean / std / n per cell: the summary route (ttest_ind_from_stats + our dof) must
    be scipy's ttest_ind(equal_var=False) on the raw values, t, dof and p."""
    rng = random.Random(0)
    worst = 0.0
    for _ in range(50):
        x = [rng.gauss(0.0, 1.0) for _ in range(rng.randint(2, 6))]
        y = [rng.gauss(0.5, rng.uniform(0.2, 3.0)) for _ in range(rng.randint(2, 6))]
        ours, ref = welch_ttest(seed_stats(x), seed_stats(y)), sps.ttest_ind(x, y, equal_var=False)
        for got, want in ((ours.t, ref.statistic), (ours.p, ref.pvalue), (ours.df, ref.df)):
            worst = max(worst, abs(got - want) / max(1.0, abs(want)))
    assert worst < 1e-12, worst


def test_confidence_interval_uses_the_t_quantile():
    st = seed_stats([1.0, 2.0, 3.0])  # mean 2, std 1, sem 1/sqrt(3); t_(0.975, 2) = 4.303 (any t table)
    assert st.sem == pytest.approx(1 / math.sqrt(3))
    lo, hi = st.interval(0.95)
    assert (lo, hi) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)), abs=1e-3)
    assert seed_stats([1.0]).interval() is None and seed_stats([]).mean is None


def test_zero_spread_is_decided_without_scipy_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scipy warns (and returns nan) on identical samples
        assert paired_ttest([1.0, 2.0, 3.0], [0.5, 1.5, 2.5]).beyond(0.05)       # the same shift on every seed
        assert not paired_ttest([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]).beyond(0.05)   # no difference at all
        assert welch_ttest(seed_stats([1.0, 1.0]), seed_stats([2.0, 2.0])).beyond(0.05)
        assert not welch_ttest(seed_stats([1.0, 1.0]), seed_stats([1.0, 1.0])).beyond(0.05)


def test_one_nan_policy_for_aggregate_rows_and_comparison_cells():
    """A NaN / inf / missing seed is left out of mean and std and counted, in both tables (aggregate.py used to
    blank the whole cell on one NaN seed; compare.py's ours-only tables dropped the count)."""
    values = [0.01, float("nan"), 0.02, None, float("inf")]
    row, cell = aggregate.metric_stats(values), compare._stats(values)
    assert (row["n"], row["n_nonfinite"], cell["n"], cell["nonfinite"]) == (2, 3, 2, 3)
    assert row["mean"] == cell["mean"] == pytest.approx(0.015)
    assert row["std"] == cell["std"] == pytest.approx(0.01 / math.sqrt(2))
    assert aggregate.fmt_cell(row, "ece") == "0.0150 ± 0.0071 [3/5 non-finite]"
    assert aggregate.fmt_cell(aggregate.metric_stats([float("nan")] * 2), "nll") == "nan [2/2 non-finite]"
    rec = {"cell": "a", "metric": "ece", "unit": "fraction", "state": "2/5 seeds",
           **{f"ours_{k}": v for k, v in cell.items()}}
    md = "\n".join(compare_markdown._cells_markdown([rec], "Our cells", "x."))
    assert "| `a` | 0.0150 ± 0.0071 (n=2) [3/5 non-finite] | 2/5 seeds |" in md and "left out of the mean" in md
    assert "left out of the mean" in aggregate.STATS_NOTE
