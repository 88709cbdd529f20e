"""Ours vs the paper, cell by cell: value, delta, seeds, budget, commit -> Markdown (+ JSON for the status board).

At ``paper`` scale each cell gets a verdict: within the paper's reported spread (|ours - paper| <= 2 sqrt(s_p^2 +
s_o^2), the seed std of each side) or not; a cell without a printed spread gets none. Below paper scale absolute
numbers are not comparable (smaller data, net and budget), so only the DIRECTION is checked: for each pair of the
spec's ``compare.pairs`` (e.g. F-SWAG vs SWAG), is the first better than the second on each metric -- in the paper
and in ours, and is our difference beyond seed noise (a two-sided 5 % t-test, paired over shared seeds; a
direction inside the noise is a coin flip, whichever way it points). Can be rerun at any time on partial results:
finished cells are shown, the rest marked.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from flatbnn.engine.checkpoint import write_json, write_text
from flatbnn.engine.report import CHANCE_SE
from flatbnn.reproduce import archive
from flatbnn.reproduce.launch import OUTPUT_ROOT, checks_staleness, job_state, run_dir, stale_run
from flatbnn.reproduce.spec import REPO, Row

RESULTS_ROOT = REPO / "results" / "reproduce"
# paper metric name -> where it lives in our results.json "metrics" (dotted path)
METRIC_PATHS = {"accuracy": "accuracy", "acc": "accuracy", "top1": "accuracy", "nll": "nll", "ece": "ece",
                "brier": "brier", "auroc": "auroc_misclassification", "top5": "top5_accuracy",
                "error": "accuracy"}
NOT_AT_SCALE = "not run at this scale"
# the metrics of the "our cells" table of a row whose paper file names none
DEFAULT_METRICS = {"accuracy": {"unit": "percent", "better": "higher"}, "nll": {"unit": "nats", "better": "lower"},
                   "ece": {"unit": "fraction", "better": "lower"},
                   "auroc": {"unit": "fraction", "better": "higher", "results_key": "auroc_misclassification"}}
SCALE_BANNER = {
    "smoke": "SMOKE run: a few steps on fake data; checks that the row's configs run, nothing about its numbers.",
    "cpu": "CPU-budget run (reduced data, network and epochs; see Budget): NOT a paper reproduction. Absolute "
           "numbers are not comparable with the paper's; only the direction of each F-vs-base pair is checked.",
    "paper": "Paper-scale run (the paper's protocol): each cell is checked against the paper's spread.",
}


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _to_paper_unit(value: float, metric: str, unit: str | None) -> float:
    if value is None:
        return None
    if metric == "error":  # printed as error %, ours is accuracy
        return 100.0 * (1.0 - value) if unit == "percent" else 1.0 - value
    return 100.0 * value if unit == "percent" else value


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def collect(row: Row, scale: str, out: Path | None = None, archive_root: Path | None = None) -> dict:
    """Our runs of ``row`` at ``scale``: per cell the seeds' results.json (and the states of missing jobs). A job
    whose run dir holds no results.json is read from its committed record (flatbnn/reproduce/archive.py) under
    ``archive_root`` -- by default results/reproduce when ``out`` is the default outputs dir; a caller naming
    another ``out`` (a test, a scratch sweep) reads no records unless it names ``archive_root`` too."""
    from flatbnn.reproduce.archive import ARCHIVE_ROOT, archived_detail, run_or_record
    from flatbnn.reproduce.launch import stale_detail

    if archive_root is None and out is None:
        archive_root = ARCHIVE_ROOT
    out = Path(out or OUTPUT_ROOT / row.row / scale)
    if row.kind == "script":
        return {"out": str(out), "cells": _script_cells(row, out)}
    cells = {}
    for cell in row.cells_for(scale):
        runs, states, chance = [], {}, []
        for seed in cell.seeds:
            state, detail = job_state(out, cell.id, seed)
            live = run_dir(out, cell.id, seed)
            d = run_or_record(live, archive_root, row.row, scale, cell.id, seed)
            if d != live:  # the live run dir is gone (or unfinished): its committed record stands in
                state, detail = "done", archived_detail(d)
            if state == "done" and checks_staleness(row, scale) and (why := stale_run(cell, seed, d)):
                state, detail = "stale", stale_detail(row, scale, cell.id, seed, why)
            if state == "done":
                runs.append(json.loads((d / "results.json").read_text()))
                chance.append(_at_chance(runs[-1], d))
            states[seed] = (state, detail)
        cells[cell.id] = {"runs": runs, "states": states, "blocked": cell.blocked,
                          "at_chance": bool(chance) and all(chance)}
    return {"out": str(out), "cells": cells}


# CHANCE_SE: a run within this many binomial standard errors of 1/K test accuracy learned nothing we can rank; the
# same rule makes a finished run warn "at chance" (declared in flatbnn/engine/report.py, imported above)


def _at_chance(result: dict, run: Path) -> bool:
    """Whether a finished run's test accuracy is indistinguishable from a constant guess: within ``CHANCE_SE``
    binomial standard errors of 1/K (K from the run's resolved ``model.num_classes``, n = its test size). Such a
    run (e.g. a deep ResNet whose first steps at lr 0.1 diverged and left it predicting one class) ranks nothing:
    its pairs are undecided, whatever the third decimal of its accuracy says. Unknown K or n: False."""
    import yaml

    acc, n = _get(result, "metrics.accuracy"), _get(result, "meta.budget.test_size")
    try:
        k = int(_get(yaml.safe_load((run / "config_resolved.yaml").read_text()) or {}, "model.num_classes"))
    except (OSError, TypeError, ValueError, yaml.YAMLError):
        return False
    if not _finite(acc) or not n or k < 2:
        return False
    p = 1.0 / k
    return acc <= p + CHANCE_SE * math.sqrt(p * (1.0 - p) / n)


def _script_cells(row: Row, out: Path) -> dict:
    """A script row's cells, read from the JSON its analysis wrote (spec ``compare.cells_from: {file, metrics:
    {<metric>: "<dotted path with {cell}>"}}``, e.g. fsam_overhead's ``seconds_per_batch.map+{cell}`` in
    overhead.json): one pseudo-run per cell, state done / missing. Rows without it have no cells to compare."""
    spec = (row.compare or {}).get("cells_from")
    if not spec:
        return {}
    path = out / spec["file"]
    data = json.loads(path.read_text()) if path.exists() else None
    cells = {}
    for cell in row.cells or []:
        metrics = {}
        for metric, template in (spec.get("metrics") or {}).items():
            value = _get(data or {}, template.format(cell=cell))
            if value is not None:
                metrics[METRIC_PATHS.get(metric, metric)] = value
        state = ("done", str(path)) if metrics else ("missing", f"{path} has no numbers for {cell}")
        cells[cell] = {"runs": [{"metrics": metrics, "meta": None}] if metrics else [], "states": {0: state},
                       "blocked": None, "at_chance": False}
    return cells


def _paper_to_ours(row: Row, paper_cell: str, metric: str, scale: str = "paper") -> tuple[str, str]:
    """(our cell id, dotted metrics path) for a paper cell: identity, unless the spec's ``compare.join`` maps it
    (e.g. FlatBNN T5: paper cell ``noise/swag`` -> our cell ``swag``, metrics ``shift.per_group.noise``)."""
    join = (row.compare or {}).get("join")
    path = METRIC_PATHS.get(metric, metric)
    if not join:
        return paper_cell, path
    pd_axes = join.get("paper_axes") or []
    fields = dict(zip(pd_axes, paper_cell.split("/")))
    template = join["cell"]
    if isinstance(template, dict):  # per scale (e.g. the cpu scale runs another column)
        template = template.get(scale) or template.get("default")
    ours = template.format(**fields)
    prefix = None
    for pattern, template in (join.get("metrics") or {}).items():
        if fnmatch.fnmatchcase(paper_cell, pattern):
            prefix = template.format(**fields)
            break
    return ours, (f"{prefix}.{path}" if prefix else path)


def _by_seed(runs: list[dict], values: list) -> dict:
    """{seed: value} of the finite values (for the paired seed-noise test of two cells that share seeds)."""
    return {str(r["meta"]["seed"]): v for r, v in zip(runs, values)
            if _finite(v) and (r.get("meta") or {}).get("seed") is not None}


def _stats(values: list) -> dict:
    finite = [v for v in values if _finite(v)]
    n_bad = len(values) - len(finite)
    if not finite:
        return {"mean": None, "std": None, "n": 0, "nonfinite": n_bad}
    return {"mean": statistics.fmean(finite), "std": statistics.stdev(finite) if len(finite) > 1 else None,
            "n": len(finite), "nonfinite": n_bad}


def build(row: Row, scale: str, out: Path | None = None, archive_root: Path | None = None) -> dict:
    pd = row.paper_data() or {"cells": [], "metrics": {}}
    ours = collect(row, scale, out, archive_root)
    metrics = pd.get("metrics") or {}
    table = []
    for pc in pd.get("cells") or []:
        for metric, spec in metrics.items():
            printed = pc.get(metric)
            if not isinstance(printed, dict) or printed.get("mean") is None:
                continue
            our_cell, path = _paper_to_ours(row, pc["cell"], metric, scale)
            entry = ours["cells"].get(our_cell)
            values = [_to_paper_unit(_get(r["metrics"], path), metric, spec.get("unit")) if _finite(
                _get(r["metrics"], path)) else _get(r["metrics"], path) for r in (entry or {}).get("runs", [])]
            st = _stats(values)
            rec = {"cell": pc["cell"], "our_cell": our_cell, "metric": metric, "unit": spec.get("unit"),
                   "better": spec.get("better"), "paper_mean": printed.get("mean"), "paper_std": printed.get("std"),
                   **{f"ours_{k}": v for k, v in st.items()}, "flags": pc.get("flags") or [],
                   "ours_by_seed": _by_seed((entry or {}).get("runs", []), values),
                   "at_chance": bool(entry and entry["at_chance"])}
            if entry is None:
                rec["state"] = NOT_AT_SCALE
            elif entry["blocked"]:
                rec["state"] = f"blocked: {entry['blocked']}"
            elif st["n"] == 0:
                states = sorted({s for s, _ in entry["states"].values()})
                rec["state"] = "/".join(states)
            else:
                rec["state"] = "done" if st["n"] == len(entry["states"]) else f"{st['n']}/{len(entry['states'])} seeds"
            if st["mean"] is not None:
                rec["delta"] = st["mean"] - float(printed["mean"])
                if scale == "paper" and rec["state"] == "done":  # a verdict once every seed of the cell is in
                    rec["verdict"] = _verdict(rec)
                    rec["verdict_seeds"] = st["n"]
            table.append(rec)
    ours_only = not (pd.get("cells") or [])
    if ours_only and row.kind != "script":  # the paper's numbers are lost: our cells ranked against each other
        table = _ours_table(ours, metrics or DEFAULT_METRICS)
    extra = []  # our cells the paper prints no number for (e.g. VSAM T3's MFVI extension): shown, never compared
    if not ours_only and row.kind != "script" and table:
        covered = {r["our_cell"] for r in table}
        rest = {"out": ours["out"], "cells": {k: v for k, v in ours["cells"].items() if k not in covered}}
        extra = _ours_table(rest, metrics or DEFAULT_METRICS) if rest["cells"] else []
    direction = _directions(row, table) if scale != "smoke" else []
    runs = [r for c in ours["cells"].values() for r in c["runs"] if r.get("meta")]  # not a script's pseudo-runs
    script = None
    launch_file = Path(ours["out"]) / "launch.json"
    if row.kind == "script" and launch_file.exists():
        script = json.loads(launch_file.read_text())
    return {"script": script, "row": row.row, "paper": row.paper, "title": row.title, "scale": scale, "out": ours["out"],
            "table": table, "ours_only": ours_only and row.kind != "script", "extra_table": extra, "direction": direction, "budget": _budget(row, scale, runs),
            "jobs": {cid: {str(s): st for s, (st, _) in c["states"].items()} for cid, c in ours["cells"].items()},
            "failed": {f"{cid}/seed{s}": d for cid, c in ours["cells"].items() for s, (st, d) in c["states"].items()
                       if st == "failed"},
            "stale": {f"{cid}/seed{s}": d for cid, c in ours["cells"].items() for s, (st, d) in c["states"].items()
                      if st == "stale"},
            "blocked": {cid: c["blocked"] for cid, c in ours["cells"].items() if c["blocked"]},
            "reused": {f"{cid}/seed{s}": d.split(": ", 1)[1] for cid, c in ours["cells"].items()
                       for s, (st, d) in c["states"].items() if st == "done" and d.startswith("reused: ")},
            "provenance": pd.get("provenance"), "paper_source": pd.get("source"),
            "paper_conventions": pd.get("conventions"), "paper_notes": pd.get("notes") or [],
            "figure": pd.get("figure"), "available": pd.get("available", True),
            "choices": row.choices or {},
            "fidelity": _fidelity(row),
            "reads_runs": "{runs}" in str((row.script or {}).get(scale, "")),  # a script over other rows' runs
            "included": {n: (Path(ours["out"]) / n).read_text() for n in (row.compare or {}).get("include") or []
                         if (Path(ours["out"]) / n).exists()},
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _ours_table(ours: dict, metrics: dict) -> list[dict]:
    """Every cell of ours x every metric of the paper's table, with no paper value: for tables whose numbers are
    lost (bSAM T1/T3-T6), where our cells can only be ranked against each other."""
    table = []
    for cid, entry in ours["cells"].items():
        for metric, spec in metrics.items():
            path = spec.get("results_key") or METRIC_PATHS.get(metric, metric)
            values = [_to_paper_unit(v, metric, spec.get("unit")) if _finite(v := _get(r["metrics"], path)) else v
                      for r in entry["runs"]]
            st = _stats(values)
            if entry["blocked"]:
                state = f"blocked: {entry['blocked']}"
            elif st["n"] == 0:
                state = "/".join(sorted({s for s, _ in entry["states"].values()}))
            else:
                state = "done" if st["n"] == len(entry["states"]) else f"{st['n']}/{len(entry['states'])} seeds"
            table.append({"cell": cid, "our_cell": cid, "metric": metric, "unit": spec.get("unit"),
                          "better": spec.get("better"), "paper_mean": None, "paper_std": None,
                          **{f"ours_{k}": v for k, v in st.items()}, "flags": [], "state": state,
                          "ours_by_seed": _by_seed(entry["runs"], values),
                          "at_chance": entry["at_chance"]})
    return table


def _verdict(rec: dict) -> str:
    if rec["paper_std"] is None:
        return "no spread printed"
    spread = 2.0 * math.sqrt(float(rec["paper_std"]) ** 2 + (rec["ours_std"] or 0.0) ** 2)
    return "within" if abs(rec["delta"]) <= spread else "outside"


#: two-sided level of "beyond seed noise": |difference| > t_(1 - ALPHA/2, dof) standard errors of it
NOISE_ALPHA = 0.05


def _t_crit(dof: float) -> float:
    """Student-t quantile for the two-sided NOISE_ALPHA test: 12.7 at 1 dof (2 seeds), 4.30 at 2, 2.78 at 4 (vs
    1.96 for many seeds). A fixed 2 standard errors calls a pure-noise difference 'beyond' 30 % of the time at 2
    seeds and 18 % at 3."""
    from scipy.stats import t

    return float(t.ppf(1.0 - NOISE_ALPHA / 2.0, dof))


def _separated(r: dict, b: dict) -> tuple[str | None, float | None]:
    """Is our difference of two cells beyond seed noise: a two-sided t-test at NOISE_ALPHA (5 %)? Paired when both
    cells have 2+ seeds in common (a seed fixes init and data order, and an eval row's cells share the trained run):
    the mean of the per-seed differences against se = sd(d)/sqrt(n), n - 1 dof; otherwise Welch: |m_r - m_b| against
    se = sqrt(s_r^2/n_r + s_b^2/n_b) with the Welch-Satterthwaite dof. Returns (verdict, se); ``None`` with fewer
    than 2 finite seeds on either side (``_stats`` gives no std there)."""
    xr, xb = r.get("ours_by_seed") or {}, b.get("ours_by_seed") or {}
    common = sorted(set(xr) & set(xb))
    if len(common) >= 2:
        d = [xr[k] - xb[k] for k in common]
        se = statistics.stdev(d) / math.sqrt(len(d))
        return ("yes" if abs(statistics.fmean(d)) > _t_crit(len(d) - 1) * se else "no"), se
    if r.get("ours_std") is None or b.get("ours_std") is None:
        return None, None
    vr, vb = r["ours_std"] ** 2 / r["ours_n"], b["ours_std"] ** 2 / b["ours_n"]
    se = math.sqrt(vr + vb)
    dof = ((vr + vb) ** 2 / (vr ** 2 / (r["ours_n"] - 1) + vb ** 2 / (b["ours_n"] - 1)) if vr + vb > 0
           else r["ours_n"] + b["ours_n"] - 2)
    return ("yes" if abs(r["ours_mean"] - b["ours_mean"]) > _t_crit(dof) * se else "no"), se


def _directions(row: Row, table: list[dict]) -> list[dict]:
    """F-vs-base direction per pair and metric, in the paper and in ours."""
    pairs = (row.compare or {}).get("pairs") or {}
    axis = (row.compare or {}).get("pair_axis")
    pd_axes = ((row.compare or {}).get("join") or {}).get("paper_axes") or row.axes
    if not pairs or axis not in pd_axes:
        return []
    k = pd_axes.index(axis)
    by = {(r["cell"], r["metric"]): r for r in table}
    out = []
    for r in table:
        parts = r["cell"].split("/")
        if parts[k] not in pairs:
            continue
        base_parts = list(parts)
        base_parts[k] = pairs[parts[k]]
        b = by.get(("/".join(base_parts), r["metric"]))
        if b is None or NOT_AT_SCALE in (r["state"], b["state"]):
            continue
        sign = 1.0 if r["better"] == "higher" else -1.0

        def better(x, y):
            if x is None or y is None:
                return None
            return "tie" if x == y else ("yes" if sign * (x - y) > 0 else "no")

        paper = better(r["paper_mean"], b["paper_mean"])
        ours = better(r["ours_mean"], b["ours_mean"])
        chance = [x["cell"] for x in (r, b) if x.get("at_chance")]
        # no evidence either way, so undecided rather than a disagreement: our tie against a paper that ranks the
        # pair, or a pair with a cell of ours that learned nothing (at chance: its ranking is noise)
        undecided = (f"at chance: {', '.join(chance)}" if chance and ours is not None
                     else "tie on one side only" if None not in (ours, paper) and (ours == "tie") != (paper == "tie")
                     else None)
        beyond_noise, diff_se = _separated(r, b)
        out.append({"cell": r["cell"], "vs": "/".join(base_parts), "metric": r["metric"], "unit": r.get("unit"),
                    "paper_better": paper, "ours_better": ours,
                    "agree": None if undecided or ours is None or paper is None else ours == paper,
                    "undecided": undecided, "beyond_noise": beyond_noise, "diff_se": diff_se,
                    "ours": (r["ours_mean"], b["ours_mean"]), "paper": (r["paper_mean"], b["paper_mean"])})
    return out


def _budget(row: Row, scale: str, runs: list[dict]) -> dict:
    if not runs:
        return {"scale": scale, "runs": 0, "note": (row.scale(scale) or {}).get("budget")}
    meta = [r["meta"] for r in runs]
    b = meta[0]["budget"]
    hw = meta[0]["hardware"]
    commits = sorted({g["commit"][:8] + ("+dirty" if g.get("dirty") else "")
                      for m in meta for g in (m.get("git_segments") or [m["git"]])})  # resumed on another commit: both
    epochs = sorted({m["budget"]["epochs"] for m in meta})
    train = sorted({m["budget"]["train_size"] for m in meta})
    return {"scale": scale, "runs": len(runs), "note": (row.scale(scale) or {}).get("budget"),
            "datasets": sorted({m["dataset"] for m in meta}), "models": sorted({m["model"] for m in meta}),
            "epochs": epochs, "train_size": train, "test_size": sorted({m["budget"]["test_size"] for m in meta}),
            "global_batch": sorted({m["budget"]["global_batch"] for m in meta}),
            "seeds": sorted({m["seed"] for m in meta}),
            "hardware": sorted({f"{h.get('world_size', 1)}x {h.get('gpu') or h.get('cpu')} ({h.get('cpu_count')} "
                                f"cpus), torch {h.get('torch')}" for h in (m["hardware"] for m in meta)}),
            "precision": sorted({m["budget"].get("precision", "fp32") for m in meta}),
            "commits": commits,
            # an eval row's results are re-evaluations: count each trained source run's training once
            "train_hours": round(sum({(m.get("evaluated_from") or {}).get("run_dir") or id(m): m.get("train_seconds", 0)
                                      for m in meta}.values()) / 3600, 3),
            "evaluations": sum(1 for m in meta if m.get("evaluated_from")),
            "metric_conventions": meta[0].get("metric_conventions"), "first": b, "hw": hw}


_CHANCE_NOTE = (f" A cell is at chance when every seed's test accuracy is within {CHANCE_SE:g} binomial standard errors "
                "of 1/classes: it learned nothing, so its pairs rank nothing.")


def _noise_sentence(direction: list[dict]) -> str:
    judged = [d for d in direction if d.get("beyond_noise")]
    n_sep = sum(d["beyond_noise"] == "yes" for d in judged)
    return (f"Beyond seed noise (two-sided t-test at {NOISE_ALPHA:.0%}: paired over the seeds both cells have, "
            f"se = sd(per-seed differences)/sqrt(n) with n - 1 dof -- |difference| > 12.7 se at 2 seeds, 4.3 se at 3; "
            f"else Welch; needs 2+ seeds): {n_sep} of "
            f"{len(judged)} pairs"
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


def to_markdown(c: dict) -> str:
    b = c["budget"]
    lines = [f"<!-- generated by scripts/reproduce.py compare {c['row']} --scale {c['scale']}; do not edit -->",
             f"# {c['title']}", "", f"**Scale: {c['scale']}.** {SCALE_BANNER[c['scale']]}", "",
             f"Paper numbers: `results/paper/{c['row']}.yaml` ({c['paper']}, {c.get('paper_source') or '?'}, "
             f"provenance: {c.get('provenance') or '?'}). Spec: `rows/{c['row']}.yaml`."]
    if c["provenance"] == "author_readme":
        lines += ["", "> The paper's own table numbers were lost in our copy of the text: the numbers below are the "
                      "authors' README rows (REFERENCE.md), not the paper's table."]
    if not c["available"]:
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
        lines += ["", f"**Progress: {progress_sentence(paper_progress(c))}** (a cell's verdict comes when all its "
                      f"seeds are in: outside if any metric is outside the paper's ±2σ)."]
    if c["table"] and c.get("ours_only"):
        lines += _ours_only_markdown(c)
    elif c["table"]:
        head = "| cell | metric | paper | ours (mean ± std over seeds, ddof 1) | Δ | state |"
        if c["scale"] == "paper":
            head = head[:-1] + " verdict (±2σ) |"
        lines += ["", "## Cells", "", head, "|" + "---|" * (head.count("|") - 1)]
        skipped = sorted({r["cell"] for r in c["table"] if r["state"] == NOT_AT_SCALE})
        for r in (r for r in c["table"] if r["state"] != NOT_AT_SCALE):
            cells = [f"`{r['cell']}`", r["metric"] + (f" ({r['unit']})" if r["unit"] else ""),
                     _fmt(r["paper_mean"], r["paper_std"], unit=r["unit"]),
                     _fmt(r["ours_mean"], r["ours_std"], r["ours_n"] or None, r["unit"]) +
                     (f" [{r['ours_nonfinite']} non-finite]" if r["ours_nonfinite"] else ""),
                     _fmt(r.get("delta"), unit=r["unit"]),
                     r["state"] + (" · at chance" if r.get("at_chance") else "") + (" ⚑" if r["flags"] else "")]
            if c["scale"] == "paper":
                cells.append(f"{r['verdict']} ({r['verdict_seeds']} seeds)" if r.get("verdict") else "–")
            lines.append("| " + " | ".join(cells) + " |")
        if skipped:
            lines += ["", f"{len(skipped)} paper cells are not part of this scale: " + ", ".join(f"`{x}`" for x in skipped)]
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
                  + ")." + (_CHANCE_NOTE if len(undecided) > ties else ""), "", _noise_sentence(c["direction"]), "",
                  "| method | vs | metric | paper | ours | agree | ours beyond seed noise? |",
                  "|---|---|---|---|---|---|---|"]
        for d in c["direction"]:
            mark = {True: "yes", False: "**no**"}.get(d["agree"], f"– ({d['undecided']})" if d.get("undecided") else "–")
            lines.append(f"| `{d['cell']}` | `{d['vs']}` | {d['metric']} | {d['paper_better'] or '–'} "
                         f"({_fmt(d['paper'][0], unit=d.get('unit'))} vs {_fmt(d['paper'][1], unit=d.get('unit'))}) | "
                         f"{d['ours_better'] or '–'} ({_fmt(d['ours'][0], unit=d.get('unit'))} vs "
                         f"{_fmt(d['ours'][1], unit=d.get('unit'))}) | {mark} | {d.get('beyond_noise') or '–'} |")
    for name, text in (c.get("included") or {}).items():  # the script's own report (e.g. derived ratios)
        body = text.splitlines()
        if body and body[0].startswith("# "):
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


def _fidelity(row: Row) -> dict:
    """The paper scale's fidelity to the paper's protocol: the entries CI checks and the row's declared departures."""
    from flatbnn.reproduce.protocol import fidelity_summary
    return {"summary": fidelity_summary(row), "departures": list(row.departures or [])}


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


def paper_progress(c: dict) -> dict:
    """A paper-scale comparison's progress, per paper cell (all its metrics): ``cells`` (the paper cells of this
    scale), ``done`` (every seed in), ``within`` / ``outside`` (a verdict: outside if any metric is outside the
    paper's spread), ``no_spread`` (done, but the paper prints no spread to judge by). A table whose numbers are
    lost counts our cells (``done``) and has no verdicts."""
    by_cell: dict[str, list[dict]] = {}
    for r in c.get("table") or []:
        if r.get("state") != NOT_AT_SCALE and not str(r.get("state", "")).startswith("blocked"):
            by_cell.setdefault(r["cell"], []).append(r)
    done = {k: rs for k, rs in by_cell.items() if all(r.get("state") == "done" for r in rs)}
    verdicts = {k: [r.get("verdict") for r in rs if r.get("verdict") in ("within", "outside")] for k, rs in done.items()}
    return {"cells": len(by_cell), "done": len(done),
            "within": sum(1 for v in verdicts.values() if v and "outside" not in v),
            "outside": sum(1 for v in verdicts.values() if "outside" in v),
            "no_spread": sum(1 for v in verdicts.values() if not v), "numbers_lost": bool(c.get("ours_only"))}


def progress_sentence(pr: dict) -> str:
    """``7/20 cells done: 5 within the paper's spread, 2 outside`` (what STATUS.md and the comparison say)."""
    s = f"{pr['done']}/{pr['cells']} cells done"
    if pr["numbers_lost"]:
        return s + " (the paper's numbers are lost: no verdicts)"
    if pr["done"]:
        s += f": {pr['within']} within the paper's spread, {pr['outside']} outside"
        s += f", {pr['no_spread']} without a printed spread" if pr["no_spread"] else ""
    return s


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
        lines.append(f"| `{cell}` | " + " | ".join(_fmt(r["ours_mean"], r["ours_std"], r["ours_n"] or None, r["unit"])
                                                  for r in rs)
                     + f" | {rs[0]['state']}{' · at chance' if rs[0].get('at_chance') else ''} |")
    return lines


def _ours_only_markdown(c: dict) -> list[str]:
    """A table whose paper numbers are lost: our cells x metrics, and the spec's pairs ranked within our runs."""
    units = {r["metric"]: r["unit"] for r in c["table"]}
    lines = _cells_markdown(c["table"], "Our cells", "The paper's numbers for this table are lost (see the paper "
                            "file): there is no paper column, and our cells can only be ranked against each other.")
    if c["direction"]:
        lines += ["", "## Pairs within our runs (no paper numbers to agree with)", ""]
        if any(d.get("undecided") for d in c["direction"]):
            lines += ["Pairs marked 'at chance' rank nothing." + _CHANCE_NOTE, ""]
        lines += [_noise_sentence(c["direction"]), "",
                  "| method | vs | metric | ours better? | ours | beyond seed noise? |", "|---|---|---|---|---|---|"]
        for d in c["direction"]:
            better = (d["ours_better"] or "–") + (f" ({d['undecided']})" if d.get("undecided") else "")
            lines.append(f"| `{d['cell']}` | `{d['vs']}` | {d['metric']} | {better} | "
                         f"{_fmt(d['ours'][0], unit=units[d['metric']])} vs "
                         f"{_fmt(d['ours'][1], unit=units[d['metric']])} | {d.get('beyond_noise') or '–'} |")
    return lines


def finished_runs(comparison: dict) -> int:
    """How many (cell, seed) runs a comparison was built from."""
    return sum(st == "done" for cell in (comparison.get("jobs") or {}).values() for st in cell.values())


# archive_row lives here, not in archive.py (the record store, below launch.py): it walks a row's run dirs
def archive_row(row, scale: str, out: Path, root: Path | None = None) -> int:
    """Archive every finished job (as committed records, archive.py) of ``row`` at ``scale`` found in ``out``; returns how many records changed.
    A linked job (another row's run, see launch.reusable_runs) is archived with the link it was; a stale run (trained
    with another config than the spec's now, launch.stale_run) is not: it must not replace a good record."""
    if scale not in archive.SCALES or row.kind not in ("train", "eval"):  # a script row's outputs are its own files
        return 0
    root = Path(root or archive.ARCHIVE_ROOT)
    n = 0
    for cell in row.cells_for(scale):
        for seed in cell.seeds:
            d = run_dir(out, cell.id, seed)
            if not (d / "results.json").is_file() or (checks_staleness(row, scale) and stale_run(cell, seed, d)):
                continue
            reused = os.readlink(d) if d.is_symlink() else None
            n += archive.archive_run(d, archive.record_dir(root, row.row, scale, cell.id, seed), reused)
    return n


def write_comparison(row: Row, scale: str, out: Path | None = None, dest: Path | None = None,
                     force: bool = False) -> Path:
    """Write ``results/reproduce/<row>/<scale>.json`` (always) and ``<scale>.md`` (not for smoke), with the
    figures the row's analysis produced copied beside the Markdown. First every finished run is archived as a
    committed record (``<dest>/<scale>/runs/``, flatbnn/reproduce/archive.py), which stands in for any run dir
    that is gone: a later session adds seeds to the same table. A comparison built from fewer finished runs
    than the one already there (an interrupted rerun, a row whose earlier runs have no records) does not
    replace it unless ``force``: the existing one is kept and a line says so."""
    dest = Path(dest or RESULTS_ROOT / row.row)
    archive_root = dest.parent
    archive_row(row, scale, Path(out or OUTPUT_ROOT / row.row / scale), archive_root)
    c = build(row, scale, out, archive_root)
    existing = dest / f"{scale}.json"
    if existing.exists() and not force:
        try:
            before = finished_runs(json.loads(existing.read_text()))
        except (OSError, ValueError):
            before = 0
        if before > finished_runs(c):
            print(f"compare {row.row} ({scale}): kept {existing.with_suffix('.md' if scale != 'smoke' else '.json')} "
                  f"({before} finished runs); this build has only {finished_runs(c)} (the others' run dirs and "
                  f"records are not here): not replaced (--force replaces it)", file=sys.stderr)
            return existing.with_suffix(".md") if scale != "smoke" else existing
    dest.mkdir(parents=True, exist_ok=True)
    if any(st == "done" for cell in c["jobs"].values() for st in cell.values()):
        Path(c["out"]).mkdir(parents=True, exist_ok=True)  # records only (a fresh clone): figures still drawn
    if Path(c["out"]).exists():  # the spec's compare.figures (curves / sweeps) drawn from the runs themselves
        from flatbnn.reproduce.figures import draw_figures
        try:
            draw_figures(row, scale, Path(c["out"]), archive_root)
        except (ValueError, OSError) as e:  # a figure must not cost the comparison table: say so, go on
            print(f"compare {row.row} ({scale}): figure not drawn: {' '.join(str(e).split())[:300]}", file=sys.stderr)
    pngs = sorted(Path(c["out"]).glob("*.png")) if Path(c["out"]).exists() else []
    if scale != "smoke":
        for p in pngs:
            shutil.copyfile(p, dest / f"{scale}_{p.name}")
        c["figures"] = [str(dest / f"{scale}_{p.name}") for p in pngs]
        write_text(dest / f"{scale}.md", to_markdown(c))
    write_json(dest / f"{scale}.json", c)
    return dest / (f"{scale}.md" if scale != "smoke" else f"{scale}.json")
