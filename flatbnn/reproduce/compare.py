"""Ours vs the paper, cell by cell: the comparison model -- value, delta, seeds, verdicts, directions, budget.

:func:`build` returns the comparison as a dict (the ``results/reproduce/<row>/<scale>.json`` the status board
reads); flatbnn/reproduce/compare_markdown.py renders it as Markdown and writes both files.

At ``paper`` scale each cell gets a verdict: within the paper's reported spread (|ours - paper| <= 2 sqrt(s_p^2 +
s_o^2), the seed std of each side) or not; a cell without a printed spread gets none, unless the row declares
``compare.exact`` (a deterministic computation, one value, e.g. a toy's minima): then within = it rounds to the
paper's printed digits. Below paper scale absolute
numbers are not comparable (smaller data, net and budget), so only the DIRECTION is checked: for each pair of the
spec's ``compare.pairs`` (e.g. F-SWAG vs SWAG), is the first better than the second on each metric -- in the paper
and in ours, and is our difference beyond seed noise (a two-sided 5 % t-test, paired over shared seeds; a
direction inside the noise is a coin flip, whichever way it points). Seeds with a non-finite value are left out
and counted (the NaN policy of flatbnn/reproduce/stats.py). Can be rerun at any time on partial results: finished
cells are shown, the rest marked.
"""

from __future__ import annotations

import fnmatch
import math
import os
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import yaml

from flatbnn.engine.report import CHANCE_SE
from flatbnn.reproduce import archive, claims, curves
from flatbnn.reproduce.launch import OUTPUT_ROOT, checks_staleness, job_state_now, run_dir, stale_detail, stale_run
from flatbnn.reproduce.protocol import fidelity_summary
from flatbnn.reproduce.spec import REPO, Row, load_json, load_yaml
from flatbnn.reproduce.stats import NOISE_ALPHA, SeedStats, is_finite, seed_difference_test, seed_stats

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

def _get(d: dict, dotted: str):
    """The value at ``dotted`` ("minima.flat.theta.0": a list is indexed by an integer part), or None."""
    for part in dotted.split("."):
        if isinstance(d, list) and part.isdigit() and int(part) < len(d):
            d = d[int(part)]
        elif isinstance(d, dict) and part in d:
            d = d[part]
        else:
            return None
    return d


def _to_paper_unit(value: float, metric: str, unit: str | None) -> float:
    if value is None:
        return None
    if metric == "error":  # printed as error %, ours is accuracy
        return 100.0 * (1.0 - value) if unit == "percent" else 1.0 - value
    return 100.0 * value if unit == "percent" else value


def collect(row: Row, scale: str, out: Path | None = None, archive_root: Path | None = None) -> dict:
    """Our runs of ``row`` at ``scale``: per cell the seeds' results.json (and the states of missing jobs). A job
    whose run dir holds no results.json is read from its committed record (flatbnn/reproduce/archive.py) under
    ``archive_root`` -- by default results/reproduce when ``out`` is the default outputs dir; a caller naming
    another ``out`` (a test, a scratch sweep) reads no records unless it names ``archive_root`` too."""
    if archive_root is None and out is None:
        archive_root = archive.ARCHIVE_ROOT
    out = Path(out or OUTPUT_ROOT / row.row / scale)
    curve_metrics = curves.declared((row.paper_data() or {}).get("metrics"))
    if row.kind == "script":
        return {"out": str(out), "cells": _script_cells(row, out, curve_metrics)}
    cells = {}
    for cell in row.cells_for(scale):
        runs, states, chance = [], {}, []
        for seed in cell.seeds:
            state, detail = job_state_now(out, cell.id, seed)  # running: a live process holds its run dir
            live = run_dir(out, cell.id, seed)
            d = archive.run_or_record(live, archive_root, row.row, scale, cell.id, seed)
            if d != live:  # the live run dir is gone (or unfinished): its committed record stands in
                state, detail = "done", archive.archived_detail(d)
            if state == "done" and checks_staleness(row, scale) and (why := stale_run(cell, seed, d)):
                state, detail = "stale", stale_detail(row, scale, cell.id, seed, why)
            if state == "done":
                runs.append(_with_curve_metrics(load_json(d / "results.json"), d, curve_metrics))
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
    acc, n = _get(result, "metrics.accuracy"), _get(result, "meta.budget.test_size")
    try:
        k = int(_get(load_yaml(run / "config_resolved.yaml") or {}, "model.num_classes"))
    except (OSError, TypeError, ValueError, yaml.YAMLError):
        return False
    if not is_finite(acc) or not n or k < 2:
        return False
    p = 1.0 / k
    return acc <= p + CHANCE_SE * math.sqrt(p * (1.0 - p) / n)


def _with_curve_metrics(result: dict, run: Path, curve_metrics: dict) -> dict:
    """``result`` (a run's results.json) with the paper file's curve metrics (curves.py) added to its ``metrics``,
    each summarised from the run's ``metrics.jsonl`` (kept in its committed record too); absent when it cannot be."""
    for name, curve in curve_metrics.items():
        if (value := curves.from_jsonl(run / "metrics.jsonl", curve)) is not None:
            result.setdefault("metrics", {})[name] = value
    return result


def _script_cells(row: Row, out: Path, curve_metrics: dict | None = None) -> dict:
    """A script row's cells, read from the JSON its analysis wrote (spec ``compare.cells_from``; rows without it
    have no cells to compare), state done / missing per cell:

    - ``{file, metrics: {<metric>: "<dotted path with {cell}>"}}``: one value per cell (e.g. fsam_overhead's
      ``seconds_per_batch.map+{cell}`` in overhead.json), one pseudo-run without seeds;
    - ``{file, runs: "<dotted path with {cell}>", metrics: {<metric>: "<path inside a run's record>"}}``: the
      list of the cell's per-run records (e.g. fsam_fig4's ``curves.{cell}.runs``), one pseudo-run per record with
      its ``seed`` (a record without one has no per-seed value) and the paper file's curve metrics summarised
      from it (curves.py)."""
    spec = (row.compare or {}).get("cells_from")
    if not spec:
        return {}
    path = out / spec["file"]
    data = load_json(path) if path.exists() else None
    cells = {}
    for cell in row.cells or []:
        if spec.get("runs"):
            records = _get(data or {}, spec["runs"].format(cell=cell))
            runs = [_record_run(r, spec.get("metrics") or {}, curve_metrics or {})
                    for r in (records if isinstance(records, list) else []) if isinstance(r, dict)]
            runs = [r for r in runs if r["metrics"]]
        else:
            metrics = {}
            for metric, template in (spec.get("metrics") or {}).items():
                value = _get(data or {}, template.format(cell=cell))
                if value is not None:
                    metrics[METRIC_PATHS.get(metric, metric)] = value
            runs = [{"metrics": metrics, "meta": None}] if metrics else []
        states = ({(r.get("seed") if r.get("seed") is not None else k): ("done", str(path)) for k, r in enumerate(runs)}
                  or {0: ("missing", f"{path} has no numbers for {cell}")})
        cells[cell] = {"runs": runs, "states": states, "blocked": None, "at_chance": False}
    return cells


def _record_run(record: dict, paths: dict, curve_metrics: dict) -> dict:
    """A script's per-run record as a pseudo-run: its values at ``paths`` and its curve metrics, and its seed."""
    metrics = {METRIC_PATHS.get(m, m): v for m, p in paths.items() if (v := _get(record, p)) is not None}
    metrics.update({m: v for m, curve in curve_metrics.items() if (v := curves.from_record(record, curve)) is not None})
    return {"metrics": metrics, "meta": None, "seed": record.get("seed")}


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
    """{seed: value} of the finite values (for the paired seed-noise test of two cells that share seeds): the run's
    ``meta.seed``, a script's pseudo-run's own ``seed``."""
    return {str(seed): v for r, v in zip(runs, values)
            if is_finite(v) and (seed := (r.get("meta") or {}).get("seed", r.get("seed"))) is not None}


def _seed_values(runs: list[dict], path: str, metric: str, unit: str | None) -> list:
    """Each run's value at ``path`` in the paper's unit; non-finite / missing values kept as they are (NaN policy)."""
    return [_to_paper_unit(v, metric, unit) if is_finite(v := _get(r["metrics"], path)) else v for r in runs]


def _stats(values: list) -> dict:
    """``{mean, std, n, nonfinite}`` over seeds (the record's ``ours_*`` keys; NaN policy of reproduce/stats.py)."""
    st = seed_stats(values)
    missing = sum(v is None for v in values)  # not recorded (counted in nonfinite too): no verdict, not a divergence
    return {"mean": st.mean, "std": st.std, "n": st.n, "nonfinite": st.n_nonfinite,
            **({"missing": missing} if missing else {}),
            **({"nonnumeric": st.n_nonnumeric} if st.n_nonnumeric else {})}  # (absent from the records otherwise)


def build(row: Row, scale: str, out: Path | None = None, archive_root: Path | None = None) -> dict:
    pd = row.paper_data() or {"cells": [], "metrics": {}}
    ours = collect(row, scale, out, archive_root)
    exact = bool((row.compare or {}).get("exact"))  # a deterministic computation: judged by the printed digits
    metrics = pd.get("metrics") or {}
    table = []
    for pc in pd.get("cells") or []:
        for metric, spec in metrics.items():
            printed = pc.get(metric)
            if not isinstance(printed, dict) or printed.get("mean") is None:
                continue
            our_cell, path = _paper_to_ours(row, pc["cell"], metric, scale)
            entry = ours["cells"].get(our_cell)
            values = _seed_values((entry or {}).get("runs", []), path, metric, spec.get("unit"))
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
                    rec["verdict"] = _verdict(rec, exact=exact)
                    rec["verdict_seeds"] = st["n"]
            table.append(rec)
    # the paper prints no numbers (lost, or a figure): our cells ranked against each other -- a script row's too
    # when its output names cells (compare.cells_from)
    ours_only = not (pd.get("cells") or []) and (row.kind != "script" or bool(ours["cells"]))
    if ours_only:
        table = _ours_table(ours, metrics or DEFAULT_METRICS)
    extra = []  # our cells the paper prints no number for (e.g. VSAM T3's MFVI extension): shown, never compared
    if not ours_only and row.kind != "script" and table:
        covered = {r["our_cell"] for r in table}
        rest = {"out": ours["out"], "cells": {k: v for k, v in ours["cells"].items() if k not in covered}}
        extra = _ours_table(rest, metrics or DEFAULT_METRICS) if rest["cells"] else []
    direction = _directions(row, table) if scale != "smoke" else []
    jobs = {cid: {str(s): st for s, (st, _) in c["states"].items()} for cid, c in ours["cells"].items()}
    runs = [r for c in ours["cells"].values() for r in c["runs"] if r.get("meta")]  # not a script's pseudo-runs
    script = None
    launch_file = Path(ours["out"]) / "launch.json"
    if row.kind == "script" and launch_file.exists():
        script = load_json(launch_file)
    return {"script": script, "exact": exact,
            "row": row.row, "paper": row.paper, "title": row.title, "scale": scale, "out": ours["out"],
            "table": table, "ours_only": ours_only, "extra_table": extra, "direction": direction,
            "seed_test": row.seed_test()[0], "budget": _budget(row, scale, runs),
            "jobs": jobs, "claims": judge_claims(row, pd, table + extra, jobs) if scale != "smoke" else [],
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


def judge_claims(row: Row, pd: dict, records: list[dict], jobs: dict) -> list[dict]:
    """The paper file's claims, each judged on this comparison's records by the row's declared seed test, the
    paper's own numbers beside (flatbnn/reproduce/claims.py)."""
    axes, cells = claims.cell_axes(row, pd)
    paper_n = pd.get("seeds") if isinstance(pd.get("seeds"), int) else None
    return claims.evaluate(pd.get("claims"), records, jobs, cells, axes, paired=row.seed_test()[0] == "paired",
                           metrics=pd.get("metrics") or {}, paper_n=paper_n)


def _ours_table(ours: dict, metrics: dict) -> list[dict]:
    """Every cell of ours x every metric of the paper's table, with no paper value: for tables whose numbers are
    lost (bSAM T1/T3-T6), where our cells can only be ranked against each other."""
    table = []
    for cid, entry in ours["cells"].items():
        for metric, spec in metrics.items():
            path = spec.get("results_key") or METRIC_PATHS.get(metric, metric)
            values = _seed_values(entry["runs"], path, metric, spec.get("unit"))
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


def printed_half_unit(value: float) -> float:
    """Half a unit of the last digit ``value`` was printed with (0.51 -> 0.005, 0.001 -> 0.0005): how far an exact
    value may lie from it and still round to it. Read from the shortest repr of the float the paper file holds, so
    a printed trailing zero (0.50) is not seen and the check is then one digit looser, never stricter."""
    return 0.5 * 10.0 ** Decimal(repr(float(value))).as_tuple().exponent


def _verdict(rec: dict, exact: bool = False) -> str:
    if rec["paper_std"] is None:
        if exact and rec["ours_n"] == 1:  # a deterministic computation: it agrees when it rounds to the printed value
            return "within" if abs(rec["delta"]) <= printed_half_unit(rec["paper_mean"]) * (1 + 1e-9) else "outside"
        return "no spread printed"
    spread = 2.0 * math.sqrt(float(rec["paper_std"]) ** 2 + (rec["ours_std"] or 0.0) ** 2)
    return "within" if abs(rec["delta"]) <= spread else "outside"


def _separated(r: dict, b: dict, paired: bool) -> tuple[str | None, float | None]:
    """Is our difference of two cells beyond seed noise: a two-sided t-test at NOISE_ALPHA (5 %), paired over the
    seeds where the row's cells share one trained run per seed (``Row.seed_test``), else Welch
    (stats.seed_difference_test). Returns (verdict, se of the difference); ``None`` with fewer than 2 finite seeds
    (pairs) on either side."""
    test = seed_difference_test(r.get("ours_by_seed") or {}, b.get("ours_by_seed") or {}, _summary(r), _summary(b),
                                paired=paired)
    if test is None:
        return None, None
    return ("yes" if test.result.beyond(NOISE_ALPHA) else "no"), test.result.se


def _summary(rec: dict) -> SeedStats:
    """A table record's ``ours_*`` numbers as :class:`SeedStats`."""
    return SeedStats(rec.get("ours_n") or 0, rec.get("ours_nonfinite", 0), rec.get("ours_mean"), rec.get("ours_std"))


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
        beyond_noise, diff_se = _separated(r, b, row.seed_test()[0] == "paired")
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


def _fidelity(row: Row) -> dict:
    """The paper scale's fidelity to the paper's protocol: the entries CI checks and the row's declared departures."""
    return {"summary": fidelity_summary(row), "departures": list(row.departures or [])}


def paper_progress(c: dict) -> dict:
    """A paper-scale comparison's progress, per paper cell (all its metrics): ``cells`` (the paper cells of this
    scale), ``done`` (every seed in), ``within`` / ``outside`` (a verdict: outside if any metric is outside the
    paper's spread), ``no_spread`` (done, but the paper prints no spread to judge by). A table whose numbers are
    lost, a figure's or our own row's counts our cells (``done``) and has no per-cell verdicts (``no_numbers``
    says why; its claims are judged)."""
    by_cell: dict[str, list[dict]] = {}
    for r in c.get("table") or []:
        if r.get("state") != NOT_AT_SCALE and not str(r.get("state", "")).startswith("blocked"):
            by_cell.setdefault(r["cell"], []).append(r)
    done = {k: rs for k, rs in by_cell.items() if all(r.get("state") == "done" for r in rs)}
    verdicts = {k: [r.get("verdict") for r in rs if r.get("verdict") in ("within", "outside")] for k, rs in done.items()}
    return {"cells": len(by_cell), "done": len(done),
            "within": sum(1 for v in verdicts.values() if v and "outside" not in v),
            "outside": sum(1 for v in verdicts.values() if "outside" in v),
            "no_spread": sum(1 for v in verdicts.values() if not v), "no_numbers": no_numbers(c),
            "exact": bool(c.get("exact"))}


def no_numbers(c: dict) -> str | None:
    """Why a comparison has no paper numbers to judge its cells by: ``ours`` (our own row, no paper), ``figure`` (the
    paper shows a figure and prints no numbers), ``lost`` (lost from our copy of the paper); None where it has them."""
    if not c.get("ours_only"):
        return None
    if c.get("provenance") == "ours":
        return "ours"
    return "figure" if c.get("available", True) and c.get("figure") else "lost"


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
