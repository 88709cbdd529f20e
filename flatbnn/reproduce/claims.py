"""The papers' claims as data (``claims:`` in ``results/paper/<row>.yaml``) and one verdict per claim at a scale.

A claim is a sentence of the paper, copied exactly (``quote``, found in ``../shared/papers/<file>`` by
tests/test_claims.py), that compares the row's cells: along one ``axis`` of the cell ids, for each ``pairs`` entry
``[a, b]`` of that axis's values, cell ``a`` against the same cell with ``b`` on each of ``metrics`` (the paper
file's metric names, whose ``better:`` says which way is better), restricted to the cells matching ``cells`` (globs;
default all). Its ``direction`` says what the paper claims of a against b:

- ``better`` / ``worse``: a is better / worse than b;
- ``comparable``: a and b do not differ;
- ``not_worse``: a is at least as good as b ("competitive", "does not work better than" read from b's side).

Each comparison (a cell pair on one metric) gets a verdict from our runs at the scale: a two-sided t-test at
``stats.NOISE_ALPHA`` (5 %) of mean(a) - mean(b), paired over the seeds both cells have, else Welch
(``stats.seed_difference_test``); seeds with a non-finite value are left out (the NaN policy of stats.py).

- better / worse: **holds** when the test rejects and the difference points the claimed way, **reversed** when it
  rejects the other way, **within seed noise** when it does not reject;
- comparable: **holds** when the test does not reject, **reversed** when it does (a difference beyond seed noise);
- not_worse: **reversed** only when the test rejects with a worse, else **holds**;
- **not run**: a cell is not part of this scale, blocked, has unfinished jobs, or has fewer than 2 finite seeds
  a side (no test).

The claim's verdict: not run if every comparison is; else reversed if any comparison is reversed; else within seed
noise if any is; else holds -- with the counts, so "reversed (1 of 48)" reads as what it is.
"""

from __future__ import annotations

import fnmatch

from flatbnn.reproduce.stats import NOISE_ALPHA, SeedStats, seed_difference_test

DIRECTIONS = ("better", "worse", "comparable", "not_worse")
VERDICTS = ("holds", "reversed", "within seed noise", "not run")
REQUIRED_KEYS = ("id", "quote", "file", "section", "direction", "axis", "pairs", "metrics")
OPTIONAL_KEYS = ("cells", "note")


def problems(claims, axes: list[str], metrics: dict) -> list[str]:
    """What is wrong with a paper file's ``claims:`` (empty = nothing): keys, direction, axis, metrics, pairs."""
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
        if c.get("direction") not in DIRECTIONS:
            out.append(f"{name}: direction {c.get('direction')!r} is not one of {', '.join(DIRECTIONS)}")
        if "axis" in c and c["axis"] not in axes:
            out.append(f"{name}: axis {c['axis']!r} is not one of the cell axes {axes}")
        for m in c.get("metrics") or []:
            if m not in metrics:
                out.append(f"{name}: metric {m!r} is not one of the paper file's metrics {sorted(metrics)}")
            elif c.get("direction") != "comparable" and (metrics[m] or {}).get("better") not in ("higher", "lower"):
                out.append(f"{name}: metric {m!r} has no better: higher|lower to judge {c.get('direction')!r} by")
        if not c.get("metrics"):
            out.append(f"{name}: metrics: must name at least one metric")
        pairs = c.get("pairs")
        if not pairs or not all(isinstance(p, list) and len(p) == 2 and p[0] != p[1] for p in pairs):
            out.append(f"{name}: pairs: must be a list of [a, b] value pairs, a != b")
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


def _not_run(detail: str) -> dict:
    return {"verdict": "not run", "detail": detail}


def _unfinished(rec: dict, jobs: dict) -> str | None:
    """Why ``rec``'s cell is not finished at this scale (not part of it, blocked, jobs left); None = every job done."""
    states = jobs.get(rec.get("our_cell", rec["cell"])) or {}
    if not states or any(st != "done" for st in states.values()):
        return f"{rec['cell']}: {rec.get('state') or 'no jobs'}"
    return None


def judge(direction: str, a: dict | None, b: dict | None, jobs: dict) -> dict:
    """One comparison's verdict (module docstring) from two comparison-table records (compare.py: ``ours_by_seed``,
    ``ours_mean`` / ``ours_std`` / ``ours_n``, ``better``, ``state``, ``our_cell``) and the comparison's ``jobs``
    ({our cell: {seed: state}})."""
    if a is None or b is None:
        return _not_run("not at this scale")
    for rec in (a, b):
        if why := _unfinished(rec, jobs):
            return _not_run(why)
    test = seed_difference_test(a.get("ours_by_seed") or {}, b.get("ours_by_seed") or {},
                                *(SeedStats(r.get("ours_n") or 0, r.get("ours_nonfinite") or 0, r.get("ours_mean"),
                                            r.get("ours_std")) for r in (a, b)))
    if test is None:
        return _not_run(f"fewer than 2 finite seeds a side ({a.get('ours_n')} and {b.get('ours_n')}): no test")
    t = test.result
    beyond = t.beyond(NOISE_ALPHA)
    sign = -1.0 if a.get("better") == "lower" else 1.0
    a_better = sign * t.diff > 0  # only read when beyond: a nonzero difference
    if direction == "comparable":
        verdict = "reversed" if beyond else "holds"
    elif direction == "not_worse":
        verdict = "reversed" if beyond and not a_better else "holds"
    elif not beyond:
        verdict = "within seed noise"
    else:
        verdict = "holds" if a_better == (direction == "better") else "reversed"
    return {"verdict": verdict, "test": test.name, "n": test.n, "p": t.p, "diff": t.diff, "se": t.se}


def claim_verdict(verdicts: list[str]) -> str:
    """A claim's verdict from its comparisons' (module docstring)."""
    ran = [v for v in verdicts if v != "not run"]
    if not ran:
        return "not run"
    for v in ("reversed", "within seed noise"):
        if v in ran:
            return v
    return "holds"


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


def evaluate(claims: list[dict] | None, records: list[dict], jobs: dict, cell_ids: list[str],
             axes: list[str]) -> list[dict]:
    """Every claim with its comparisons judged on ``records`` (the comparison's table and extra table), and its
    verdict. ``cell_ids``: every cell the row names (so a cell not run at this scale is 'not run', not absent)."""
    by = {(r["cell"], r["metric"]): r for r in records}
    out = []
    for claim in claims or []:
        axes_ok = claim["axis"] in axes
        comparisons = []
        for a_cell, b_cell in (expand(claim, cell_ids, axes) if axes_ok else []):
            for metric in claim["metrics"]:
                a, b = by.get((a_cell, metric)), by.get((b_cell, metric))
                comparisons.append({"a": a_cell, "b": b_cell, "metric": metric,
                                    "unit": (a or b or {}).get("unit"),
                                    "ours": [(a or {}).get("ours_mean"), (b or {}).get("ours_mean")],
                                    "paper": [(a or {}).get("paper_mean"), (b or {}).get("paper_mean")],
                                    **judge(claim["direction"], a, b, jobs)})
        verdicts = [c["verdict"] for c in comparisons]
        tests = sorted({f"{c['test']}, n={c['n']}" for c in comparisons if c.get("test")})
        out.append({**{k: claim[k] for k in REQUIRED_KEYS + OPTIONAL_KEYS if k in claim},
                    "verdict": claim_verdict(verdicts) if comparisons else "not run",
                    "counts": {v: verdicts.count(v) for v in VERDICTS}, "tests": tests,
                    "comparisons": comparisons})
    return out


def verdict_line(c: dict) -> str:
    """``**holds** (3 holds of 3 judged; 1 not run; paired t, n=3)``: a claim's verdict as STATUS.md and the comparison
    page print it."""
    counts, total = c["counts"], len(c["comparisons"])
    if not total:
        return "not run (no cells of the row to compare)"
    if c["verdict"] == "not run":
        return f"not run (0 of {total} comparisons)"
    ran = total - counts["not run"]
    parts = [f"{counts[v]} {v}" for v in VERDICTS[:3] if counts[v]]
    s = f"**{c['verdict']}** ({', '.join(parts)} of {ran} judged"
    s += f"; {counts['not run']} not run" if counts["not run"] else ""
    return s + ("; " + "; ".join(c["tests"]) if c["tests"] else "") + ")"


def describe(c: dict) -> str:
    """``a better than b on accuracy, nll (axis method; cells mnist/*)``: what a claim compares."""
    word = {"better": "better than", "worse": "worse than", "comparable": "comparable to",
            "not_worse": "not worse than"}[c["direction"]]
    pairs = "; ".join(f"`{a}` {word} `{b}`" for a, b in c["pairs"])
    where = f"; cells {', '.join(c['cells'])}" if c.get("cells") else ""
    return f"{pairs} on {', '.join(c['metrics'])} (axis {c['axis']}{where})"


__all__ = ["DIRECTIONS", "VERDICTS", "cell_axes", "claim_verdict", "describe", "evaluate", "expand", "judge", "problems",
           "verdict_line"]
