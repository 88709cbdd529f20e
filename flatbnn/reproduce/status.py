"""``results/STATUS.md``: every paper row -> its smoke / cpu / paper state, linked to its comparison.

Generated only from the files the pipeline writes (``rows/*.yaml``, ``results/paper/*.yaml``,
``results/reproduce/<row>/<scale>.json``); never edited by hand. A row is "reproduced" only at paper scale.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from flatbnn.engine.checkpoint import write_text
from flatbnn.reproduce.claims import (PAPER_N_ASSUMED, VERDICTS, cell_axes, judge_claim, paper_line, verdict_line,
                                      verdict_word)
from flatbnn.reproduce.compare import RESULTS_ROOT, paper_progress
from flatbnn.reproduce.compare_markdown import progress_sentence
from flatbnn.reproduce.protocol import fidelity_summary
from flatbnn.reproduce import spec
from flatbnn.reproduce.spec import (PAPER_DIR, REPO, SCALES, SpecError, list_rows, load_json, load_paper_data,
                                    load_row, load_yaml)

STATUS_PATH = REPO / "results" / "STATUS.md"


def _scale_state(row, scale: str) -> str:
    if row.kind == "train" and row.scale(scale) is None or row.kind == "script" and scale not in (row.script or {}):
        reason = row.scale_missing_reason(scale) if row.kind == "train" else "no script at this scale"
        return f"– ({reason})" if scale != "smoke" or row.blocked else "**missing**"
    f = RESULTS_ROOT / row.row / f"{scale}.json"
    if not f.exists():
        return f"not run (0/{_paper_cells(row)} cells)" if scale == "paper" and row.kind == "train" else "not run"
    c = load_json(f)
    link = f"[{scale}](reproduce/{row.row}/{scale}.md)" if (RESULTS_ROOT / row.row / f"{scale}.md").exists() else scale
    if row.kind == "script":
        s = c.get("script") or {}
        if not s:
            return "not run"
        git = (s.get("git") or {})
        ok = "passed" if s.get("returncode") == 0 else f"**failed** (exit {s.get('returncode')})"
        judged = f"; {_paper_progress(c)}" if scale == "paper" and c.get("table") and not c.get("ours_only") else ""
        return f"{ok}{judged} @ {str(git.get('commit', '?'))[:8]}{'+dirty' if git.get('dirty') else ''}" + (
            f" ({link})" if scale != "smoke" else "")
    jobs = c.get("jobs") or {}
    total = sum(len(v) for v in jobs.values())
    done = sum(1 for v in jobs.values() for st in v.values() if st == "done")
    failed = len(c.get("failed") or {})
    blocked = len(c.get("blocked") or {})
    commits = ",".join(c.get("budget", {}).get("commits") or []) or "?"
    parts = [f"{done}/{total} jobs"]
    if failed:
        parts.append(f"**{failed} failed**")
    if blocked:
        parts.append(f"{blocked} cells blocked")
    if c.get("stale"):
        parts.append(f"**{len(c['stale'])} stale** (trained with another config than the spec's)")
    word = "passed" if total and done == total and not failed else ("**failed**" if failed else "partial")
    if scale == "paper" and not done and not failed and not c.get("stale"):  # a page of what is left, priced
        return f"{link}: not run (0/{total} jobs; each run's cost under 'Still to run')"
    if scale == "smoke":
        return f"{word}: {', '.join(parts)} @ {commits}"
    agree = [d for d in c.get("direction") or [] if d.get("agree") is not None]
    verdicts = [r.get("verdict") for r in c.get("table") or [] if r.get("verdict") in ("within", "outside")]
    extra = ""
    undecided = sum(1 for d in c.get("direction") or [] if d.get("undecided"))
    if (agree or undecided) and scale != "paper":
        extra = f"; direction agrees {sum(d['agree'] for d in agree)}/{len(agree)}"
        extra += f" ({undecided} undecided: a tie or a cell at chance)" if undecided else ""
    judged = [d["beyond_noise"] for d in c.get("direction") or [] if d.get("beyond_noise")]
    if judged and scale != "paper":
        extra += f"; {judged.count('yes')}/{len(judged)} pairs beyond seed noise"
    if verdicts:
        extra = f"; {verdicts.count('within')}/{len(verdicts)} cells within ±2σ"
    if scale == "paper":
        extra = f"; {_paper_progress(c)}"
    if scale == "cpu":
        extra += _cpu_hours(c)
    return f"{link}: {', '.join(parts)}{extra} @ {commits}{_unrecorded(row, scale)}"


def _unrecorded(row, scale: str) -> str:
    """A comparison whose runs have no committed record cannot be rebuilt in a fresh clone (issue 36 #6): say so,
    rather than let a later, smaller render look like the whole table."""
    runs = RESULTS_ROOT / row.row / scale / "runs"
    if runs.is_dir() and any(runs.rglob("record.json")):
        return ""
    return " (**no run records committed**: this comparison can only be rebuilt where its run dirs are)"


def _cpu_hours(c: dict) -> str:
    """The CPU time behind a cpu comparison: its runs' training time summed (the comparison's budget)."""
    hours = (c.get("budget") or {}).get("train_hours")
    return f"; {hours:.2f} CPU-h of training" if hours else ""


def _paper_progress(c: dict) -> str:
    """Paper-scale progress of a row: cells done / total and their verdicts (compare.paper_progress)."""
    return progress_sentence(paper_progress(c))


def _paper_cells(row) -> int:
    """The cells a row's paper-scale comparison judges: the paper's printed cells, or ours where they are lost."""
    pd = row.paper_data() or {}
    return len(pd.get("cells") or []) or len(row.cells_for("paper"))


def _paper_headline() -> str:
    """The board's first line: paper-scale cells with all seeds in, and their verdicts, over every row."""
    total = {"cells": 0, "done": 0, "within": 0, "outside": 0, "no_spread": 0}
    rows = 0
    for name in list_rows():
        try:
            row = load_row(name)
        except SpecError:
            continue
        if row.scale("paper") is None and "paper" not in (row.script or {}):  # every row with a paper scale
            continue
        f = RESULTS_ROOT / name / "paper.json"
        if not f.exists():  # not started: its cells still count in the total
            total["cells"] += _paper_cells(row)
            continue
        pr = paper_progress(load_json(f))
        rows += 1 if pr["done"] else 0
        for k in total:
            total[k] += pr[k]
    return (f"**Paper scale: {total['done']} of {total['cells']} cells done, in {rows} rows; {total['within']} within "
            f"the paper's spread, "
            f"{total['outside']} outside** ({total['no_spread']} done without a printed spread; `make campaign`, "
            f"docs/cluster.md).")


def _paper_state(row) -> str:
    p = PAPER_DIR / f"{row.row}.yaml"
    if not p.exists():
        return "**missing**"
    try:
        d = load_paper_data(p)
    except SpecError as e:
        return f"**invalid**: {e}"
    if d.get("provenance") == "ours":
        return f"our own row (no paper) [{row.row}.yaml](paper/{row.row}.yaml)"
    if d.get("available") is False:
        return "not in our copy"
    n = len(d.get("cells") or [])
    prov = " (author README)" if d.get("provenance") == "author_readme" else ""
    return (f"{n} cells{prov}" if n else "figure (no numbers)") + f" [{row.row}.yaml](paper/{row.row}.yaml)"


CLAIM_SCALES = ("cpu", "paper")  # smoke runs fake data: no verdicts


def _claims_by_scale(name: str) -> dict:
    """{scale: {claim id: judged claim}} from the row's committed comparisons (none where a scale has none)."""
    out = {}
    for scale in CLAIM_SCALES:
        f = RESULTS_ROOT / name / f"{scale}.json"
        out[scale] = {c["id"]: c for c in load_json(f).get("claims") or []} if f.exists() else {}
    return out


def _papers_own(name: str, claim: dict) -> dict | None:
    """The claim judged on the paper's printed numbers alone (no run of ours needed), or None where it prints none
    of the claim's cells."""
    from flatbnn.reproduce.calibrate import paper_records
    row, pd = load_row(name), load_paper_data(PAPER_DIR / f"{name}.yaml")
    axes, cells = cell_axes(row, pd)
    n = pd.get("seeds") if isinstance(pd.get("seeds"), int) else None
    j = judge_claim(claim, paper_records(pd), {}, cells, axes, metrics=pd.get("metrics") or {}, source="paper",
                    paper_n=n or PAPER_N_ASSUMED)
    if j["verdict"] == "not run":
        return None
    return {"paper": {**j, "paper_n": n or PAPER_N_ASSUMED, "paper_n_assumed": n is None}}


def _claims_section() -> tuple[list[str], list[str]]:
    """The board's claims headline (one line per scale) and its section: every row's claims
    (results/paper/<row>.yaml ``claims:``) with their verdict at each scale and on the paper's own numbers."""
    lines, rows = [], 0
    totals = {s: dict.fromkeys(VERDICTS, 0) for s in CLAIM_SCALES}
    partial = dict.fromkeys(CLAIM_SCALES, 0)  # judged on the comparisons run so far, others still to run
    paper_totals = dict.fromkeys(VERDICTS, 0)
    for name in list_rows():
        p = PAPER_DIR / f"{name}.yaml"
        try:
            claims = (load_paper_data(p).get("claims") or []) if p.exists() else []
        except SpecError:
            continue
        rows += bool(claims)
        judged = _claims_by_scale(name) if claims else {}
        for claim in claims:
            cells, own = [], None
            for scale in CLAIM_SCALES:
                j = judged[scale].get(claim["id"])
                verdict = j["verdict"] if j and j.get("verdict") in VERDICTS else "not run"
                totals[scale][verdict] += 1
                partial[scale] += bool(verdict != "not run" and j and (j.get("tally") or {}).get("not run"))
                link = (f" ([{scale}](reproduce/{name}/{scale}.md))"
                        if j and (RESULTS_ROOT / name / f"{scale}.md").exists() else "")
                cells.append((verdict_line(j, scale) if j and "tally" in j else
                              "not run (no comparison at this scale)" if not j else
                              "not judged (a comparison from before the family rule: rebuild it)") + link)
            own = _papers_own(name, claim)
            paper_totals[own["paper"]["verdict"] if own else "not run"] += 1
            cells.append(paper_line(own) if own else "– (the paper prints none of these cells)")
            quote = claim["quote"] if len(claim["quote"]) <= 160 else claim["quote"][:157] + "..."
            # the row as a link to its claims (not `name`: the main table's lines are the ones that start "| `row`")
            lines.append(f"| [{name}](paper/{name}.yaml) | `{claim['id']}` | \"{quote}\" ({claim['section']}; "
                         f"{claim.get('quantifier', 'overall')}) | " + " | ".join(cells) + " |")
    n = sum(totals["paper"].values())

    def counts(t: dict, scale: str) -> str:
        return ", ".join(f"{t[v]} {verdict_word(v, scale)}" for v in VERDICTS if t[v])

    def part(scale: str) -> str:  # a verdict on a few of a claim's comparisons is not one on the claim
        k, judged = partial[scale], sum(totals[scale].values()) - totals[scale]["not run"]
        return (f"; {k} of the {judged} judged rest on part of their comparisons, the others not run yet (each line "
                f"says how many): a verdict on the part run, not on the claim" if k else "")

    head = [f"**Claims, paper scale: {n} claims in {rows} rows** -- {counts(totals['paper'], 'paper')}"
            f"{part('paper')}.",
            "",
            f"**Claims, cpu scale -- direction check (reduced budget), never a reproduction**: "
            f"{counts(totals['cpu'], 'cpu')}{part('cpu')}.",
            "",
            f"**Claims judged on the papers' own printed numbers** (same rule): {counts(paper_totals, 'paper')}."]
    return head, ["", "## The papers' claims", "",
                  "Each claim is a sentence of the paper (`results/paper/<row>.yaml` `claims:`, its quote checked "
                  "against ../shared/papers by tests/test_claims.py) that compares cells, with a quantifier (all / "
                  "overall / most) and, for comparable / not worse, a margin per metric. Its comparisons are tested "
                  "by the row's declared design (Welch for separately trained cells, paired where cells share a "
                  "trained run), Holm-adjusted within the claim (family-wise 5 %); the tally counts significant "
                  "agreements, significant reversals and the rest with the sign of their estimate (definitions: "
                  "docs/reproduce.md, Claims; `scripts/reproduce.py claims --calibrate` checks the rule's error "
                  "rates). cpu verdicts are a direction check at the reduced cpu budget, NOT the paper's scale. The "
                  "last column judges the paper's own printed numbers by the same rule: where it does not hold, "
                  "neither can a faithful reproduction.", "",
                  "| row | claim | quote | cpu (direction check) | paper scale | the paper's own numbers |",
                  "|---|---|---|---|---|---|"] + lines


def render() -> str:
    claims_head, claims_table = _claims_section()
    lines = ["<!-- generated by `python scripts/reproduce.py status` from rows/, results/paper/ and "
             "results/reproduce/; do not edit -->",
             "# Reproduction status", "", _paper_headline(), "", *claims_head, "",
             "Every paper row: its spec (`rows/<row>.yaml`), the paper's numbers (`results/paper/<row>.yaml`) and the "
             "state of each scale. `smoke` = every cell for a few steps on fake data (CI); `cpu` = a stated reduced "
             "budget on 2 CPU cores (direction checks only, never a reproduction); `paper` = the paper's protocol "
             "(the only scale at which a row can be called reproduced). Commit after `@` (+dirty: uncommitted "
             "changes in the tree at run time). `fidelity` = the paper's protocol entries with a value that CI checks "
             "against every composed paper-scale cell (`results/paper/<row>.yaml` `protocol:`) / the departures the "
             "row declares (`rows/<row>.yaml` `departures:`).", "",
             "| row | paper | what | paper numbers | fidelity | smoke | cpu | paper scale |",
             "|---|---|---|---|---|---|---|---|"]
    for name in list_rows():
        try:
            row = load_row(name)
        except SpecError as e:
            lines.append(f"| {name} | | **invalid spec**: {e} | | | | | |")
            continue
        what = row.title + (f" — **blocked**: {row.blocked}" if row.blocked else "")
        states = [_scale_state(row, s) for s in SCALES]
        lines.append(f"| `{name}` | {row.paper} | {what} | {_paper_state(row)} | {fidelity_summary(row)} | "
                     + " | ".join(states) + " |")
    orphans = sorted(p.stem for p in PAPER_DIR.glob("*.yaml") if p.stem not in list_rows())
    if orphans:
        lines += ["", "Paper data without a row spec (tables kept as data only): " +
                  ", ".join(f"[{o}](paper/{o}.yaml)" for o in orphans)]
    lines += claims_table
    lines += ["", f"Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}."]
    return "\n".join(lines) + "\n"


def check_readable() -> None:
    """Every file the board reads parses -- the row specs and paper files (a YAML syntax error, e.g. an unescaped
    quote in a claim's ``quote:``) and the committed comparisons (a truncated ``<row>/<scale>.json``) -- else
    :class:`~flatbnn.reproduce.spec.UnreadableFile` (``file:line:column: message``, exit 2) before anything is
    written. A file that parses but breaks the schema is shown on the board as ``invalid``."""
    for f in sorted(spec.ROWS_DIR.glob("*.yaml")) + sorted(PAPER_DIR.glob("*.yaml")):
        load_yaml(f)
    for f in sorted(Path(RESULTS_ROOT).glob("*/*.json")):
        load_json(f)


def write_status(path: Path | None = None) -> Path:
    path = Path(path or STATUS_PATH)
    check_readable()
    text = render()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text)
    return path
