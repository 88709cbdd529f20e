"""Statistics over seeds: summaries (mean, std, sem, confidence interval) and the two t-tests of "beyond seed noise".

One policy for values that are not numbers, used by every table (aggregate.py's rows, compare.py's cells):

    NaN policy: a seed whose value is NaN, inf or missing is LEFT OUT of the mean, std, sem, interval and of every
    test, and COUNTED (``n_nonfinite``); a table prints the count beside the number, never a bare mean. With no
    finite value the mean is None (printed ``nan``). ``n`` is the number of finite values the numbers are over.
    A value that is not a number at all (a string, a list: a damaged or hand-edited results.json) is left out
    the same way but counted apart (``n_nonnumeric``, printed ``[k/N non-numeric]``): it is not a diverged seed.

(:data:`NAN_POLICY` is that sentence for the tables' notes.) Why not "any NaN makes the cell NaN": one diverged
seed of five would hide the other four, and the table would not say which metric diverged how often. Why not drop
silently: a mean over the survivors is biased toward the seeds that converged, so the reader must see how many did
not.

Mean and std come from :mod:`statistics` (``fmean``, ``stdev``: ddof = 1, correctly rounded, so committed tables
stay bit-identical); quantiles and tests from :mod:`scipy.stats` (``t.interval``, ``ttest_rel``,
``ttest_ind_from_stats(equal_var=False)``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from scipy import stats as sps

#: two-sided level of "beyond seed noise": p < NOISE_ALPHA, i.e. |difference| > t_(1 - ALPHA/2, dof) standard errors
#: of it -- 12.7 se at 1 dof (2 seeds), 4.30 at 2, 2.78 at 4 (vs 1.96 for many seeds). A fixed 2 standard errors
#: calls a pure-noise difference 'beyond' 30 % of the time at 2 seeds and 18 % at 3.
NOISE_ALPHA = 0.05

NAN_POLICY = ("a seed whose value is NaN / inf / missing is left out of the mean, std and tests and counted beside "
              "the number ([k/N non-finite])")


def is_finite(v) -> bool:
    """A real number that is not NaN / inf (bools are not numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SeedStats:
    """Summary of one metric over seeds, under the NaN policy above."""
    n: int                 # finite values the numbers are over
    n_nonfinite: int       # NaN / inf / missing values left out
    mean: float | None     # None when n = 0
    std: float | None      # sample std (ddof = 1); None when n < 2
    n_nonnumeric: int = 0  # values that are not numbers (a string, a list, a bool), left out

    @property
    def sem(self) -> float | None:
        """Standard error of the mean, std / sqrt(n)."""
        return None if self.std is None else self.std / math.sqrt(self.n)

    def interval(self, level: float = 0.95) -> tuple[float, float] | None:
        """Two-sided Student-t confidence interval of the mean (n - 1 dof); None when n < 2."""
        if self.std is None:
            return None
        if self.std == 0.0:
            return self.mean, self.mean
        lo, hi = sps.t.interval(level, self.n - 1, loc=self.mean, scale=self.sem)
        return float(lo), float(hi)


def is_number(v) -> bool:
    """A real number, finite or not (NaN and inf are numbers; None, bools, strings are not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def nonfinite_note(n: int, n_nonfinite: int, n_nonnumeric: int = 0) -> str:
    """`` [k/N non-finite]`` when k of N seeds were left out as NaN / inf / missing, `` [j/N non-numeric]`` for the
    values that are no number at all, else empty: what every table prints beside a number."""
    total = n + n_nonfinite + n_nonnumeric
    return ((f" [{n_nonfinite}/{total} non-finite]" if n_nonfinite else "")
            + (f" [{n_nonnumeric}/{total} non-numeric]" if n_nonnumeric else ""))


def seed_stats(values: Iterable) -> SeedStats:
    """:class:`SeedStats` of ``values`` (one per seed; NaN / inf / None are left out and counted, values that are
    no number apart)."""
    values = list(values)
    finite = [v for v in values if is_finite(v)]
    n, nonnumeric = len(finite), sum(v is not None and not is_number(v) for v in values)
    return SeedStats(n=n, n_nonfinite=len(values) - n - nonnumeric, mean=statistics.fmean(finite) if n else None,
                     std=statistics.stdev(finite) if n > 1 else None, n_nonnumeric=nonnumeric)


@dataclass(frozen=True)
class TTest:
    """A two-sided t-test of a difference of means: the difference, its standard error, t, dof and p."""
    diff: float
    se: float
    t: float
    df: float
    p: float

    def beyond(self, alpha: float) -> bool:
        """Is the difference significant at two-sided level ``alpha`` (p < alpha, i.e. |t| > t_(1-alpha/2, df))?"""
        return self.p < alpha


def _degenerate(diff: float, se: float, df: float) -> TTest:
    # zero spread on both sides: scipy returns t = inf / nan with a warning; the same answer, said outright -- any
    # difference is beyond noise that does not exist, no difference is not
    return TTest(diff, se, math.copysign(math.inf, diff) if diff else 0.0, df, 0.0 if diff else 1.0)


def paired_ttest(x: list[float], y: list[float]) -> TTest:
    """Paired t-test of mean(x - y) = 0 over matched seeds (``scipy.stats.ttest_rel``): se = sd(d) / sqrt(n),
    n - 1 dof. Needs 2+ pairs of finite values (the caller drops the rest, as the NaN policy says)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"paired t-test needs 2+ matched pairs, got {len(x)} and {len(y)} values")
    d = [a - b for a, b in zip(x, y)]
    diff, se, df = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d)), len(d) - 1
    if se == 0.0:
        return _degenerate(diff, se, df)
    res = sps.ttest_rel(x, y)
    return TTest(diff, se, float(res.statistic), df, float(res.pvalue))


def welch_ttest(a: SeedStats, b: SeedStats) -> TTest:
    """Welch's unequal-variance t-test of mean(a) = mean(b) from the two summaries
    (``scipy.stats.ttest_ind_from_stats(equal_var=False)``, the same test as ``ttest_ind(equal_var=False)`` on the
    values): se = sqrt(s_a^2/n_a + s_b^2/n_b), Welch-Satterthwaite dof (reported; scipy does not return it).
    Needs a std on both sides (2+ finite values each)."""
    if a.std is None or b.std is None:
        raise ValueError(f"Welch t-test needs 2+ finite values on each side, got n = {a.n} and {b.n}")
    va, vb = a.std ** 2 / a.n, b.std ** 2 / b.n
    diff, se = a.mean - b.mean, math.sqrt(va + vb)
    if se == 0.0:
        return _degenerate(diff, se, a.n + b.n - 2)
    df = (va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1))
    res = sps.ttest_ind_from_stats(a.mean, a.std, a.n, b.mean, b.std, b.n, equal_var=False)
    return TTest(diff, se, float(res.statistic), df, float(res.pvalue))


@dataclass(frozen=True)
class SeedTest:
    """Which t-test compared two cells over their seeds, on how many, and its result."""
    name: str          # "paired t" (over the seeds both cells have) or "Welch t"
    n: str             # "3" (pairs) or "3+2" (values on each side)
    result: TTest


# ------------------------------------------------------------------------------------------ zero spread
def sd_floor(resolution: float) -> float:
    """The seed std assumed where the recorded values show less than one unit of ``resolution``: one unit. Seeds
    that print the same number did not agree to infinitely many digits -- their spread is below what the record can
    show, so the largest spread it cannot show is taken (rounding alone would give resolution / sqrt(12), which
    calls a one-digit difference of identical triples significant). A std of 0 would make every difference
    'beyond noise' (p = 0); with the floor the minimum detectable difference is a few units of the last digit."""
    return float(resolution)


def floored(st: SeedStats, resolution: float | None) -> SeedStats:
    """``st`` with its std raised to :func:`sd_floor` (unchanged without a resolution or below 2 values)."""
    if resolution is None or st.std is None or st.std >= sd_floor(resolution):
        return st
    return SeedStats(st.n, st.n_nonfinite, st.mean, sd_floor(resolution), st.n_nonnumeric)


def paired_difference(x: list[float], y: list[float], resolution: float | None = None) -> TTest:
    """mean(x - y) over matched seeds as a :class:`TTest` (two-sided p), the std of the differences floored at the
    rounding error of a difference of two values recorded to ``resolution`` (sqrt(2) x :func:`sd_floor`)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"paired t-test needs 2+ matched pairs, got {len(x)} and {len(y)} values")
    d = [a - b for a, b in zip(x, y)]
    sd = statistics.stdev(d)
    if resolution is not None:
        sd = max(sd, math.sqrt(2.0) * sd_floor(resolution))
    if sd == 0.0:
        return _degenerate(statistics.fmean(d), 0.0, len(d) - 1)
    diff, se, df = statistics.fmean(d), sd / math.sqrt(len(d)), len(d) - 1
    t = diff / se
    return TTest(diff, se, t, df, float(2.0 * sps.t.sf(abs(t), df)))


def seed_difference_test(x_by_seed: dict, y_by_seed: dict, x: SeedStats, y: SeedStats, *, paired: bool = False,
                         resolution: float | None = None) -> SeedTest | None:
    """The test of mean(x) - mean(y) = 0 for two cells, as the row declares it: ``paired`` over the seeds both have
    (cells that share one trained run per seed: an eval row's sample counts or corruption sets), else Welch from
    the two summaries (separately trained cells: a shared seed number couples nothing but init and data order,
    and pairing them spends degrees of freedom on correlations that range from -1 to +1). ``resolution``: the
    stds are floored at its rounding error (:func:`sd_floor`). None with fewer than 2 finite values (pairs) a
    side."""
    if paired:
        common = sorted(set(x_by_seed) & set(y_by_seed))
        if len(common) < 2:
            return None
        return SeedTest("paired t", str(len(common)), paired_difference(
            [x_by_seed[k] for k in common], [y_by_seed[k] for k in common], resolution))
    if x.std is None or y.std is None:
        return None
    return SeedTest("Welch t", f"{x.n}+{y.n}", welch_ttest(floored(x, resolution), floored(y, resolution)))


# ------------------------------------------------------------------------------------------ margins, families
# (numpy-friendly: a TTest whose fields are arrays gives arrays -- the calibration simulates thousands of claims)
def one_sided_p(t, df, alternative: str):
    """P(T >= t) ('greater') or P(T <= t) ('less') under Student t with ``df`` dof."""
    if alternative == "greater":
        return sps.t.sf(t, df)
    if alternative == "less":
        return sps.t.cdf(t, df)
    raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")


def _t(x, se):
    """x / se, with a zero se giving +-inf (or 0 for x = 0) instead of a division error."""
    x, se = np.asarray(x, dtype=float), np.asarray(se, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(se > 0, x / np.where(se > 0, se, 1.0), np.sign(x) * np.inf)


def _out(v):
    return float(v) if np.ndim(v) == 0 else v


def equivalence_p(t: TTest, margin):
    """TOST (two one-sided tests) of |mean difference| < ``margin``: the larger of the p-values of
    H0: diff <= -margin and H0: diff >= +margin. p < alpha <=> the (1 - 2 alpha) confidence interval of the
    difference lies inside (-margin, +margin): equivalence shown."""
    return _out(np.maximum(one_sided_p(_t(t.diff + margin, t.se), t.df, "greater"),
                           one_sided_p(_t(t.diff - margin, t.se), t.df, "less")))


def beyond_margin_p(t: TTest, margin):
    """The test of H0: |diff| <= ``margin`` against |diff| > margin (a difference larger than the margin shown):
    two-sided, i.e. twice the smaller one-sided p of diff - margin > 0 and diff + margin < 0 (at most 1)."""
    return _out(np.minimum(1.0, 2.0 * np.minimum(one_sided_p(_t(t.diff - margin, t.se), t.df, "greater"),
                                                  one_sided_p(_t(t.diff + margin, t.se), t.df, "less"))))


def noninferiority_p(t: TTest, margin, sign: float = 1.0):
    """Non-inferiority of a to b by ``margin``: H0: sign * diff <= -margin (a worse by the margin or more) against
    a worse by less than the margin, or better. ``sign`` = +1 where higher is better, -1 where lower is."""
    return _out(one_sided_p(_t(sign * t.diff + margin, t.se), t.df, "greater"))


def inferiority_p(t: TTest, margin, sign: float = 1.0):
    """The other side of :func:`noninferiority_p`: H0: sign * diff >= -margin against a worse than b by more
    than the margin (inferiority beyond the margin shown)."""
    return _out(one_sided_p(_t(sign * t.diff + margin, t.se), t.df, "less"))


def welch_arrays(mean_a, sd_a, n_a: int, mean_b, sd_b, n_b: int) -> TTest:
    """:func:`welch_ttest` over arrays of summaries (the calibration's thousands of simulated cells at once):
    the same difference, se, Welch-Satterthwaite dof and two-sided p."""
    va, vb = np.asarray(sd_a) ** 2 / n_a, np.asarray(sd_b) ** 2 / n_b
    diff, se = np.asarray(mean_a) - np.asarray(mean_b), np.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
    t = _t(diff, se)
    return TTest(diff, se, t, df, 2.0 * sps.t.sf(np.abs(t), df))


def paired_arrays(d) -> TTest:
    """:func:`paired_ttest` over arrays of per-seed differences (last axis = seeds)."""
    d = np.asarray(d, dtype=float)
    n = d.shape[-1]
    diff, se = d.mean(-1), d.std(-1, ddof=1) / math.sqrt(n)
    t = _t(diff, se)
    return TTest(diff, se, t, np.full_like(diff, n - 1.0), 2.0 * sps.t.sf(np.abs(t), n - 1))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control under any dependence): the i-th smallest p
    times (m - i + 1), made monotone, capped at 1. Reject where the adjusted p < alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out, running = [1.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


__all__ = ["NOISE_ALPHA", "NAN_POLICY", "SeedTest", "seed_difference_test", "SeedStats", "TTest", "beyond_margin_p",
           "equivalence_p", "floored", "holm", "inferiority_p", "is_finite", "is_number", "noninferiority_p",
           "nonfinite_note", "one_sided_p", "paired_arrays", "paired_difference", "paired_ttest", "sd_floor",
           "seed_stats", "welch_arrays", "welch_ttest"]
