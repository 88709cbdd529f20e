"""The papers' claims as data (``claims:`` in ``results/paper/<row>.yaml``) and one verdict per claim, by a rule a
statistician would sign (docs/reproduce.md, Claims; issue 51).

A claim is a sentence of the paper, copied exactly (``quote``, found in ``../shared/papers/<file>`` by
tests/test_claims.py), that compares the row's cells: along one ``axis`` of the cell ids, for each ``pairs`` entry
``[a, b]``, cell ``a`` against the same cell with ``b`` on each of ``metrics`` (the paper file's names; their
``better:`` says which way is better), restricted to ``cells`` (globs). ``direction`` is what the sentence says of a
against b (better / worse / comparable / not_worse), ``quantifier`` how many of its comparisons it speaks for
(``all`` / ``overall`` / ``most``, with ``quantifier_word``, the word of the quote that says so; ``overall`` is the
reading of a sentence without one), and ``margins`` (comparable / not_worse) the difference per metric that still
counts as "comparable": ``{abs: x}`` in the metric's unit or ``{rel: r}`` of b's mean, with ``margin_reason``.

**One comparison** (a cell pair on one metric) is tested by the row's declared design (``Row.seed_test``): a paired
t-test over the seeds where the cells share one trained run per seed (eval rows), else Welch's t-test (cells trained
separately). A std below the rounding error of the metric's ``resolution`` is raised to it (stats.sd_floor: zero
spread gives a minimum detectable difference, never p = 0). Its p-values:

- better / worse: the two-sided test of no difference; its sign says agreement or reversal;
- comparable: equivalence within the margin (TOST) for agreement, a difference beyond the margin for reversal;
- not_worse: non-inferiority by the margin for agreement, inferiority beyond the margin for reversal.

**The family** is the claim's comparisons: the p-values of reversal are Holm-adjusted over them (family-wise error
5 % under any dependence -- the comparisons share cells), and so are those of agreement, except under ``all``:
there the claim holds only if every comparison agrees, an intersection-union test that is level 5 % with each
comparison at 5 %. A comparison then *agrees* (adjusted p < 5 % the claimed
way), is *reversed* (adjusted p < 5 % the other way), or is neither -- *within seed noise* (better / worse) or
*inconclusive* (comparable / not_worse: the interval reaches past the margin), with the sign of its point estimate.
A cell that failed -- at chance, or a seed that diverged -- counts against the method it belongs to: against a
(``failed``, tallied with the reversals) when a failed, and it never supports the claim when b failed (``b failed``,
tallied with the undecided). A metric without a record, or a record without per-seed values, is ``not judged``
(with its reason, never a silent switch of test); a cell not run at the scale is ``not run``.

**The claim** (A agreements, R reversals + failures, K judged comparisons):

- ``all``: holds when A = K; reversed when R > 0 and A = 0; mixed when both; else within seed noise / inconclusive;
- ``most``: holds when A > K / 2; reversed when R > K / 2; mixed when A > 0 and R > 0; else within noise;
- ``overall``: holds when A > 0, R = 0 and more point estimates point the claimed way than against; reversed in the
  mirror case; mixed when any comparison is significant otherwise -- A > 0 and R > 0, or significant ones one way
  with the estimates not leaning that way (a significant exception is a finding, shown, never outvoted); within
  seed noise / inconclusive only when none is significant.

With no true difference a false "holds" or "reversed" needs a false significant comparison, which Holm keeps below
5 % (``scripts/reproduce.py claims --calibrate`` simulates every claim at its shape and checks it). Below the paper's
scale the same verdicts are a direction check on a reduced budget and are worded so (:data:`CPU_WORDS`).
The paper's own printed numbers (mean ± std over the paper's seeds) are judged by the same rule (Welch from the
summaries) beside ours: where they do not support the claim, our "reversed" is not a failure to reproduce.
"""

from __future__ import annotations

import fnmatch

import numpy as np

from flatbnn.reproduce.stats import (NOISE_ALPHA, SeedStats, TTest, beyond_margin_p, equivalence_p, holm,
                                     inferiority_p, noninferiority_p, seed_difference_test)

DIRECTIONS = ("better", "worse", "comparable", "not_worse")
QUANTIFIERS = ("all", "overall", "most")
# one comparison's outcome
AGREES, REVERSED, FAILED, NOISE, INCONCLUSIVE, B_FAILED, NOT_JUDGED, NOT_RUN = (
    "agrees", "reversed", "failed", "within seed noise", "inconclusive", "b failed", "not judged", "not run")
OUTCOMES = (AGREES, REVERSED, FAILED, NOISE, INCONCLUSIVE, B_FAILED, NOT_JUDGED, NOT_RUN)
# a claim's verdict
VERDICTS = ("holds", "reversed", "mixed", "within seed noise", "inconclusive", "not judged", "not run")
# below the paper's scale: a direction check on a reduced budget, never the paper-scale words
CPU_WORDS = {"holds": "direction agrees", "reversed": "direction opposes", "mixed": "directions mixed",
             "within seed noise": "within seed noise", "inconclusive": "inconclusive", "not judged": "not judged",
             "not run": "not run"}
REQUIRED_KEYS = ("id", "quote", "file", "section", "direction", "axis", "pairs", "metrics", "quantifier")
OPTIONAL_KEYS = ("cells", "note", "quantifier_word", "margins", "margin_reason")
MARGIN_DIRECTIONS = ("comparable", "not_worse")
FAMILY_ADJUST = holm  # the family rule's p-value adjustment (read at call time: the calibration's test swaps it)
DEFAULT_RESOLUTION = {"percent": 0.01}   # else 1e-4: the papers print accuracy to 0.01 %, the rest to 4 digits
PAPER_N_ASSUMED = 3


def resolution(metric_spec: dict | None) -> float:
    """A metric's recording resolution (the paper file's ``resolution:``, else by unit)."""
    spec = metric_spec or {}
    return float(spec.get("resolution") or DEFAULT_RESOLUTION.get(spec.get("unit"), 1e-4))


def problems(claims, axes: list[str], metrics: dict) -> list[str]:
    """What is wrong with a paper file's ``claims:`` (empty = nothing): keys, direction, quantifier, axis, metrics,
    pairs, margins."""
    if claims is None:
        return []
    if not isinstance(claims, list):
        return ["claims: must be a list"]
    out, ids = [], set()
    for i, c in enumerate(claims):
        if not isinstance(c, dict):
            out.append(f"claims[{i}]: must be a mapping")
            continue
        name = f"claim {c.get('id', i)!r}"
        out += [f"{name}: missing key {k!r}" for k in REQUIRED_KEYS if k not in c]
        out += [f"{name}: unknown key {k!r}" for k in c if k not in REQUIRED_KEYS + OPTIONAL_KEYS]
        if c.get("id") in ids:
            out.append(f"{name}: duplicate id")
        ids.add(c.get("id"))
        direction = c.get("direction")
        if direction not in DIRECTIONS:
            out.append(f"{name}: direction {direction!r} is not one of {', '.join(DIRECTIONS)}")
        q = c.get("quantifier")
        if "quantifier" in c and q not in QUANTIFIERS:
            out.append(f"{name}: quantifier {q!r} is not one of {', '.join(QUANTIFIERS)}")
        word = c.get("quantifier_word")
        if q in ("all", "most") and not word:
            out.append(f"{name}: quantifier {q!r} needs quantifier_word, the word of the quote that says so")
        if word and " ".join(str(word).lower().split()) not in " ".join(str(c.get("quote", "")).lower().split()):
            out.append(f"{name}: quantifier_word {word!r} is not in the quote")
        if "axis" in c and c["axis"] not in axes:
            out.append(f"{name}: axis {c['axis']!r} is not one of the cell axes {axes}")
        for m in c.get("metrics") or []:
            if m not in metrics:
                out.append(f"{name}: metric {m!r} is not one of the paper file's metrics {sorted(metrics)}")
            elif direction != "comparable" and (metrics[m] or {}).get("better") not in ("higher", "lower"):
                out.append(f"{name}: metric {m!r} has no better: higher|lower to judge {direction!r} by")
        if not c.get("metrics"):
            out.append(f"{name}: metrics: must name at least one metric")
        out += _margin_problems(name, c)
        pairs = c.get("pairs")
        if not pairs or not all(isinstance(p, list) and len(p) == 2 and p[0] != p[1] for p in pairs):
            out.append(f"{name}: pairs: must be a list of [a, b] value pairs, a != b")
    return out


def _margin_problems(name: str, c: dict) -> list[str]:
    margins = c.get("margins")
    if c.get("direction") not in MARGIN_DIRECTIONS:
        return [f"{name}: margins are for comparable / not_worse claims"] if margins else []
    if not isinstance(margins, dict):
        return [f"{name}: a {c.get('direction')} claim needs margins: {{metric: {{abs: x}} or {{rel: r}}}} "
                "and margin_reason (docs/reproduce.md, Claims)"]
    out = [f"{name}: no margin for metric {m!r}" for m in c.get("metrics") or [] if m not in margins]
    for m, spec in margins.items():
        if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in ("abs", "rel")
                and isinstance(next(iter(spec.values())), (int, float)) and next(iter(spec.values())) > 0):
            out.append(f"{name}: margin of {m!r} must be {{abs: x}} or {{rel: r}} with a positive number")
    if not c.get("margin_reason"):
        out.append(f"{name}: margins need margin_reason (why that size)")
    return out


def expand(claim: dict, cell_ids: list[str], axes: list[str]) -> list[tuple[str, str]]:
    """The (a cell, b cell) pairs a claim compares among ``cell_ids`` (ids over ``axes``): every cell whose
    ``axis`` value is a pair's a and that matches ``cells``, with the same cell at b -- when that one exists too."""
    k = axes.index(claim["axis"])
    known = set(cell_ids)
    globs = claim.get("cells") or ["*"]
    out = []
    for a_value, b_value in claim["pairs"]:
        for cid in cell_ids:
            parts = cid.split("/")
            if parts[k] != a_value or not any(fnmatch.fnmatchcase(cid, g) for g in globs):
                continue
            parts[k] = b_value
            if (partner := "/".join(parts)) in known:
                out.append((cid, partner))
    return out


def margin(claim: dict, metric: str, b_mean: float | None) -> float | None:
    """The claim's margin on ``metric`` in the metric's unit (a relative one taken of |b's mean|); None without."""
    spec = (claim.get("margins") or {}).get(metric)
    if not spec:
        return None
    if "abs" in spec:
        return float(spec["abs"])
    return None if b_mean is None else float(spec["rel"]) * abs(float(b_mean))


def margin_text(claim: dict, metric: str) -> str:
    spec = (claim.get("margins") or {}).get(metric) or {}
    return f"±{spec['abs']:g}" if "abs" in spec else f"±{100 * spec['rel']:g} % of b" if "rel" in spec else ""


# ------------------------------------------------------------------------------------------ one comparison
def _unfinished(rec: dict, jobs: dict) -> str | None:
    """Why ``rec``'s cell is not finished at this scale (not part of it, blocked, jobs left); None = every job done."""
    states = jobs.get(rec.get("our_cell", rec["cell"])) or {}
    if not states or any(st != "done" for st in states.values()):
        return f"{rec['cell']}: {rec.get('state') or 'no jobs'}"
    return None


def _failure(rec: dict) -> str | None:
    """Why our cell failed (at chance; a seed whose value is NaN / inf: diverged), or None."""
    if rec.get("at_chance"):
        return f"{rec['cell']} at chance"
    bad = int(rec.get("ours_nonfinite") or 0) - int(rec.get("ours_missing") or 0)
    if bad > 0:
        n = int(rec.get("ours_n") or 0) + int(rec.get("ours_nonfinite") or 0)
        return f"{rec['cell']} diverged in {bad} of {n} seeds ({rec['metric']} not finite)"
    return None


def _not_judged_ours(rec: dict) -> str | None:
    n = int(rec.get("ours_n") or 0)
    if n == 0 and int(rec.get("ours_missing") or 0) > 0:
        return f"no {rec['metric']} recorded for {rec['cell']}"
    if n >= 2 and not rec.get("ours_by_seed"):
        return f"{rec['cell']}: per-seed values missing from the record"
    return None


def ours_test(a: dict, b: dict, paired: bool, res: float):
    """(SeedTest, None) for our two records, or (None, (outcome, detail)) when no test applies."""
    for rec in (a, b):
        if why := _not_judged_ours(rec):
            return None, (NOT_JUDGED, why)
    test = seed_difference_test(a.get("ours_by_seed") or {}, b.get("ours_by_seed") or {},
                                *(SeedStats(r.get("ours_n") or 0, r.get("ours_nonfinite") or 0, r.get("ours_mean"),
                                            r.get("ours_std")) for r in (a, b)), paired=paired, resolution=res)
    if test is None:
        what = "paired seeds" if paired else "finite seeds a side"
        return None, (NOT_RUN, f"fewer than 2 {what} ({a.get('ours_n')} and {b.get('ours_n')}): no test")
    return test, None


def paper_test(a: dict, b: dict, paper_n: int, res: float):
    """Welch's test on the paper's printed mean ± std (n = the paper's seeds), or (None, (outcome, detail))."""
    for rec in (a, b):
        if rec.get("paper_mean") is None:
            return None, (NOT_RUN, f"the paper prints no {rec['metric']} for {rec['cell']}")
        if rec.get("paper_std") is None:
            return None, (NOT_JUDGED, f"the paper prints no spread for {rec['cell']} {rec['metric']}")
    sides = [SeedStats(paper_n, 0, float(r["paper_mean"]), float(r["paper_std"])) for r in (a, b)]
    return seed_difference_test({}, {}, *sides, paired=False, resolution=res), None


def p_values(direction: str, t: TTest, sign: float, m):
    """(p of agreement, p of reversal, sign of the point estimate: +1 the claimed way, -1 against, 0 neither) of one
    tested comparison (or of arrays of them: the calibration). ``sign`` = +1 where higher is better; ``m`` the
    margin (comparable / not_worse)."""
    good = sign * np.asarray(t.diff, dtype=float)  # > 0: a better than b
    if direction in ("better", "worse"):
        toward = np.sign(good if direction == "better" else -good)
        p = np.asarray(t.p, dtype=float)
        out = np.where(toward > 0, p, 1.0), np.where(toward < 0, p, 1.0), toward
    elif direction == "comparable":
        out = (np.asarray(equivalence_p(t, m)), np.asarray(beyond_margin_p(t, m)),
               np.where(np.abs(np.asarray(t.diff)) < m, 1.0, -1.0))
    else:
        out = (np.asarray(noninferiority_p(t, m, sign)), np.asarray(inferiority_p(t, m, sign)),
               np.where(good > -m, 1.0, -1.0))
    if np.ndim(out[0]) == 0:
        return float(out[0]), float(out[1]), int(out[2])
    return out


def judge(direction: str, a: dict | None, b: dict | None, jobs: dict, *, paired: bool = False,
          res: float = 1e-4, claim: dict | None = None, source: str = "ours", paper_n: int = PAPER_N_ASSUMED) -> dict:
    """One comparison's evidence before the family's adjustment: the test and its raw p-values of agreement and
    reversal, or an outcome that needs none (not run, not judged, failed, b failed). ``source``: our runs
    (``ours_*`` of the comparison-table records, compare.py) or the paper's printed numbers (``paper_*``)."""
    if a is None or b is None:
        return {"outcome": NOT_RUN, "detail": "not at this scale"}
    if source == "ours":
        for rec in (a, b):
            if why := _unfinished(rec, jobs):
                return {"outcome": NOT_RUN, "detail": why}
        fa, fb = _failure(a), _failure(b)
        if fa or (fb and direction == "comparable"):
            return {"outcome": FAILED, "detail": fa or fb}
        test, none = ours_test(a, b, paired, res)
    else:
        fb, (test, none) = None, paper_test(a, b, paper_n, res)
    if none:
        return {"outcome": none[0], "detail": none[1]}
    sign = -1.0 if a.get("better") == "lower" else 1.0
    mean_b = b.get("ours_mean") if source == "ours" else b.get("paper_mean")
    m = margin(claim or {}, a["metric"], mean_b) if direction in MARGIN_DIRECTIONS else None
    if direction in MARGIN_DIRECTIONS and m is None:
        return {"outcome": NOT_JUDGED, "detail": f"no margin for {a['metric']}"}
    p_agree, p_rev, toward = p_values(direction, test.result, sign, m)
    t = test.result
    out = {"test": test.name, "n": test.n, "diff": t.diff, "se": t.se, "df": t.df, "p": t.p,
           "p_agree": p_agree, "p_reverse": p_rev, "toward": toward, "margin": m}
    if fb:  # b failed: shown, never support for the claim
        out.update(outcome=B_FAILED, detail=fb, p_agree=1.0)
    return out


def adjust_family(comparisons: list[dict], alpha: float = NOISE_ALPHA, adjust=None,
                  quantifier: str = "overall") -> None:
    """Adjust the tested comparisons' p-values and set each one's outcome (in place). Reversals: Holm over the
    family (a claim is reversed by ANY significant reversal, a union: its error needs the adjustment). Agreements:
    Holm too, except under ``all``, where the claim holds only when EVERY comparison agrees -- an intersection-union
    test, level alpha with each comparison at alpha (adjusting it as well would leave an ``all`` claim no power).
    ``adjust``: another adjustment (default :data:`FAMILY_ADJUST`, Holm)."""
    adjust = adjust or FAMILY_ADJUST
    tested = [c for c in comparisons if "p_agree" in c]
    if not tested:
        return
    agree_adj = [c["p_agree"] for c in tested] if quantifier == "all" else adjust([c["p_agree"] for c in tested])
    rev_adj = adjust([c["p_reverse"] for c in tested])
    for c, pa, pr in zip(tested, agree_adj, rev_adj):
        c["p_agree_adj"], c["p_reverse_adj"] = pa, pr
        if c.get("outcome") == B_FAILED:
            continue
        weak = NOISE if c["direction"] in ("better", "worse") else INCONCLUSIVE
        c["outcome"] = AGREES if pa < alpha else REVERSED if pr < alpha else weak


def claim_verdict(quantifier: str, comparisons: list[dict]) -> tuple[str, dict]:
    """A claim's verdict from its adjusted comparisons (module docstring) and the tally behind it."""
    counts = {o: sum(c["outcome"] == o for c in comparisons) for o in OUTCOMES}
    agree, bad = counts[AGREES], counts[REVERSED] + counts[FAILED]
    judged = [c for c in comparisons if c["outcome"] not in (NOT_JUDGED, NOT_RUN)]
    k = len(judged)
    toward = sum(c.get("toward", -1 if c["outcome"] == FAILED else 0) > 0 for c in judged)
    against = sum(c.get("toward", -1 if c["outcome"] == FAILED else 0) < 0 for c in judged)
    tally = {"judged": k, "agree": agree, "reverse": bad, "toward": toward, "against": against, **counts}
    if not k:
        return ("not judged" if counts[NOT_JUDGED] else "not run"), tally
    weak = NOISE if any(c["direction"] in ("better", "worse") for c in judged) else INCONCLUSIVE
    if quantifier == "all":
        verdict = "holds" if agree == k else "mixed" if agree and bad else "reversed" if bad else weak
    elif quantifier == "most":
        verdict = ("holds" if agree > k / 2 else "reversed" if bad > k / 2 else "mixed" if agree and bad else weak)
    else:  # overall: no significant exception either way, and the estimates lean the claimed way
        if agree and not bad and toward > against:
            verdict = "holds"
        elif bad and not agree and against > toward:
            verdict = "reversed"
        else:   # a significant comparison either way is a finding: never read as noise (nor outvoted)
            verdict = "mixed" if agree or bad else weak
    return verdict, tally


# ------------------------------------------------------------------------------------------ a row's claims
def cell_axes(row, paper: dict) -> tuple[list[str], list[str]]:
    """The axes and every cell id a row's claims are written over: the comparison table's naming -- the paper's
    cells where the spec joins them onto ours (``compare.join``, e.g. FlatBNN T5's ``noise/f_swag``), else the spec's
    cells and the paper's. With one axis a cell id is its value, so the claims' own values name cells too (a script
    row without cells, e.g. flatbnn_sharpness)."""
    join = (row.compare or {}).get("join")
    if join:
        axes, cells = list(join["paper_axes"]), [c["cell"] for c in paper.get("cells") or []]
    else:
        axes = list(row.axes or paper.get("axes") or [])
        cells = list(dict.fromkeys(list(row.cell_ids()) + list(row.cells or [])
                                   + [c["cell"] for c in paper.get("cells") or []]))
    if len(axes) == 1:
        cells += [v for c in paper.get("claims") or [] for pair in c["pairs"] for v in pair if v not in cells]
    return axes, list(dict.fromkeys(cells))


def judge_claim(claim: dict, records: list[dict], jobs: dict, cell_ids: list[str], axes: list[str], *,
                paired: bool = False, metrics: dict | None = None, source: str = "ours",
                paper_n: int = PAPER_N_ASSUMED, adjust=None) -> dict:
    """One claim judged on the comparison's records (module docstring): its comparisons, verdict and tally."""
    by = {(r["cell"], r["metric"]): r for r in records}
    comparisons = []
    pairs = expand(claim, cell_ids, axes) if claim["axis"] in axes else []
    for a_cell, b_cell in pairs:
        for metric in claim["metrics"]:
            a, b = by.get((a_cell, metric)), by.get((b_cell, metric))
            res = resolution((metrics or {}).get(metric) or {"unit": (a or b or {}).get("unit")})
            comparisons.append({"a": a_cell, "b": b_cell, "metric": metric, "direction": claim["direction"],
                                "unit": (a or b or {}).get("unit"),
                                "ours": [(a or {}).get("ours_mean"), (b or {}).get("ours_mean")],
                                "paper": [(a or {}).get("paper_mean"), (b or {}).get("paper_mean")],
                                **judge(claim["direction"], a, b, jobs, paired=paired, res=res, claim=claim,
                                        source=source, paper_n=paper_n)})
    adjust_family(comparisons, adjust=adjust, quantifier=claim.get("quantifier", "overall"))
    verdict, tally = claim_verdict(claim.get("quantifier", "overall"), comparisons)
    tests = sorted({f"{c['test']}, n={c['n']}" for c in comparisons if c.get("test")})
    return {**{k: claim[k] for k in REQUIRED_KEYS + OPTIONAL_KEYS if k in claim},
            "quantifier": claim.get("quantifier", "overall"), "verdict": verdict, "tally": tally, "tests": tests,
            "design": ("Welch t on the printed mean ± std" if source == "paper"
                       else "paired t over seeds (one trained run per seed)" if paired else "Welch t"),
            "comparisons": comparisons}


def evaluate(claims: list[dict] | None, records: list[dict], jobs: dict, cell_ids: list[str], axes: list[str], *,
             paired: bool = False, metrics: dict | None = None, paper_n: int | None = None) -> list[dict]:
    """Every claim judged on our runs, with the paper's own numbers judged by the same rule beside (``paper``:
    absent where the paper prints none of the claim's cells). ``paper_n``: the paper's seeds (None: assumed 3)."""
    out = []
    for claim in claims or []:
        ours = judge_claim(claim, records, jobs, cell_ids, axes, paired=paired, metrics=metrics)
        theirs = judge_claim(claim, records, jobs, cell_ids, axes, metrics=metrics, source="paper",
                             paper_n=paper_n or PAPER_N_ASSUMED)
        if theirs["verdict"] != "not run":
            theirs["paper_n"] = paper_n or PAPER_N_ASSUMED
            theirs["paper_n_assumed"] = paper_n is None
            ours["paper"] = {k: theirs[k] for k in ("verdict", "tally", "design", "paper_n", "paper_n_assumed",
                                                     "comparisons")}
        out.append(ours)
    return out


# ------------------------------------------------------------------------------------------ words
def verdict_word(verdict: str, scale: str) -> str:
    return verdict if scale == "paper" else CPU_WORDS.get(verdict, verdict)


def tally_text(c: dict) -> str:
    """``2 agree, 1 reversed (adjusted); 5 within seed noise, 4 of 5 the claimed way; 3 not run``."""
    t = c.get("tally") or {}
    if not t:
        return ""
    parts = [f"{t['agree']} agree" if t.get("agree") else "0 agree",
             f"{t.get('reversed', 0)} reversed" + (f" + {t['failed']} failed" if t.get("failed") else "")
             + " (Holm-adjusted, 5 %)"]
    weak = t.get(NOISE, 0) + t.get(INCONCLUSIVE, 0) + t.get(B_FAILED, 0)
    if weak:
        rest = [c for c in c.get("comparisons", []) if c["outcome"] in (NOISE, INCONCLUSIVE, B_FAILED)]
        toward = sum(x.get("toward", 0) > 0 for x in rest)
        what = ", ".join(f"{n} {w}" for w, n in ((NOISE, t.get(NOISE, 0)), (INCONCLUSIVE, t.get(INCONCLUSIVE, 0)),
                                               (B_FAILED, t.get(B_FAILED, 0))) if n)
        parts.append(f"{what}: {toward} of {weak} the claimed way")
    for o in (NOT_JUDGED, NOT_RUN):
        if t.get(o):
            parts.append(f"{t[o]} {o}")
    return "; ".join(parts)


def _on_part(c: dict, what: str) -> str:
    """`` on the 6 of 144 comparisons run`` where some of the claim's comparisons have no data (the rest of the
    claim may still reverse it: a verdict on the part, not on the claim), else ''."""
    missing, total = (c.get("tally") or {}).get(NOT_RUN, 0), len(c.get("comparisons") or [])
    if c.get("verdict") in ("not judged", "not run") or not missing or total <= missing:
        return ""
    return f" on the {total - missing} of {total} comparisons {what}"


def verdict_line(c: dict, scale: str = "paper") -> str:
    """``**holds** (overall; 3 agree, 0 reversed (Holm-adjusted, 5 %); ...; Welch t, n=3+3)``: a claim's verdict as
    STATUS.md and the comparison page print it; below paper scale in the direction-check words. A claim with some
    comparisons not run: ``**holds on the 6 of 144 comparisons run** (...)``."""
    if not c.get("comparisons"):
        return "not run (no cells of the row to compare)"
    word = verdict_word(c["verdict"], scale)
    if c["verdict"] == "not run":
        return f"not run (0 of {len(c['comparisons'])} comparisons)"
    tests = "; ".join(c.get("tests") or [])
    return (f"**{word}{_on_part(c, 'run')}** ({c.get('quantifier', 'overall')}; {tally_text(c)}"
            + (f"; {tests}" if tests else "") + ")")


def paper_line(c: dict) -> str:
    """The verdict of the paper's own numbers, or why there is none."""
    p = c.get("paper")
    if not p:
        return "– (the paper prints none of these cells)"
    n = f"n = {p['paper_n']}" + (" assumed" if p.get("paper_n_assumed") else "")
    return f"**{p['verdict']}{_on_part(p, 'it prints')}** ({tally_text(p)}; {n})"


def describe(c: dict) -> str:
    """``a better than b on accuracy, nll (axis method; cells mnist/*; all)``: what a claim compares."""
    word = {"better": "better than", "worse": "worse than", "comparable": "comparable to",
            "not_worse": "not worse than"}[c["direction"]]
    pairs = "; ".join(f"`{a}` {word} `{b}`" for a, b in c["pairs"])
    where = f"; cells {', '.join(c['cells'])}" if c.get("cells") else ""
    q = c.get("quantifier", "overall")
    qw = f" (\"{c['quantifier_word']}\")" if c.get("quantifier_word") else " (no quantifier word: read as overall)"
    margins = ""
    if c.get("margins"):
        margins = "; margins " + ", ".join(f"{m} {margin_text(c, m)}" for m in c["metrics"]) + \
            f" ({c.get('margin_reason', '')})"
    return f"{pairs} on {', '.join(c['metrics'])} (axis {c['axis']}{where}); quantifier {q}{qw}{margins}"


__all__ = ["CPU_WORDS", "DIRECTIONS", "OUTCOMES", "QUANTIFIERS", "VERDICTS", "adjust_family", "cell_axes",
           "claim_verdict", "describe", "evaluate", "expand", "judge", "judge_claim", "margin", "paper_line",
           "problems", "resolution", "tally_text", "verdict_line", "verdict_word"]
