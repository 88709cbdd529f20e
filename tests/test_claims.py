"""The papers' claims as data (results/paper/<row>.yaml ``claims:``): every quote is in its paper, and the verdict
of a claim at a scale (flatbnn/reproduce/claims.py) on synthetic seed values -- holds / reversed / within seed noise /
not run, for each direction."""

import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml

from flatbnn.reproduce import claims, compare, compare_markdown, spec, stats, status

REPO = Path(__file__).resolve().parents[1]
# the papers' text lives beside the repository (../shared/papers, as in CI); FLATBNN_PAPERS points elsewhere
PAPERS = Path(os.environ.get("FLATBNN_PAPERS", REPO.parent / "shared" / "papers"))


def _words(text: str) -> str:
    return " ".join(text.split())


def _all_claims():
    for p in sorted(spec.PAPER_DIR.glob("*.yaml")):
        for c in (yaml.safe_load(p.read_text()) or {}).get("claims") or []:
            yield p.stem, c


def test_every_claims_quote_is_in_its_paper():
    if not PAPERS.is_dir():
        if os.environ.get("FLATBNN_REQUIRE_REAL_DATA") == "1":
            pytest.fail(f"papers required (FLATBNN_REQUIRE_REAL_DATA=1) but {PAPERS} is absent; set FLATBNN_PAPERS")
        pytest.skip(f"{PAPERS} not found (../shared beside the repository); set FLATBNN_PAPERS")
    found = list(_all_claims())
    assert len(found) >= 20  # every row whose text states a comparison has its claims
    missing = []
    for row, c in found:
        text = _words((PAPERS / c["file"]).read_text())
        if _words(c["quote"]) not in text:
            missing.append(f"{row}/{c['id']}")
    assert not missing, f"quotes not found word for word in their paper: {missing}"


def test_the_rows_the_issue_names_have_claims():
    rows = {row for row, _ in _all_claims()}
    assert {"bsam_t1", "bsam_t3", "bsam_t6", "hwa_fig1", "flatbnn_t1", "flatbnn_t2", "flatbnn_sharpness",
            "fsam_t1", "fsam_t4", "vsam_t3"} <= rows
    by = {(row, c["id"]): c for row, c in _all_claims()}
    t3 = by[("bsam_t3", "noisy_linearization_helps")]
    assert t3["quote"] == "The following Table 3 confirms that the noisy linearization helps in practice."
    assert (t3["direction"], t3["pairs"]) == ("better", [["bsam", "bsam_no_noise"]])
    assert by[("bsam_t6", "bsam_competitive")]["direction"] == "not_worse"
    assert by[("hwa_fig1", "hwa_sgld_comparable_mnist")]["direction"] == "comparable"
    assert spec.check_all() == []  # every claim names metrics of its paper file and pairs of existing cells


def test_a_malformed_claim_is_refused_in_one_line(tmp_path):
    p = tmp_path / "x.yaml"
    base = {"row": "x", "paper": "p", "cells": [], "axes": ["method"],
            "metrics": {"accuracy": {"unit": "percent", "better": "higher"}}}
    good = {"id": "a", "quote": "q for all of them", "file": "f.txt", "section": "1", "direction": "better",
            "quantifier": "overall", "axis": "method", "pairs": [["fsam", "sam"]], "metrics": ["accuracy"]}
    p.write_text(yaml.safe_dump({**base, "claims": [good]}))
    assert spec.load_paper_data(p)["claims"][0]["id"] == "a"
    margins = {"margins": {"accuracy": {"abs": 0.5}}, "margin_reason": "why"}
    p.write_text(yaml.safe_dump({**base, "claims": [{**good, "direction": "comparable", **margins}]}))
    assert spec.load_paper_data(p)["claims"][0]["margins"] == {"accuracy": {"abs": 0.5}}
    for bad, says in [({"direction": "superior"}, "direction"), ({"metrics": ["nll"]}, "metric 'nll'"),
                      ({"axis": "model"}, "axis 'model'"), ({"pairs": [["sam", "sam"]]}, "pairs"),
                      ({"quote": None, "typo": 1}, "unknown key 'typo'"),
                      ({"quantifier": "always"}, "quantifier 'always'"),
                      ({"quantifier": "all"}, "needs quantifier_word"),
                      ({"quantifier": "all", "quantifier_word": "every"}, "quantifier_word 'every' is not in the quote"),
                      ({"direction": "comparable"}, "needs margins"),
                      ({"direction": "not_worse", "margins": {"accuracy": {"abs": -1}}, "margin_reason": "r"},
                       "positive number"),
                      ({"direction": "comparable", "margins": {"accuracy": {"abs": 1}}}, "margin_reason"),
                      ({**margins}, "margins are for comparable / not_worse")]:
        claim = {k: v for k, v in {**good, **bad}.items() if v is not None or k != "quote"}
        if "quote" in bad:
            claim["quote"] = None
        p.write_text(yaml.safe_dump({**base, "claims": [claim]}))
        with pytest.raises(spec.SpecError, match=re.escape(says)):
            spec.load_paper_data(p)
    p.write_text(yaml.safe_dump({**base, "claims": [{k: v for k, v in good.items() if k != "quantifier"}]}))
    with pytest.raises(spec.SpecError, match="missing key 'quantifier'"):
        spec.load_paper_data(p)


def rec(cell, by_seed, better="higher", metric="accuracy", **extra):
    """A comparison-table record (compare.py's) of one cell: its values by seed (None = not recorded)."""
    vals = list(by_seed.values())
    st = compare._stats(vals)
    return {"cell": cell, "our_cell": cell, "metric": metric, "unit": "percent", "better": better,
            "paper_mean": None, "ours_by_seed": {k: v for k, v in by_seed.items() if stats.is_finite(v)},
            **{f"ours_{k}": v for k, v in st.items()}, "state": "done", **extra}


JOBS = {c: {"0": "done", "1": "done", "2": "done"} for c in ("a", "b")}
# a - b = (0.9, 1.1, 1.0): Welch over (60, 62, 64) vs (59.1, 60.9, 63.0) is within noise (sd 2 a side), the paired
# test beyond it (sd of the differences 0.1)
A = {"0": 60.0, "1": 62.0, "2": 64.0}
B = {"0": 59.1, "1": 60.9, "2": 63.0}
FAR = {"0": 50.0, "1": 51.0, "2": 52.0}      # 10 below A: beyond noise either way
NEAR = {"0": 60.1, "1": 61.9, "2": 63.9}     # 0.03 below A


def one(direction, a, b, better="higher", paired=False, margin=None, **kw):
    """One comparison judged as a one-comparison claim: (outcome, the comparison)."""
    claim = {"direction": direction, "metrics": ["accuracy"], "margins": {"accuracy": {"abs": margin}} if margin else {}}
    c = {"direction": direction, **claims.judge(direction, rec("a", a, better, **kw.get("ka", {})),
                                                rec("b", b, better, **kw.get("kb", {})), JOBS, paired=paired,
                                                res=0.01, claim=claim)}
    claims.adjust_family([c])
    return c["outcome"], c


@pytest.mark.parametrize("direction,a,b,better,paired,outcome", [
    ("better", A, FAR, "higher", False, "agrees"),
    ("better", FAR, A, "higher", False, "reversed"),
    ("better", A, B, "higher", False, "within seed noise"),   # Welch: separately trained cells
    ("better", A, B, "higher", True, "agrees"),               # paired: the same trained run per seed
    ("better", A, FAR, "lower", False, "reversed"),          # a lower-is-better metric: a's larger value is worse
    ("worse", FAR, A, "higher", False, "agrees"),
    ("worse", A, FAR, "higher", False, "reversed"),
])
def test_a_better_or_worse_comparison_by_the_rows_declared_test(direction, a, b, better, paired, outcome):
    got, c = one(direction, a, b, better, paired)
    assert got == outcome
    assert c["test"] == ("paired t" if paired else "Welch t") and c["n"] == ("3" if paired else "3+3")
    assert c["diff"] == pytest.approx(sum(a.values()) / 3 - sum(b.values()) / 3)


def test_comparable_needs_equivalence_within_the_margin_not_a_failure_to_reject():
    # 0.03 apart with sd 2: no difference detectable, but the interval is wider than a 0.5 margin -> inconclusive
    assert one("comparable", A, NEAR, margin=0.5)[0] == "inconclusive"
    # the same pair, paired (sd of the differences ~0.03): equivalence within 0.5 shown
    assert one("comparable", A, NEAR, paired=True, margin=0.5)[0] == "agrees"
    # 10 apart, margin 0.5: a difference beyond the margin shown -> reversed
    assert one("comparable", A, FAR, margin=0.5)[0] == "reversed"
    # not worse by 1: a far better -> agrees; a far worse -> reversed; close but noisy -> inconclusive
    assert one("not_worse", A, FAR, margin=1.0)[0] == "agrees"
    assert one("not_worse", FAR, A, margin=1.0)[0] == "reversed"
    assert one("not_worse", A, NEAR, margin=1.0)[0] == "inconclusive"


def test_tost_and_non_inferiority_agree_with_scipy_on_fixed_numbers():
    """The margin tests against a hand computation with scipy's own t-tests on shifted samples."""
    from scipy import stats as sps
    a, b, m = [61.2, 62.0, 63.1, 62.4], [61.0, 61.5, 62.9], 1.5
    t = stats.welch_ttest(stats.seed_stats(a), stats.seed_stats(b))
    lo = sps.ttest_ind([x + m for x in a], b, equal_var=False, alternative="greater").pvalue   # H0: d <= -m
    hi = sps.ttest_ind([x - m for x in a], b, equal_var=False, alternative="less").pvalue      # H0: d >= +m
    assert stats.equivalence_p(t, m) == pytest.approx(max(lo, hi), rel=1e-10)
    assert stats.noninferiority_p(t, m) == pytest.approx(lo, rel=1e-10)
    assert stats.noninferiority_p(t, m, sign=-1.0) == pytest.approx(
        sps.ttest_ind([x - m for x in a], b, equal_var=False, alternative="less").pvalue, rel=1e-10)
    assert stats.inferiority_p(t, m) == pytest.approx(
        sps.ttest_ind([x + m for x in a], b, equal_var=False, alternative="less").pvalue, rel=1e-10)
    beyond = 2 * min(sps.ttest_ind([x - m for x in a], b, equal_var=False, alternative="greater").pvalue,
                     sps.ttest_ind([x + m for x in a], b, equal_var=False, alternative="less").pvalue)
    assert stats.beyond_margin_p(t, m) == pytest.approx(min(1.0, beyond), rel=1e-10)
    # paired, as scipy's ttest_rel of the shifted differences
    x, y = [1.0, 1.4, 0.9, 1.3], [0.8, 1.1, 0.95, 1.0]
    tp = stats.paired_difference(x, y)
    assert stats.equivalence_p(tp, 0.5) == pytest.approx(max(
        sps.ttest_rel([u + 0.5 for u in x], y, alternative="greater").pvalue,
        sps.ttest_rel([u - 0.5 for u in x], y, alternative="less").pvalue), rel=1e-10)
    # Holm by hand: sorted 0.01, 0.03, 0.04, 0.2 -> 0.04, 0.09, max(0.08, 0.09), 0.2
    assert stats.holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])


def test_holm_keeps_one_noisy_comparison_of_twenty_from_reversing_a_claim():
    """Today's rule reversed a claim on any single p < 0.05; in a family of 20 a raw p of 0.02 is noise."""
    def comp(p, toward):
        return {"direction": "better", "p_agree": p if toward > 0 else 1.0, "p_reverse": p if toward < 0 else 1.0,
                "toward": toward}
    comps = [comp(0.02, -1)] + [comp(0.5, 1) for _ in range(19)]
    claims.adjust_family(comps)
    assert comps[0]["outcome"] == "within seed noise" and comps[0]["p_reverse_adj"] == pytest.approx(0.4)
    assert claims.claim_verdict("overall", comps)[0] == "within seed noise"
    comps = [comp(0.001, -1)] + [comp(0.5, 1) for _ in range(19)]   # 0.02 after Holm: a real reversal
    claims.adjust_family(comps)
    assert comps[0]["outcome"] == "reversed"
    assert claims.claim_verdict("overall", comps)[0] == "mixed"   # a real exception, never outvoted by 19 nulls


def test_overall_never_calls_significant_comparisons_seed_noise():
    """The grid's SGVB-LRT shape: NLL twice within noise the claimed way, ECE twice reversed after Holm, estimates
    tied 2 : 2. Two significant reversals are a finding ("mixed"), not "within seed noise"; so is an agreement
    outvoted by estimates the other way. Only a family with nothing significant is seed noise."""
    def comp(outcome, toward):
        return {"direction": "better", "outcome": outcome, "toward": toward}
    tied = [comp("within seed noise", 1), comp("within seed noise", 1), comp("reversed", -1), comp("reversed", -1)]
    assert claims.claim_verdict("overall", tied)[0] == "mixed"
    outvoted = [comp("agrees", 1), comp("within seed noise", -1), comp("within seed noise", -1)]
    assert claims.claim_verdict("overall", outvoted)[0] == "mixed"
    assert claims.claim_verdict("overall", [comp("reversed", -1), comp("within seed noise", -1)])[0] == "reversed"
    assert claims.claim_verdict("overall", [comp("agrees", 1), comp("within seed noise", 1)])[0] == "holds"
    assert claims.claim_verdict("overall", [comp("within seed noise", 1), comp("within seed noise", -1)])[0] \
        == "within seed noise"


def test_an_all_claim_tests_its_agreements_as_an_intersection_union():
    """'all' holds only if every comparison agrees: each at 5 % is already a 5 % test of the conjunction, so its
    agreements are not Holm-adjusted (which would leave it no power); its reversals are (any one reverses)."""
    comps = [{"direction": "better", "p_agree": 0.03, "p_reverse": 1.0, "toward": 1} for _ in range(8)]
    claims.adjust_family(comps, quantifier="all")
    assert all(c["outcome"] == "agrees" for c in comps) and claims.claim_verdict("all", comps)[0] == "holds"
    claims.adjust_family(comps, quantifier="overall")   # overall: the same p-values are Holm-adjusted (x 8)
    assert all(c["outcome"] == "within seed noise" for c in comps)
    rev = [{"direction": "better", "p_agree": 1.0, "p_reverse": 0.03, "toward": -1}] + comps[1:]
    claims.adjust_family(rev, quantifier="all")
    assert rev[0]["outcome"] == "within seed noise"      # 0.03 x 8 after Holm: no reversal


def _comps(agree=0, reverse=0, noise_toward=0, noise_against=0, failed=0, direction="better"):
    out = ([{"outcome": "agrees", "toward": 1}] * agree + [{"outcome": "reversed", "toward": -1}] * reverse
           + [{"outcome": "within seed noise", "toward": 1}] * noise_toward
           + [{"outcome": "within seed noise", "toward": -1}] * noise_against + [{"outcome": "failed"}] * failed)
    return [{**c, "direction": direction} for c in out]


@pytest.mark.parametrize("quantifier,counts,verdict", [
    ("all", dict(agree=4), "holds"),
    ("all", dict(agree=3, noise_toward=1), "within seed noise"),
    ("all", dict(agree=3, reverse=1), "mixed"),
    ("all", dict(reverse=1, noise_toward=3), "reversed"),
    ("most", dict(agree=3, reverse=1), "holds"),
    ("most", dict(agree=2, reverse=1, noise_toward=1), "mixed"),
    ("most", dict(agree=1, noise_toward=3), "within seed noise"),
    ("most", dict(reverse=3, noise_toward=1), "reversed"),
    ("overall", dict(agree=1, noise_toward=3), "holds"),
    ("overall", dict(agree=1, noise_against=3), "mixed"),   # one significant win, most estimates the other way: a finding, not noise
    ("overall", dict(agree=3, reverse=1, noise_toward=2), "mixed"),     # a significant exception is never outvoted
    ("overall", dict(agree=1, reverse=1, noise_toward=2), "mixed"),
    ("overall", dict(reverse=1, noise_against=2), "reversed"),
    ("overall", dict(failed=1, noise_against=2), "reversed"),           # a failed cell counts against its method
    ("overall", dict(noise_toward=4), "within seed noise"),
])
def test_a_claims_verdict_follows_its_quantifier(quantifier, counts, verdict):
    assert claims.claim_verdict(quantifier, _comps(**counts))[0] == verdict


def test_failed_cells_count_against_their_method_and_missing_numbers_are_not_judged():
    # a at chance: counts against a
    assert one("better", A, FAR, ka={"at_chance": True})[0] == "failed"
    # b at chance: shown, never support for the claim
    out, c = one("better", A, FAR, kb={"at_chance": True})
    assert out == "b failed" and claims.claim_verdict("overall", [c])[0] == "within seed noise"
    # a seed of a diverged (NaN): counts against a
    out, c = one("better", {**A, "2": float("nan")}, FAR)
    assert out == "failed" and "diverged in 1 of 3 seeds" in c["detail"]
    # a metric not recorded: its own reason, not 'fewer than 2 seeds'
    out, c = one("better", {"0": None, "1": None, "2": None}, FAR)
    assert out == "not judged" and c["detail"] == "no accuracy recorded for a"
    # a record without per-seed values (an old comparison): not judged, never another test in silence
    a = {**rec("a", A), "ours_by_seed": {}}
    c = claims.judge("better", a, rec("b", FAR), JOBS)
    assert c["outcome"] == "not judged" and "per-seed values missing" in c["detail"]
    # unfinished or absent cells: not run
    assert claims.judge("better", rec("a", A), rec("b", B), {"a": JOBS["a"], "b": {**JOBS["b"], "2": "missing"}})[
        "outcome"] == "not run"
    assert claims.judge("better", rec("a", A), None, JOBS)["outcome"] == "not run"


def test_zero_spread_gives_a_minimum_detectable_difference_not_p_zero():
    same_a, same_b = {"0": 70.0, "1": 70.0, "2": 70.0}, {"0": 69.99, "1": 69.99, "2": 69.99}
    out, c = one("better", same_a, same_b)          # 0.01 apart, both sides recorded to 0.01, no spread
    assert 0.0 < c["p"] and out == "within seed noise"   # one unit of the last digit is not a result
    out, c = one("better", same_a, {k: v - 0.1 for k, v in same_b.items()})   # 11 units apart: beyond it
    assert out == "agrees" and c["se"] == pytest.approx(math.sqrt(2 * 0.01 ** 2 / 3))
    out, c = one("better", same_a, same_b, paired=True)  # identical differences: floored too
    assert 0.0 < c["p"] and out == "within seed noise"


def test_a_claim_expands_over_the_rows_cells_and_is_judged_on_a_comparison():
    claim = {"id": "x", "quote": "q", "file": "f", "section": "s", "direction": "better", "quantifier": "overall",
             "axis": "method", "pairs": [["bsam", "bsam_no_noise"]], "metrics": ["accuracy"],
             "cells": ["mnist/*", "cifar10/*"]}
    cells = ["mnist/mlp/bsam_no_noise", "mnist/mlp/bsam", "cifar10/r20/bsam", "cifar10/r20/bsam_no_noise",
             "cifar100/r20/bsam", "cifar100/r20/bsam_no_noise"]
    axes = ["dataset", "model", "method"]
    assert claims.expand(claim, cells, axes) == [("mnist/mlp/bsam", "mnist/mlp/bsam_no_noise"),
                                                 ("cifar10/r20/bsam", "cifar10/r20/bsam_no_noise")]
    records = [rec("cifar10/r20/bsam", A), rec("cifar10/r20/bsam_no_noise", FAR)]
    jobs = {r["cell"]: JOBS["a"] for r in records}
    [got] = claims.evaluate([claim], records, jobs, cells, axes)
    assert got["verdict"] == "holds"        # the MNIST pair is not run at this scale: counted, not judged
    assert (got["tally"]["agrees"], got["tally"]["not run"]) == (1, 1)
    assert got["tests"] == ["Welch t, n=3+3"]
    line = claims.verdict_line(got)
    # the bold word says the verdict rests on part of the claim: the other pair may still reverse it
    assert line.startswith("**holds on the 1 of 2 comparisons run** (overall; 1 agree; 0 reversed (Holm-adjusted, "
                           "5 %); 1 not run; Welch t")
    assert claims.verdict_line(got, "cpu").startswith("**direction agrees on the 1 of 2 comparisons run** (overall;")
    records.append(rec("mnist/mlp/bsam", A))
    records.append(rec("mnist/mlp/bsam_no_noise", FAR))
    [whole] = claims.evaluate([claim], records, {r["cell"]: JOBS["a"] for r in records}, cells, axes)
    assert claims.verdict_line(whole).startswith("**holds** (overall; 2 agree;")  # every comparison run: the claim


def test_the_papers_own_numbers_are_judged_by_the_same_rule():
    claim = {"id": "x", "quote": "q", "file": "f", "section": "s", "direction": "better", "quantifier": "overall",
             "axis": "method", "pairs": [["f", "base"]], "metrics": ["accuracy"]}
    recs = [{"cell": "f", "metric": "accuracy", "unit": "percent", "better": "higher", "paper_mean": 81.06,
             "paper_std": 0.44}, {"cell": "base", "metric": "accuracy", "unit": "percent", "better": "higher",
                                  "paper_mean": 79.50, "paper_std": 0.37}]
    [got] = claims.evaluate([claim], recs, {}, ["f", "base"], ["method"], paper_n=3)
    assert got["verdict"] == "not run"                  # no runs of ours
    p = got["paper"]
    c = p["comparisons"][0]
    # Welch on the printed numbers, n = 3 a side, by hand
    se = math.sqrt((0.44 ** 2 + 0.37 ** 2) / 3)
    assert c["diff"] == pytest.approx(1.56) and c["se"] == pytest.approx(se) and c["test"] == "Welch t"
    assert p["verdict"] == "holds" and p["paper_n"] == 3 and not p["paper_n_assumed"]
    [assumed] = claims.evaluate([claim], recs, {}, ["f", "base"], ["method"])
    assert assumed["paper"]["paper_n_assumed"] and "assumed" in claims.paper_line(assumed)


def test_rsam_close_to_sam_is_no_longer_a_hold_at_cpu_scale():
    """RandomSAM 4.5 points above SAM (p 0.12) was 'holds' under 'comparable = no rejection'."""
    import json
    c = json.loads((compare.RESULTS_ROOT / "vsam_t3" / "cpu.json").read_text())
    row = spec.load_row("vsam_t3")
    pd = row.paper_data()
    [cl] = [x for x in compare.judge_claims(row, pd, c["table"] + c.get("extra_table", []), c["jobs"])
            if x["id"] == "rsam_close_to_sam_cifar10"]
    assert cl["verdict"] in ("inconclusive", "reversed")
    ours = [x for x in cl["comparisons"] if "test" in x]
    assert ours and ours[0]["diff"] > 3.0


def test_calibration_passes_on_the_board_and_fails_under_the_old_rule(monkeypatch):
    """`claims --calibrate` at a reduced Monte Carlo size: the family rule keeps every claim's false rates at 5 %;
    switched back to no adjustment with 'any reversal reverses', it does not (exit 1)."""
    from flatbnn.reproduce import calibrate
    lines = []
    assert calibrate.calibrate(reps=150, seed=1, log=lines.append) == 0
    assert lines[-1].endswith("all claims calibrated")
    monkeypatch.setattr(claims, "FAMILY_ADJUST", lambda ps: list(ps))
    base = claims.claim_verdict

    def any_reversal(quantifier, comps):
        verdict, tally = base(quantifier, comps)
        return ("reversed" if tally["reverse"] else verdict), tally
    monkeypatch.setattr(claims, "claim_verdict", any_reversal)
    lines.clear()
    assert calibrate.calibrate(reps=150, seed=1, log=lines.append) == 1
    assert "false reversal" in lines[-1]


def test_the_comparison_page_and_status_show_each_claims_verdict(tmp_path, monkeypatch):
    """bsam_t3 at cpu scale, built from synthetic run records: its claim judged on the CIFAR-10 pair, the MNIST /
    FashionMNIST / CIFAR-100 pairs 'not run'; the page and STATUS.md say so."""
    import json
    row = spec.load_row("bsam_t3")
    out = tmp_path / "out"
    for cid, accs in (("cifar10/resnet20_frn/bsam", (0.62, 0.64, 0.66)),
                      ("cifar10/resnet20_frn/bsam_no_noise", (0.55, 0.57, 0.60))):
        for s, acc in enumerate(accs):
            d = out / cid / f"seed{s}"
            d.mkdir(parents=True)
            (d / "results.json").write_text(json.dumps({
                "metrics": {"accuracy": acc, "nll": 1.0 - acc, "ece": 0.05, "auroc_misclassification": 0.8},
                "meta": {"seed": s, "dataset": "cifar10", "model": "resnet20_frn", "train_seconds": 1.0,
                         "budget": {"epochs": 1, "train_size": 10, "test_size": 10, "global_batch": 2},
                         "hardware": {"cpu": "x"}, "git": {"commit": "0" * 40}}}))
    monkeypatch.setattr(compare, "checks_staleness", lambda *a: False)
    c = compare.build(row, "cpu", out)
    [cl] = c["claims"]
    # Welch (separately trained cells), Holm over the 4 judged comparisons: accuracy and nll (7 points apart,
    # sd 2-2.5) are within seed noise at n = 3 a side; ece and auroc are equal (zero spread, floored) -- noise too
    assert cl["id"] == "noisy_linearization_helps" and cl["verdict"] == "within seed noise"
    assert cl["tally"]["within seed noise"] == 4 and cl["tally"]["agrees"] == 0
    assert cl["tally"]["not run"] == 12  # MNIST, FashionMNIST, CIFAR-100: 3 pairs x 4 metrics
    assert cl["design"] == "Welch t"
    md = compare_markdown.to_markdown(c)
    assert "## The paper's claims: direction check (reduced budget) at cpu scale" in md
    assert "NOT the paper's scale" in md and "Holm-adjusted" in md
    assert "> The following Table 3 confirms that the noisy linearization helps in practice." in md
    assert "| `cifar10/resnet20_frn/bsam` | `cifar10/resnet20_frn/bsam_no_noise` | accuracy |" in md
    dest = tmp_path / "results"
    (dest / "bsam_t3").mkdir(parents=True)
    (dest / "bsam_t3" / "cpu.json").write_text(json.dumps(c))
    monkeypatch.setattr(status, "RESULTS_ROOT", dest)
    board = status.render()
    line = next(ln for ln in board.splitlines() if "`noisy_linearization_helps`" in ln)
    assert line.startswith("| [bsam_t3](paper/bsam_t3.yaml) | ")
    assert "**within seed noise on the 4 of 16 comparisons run**" in line and "Welch t, n=3+3" in line  # cpu column
    assert "| not run (no comparison at this scale) |" in line            # paper column
    assert line.endswith("| – (the paper prints none of these cells) |")  # bSAM T3's numbers are lost
    assert "**Claims, paper scale:" in board and "**Claims, cpu scale -- direction check (reduced budget)" in board
    # its 4 judged comparisons are 4 of 16: the headline says the verdict rests on part of the claim
    cpu_head = next(ln for ln in board.splitlines() if ln.startswith("**Claims, cpu scale"))
    assert "1 of the 1 judged rest on part of their comparisons" in cpu_head, cpu_head


def test_a_kept_page_gets_its_claims_section_spliced_in_and_nothing_else_changes():
    """A comparison kept because its run dirs are elsewhere is not re-rendered (it may be older than the renderer):
    only its claims section is replaced, or inserted before the sections that follow it."""
    judged = claims.evaluate([{"id": "x", "quote": "Q.", "file": "f.txt", "section": "S", "direction": "better",
                               "quantifier": "overall", "axis": "method", "pairs": [["a", "b"]],
                               "metrics": ["accuracy"]}], [rec("a", A), rec("b", FAR)], JOBS, ["a", "b"], ["method"])
    c = {"scale": "cpu", "claims": judged}
    page = "# T\n\n## Cells\n\n| x |\n\n## Our figures\n\n![f](f.png)\n\n<details>\n\nnotes\n</details>\n"
    once = compare_markdown.splice_claims(page, c)
    assert once.startswith("# T\n\n## Cells\n\n| x |\n\n## The paper's claims: direction check (reduced budget)")
    assert once.endswith("\n\n## Our figures\n\n![f](f.png)\n\n<details>\n\nnotes\n</details>\n")
    assert "### `x`: **direction agrees** (overall; 1 agree; 0 reversed (Holm-adjusted, 5 %); Welch t, n=3+3)" in once
    # judged again (a verdict changed): the old section is replaced, not added to
    c2 = {"scale": "cpu", "claims": [{**judged[0], "verdict": "reversed"}]}
    twice = compare_markdown.splice_claims(once, c2)
    assert twice.count("## The paper's claims") == 1 and "### `x`: **direction opposes**" in twice
    assert twice.replace("**direction opposes**", "**direction agrees**") == once
    assert compare_markdown.splice_claims("# T\n\n## Cells\n", c).startswith("# T\n\n## Cells\n\n## The paper's claims")
    # a paper page's priced 'Still to run' section follows the claims and survives every splice (make regen's
    # rejudge used to delete it)
    paper = "# T\n\n## Cells\n\n| x |\n\n## Still to run\n\n| cell | runs left |\n\n<details>\n\nnotes\n</details>\n"
    spliced = compare_markdown.splice_claims(compare_markdown.splice_claims(paper, c), c2)
    assert spliced.endswith("\n\n## Still to run\n\n| cell | runs left |\n\n<details>\n\nnotes\n</details>\n")


# ------------------------------------------------------------------------------------------ curve metrics
def test_a_curve_summary_is_the_trapezoidal_mean_height_over_the_x_range():
    """curves.py by hand: y = (0.9, 0.7, 0.3) at x = (0, 1, 3): area 0.8 + 1.0 = 1.8 over a range of 3 -> 0.6 (a
    plain mean of the points would say 0.633); the change from the first point, (0, -0.2, -0.6): -0.9 / 3 = -0.3."""
    from flatbnn.reproduce import curves
    xs, ys = [0, 1, 3], [0.9, 0.7, 0.3]
    assert curves.summarize(xs, ys, "mean") == pytest.approx(0.6)
    assert curves.summarize(xs, ys, "mean_change") == pytest.approx(-0.3)
    # sorted by x, one y per x (the last recorded: a resumed run logs an epoch twice)
    assert curves.summarize([3, 0, 1, 1], [0.3, 0.9, 0.5, 0.7], "mean") == pytest.approx(0.6)
    assert math.isnan(curves.summarize(xs, [0.9, float("nan"), 0.3], "mean"))   # diverged: counted against it
    assert curves.summarize([0], [0.9], "mean") is None                          # one point: not recorded
    assert curves.summarize(xs, [0.9, None, 0.3], "mean") is None                # a point without a number
    assert curves.problems({"m": {"better": "lower", "curve": {"x": "epoch", "y": "a", "summary": "median"}}})
    assert curves.problems({"m": {"better": "lower", "curve": {"x": "epoch", "y": "a", "summary": "mean"}}}) == []


def _write_run(d: Path, seed: int, lines: list[dict]):
    """A finished run dir: its per-epoch metrics.jsonl and a results.json with what the comparison reads."""
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta = {"seed": seed, "dataset": "mnist", "model": "lenet5", "train_seconds": 1.0, "hardware": {"cpu": "x"},
            "budget": {"epochs": 3, "train_size": 10, "test_size": 10, "global_batch": 2}, "git": {"commit": "0" * 40}}
    (d / "results.json").write_text(json.dumps({"metrics": {"accuracy": 0.9, "nll": 0.3}, "meta": meta}))


def test_a_curve_metric_is_each_runs_metrics_jsonl_summarised_and_judged_over_seeds(tmp_path, monkeypatch):
    """hwa_fig1's 'better convergence' on the curves: each run's val/nll per epoch (MNIST's curves are on the held-out
    split: the spec's 'test/nll|val/nll') summarised to its mean height, per seed, then the claim's Welch test.
    HWA's curve (1.0, 0.5, 0.3) + 0.01 s has mean height (0.75 + 0.40) / 2 = 0.575 + 0.01 s; BBB's (2.0, 1.5, 1.0)
    + 0.01 s: 1.5 + 0.01 s."""
    row = spec.load_row("hwa_fig1")
    out = tmp_path / "out"
    for s in range(5):
        for cid, ys in (("mnist/hwa", (1.0, 0.5, 0.3)), ("mnist/bbb_flipout", (2.0, 1.5, 1.0))):
            lines = [{"epoch": e + 1, "val/nll": y + 0.01 * s, "val/accuracy": 0.5 + 0.1 * e} for e, y in enumerate(ys)]
            lines.insert(1, {"epoch": 1, "train/loss": 9.0})                    # an epoch line without evaluation
            lines[0] = {**lines[0], "val/nll": 5.0}                             # logged again on resume: the last wins
            lines.insert(2, {"epoch": 1, "val/nll": ys[0] + 0.01 * s, "val/accuracy": 0.5})
            _write_run(out / cid / f"seed{s}", s, lines)
    monkeypatch.setattr(compare, "checks_staleness", lambda *a: False)
    c = compare.build(row, "cpu", out)
    by = {(r["cell"], r["metric"]): r for r in c["table"]}
    hwa, bbb = by[("mnist/hwa", "loss_curve")], by[("mnist/bbb_flipout", "loss_curve")]
    assert hwa["ours_by_seed"] == {str(s): pytest.approx(0.575 + 0.01 * s) for s in range(5)}
    assert bbb["ours_by_seed"] == {str(s): pytest.approx(1.5 + 0.01 * s) for s in range(5)}
    assert by[("mnist/hwa", "accuracy_curve")]["ours_mean"] == pytest.approx(0.6)   # (0.55 + 0.65) / 2
    [cl] = [x for x in c["claims"] if x["id"] == "hwa_sgld_beat_bbb_mnist"]
    judged = {(x["a"], x["metric"]): x for x in cl["comparisons"] if "test" in x}
    loss = judged[("mnist/hwa", "loss_curve")]
    assert loss["test"] == "Welch t" and loss["n"] == "5+5" and loss["diff"] == pytest.approx(-0.925)
    assert loss["outcome"] == "agrees"   # lower test-loss curve, the claimed way; the accuracy curves are equal
    assert judged[("mnist/hwa", "accuracy_curve")]["outcome"] == "within seed noise"
    assert cl["tally"]["not run"] == 2   # SGLD's runs are not there


def test_a_script_rows_per_run_records_give_the_degradation_per_seed(tmp_path, monkeypatch):
    """fsam_fig4: the perturbation script's curves.<cell>.runs, one record per trained run with its seed, become one
    value per seed of the paper file's 'degradation' (accuracy at alpha minus the same run's at alpha = 0, mean over
    the alpha range, in points). FSAM (0.9, 0.8, 0.6) at alpha (0, 1, 2): (-0.05 - 0.2) / 2 = -12.5 points; SGD
    (0.92, 0.6, 0.2): (-0.16 - 0.52) / 2 = -34 points; SAM degrades as FSAM does."""
    row = spec.load_row("fsam_fig4")
    curves = {"sgd": (0.92, 0.6, 0.2), "sam": (0.9, 0.8, 0.6), "fsam": (0.9, 0.8, 0.6)}
    out = tmp_path / "fsam_fig4"
    out.mkdir()
    data = {"curves": {cell: {"runs": [{"run": f"r/{cell}/seed{s}", "seed": s, "alphas": [0.0, 1.0, 2.0],
                                        "accuracy": [a + 0.002 * s * (i > 0) for i, a in enumerate(ys)]}
                                       for s in range(3)]} for cell, ys in curves.items()}}
    (out / "fig4_perturbation.json").write_text(json.dumps(data))
    c = compare.build(row, "cpu", out)
    by = {(r["cell"], r["metric"]): r for r in c["table"]}
    # seed s's points at alpha > 0 are 0.2 s points higher: its degradation (0.1 s + 0.2 s) / 2 = 0.15 s higher
    assert by[("fsam", "degradation")]["ours_by_seed"] == {str(s): pytest.approx(-12.5 + 0.15 * s) for s in range(3)}
    assert by[("sgd", "degradation")]["ours_mean"] == pytest.approx(-34.0 + 0.15)
    assert by[("fsam", "perturbed_accuracy")]["ours_mean"] == pytest.approx(100 * (0.85 + 0.7) / 2 + 0.15)
    assert c["ours_only"] and by[("fsam", "degradation")]["state"] == "done"
    [cl] = c["claims"]
    got = {x["b"]: (x["test"], x["n"], x["outcome"]) for x in cl["comparisons"]}
    assert got == {"sgd": ("Welch t", "3+3", "agrees"), "sam": ("Welch t", "3+3", "within seed noise")}
    assert cl["verdict"] == "holds" and c["scale"] == "cpu"
    # a record without its seed has no per-seed value: not judged, never compared by another test in silence
    for rec in data["curves"]["sgd"]["runs"]:
        del rec["seed"]
    (out / "fig4_perturbation.json").write_text(json.dumps(data))
    [cl] = compare.build(row, "cpu", out)["claims"]
    assert {x["b"]: x["outcome"] for x in cl["comparisons"]}["sgd"] == "not judged"
