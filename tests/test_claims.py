"""The papers' claims as data (results/paper/<row>.yaml ``claims:``): every quote is in its paper, and the verdict
of a claim at a scale (flatbnn/reproduce/claims.py) on synthetic seed values -- holds / reversed / within seed noise /
not run, for each direction."""

import os
import re
from pathlib import Path

import pytest
import yaml

from flatbnn.reproduce import claims, compare, compare_markdown, spec, status

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
    good = {"id": "a", "quote": "q", "file": "f.txt", "section": "1", "direction": "better", "axis": "method",
            "pairs": [["fsam", "sam"]], "metrics": ["accuracy"]}
    p.write_text(yaml.safe_dump({**base, "claims": [good]}))
    assert spec.load_paper_data(p)["claims"][0]["id"] == "a"
    for bad, says in [({"direction": "superior"}, "direction"), ({"metrics": ["nll"]}, "metric 'nll'"),
                      ({"axis": "model"}, "axis 'model'"), ({"pairs": [["sam", "sam"]]}, "pairs"),
                      ({"quote": None, "typo": 1}, "unknown key 'typo'")]:
        p.write_text(yaml.safe_dump({**base, "claims": [{**good, **bad}]}))
        with pytest.raises(spec.SpecError, match=re.escape(says)):
            spec.load_paper_data(p)


def rec(cell, by_seed, better="higher", metric="accuracy"):
    """A comparison-table record (compare.py's) of one cell: its finite values by seed."""
    vals = list(by_seed.values())
    st = compare._stats(vals)
    return {"cell": cell, "our_cell": cell, "metric": metric, "unit": "percent", "better": better,
            "paper_mean": None, "ours_by_seed": by_seed, **{f"ours_{k}": v for k, v in st.items()}, "state": "done"}


JOBS = {c: {"0": "done", "1": "done", "2": "done"} for c in ("a", "b")}
# paired differences a - b = (0.9, 1.1, 1.0): se 0.058, 2 dof -> beyond seed noise (p = 0.003)
A = {"0": 60.0, "1": 62.0, "2": 64.0}
B = {"0": 59.1, "1": 60.9, "2": 63.0}
# differences (-1.0, 1.1, 2.9): sd 1.95 -> within seed noise
B_NOISY = {"0": 61.0, "1": 60.9, "2": 61.1}


@pytest.mark.parametrize("direction,a,b,better,verdict", [
    ("better", A, B, "higher", "holds"),
    ("better", B, A, "higher", "reversed"),
    ("better", A, B_NOISY, "higher", "within seed noise"),
    ("better", A, B, "lower", "reversed"),          # a lower-is-better metric: a's larger value is worse
    ("better", B, A, "lower", "holds"),
    ("worse", A, B, "higher", "reversed"),
    ("worse", B, A, "higher", "holds"),
    ("worse", A, B_NOISY, "higher", "within seed noise"),
    ("comparable", A, B_NOISY, "higher", "holds"),
    ("comparable", A, B, "higher", "reversed"),     # a difference beyond seed noise
    ("comparable", B, A, "higher", "reversed"),
    ("not_worse", A, B, "higher", "holds"),
    ("not_worse", A, B_NOISY, "higher", "holds"),
    ("not_worse", B, A, "higher", "reversed"),
])
def test_a_comparisons_verdict_from_seed_values(direction, a, b, better, verdict):
    got = claims.judge(direction, rec("a", a, better), rec("b", b, better), JOBS)
    assert got["verdict"] == verdict
    assert (got["test"], got["n"]) == ("paired t", "3")
    assert got["diff"] == pytest.approx(sum(a.values()) / 3 - sum(b.values()) / 3)


def test_unpaired_cells_use_welch_and_too_few_or_unfinished_seeds_are_not_run():
    # no seed in common: Welch over (60, 62, 64) vs (50, 51, 52) -> beyond seed noise, a better
    far = {"3": 50.0, "4": 51.0, "5": 52.0}
    got = claims.judge("better", rec("a", A), rec("b", far), {"a": JOBS["a"], "b": {"3": "done", "4": "done",
                                                                                     "5": "done"}})
    assert (got["verdict"], got["test"], got["n"]) == ("holds", "Welch t", "3+3")
    # the same seeds paired would be a different test: paired over (60, 62, 64) vs (59.1, 60.9, 63.0) beyond,
    # Welch of the same values inside the noise (sd 2 each side, difference 1)
    unpaired_b = {"3": 59.1, "4": 60.9, "5": 63.0}
    got = claims.judge("better", rec("a", A), rec("b", unpaired_b), {"a": JOBS["a"], "b": {"3": "done", "4": "done",
                                                                                           "5": "done"}})
    assert (got["verdict"], got["test"]) == ("within seed noise", "Welch t")
    one = claims.judge("better", rec("a", {"0": 60.0}), rec("b", {"0": 59.0}), {"a": {"0": "done"}, "b": {"0": "done"}})
    assert one["verdict"] == "not run" and "fewer than 2" in one["detail"]
    pending = claims.judge("better", rec("a", A), rec("b", B), {"a": JOBS["a"], "b": {**JOBS["b"], "2": "missing"}})
    assert pending["verdict"] == "not run"
    assert claims.judge("better", rec("a", A), None, JOBS)["verdict"] == "not run"   # b not at this scale
    assert claims.judge("better", rec("a", A), rec("b", B), {"a": JOBS["a"]})["verdict"] == "not run"  # no b jobs


def test_a_claims_verdict_over_its_comparisons():
    assert claims.claim_verdict(["holds", "holds"]) == "holds"
    assert claims.claim_verdict(["holds", "not run"]) == "holds"
    assert claims.claim_verdict(["holds", "within seed noise"]) == "within seed noise"
    assert claims.claim_verdict(["holds", "within seed noise", "reversed"]) == "reversed"
    assert claims.claim_verdict(["not run", "not run"]) == "not run"
    assert claims.claim_verdict([]) == "not run"


def test_a_claim_expands_over_the_rows_cells_and_is_judged_on_a_comparison():
    claim = {"id": "x", "quote": "q", "file": "f", "section": "s", "direction": "better", "axis": "method",
             "pairs": [["bsam", "bsam_no_noise"]], "metrics": ["accuracy"], "cells": ["mnist/*", "cifar10/*"]}
    cells = ["mnist/mlp/bsam_no_noise", "mnist/mlp/bsam", "cifar10/r20/bsam", "cifar10/r20/bsam_no_noise",
             "cifar100/r20/bsam", "cifar100/r20/bsam_no_noise"]
    axes = ["dataset", "model", "method"]
    assert claims.expand(claim, cells, axes) == [("mnist/mlp/bsam", "mnist/mlp/bsam_no_noise"),
                                                 ("cifar10/r20/bsam", "cifar10/r20/bsam_no_noise")]
    records = [rec("cifar10/r20/bsam", A), rec("cifar10/r20/bsam_no_noise", B)]
    jobs = {r["cell"]: JOBS["a"] for r in records}
    [got] = claims.evaluate([claim], records, jobs, cells, axes)
    assert got["verdict"] == "holds"        # the MNIST pair is not run at this scale: counted, not judged
    assert got["counts"] == {"holds": 1, "reversed": 0, "within seed noise": 0, "not run": 1}
    assert got["tests"] == ["paired t, n=3"]
    line = claims.verdict_line(got)
    assert line.startswith("**holds** (1 holds of 1 judged; 1 not run; paired t, n=3)")


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
    assert cl["id"] == "noisy_linearization_helps" and cl["verdict"] == "within seed noise"
    assert cl["counts"]["holds"] == 2 and cl["counts"]["within seed noise"] == 2  # accuracy, nll / ece, auroc
    assert cl["counts"]["not run"] == 12  # MNIST, FashionMNIST, CIFAR-100: 3 pairs x 4 metrics
    md = compare_markdown.to_markdown(c)
    assert "## The paper's claims: verdicts at cpu scale" in md and "NOT the paper's scale" in md
    assert "> The following Table 3 confirms that the noisy linearization helps in practice." in md
    assert "| `cifar10/resnet20_frn/bsam` | `cifar10/resnet20_frn/bsam_no_noise` | accuracy |" in md
    dest = tmp_path / "results"
    (dest / "bsam_t3").mkdir(parents=True)
    (dest / "bsam_t3" / "cpu.json").write_text(json.dumps(c))
    monkeypatch.setattr(status, "RESULTS_ROOT", dest)
    board = status.render()
    line = next(ln for ln in board.splitlines() if "`noisy_linearization_helps`" in ln)
    assert line.startswith("| [bsam_t3](paper/bsam_t3.yaml) | ")
    assert "**within seed noise**" in line and "paired t, n=3" in line   # cpu column
    assert line.endswith("| not run (no comparison at this scale) |")    # paper column


def test_a_kept_page_gets_its_claims_section_spliced_in_and_nothing_else_changes():
    """A comparison kept because its run dirs are elsewhere is not re-rendered (it may be older than the renderer):
    only its claims section is replaced, or inserted before the sections that follow it."""
    judged = claims.evaluate([{"id": "x", "quote": "Q.", "file": "f.txt", "section": "S", "direction": "better",
                               "axis": "method", "pairs": [["a", "b"]], "metrics": ["accuracy"]}],
                             [rec("a", A), rec("b", B)], JOBS, ["a", "b"], ["method"])
    c = {"scale": "cpu", "claims": judged}
    page = "# T\n\n## Cells\n\n| x |\n\n## Our figures\n\n![f](f.png)\n\n<details>\n\nnotes\n</details>\n"
    once = compare_markdown.splice_claims(page, c)
    assert once.startswith("# T\n\n## Cells\n\n| x |\n\n## The paper's claims: verdicts at cpu scale")
    assert once.endswith("\n\n## Our figures\n\n![f](f.png)\n\n<details>\n\nnotes\n</details>\n")
    assert "### `x`: **holds** (1 holds of 1 judged; paired t, n=3)" in once
    # judged again (a verdict changed): the old section is replaced, not added to
    c2 = {"scale": "cpu", "claims": [{**judged[0], "verdict": "reversed"}]}
    twice = compare_markdown.splice_claims(once, c2)
    assert twice.count("## The paper's claims") == 1 and "### `x`: **reversed**" in twice
    assert twice.replace("**reversed**", "**holds**") == once
    assert compare_markdown.splice_claims("# T\n\n## Cells\n", c).startswith("# T\n\n## Cells\n\n## The paper's claims")
