"""A comparison (flatbnn/reproduce/compare.py's model) as Markdown, and :func:`write_comparison`, which writes
``results/reproduce/<row>/<scale>.md`` beside its ``.json`` (and the row's figures).

Nothing here decides anything: verdicts, directions and seed-noise tests are the model's; this module says them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flatbnn.engine.checkpoint import write_bytes, write_json, write_text
from flatbnn.engine.report import CHANCE_SE
from flatbnn.reproduce.claims import describe, paper_line, verdict_line
from flatbnn.reproduce.compare import (NOISE_ALPHA, NOT_AT_SCALE, RESULTS_ROOT, archive_row, build, finished_runs,
                                       judge_claims, no_numbers, paper_progress)
from flatbnn.reproduce.cost import cost_left, fmt_duration
from flatbnn.reproduce.figures import draw_figures
from flatbnn.reproduce.launch import OUTPUT_ROOT
from flatbnn.reproduce.spec import Row, load_json
from flatbnn.reproduce.stats import NAN_POLICY, nonfinite_note

SCALE_BANNER = {
    "smoke": "SMOKE run: a few steps on fake data; checks that the row's configs run, nothing about its numbers.",
    "cpu": "CPU-budget run (reduced data, network and epochs; see Budget): NOT a paper reproduction. Absolute "
           "numbers are not comparable with the paper's; only the direction of each F-vs-base pair is checked.",
    "paper": "Paper-scale run (the paper's protocol): each cell is checked against the paper's spread.",
}
# a paper-scale page without paper numbers (compare.no_numbers: why), in place of SCALE_BANNER["paper"]
NO_NUMBERS_BANNER = {
    "ours": "Full-protocol run of our own row (the protocol in its results/paper file): there is no paper to check a "
            "cell against; its cells are ranked against each other and its claims judged.",
    "figure": "Paper-scale run (the paper's protocol): the paper shows a figure and prints no numbers to check a cell "
              "against; its cells are ranked against each other and its claims judged.",
    "lost": "Paper-scale run (the paper's protocol): the paper's numbers for this table are lost from our copy, so no "
            "cell is checked against them; its cells are ranked against each other and its claims judged.",
}
NO_NUMBERS_PROGRESS = {"ours": "our own row: no paper numbers, so no per-cell verdicts",
                       "figure": "a figure: the paper prints no numbers, so no per-cell verdicts",
                       "lost": "the paper's numbers are lost from our copy, so no per-cell verdicts"}


_CHANCE_NOTE = (f" A cell is at chance when every seed's test accuracy is within {CHANCE_SE:g} binomial standard errors "
                "of 1/classes: it learned nothing, so its pairs rank nothing.")


# the test behind a page's "beyond seed noise" column: the row's declared design (Row.seed_test), as in its claims
_NOISE_TESTS = {
    "welch": "Welch t-test, the cells trained separately (their seeds are independent samples)",
    "paired": "paired t-test over the seeds both cells have, the row's cells sharing one trained run per seed: se = "
              "sd(per-seed differences)/sqrt(n) with n - 1 dof -- |difference| > 12.7 se at 2 seeds, 4.3 se at 3",
}


def _noise_sentence(direction: list[dict], seed_test: str | None) -> str:
    judged = [d for d in direction if d.get("beyond_noise")]
    n_sep = sum(d["beyond_noise"] == "yes" for d in judged)
    test = _NOISE_TESTS.get(seed_test, "the row's seed test (Row.seed_test)")  # a comparison written before it said
    return (f"Beyond seed noise ({test}; two-sided at {NOISE_ALPHA:.0%}, each pair on its own -- a claim below adjusts "
            f"for its family; needs 2+ seeds a side): {n_sep} of {len(judged)} pairs"
            + (f"; {len(direction) - len(judged)} not judged (fewer than 2 seeds, or a metric a cell has no value for)"
               if len(judged) < len(direction) else "") + ". A direction within seed noise is a coin flip at this budget, agree or not.")


def _fmt(v, std=None, n=None, unit=None) -> str:
    if v is None:
        return "–"
    digits = 2 if unit == "percent" else 4
    s = f"{v:.{digits}f}"
    if std is not None:
        s += f" ± {std:.{digits}f}"
    if n is not None:
        s += f" (n={n})"
    return s


def _fmt_ours(r: dict) -> str:
    """Our mean ± std (n = finite seeds), and how many seeds were non-finite (left out: stats.NAN_POLICY)."""
    return (_fmt(r["ours_mean"], r["ours_std"], r["ours_n"] or None, r["unit"])
            + nonfinite_note(r["ours_n"], r.get("ours_nonfinite") or 0, r.get("ours_nonnumeric") or 0))


def _nonfinite_line(table: list[dict]) -> list[str]:
    """The NaN policy, said under a table that has non-finite seeds (and only there)."""
    return ["", f"[k/N non-finite]: {NAN_POLICY}."] if any(r.get("ours_nonfinite") for r in table) else []


def to_markdown(c: dict) -> str:
    b = c["budget"]
    why = no_numbers(c) if c["scale"] == "paper" else None
    lines = [f"<!-- generated by scripts/reproduce.py compare {c['row']} --scale {c['scale']}; do not edit -->",
             f"# {c['title']}", "",
             f"**Scale: {c['scale']}.** {NO_NUMBERS_BANNER[why] if why else SCALE_BANNER[c['scale']]}", "",
             f"Paper numbers: `results/paper/{c['row']}.yaml` ({c['paper']}, {c.get('paper_source') or '?'}, "
             f"provenance: {c.get('provenance') or '?'}). Spec: `rows/{c['row']}.yaml`."]
    if c["provenance"] == "author_readme":
        lines += ["", "> The paper's own table numbers were lost in our copy of the text: the numbers below are the "
                      "authors' README rows (REFERENCE.md), not the paper's table."]
    if c["provenance"] == "ours":
        lines += ["", "> Our own benchmark, not a paper's table: there are no paper numbers; our cells are listed and "
                      "their pairs tested against each other below."]
    elif not c["available"]:
        lines += ["", "> This table's numbers are not in our copy of the paper (see the paper file's notes): nothing "
                      "to compare with" + ("; our cells are listed and ranked against each other below."
                                           if c.get("ours_only") and c["table"] else ".")]
    lines += ["", "## Budget", ""]
    if b.get("runs"):
        lines += [f"- runs: {b['runs']} finished; seeds {b['seeds']}; datasets {b['datasets']}; models {b['models']}",
                  f"- epochs {b['epochs']}, train size {b['train_size']}, test size {b['test_size']}, "
                  f"global batch {b['global_batch']}, precision {b['precision']}",
                  f"- hardware: {'; '.join(b['hardware'])}; train time {b['train_hours']} h in total"
                  + (f" (the {b['evaluations']} results are re-evaluations of trained runs, each counted once)"
                     if b.get("evaluations") else ""),
                  f"- commit(s): {', '.join(b['commits'])}"]
    elif c.get("script"):
        sc = c["script"]
        git = sc.get("git") or {}
        lines.append(f"- script: `{sc.get('command')}` (exit {sc.get('returncode')}, {sc.get('seconds')} s) @ "
                     f"{str(git.get('commit', '?'))[:8]}{'+dirty' if git.get('dirty') else ''}")
        if c.get("reads_runs"):
            lines.append("- it analyses other rows' finished runs at this scale: their budgets are in their comparisons")
    else:
        lines.append("- no finished runs yet")
    if c.get("reused"):
        src = sorted({next((p for p in Path(v).parts if p != ".."), v) for v in c["reused"].values()})
        lines.append(f"- {len(c['reused'])} of these runs are other rows' runs with the same seed and training config "
                     f"(linked, not retrained; from {', '.join(src)}): " + ", ".join(f"`{k}`" for k in c["reused"]))
    if b.get("note"):
        lines.append(f"- stated budget: {b['note']}")
    conv = (b.get("metric_conventions") or {}) if b.get("runs") else {}
    if conv or c.get("paper_conventions"):
        ours = (f"ECE {conv.get('ece_bins')} bins, {conv.get('ece_binning')}, edges {conv.get('ece_edges')}"
                if conv else ("see the analysed runs" if c.get("reads_runs") else "see the analysis below"))
        lines += [f"- metric conventions, ours: {ours}; paper: {c.get('paper_conventions') or 'not stated'}"]
    if c["choices"]:
        lines += ["", "## Our choices where the paper is silent", ""]
        lines += [f"- `{k}`: {v}" for k, v in c["choices"].items()]
    lines += _fidelity_markdown(c)
    if c["table"] and c["scale"] == "paper":
        progress = paper_progress(c)
        rule = ("" if progress["no_numbers"] else  # no printed number: no rule to apply
                " (a deterministic computation: outside if any metric does not round to the paper's printed digits)"
                if c.get("exact") else
                " (a cell's verdict comes when all its seeds are in: outside if any metric is outside the paper's ±2σ)")
        lines += ["", f"**Progress: {progress_sentence(progress)}**{rule}."]
    if c["table"] and c.get("ours_only"):
        lines += _ours_only_markdown(c)
    elif c["table"]:
        head = "| cell | metric | paper | ours (mean ± std over seeds, ddof 1) | Δ | state |"
        if c["scale"] == "paper":
            head += " verdict (printed digits) |" if c.get("exact") else " verdict (±2σ) |"
        lines += ["", "## Cells", "", head, "|" + "---|" * (head.count("|") - 1)]
        skipped = sorted({r["cell"] for r in c["table"] if r["state"] == NOT_AT_SCALE})
        for r in (r for r in c["table"] if r["state"] != NOT_AT_SCALE):
            cells = [f"`{r['cell']}`", r["metric"] + (f" ({r['unit']})" if r["unit"] else ""),
                     _fmt(r["paper_mean"], r["paper_std"], unit=r["unit"]),
                     _fmt_ours(r),
                     _fmt(r.get("delta"), unit=r["unit"]),
                     r["state"] + (" · at chance" if r.get("at_chance") else "") + (" ⚑" if r["flags"] else "")]
            if c["scale"] == "paper":
                cells.append(f"{r['verdict']} ({r['verdict_seeds']} seeds)" if r.get("verdict") else "–")
            lines.append("| " + " | ".join(cells) + " |")
        if skipped:
            lines += ["", f"{len(skipped)} paper cells are not part of this scale: " + ", ".join(f"`{x}`" for x in skipped)]
        lines += _nonfinite_line(c["table"])
        if any(r["flags"] for r in c["table"]):
            lines += ["", "⚑ = the paper's cell is flagged in `results/paper/" + c["row"] + ".yaml` (ambiguous text)."]
    if c.get("extra_table"):
        lines += _cells_markdown(c["extra_table"], "Our cells without a paper number",
                                 "Cells of the spec that the paper's table does not print (extensions, or rows of ours "
                                 "only): shown for reference, never compared.")
    if c["direction"] and not c.get("ours_only"):
        agree = [d for d in c["direction"] if d["agree"] is not None]
        n_ok = sum(d["agree"] for d in agree)
        undecided = [d["undecided"] for d in c["direction"] if d.get("undecided")]
        ties = sum(u.startswith("tie") for u in undecided)
        lines += ["", "## Direction: is the first method better than its base?", "",
                  f"Ours agrees with the paper on {n_ok} of {len(agree)} comparisons "
                  f"(pending: {len(c['direction']) - len(agree) - len(undecided)}"
                  + (f"; undecided, a tie on one side only: {ties}" if ties else "")
                  + (f"; undecided, a cell of ours at chance: {len(undecided) - ties}" if len(undecided) > ties else "")
                  + ")." + (_CHANCE_NOTE if len(undecided) > ties else ""), "",
                  _noise_sentence(c["direction"], c.get("seed_test")), "",
                  "| method | vs | metric | paper | ours | agree | ours beyond seed noise? |",
                  "|---|---|---|---|---|---|---|"]
        for d in c["direction"]:
            mark = {True: "yes", False: "**no**"}.get(d["agree"], f"– ({d['undecided']})" if d.get("undecided") else "–")
            lines.append(f"| `{d['cell']}` | `{d['vs']}` | {d['metric']} | {d['paper_better'] or '–'} "
                         f"({_fmt(d['paper'][0], unit=d.get('unit'))} vs {_fmt(d['paper'][1], unit=d.get('unit'))}) | "
                         f"{d['ours_better'] or '–'} ({_fmt(d['ours'][0], unit=d.get('unit'))} vs "
                         f"{_fmt(d['ours'][1], unit=d.get('unit'))}) | {mark} | {d.get('beyond_noise') or '–'} |")
    lines += _claims_markdown(c)
    lines += _left_markdown(c)
    for name, text in (c.get("included") or {}).items():  # the script's own report (e.g. derived ratios)
        body = text.splitlines()
        if body and body[0].startswith("# "):
            body = body[1:]
        while body and not body[0].strip():  # the blank line under the dropped title: the heading brings its own
            body = body[1:]
        lines += ["", f"## The analysis (`{name}`)", ""] + [ln.replace("# ", "### ", 1) if ln.startswith("# ") else ln
                                                           for ln in body]
    if c.get("figure"):
        fig = c["figure"]
        lines += ["", "## The paper's figure", "", f"- shows: {fig.get('shows', '')}",
                  f"- the paper's reading: {fig.get('claim', '')}"]
    figs = c.get("figures") or []
    if figs:
        lines += ["", "## Our figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figs]
    if c["failed"] or c["blocked"] or c.get("stale"):
        lines += ["", "## Not run", ""]
        lines += [f"- FAILED `{k}`: {v}" for k, v in c["failed"].items()]
        lines += [f"- STALE `{k}` (left out): {v}" for k, v in (c.get("stale") or {}).items()]
        lines += [f"- blocked `{k}`: {v}" for k, v in c["blocked"].items()]
    if c["paper_notes"]:
        lines += ["", "<details><summary>Notes on the paper's table</summary>", ""]
        lines += [f"- {n}" for n in c["paper_notes"]] + ["", "</details>"]
    return "\n".join(lines) + "\n"


_SCALE_WORDS = {"cpu": "cpu scale (the reduced budget above), NOT the paper's scale",
                "paper": "paper scale (the paper's protocol)"}


RULE_TEXT = ("Each comparison (a cell pair on one metric) is tested by the row's declared design ({design}); "
             "better / worse by the two-sided t-test of no difference, comparable by equivalence within the claim's "
             "margin (TOST), not worse by non-inferiority by the margin. The family is the claim's comparisons: "
             "their p-values are Holm-adjusted (family-wise error 5 %; an `all` claim's agreements are not: it holds "
             "only if every one agrees, an intersection-union test), so a comparison *agrees* or is *reversed* "
             "only when its adjusted p < 5 %; the rest are within seed noise (or inconclusive, where the interval "
             "reaches past the margin), with the sign of their point estimate. A cell at chance or with a diverged "
             "seed counts against its own method and never for the claim. The claim: `all` holds when every "
             "comparison agrees; `most` when more than half do; `overall` when some agree, none is reversed and "
             "most point estimates point the claimed way; reversed in the mirror cases, mixed when both "
             "agreements and reversals are significant (docs/reproduce.md, Claims).")


def _claims_markdown(c: dict) -> list[str]:
    """The paper's claims (results/paper/<row>.yaml ``claims:``) with one verdict each at this scale, the
    comparisons behind it, and the verdict on the paper's own numbers (flatbnn/reproduce/claims.py decides;
    definitions: docs/reproduce.md, Claims)."""
    if not c.get("claims"):
        return []
    scale = c["scale"]
    design = (c["claims"][0].get("design") or "Welch t")
    head = (f"## The paper's claims: verdicts at {_SCALE_WORDS.get(scale, scale)}" if scale == "paper" else
            f"## The paper's claims: direction check (reduced budget) at {_SCALE_WORDS.get(scale, scale)}")
    lines = ["", head, "", RULE_TEXT.format(design=design)]
    if scale != "paper":
        lines += ["", "Below the paper's scale a verdict is a direction check on a reduced budget: 'direction "
                      "agrees' / 'direction opposes', never 'holds' / 'reversed'."]
    for cl in c["claims"]:
        lines += ["", f"### `{cl['id']}`: {verdict_line(cl, scale)}", "",
                  f"> {cl['quote']}", ">", f"> -- `{cl['file']}`, {cl['section']}", "",
                  f"Claimed: {describe(cl)}." + (f" {cl['note']}" if cl.get("note") else ""), "",
                  f"The paper's own numbers by the same rule: {paper_line(cl)}."]
        ran = [x for x in cl["comparisons"] if "test" in x]
        if len({x["metric"] for x in ran}) > 1:  # a verdict over several metrics: where each one stands
            by_metric = []
            for m in dict.fromkeys(x["metric"] for x in ran):
                xs = [x for x in ran if x["metric"] == m]
                agree, rev = sum(x["outcome"] == "agrees" for x in xs), sum(x["outcome"] == "reversed" for x in xs)
                toward = sum(x.get("toward", 0) > 0 for x in xs)
                by_metric.append(f"{m}: {agree} agree, {rev} reversed, {toward} of {len(xs)} estimates the "
                                 f"claimed way")
            lines += ["", "By metric: " + "; ".join(by_metric) + "."]
        if ran:
            lines += ["", "| a | b | metric | ours a vs b | a - b ± se | margin | test (n) | p the claimed way "
                          "(Holm) | p against (Holm) | outcome |", "|---|---|---|---|---|---|---|---|---|---|"]
            for x in ran:
                lines.append(f"| `{x['a']}` | `{x['b']}` | {x['metric']} | {_fmt(x['ours'][0], unit=x['unit'])} vs "
                             f"{_fmt(x['ours'][1], unit=x['unit'])} | {_fmt(x['diff'], x['se'], unit=x['unit'])} | "
                             f"{_fmt(x['margin'], unit=x['unit']) if x.get('margin') is not None else '–'} | "
                             f"{x['test']} ({x['n']}) | {x['p_agree']:.2g} ({x.get('p_agree_adj', 1.0):.2g}) | "
                             f"{x['p_reverse']:.2g} ({x.get('p_reverse_adj', 1.0):.2g}) | {x['outcome']}"
                             + (f": {x['detail']}" if x.get("detail") else "") + " |")
        other = [x for x in cl["comparisons"] if "test" not in x]
        for outcome in ("failed", "not judged", "not run"):
            idle = [x for x in other if x["outcome"] == outcome]
            if idle:
                why = sorted({x["detail"] for x in idle})
                lines += ["", f"{outcome.capitalize()}: {len(idle)} comparisons ({'; '.join(why[:4])}"
                          + (f"; and {len(why) - 4} more" if len(why) > 4 else "") + ")."]
    return lines


def _fidelity_markdown(c: dict) -> list[str]:
    f = c.get("fidelity") or {}
    if not f or f.get("summary") == "–":
        return []
    lines = ["", "## Departures from the paper's protocol (paper scale)", "",
             f"Protocol: {f['summary']} (the paper's entries in `results/paper/{c['row']}.yaml` `protocol:`, checked "
             f"against every composed paper-scale cell by tests/test_protocol_fidelity.py; departures declared in "
             f"`rows/{c['row']}.yaml`)."]
    if f["departures"]:
        lines += ["", "| key | cells | ours | paper | why |", "|---|---|---|---|---|"]
        lines += [f"| `{d.get('key')}` | `{d.get('cells', '*')}` | {d.get('ours')!r} | {d.get('paper')!r} | "
                  f"{d.get('category')}: {d.get('reason')} |" for d in f["departures"]]
    else:
        lines += ["", "No declared departures."]
    return lines


def kept_files(row: Row) -> list[str]:
    """The files of a script row's output committed beside its page (``<scale>_<name>``): the one its cells are
    read from (``compare.cells_from``) and those ``compare.keep`` names (e.g. a toy's summary.json, which its
    tests read)."""
    compare = row.compare or {}
    names = [(compare.get("cells_from") or {}).get("file")] + list(compare.get("keep") or [])
    return list(dict.fromkeys(n for n in names if n)) if row.kind == "script" else []


def progress_sentence(pr: dict) -> str:
    """``7/20 cells done: 5 within the paper's spread, 2 outside`` (what STATUS.md and the comparison say)."""
    s = f"{pr['done']}/{pr['cells']} cells done"
    if pr["no_numbers"]:
        return s + f" ({NO_NUMBERS_PROGRESS[pr['no_numbers']]})"
    if pr["done"]:
        where = "agree to the paper's printed digits" if pr.get("exact") else "within the paper's spread"
        s += f": {pr['within']} {where}, {pr['outside']} outside"
        s += f", {pr['no_spread']} without a printed spread" if pr["no_spread"] else ""
    return s


def _left_markdown(c: dict) -> list[str]:
    """What is still to run at paper scale and what one run of each cell costs (``c["left"]``: cost.cost_left)."""
    left = c.get("left")
    if left is None:
        return []
    if not left:
        return ["", "## Still to run", "", "Nothing: every seed of every cell that can run here is done."]
    devices = next((list(x["each"]) for x in left if "error" not in x["each"]), ["cpu"])  # a priced cell's
    lines = ["", "## Still to run", "",
             f"{sum(x['runs_left'] for x in left)} runs in {len(left)} cells (`make campaign ROWS={c['row']}` runs "
             f"them cheapest first and resumes the interrupted ones). One run's wall time, estimated: measured where a "
             f"record or benchmark of that device has the same training work, else assumed (the basis says which).", "",
             "| cell | runs left | " + " | ".join(f"each on {d}" for d in devices) + " |",
             "|---|---|" + "---|" * len(devices)]
    for x in left:
        if "error" in x["each"]:
            lines.append(f"| `{x['cell']}` | {x['runs_left']} | " + " | ".join(
                [f"does not compose: {x['each']['error'][1]}"] + ["–"] * (len(devices) - 1)) + " |")
            continue
        lines.append(f"| `{x['cell']}` | {x['runs_left']} | " + " | ".join(
            f"~{fmt_duration(x['each'][d][0])} ({x['each'][d][1]})" for d in devices) + " |")
    return lines


def _cells_markdown(table: list[dict], title: str, intro: str) -> list[str]:
    """Cell x metric table of our runs (mean ± std over seeds)."""
    metrics = list(dict.fromkeys(r["metric"] for r in table))
    units = {r["metric"]: r["unit"] for r in table}
    by = {(r["cell"], r["metric"]): r for r in table}
    lines = ["", f"## {title}", "", intro + " Mean ± std over seeds (ddof 1), n = seeds.", "",
             "| cell | " + " | ".join(m + (f" ({units[m]})" if units[m] else "") for m in metrics) + " | state |",
             "|---|" + "---|" * (len(metrics) + 1)]
    for cell in dict.fromkeys(r["cell"] for r in table):
        rs = [by[(cell, m)] for m in metrics]
        lines.append(f"| `{cell}` | " + " | ".join(_fmt_ours(r) for r in rs)
                     + f" | {rs[0]['state']}{' · at chance' if rs[0].get('at_chance') else ''} |")
    return lines + _nonfinite_line(table)


def _ours_only_markdown(c: dict) -> list[str]:
    """A table whose paper numbers are lost: our cells x metrics, and the spec's pairs ranked within our runs."""
    units = {r["metric"]: r["unit"] for r in c["table"]}
    lines = _cells_markdown(c["table"], "Our cells", "Our own row: no paper reports these cells." if c["provenance"]
                            == "ours" else "The paper's numbers for this table are lost (see the paper file): there "
                            "is no paper column, and our cells can only be ranked against each other.")
    if c["direction"]:
        lines += ["", "## Pairs within our runs (no paper numbers to agree with)", ""]
        if any(d.get("undecided") for d in c["direction"]):
            lines += ["Pairs marked 'at chance' rank nothing." + _CHANCE_NOTE, ""]
        lines += [_noise_sentence(c["direction"], c.get("seed_test")), "",
                  "| method | vs | metric | ours better? | ours | beyond seed noise? |", "|---|---|---|---|---|---|"]
        for d in c["direction"]:
            better = (d["ours_better"] or "–") + (f" ({d['undecided']})" if d.get("undecided") else "")
            lines.append(f"| `{d['cell']}` | `{d['vs']}` | {d['metric']} | {better} | "
                         f"{_fmt(d['ours'][0], unit=units[d['metric']])} vs "
                         f"{_fmt(d['ours'][1], unit=units[d['metric']])} | {d.get('beyond_noise') or '–'} |")
    return lines


def _rejudge_claims(row: Row, scale: str, existing: Path) -> None:
    """A kept comparison (its run dirs are not here) still gets the paper file's current claims, judged on its own
    records (the claims are data of the paper file, the records are what the runs gave): the json rewritten when
    the claims changed, the page when its claims section reads otherwise."""
    if scale == "smoke":
        return
    kept = load_json(existing)
    fresh = judge_claims(row, row.paper_data() or {}, (kept.get("table") or []) + (kept.get("extra_table") or []),
                         kept.get("jobs") or {})
    page = existing.with_suffix(".md")
    if fresh != kept.get("claims"):
        kept["claims"] = fresh
        write_json(existing, kept)
    if page.exists() and (text := splice_claims(page.read_text(), kept)) != page.read_text():
        write_text(page, text)  # the claims as this renderer words them (a wording change rewrites the section)


def rejudge_all(root: Path = RESULTS_ROOT) -> list[Path]:
    """Every committed comparison's claims judged again by the current rule and paper files (its records as they
    are: no run is read): the comparisons whose claims changed."""
    from flatbnn.reproduce.spec import list_rows, load_row
    changed = []
    for name in list_rows():
        for scale in ("cpu", "paper"):
            f = root / name / f"{scale}.json"
            if f.exists():
                page = f.with_suffix(".md")
                before = (f.read_text(), page.read_text() if page.exists() else None)
                _rejudge_claims(load_row(name), scale, f)
                if (f.read_text(), page.read_text() if page.exists() else None) != before:
                    changed.append(f)
    return changed


# the sections to_markdown writes after the claims: a spliced claims section goes before the first of them
_AFTER_CLAIMS = ("## The analysis", "## The paper's figure", "## Our figures", "## Not run", "## Still to run", "<details>")


def splice_claims(page: str, c: dict) -> str:
    """``page`` with its claims section replaced by (or, without one, given) ``c``'s, everything else as it was: a
    kept page is not re-rendered, as it may be older than this renderer (its records lack what it now prints)."""
    lines = page.rstrip("\n").split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.startswith("## The paper's claims")), None)
    if start is not None:  # the old section, with the blank line before it
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(_AFTER_CLAIMS)), None)
        del lines[start - 1:(end - 1 if end is not None else len(lines))]
        at = start - 1
    else:
        nxt = next((i for i, ln in enumerate(lines) if ln.startswith(_AFTER_CLAIMS)), None)
        at = nxt - 1 if nxt is not None else len(lines)
    lines[at:at] = _claims_markdown(c)
    return "\n".join(lines) + "\n"


def _copy_beside(files: list[Path], dest: Path, scale: str) -> list[Path]:
    """Copy each existing file to ``<dest>/<scale>_<name>`` (atomically: a page never sits beside half a file);
    returns the copies."""
    copies = []
    for p in (p for p in files if p.is_file()):
        write_bytes(dest / f"{scale}_{p.name}", p.read_bytes())
        copies.append(dest / f"{scale}_{p.name}")
    return copies


def write_comparison(row: Row, scale: str, out: Path | None = None, dest: Path | None = None,
                     force: bool = False, records: Path | None = None) -> Path:
    """Write ``results/reproduce/<row>/<scale>.json`` and the page ``<scale>.md`` (at smoke too: which cells ran),
    with the figures the row's analysis produced copied beside the Markdown (not at smoke: fake data). First every
    finished run is archived as a committed record (``<dest>/<scale>/runs/``, flatbnn/reproduce/archive.py), which
    stands in for any run dir that is gone: a later session adds seeds to the same table. ``records``: where those
    records are read, when not beside ``dest`` (``reproduce.py compare``'s page outside results/ still reads the
    committed ones). A comparison built from fewer finished runs than the one already there (an interrupted
    rerun, a row whose earlier runs have no records) does not replace it unless ``force``: the existing one is kept
    and a line says so."""
    dest = Path(dest or RESULTS_ROOT / row.row)
    archive_root = dest.parent
    archive_row(row, scale, Path(out or OUTPUT_ROOT / row.row / scale), archive_root)
    records = Path(records or archive_root)
    c = build(row, scale, out, records)
    existing = dest / f"{scale}.json"
    if existing.exists() and not force:
        try:
            before = finished_runs(json.loads(existing.read_text()))
        except (OSError, ValueError):
            before = 0
        if before > finished_runs(c):
            _rejudge_claims(row, scale, existing)
            page = existing.with_suffix(".md") if existing.with_suffix(".md").exists() else existing
            print(f"compare {row.row} ({scale}): kept {page} "
                  f"({before} finished runs); this build has only {finished_runs(c)} (the others' run dirs and "
                  f"records are not here): not replaced (--force replaces it)", file=sys.stderr)
            return page
    dest.mkdir(parents=True, exist_ok=True)
    if any(st == "done" for cell in c["jobs"].values() for st in cell.values()):
        Path(c["out"]).mkdir(parents=True, exist_ok=True)  # records only (a fresh clone): figures still drawn
    if Path(c["out"]).exists():  # the spec's compare.figures (curves / sweeps) drawn from the runs themselves
        try:
            draw_figures(row, scale, Path(c["out"]), records)
        except (ValueError, OSError) as e:  # a figure must not cost the comparison table: say so, go on
            print(f"compare {row.row} ({scale}): figure not drawn: {' '.join(str(e).split())[:300]}", file=sys.stderr)
    if scale != "smoke":  # the figures, and a script's numbers (kept_files), committed beside the page
        pngs = sorted(Path(c["out"]).glob("*.png")) if Path(c["out"]).exists() else []
        c["figures"] = [str(p) for p in _copy_beside(pngs, dest, scale)]
        _copy_beside([Path(c["out"]) / name for name in kept_files(row)], dest, scale)
    if scale == "paper" and row.kind == "train":
        c["left"] = cost_left(row, scale, c["jobs"])
    write_text(dest / f"{scale}.md", to_markdown(c))
    write_json(dest / f"{scale}.json", c)
    return dest / f"{scale}.md"
