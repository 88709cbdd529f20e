"""Figures a row's comparison draws from its own runs (spec ``compare.figures``; docs/reproduce.md).

Three kinds, each one PNG written into the row's output folder (``write_comparison`` copies every PNG there beside
the Markdown):

* ``curves`` -- per-epoch curves from each run's ``metrics.jsonl``: one panel per (value of the ``rows`` axis x
  metric), one line per value of the ``lines`` axis, the mean over seeds with a +- 1 std band (HWA Fig. 1). A metric
  is a list of alternative keys (``"test/accuracy|val/accuracy"``: a run holding out a validation split logs
  ``val/``); the first key a run has is used and named in the panel title.
* ``sweep`` -- a final metric (``results.json`` ``metrics``) against the numeric value of the ``x`` axis (its
  labels' number: ``rho0.05`` -> 0.05), one line per value of the ``lines`` axis, mean +- std over seeds, one
  panel per metric (bSAM Fig. 4).
* ``delta_grid`` -- a heat map per (value of the ``facets`` axis x metric): the ``rows`` axis (posteriors) against
  the ``cols`` axis (flatness variants) but its ``base`` value, each cell the mean over seeds of the cell's final
  metric minus the base cell's of the same row (the row's seed test), coloured by whether that is better (green) or worse
  (red) for the metric (``results/paper/<row>.yaml`` ``metrics.<m>.better``; lower is better for nll / ece / brier
  otherwise), and outlined where it is beyond seed noise: the comparison's test (``reproduce/stats.py``: paired t
  over the seeds both cells have, else Welch; two-sided 5 %). A pair the row does not run is left blank (issue 53's
  posterior x flatness grid). Its numbers are also written as ``<name>.json``.

The paper's reading (``results/paper/<row>.yaml`` ``figure.claim``) is printed under the panels, so our curves and
the paper's words sit in one image.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import textwrap
from pathlib import Path

from flatbnn.reproduce.spec import Row, SpecError

KINDS = ("curves", "sweep", "delta_grid")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def axis_number(label: str) -> float:
    """The number in an axis label: ``rho0.05`` -> 0.05, ``m8`` -> 8."""
    found = _NUMBER.search(label)
    if not found:
        raise SpecError(f"axis value {label!r} holds no number to plot")
    return float(found.group())


def _runs(row: Row, scale: str, out: Path, archive_root: Path | None = None):
    """(axis values dict, seed, run dir) for every cell x seed of ``row`` at ``scale``; a job whose run dir holds
    no results.json is read from its committed record under ``archive_root`` when there is one."""
    from flatbnn.reproduce.archive import run_or_record
    from flatbnn.reproduce.launch import run_dir

    for cell in row.cells_for(scale):
        values = dict(zip(row.axes, cell.id.split("/")))
        for seed in cell.seeds:
            yield values, seed, run_or_record(run_dir(out, cell.id, seed), archive_root, row.row, scale, cell.id, seed)


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    return records


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def curve_data(row: Row, scale: str, out: Path, spec: dict, archive_root: Path | None = None) -> dict:
    """{facet: {metric: {line: {"epochs": [...], "mean": [...], "std": [...], "seeds": n, "key": used key}}}} over
    the finished runs (a results.json beside the curve): a running or interrupted run's first epochs would join the
    mean as a seed of the early epochs only."""
    facet_axis, line_axis = spec.get("rows"), spec["lines"]
    per = {}  # (facet, metric, line) -> {epoch: [values over seeds]}, plus the key actually used
    keys_used = {}
    for values, _seed, rd in _runs(row, scale, out, archive_root):
        if not (rd / "results.json").exists():
            continue
        records = _read_jsonl(rd / "metrics.jsonl")
        if not records:
            continue
        facet = values.get(facet_axis, "") if facet_axis else ""
        for metric in spec["metrics"]:
            key = next((k for k in metric.split("|") if any(k in r for r in records)), None)
            if key is None:
                continue
            slot = per.setdefault((facet, metric, values[line_axis]), {})
            keys_used[(facet, metric, values[line_axis])] = key
            for r in records:
                if key in r and "epoch" in r:
                    slot.setdefault(int(r["epoch"]), []).append(float(r[key]))
    data = {}
    for (facet, metric, line), by_epoch in per.items():
        epochs = sorted(by_epoch)
        stats = [_mean_std(by_epoch[e]) for e in epochs]
        data.setdefault(facet, {}).setdefault(metric, {})[line] = {
            "epochs": epochs, "mean": [s[0] for s in stats], "std": [s[1] for s in stats],
            "seeds": max(len(v) for v in by_epoch.values()), "key": keys_used[(facet, metric, line)]}
    return data


def sweep_data(row: Row, scale: str, out: Path, spec: dict, archive_root: Path | None = None) -> dict:
    """{metric: {line: {"x": [...], "mean": [...], "std": [...], "seeds": [n per x]}}} from results.json."""
    x_axis, line_axis = spec["x"], spec["lines"]
    per = {}
    for values, _seed, rd in _runs(row, scale, out, archive_root):
        res = rd / "results.json"
        if not res.exists():
            continue
        metrics = json.loads(res.read_text()).get("metrics", {})
        for metric in spec["metrics"]:
            if metric in metrics:
                per.setdefault(metric, {}).setdefault(values[line_axis], {}).setdefault(
                    axis_number(values[x_axis]), []).append(metrics[metric])
    data = {}
    for metric, lines in per.items():
        for line, by_x in lines.items():
            xs = sorted(by_x)
            stats = [_mean_std(by_x[x]) for x in xs]
            keep = [k for k, st in enumerate(stats) if math.isfinite(st[0])]  # e.g. AUROC undefined at smoke
            if keep:
                data.setdefault(metric, {})[line] = {
                    "x": [xs[k] for k in keep], "mean": [stats[k][0] for k in keep],
                    "std": [stats[k][1] for k in keep], "seeds": [len(by_x[xs[k]]) for k in keep]}
    return data


def _finish(fig, row: Row, scale: str, path: Path, caption: str | None = None) -> Path:
    """Lay out, caption with the paper's reading, write atomically, close."""
    import matplotlib.pyplot as plt

    from flatbnn.metrics.reliability import save_png

    fig.tight_layout()
    _caption(fig, row, scale, caption)
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def _caption(fig, row: Row, scale: str, text: str | None = None) -> None:
    pd = row.paper_data() or {}
    claim = (pd.get("figure") or {}).get("claim")
    text = text or f"{row.row} ({scale} scale): mean +- 1 std over seeds."
    if claim:
        text += f"  The paper's reading: {claim}"
    fig.text(0.01, -0.02, "\n".join(textwrap.wrap(text, 160)), ha="left", va="top", fontsize=7)


def seeds_label(line: str, seeds: list[int]) -> str:
    """Legend entry: the seed count per point, a range where points differ (a sweep still filling up)."""
    lo, hi = min(seeds), max(seeds)
    return f"{line} (n={lo})" if lo == hi else f"{line} (n={lo}-{hi} per point)"


def _band(ax, x, mean, std, label):
    line, = ax.plot(x, mean, marker="o" if len(x) < 12 else None, ms=3, label=label)
    lo = [m - s for m, s in zip(mean, std)]
    hi = [m + s for m, s in zip(mean, std)]
    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)


def draw_curves(row: Row, scale: str, out: Path, spec: dict, archive_root: Path | None = None) -> Path | None:
    data = curve_data(row, scale, out, spec, archive_root)
    if not data:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    facets = [v for v in (row.values.get(spec["rows"], {}) if spec.get("rows") else [""]) if v in data]
    metrics = spec["metrics"]
    fig, axes = plt.subplots(len(facets), len(metrics), figsize=(3.4 * len(metrics), 2.8 * len(facets)),
                             squeeze=False)
    for i, facet in enumerate(facets):
        for j, metric in enumerate(metrics):
            ax = axes[i][j]
            lines = data[facet].get(metric, {})
            for line in row.values[spec["lines"]]:
                if line in lines:
                    d = lines[line]
                    _band(ax, d["epochs"], d["mean"], d["std"], f"{line} (n={d['seeds']})")
            key = next(iter(lines.values()))["key"] if lines else metric.split("|")[0]
            ax.set_title(f"{facet}: {key}" if facet else key, fontsize=9)
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
            if lines and j == 0:  # one legend per row of panels: the lines are the same in every column
                ax.legend(fontsize=7)
    return _finish(fig, row, scale, Path(out) / f"{spec.get('name', row.row + '_curves')}.png")


def draw_sweep(row: Row, scale: str, out: Path, spec: dict, archive_root: Path | None = None) -> Path | None:
    data = sweep_data(row, scale, out, spec, archive_root)
    if not data:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in spec["metrics"] if m in data]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.0), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for line in row.values[spec["lines"]]:
            if line in data[metric]:
                d = data[metric][line]
                _band(ax, d["x"], d["mean"], d["std"], seeds_label(line, d["seeds"]))
        if spec.get("xscale"):
            ax.set_xscale(spec["xscale"])
        ax.set_xlabel(spec["x"])
        ax.set_title(metric, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _finish(fig, row, scale, Path(out) / f"{spec.get('name', row.row + '_sweep')}.png")


LOWER_IS_BETTER = ("nll", "ece", "brier", "fpr95")


def _metric_value(metrics: dict, metric: str, results_key: str | None):
    """A final metric from results.json's ``metrics`` (a dotted ``results_key`` such as ``ood.mnist.auroc_ood``)."""
    node = metrics
    for part in (results_key or metric).split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def delta_grid_data(row: Row, scale: str, out: Path, spec: dict, archive_root: Path | None = None) -> dict:
    """{facet: {metric: {row value: {col value: cell}}}}, cell = {"delta": mean_seeds(cell - base) or None, "n",
    "test": name, "p", "beyond": bool, "better": bool | None, "cell": mean, "base": mean} for every col but the base,
    by the row's declared seed test (``Row.seed_test``: Welch for separately trained cells, paired only where they
    share a trained run) and the claims' zero-spread floor (stats.seed_difference_test). Only cells whose every seed
    has finished, against a base that has too."""
    from flatbnn.reproduce.claims import resolution
    from flatbnn.reproduce.stats import NOISE_ALPHA, seed_difference_test, seed_stats

    paired = row.seed_test()[0] == "paired"

    facet_axis, row_axis, col_axis, base = spec.get("facets"), spec["rows"], spec["cols"], spec["base"]
    paper_metrics = (row.paper_data() or {}).get("metrics") or {}
    values = {}  # (facet, row value, col value, metric) -> {seed: value}
    seeds_of, done_of = {}, {}  # (facet, row value, col value) -> the scale's seeds / those with a results.json
    for axes, seed, rd in _runs(row, scale, out, archive_root):
        facet = axes.get(facet_axis, "") if facet_axis else ""
        where = (facet, axes[row_axis], axes[col_axis])
        seeds_of[where] = seeds_of.get(where, 0) + 1
        res = rd / "results.json"
        if not res.exists():
            continue
        done_of[where] = done_of.get(where, 0) + 1
        metrics = json.loads(res.read_text()).get("metrics", {})
        for metric in spec["metrics"]:
            v = _metric_value(metrics, metric, (paper_metrics.get(metric) or {}).get("results_key"))
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                values.setdefault((facet, axes[row_axis], axes[col_axis], metric), {})[seed] = float(v)
    # a cell is drawn only when every seed of the scale has finished on both sides, as the claims judge it: a cell
    # half-way through its seeds is not a result yet (it would show one seed's number as the cell's)
    finished = {w for w, n in seeds_of.items() if done_of.get(w) == n}
    data = {}
    for (facet, rv, cv, metric), by_seed in values.items():
        if cv == base or (facet, rv, base, metric) not in values:
            continue
        if (facet, rv, cv) not in finished or (facet, rv, base) not in finished:
            continue
        base_by_seed = values[(facet, rv, base, metric)]
        x, y = seed_stats(list(by_seed.values())), seed_stats(list(base_by_seed.values()))
        common = sorted(set(by_seed) & set(base_by_seed))
        test = seed_difference_test(by_seed, base_by_seed, x, y, paired=paired,
                                    resolution=resolution(paper_metrics.get(metric)))
        delta = (statistics.fmean(by_seed[k] - base_by_seed[k] for k in common) if paired and common
                 else x.mean - y.mean)
        better_dir = (paper_metrics.get(metric) or {}).get("better")
        lower = better_dir == "lower" if better_dir else metric in LOWER_IS_BETTER
        data.setdefault(facet, {}).setdefault(metric, {}).setdefault(rv, {})[cv] = {
            "delta": delta, "cell": x.mean, "base": y.mean, "n": test.n if test else str(len(common)),
            "test": test.name if test else None, "p": test.result.p if test else None,
            "beyond": bool(test and test.result.beyond(NOISE_ALPHA)),
            "better": None if delta == 0 else (delta < 0) == lower}
    return data


def draw_delta_grid(row: Row, scale: str, out: Path, spec: dict, archive_root: Path | None = None) -> Path | None:
    data = delta_grid_data(row, scale, out, spec, archive_root)
    if not data:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from flatbnn.engine.checkpoint import write_json

    facets = [v for v in (row.values.get(spec["facets"], {}) if spec.get("facets") else [""]) if v in data]
    metrics = [m for m in spec["metrics"] if any(m in data[f] for f in facets)]
    rows_ = [r for r in row.values[spec["rows"]] if any(r in data[f].get(m, {}) for f in facets for m in metrics)]
    cols = [c for c in row.values[spec["cols"]] if c != spec["base"]]
    fig, axes = plt.subplots(len(facets), len(metrics), squeeze=False,
                             figsize=((1.1 * len(cols) + 1.8) * len(metrics), (0.32 * len(rows_) + 1.3) * len(facets)))
    for i, facet in enumerate(facets):
        for j, metric in enumerate(metrics):
            ax, grid = axes[i][j], data[facet].get(metric, {})
            # colour saturates at the panel's 90th-percentile |change| (one outlier does not wash out the rest)
            deltas = sorted(abs(c["delta"]) for r in grid.values() for c in r.values())
            scale_ = deltas[int(0.9 * (len(deltas) - 1))] if deltas else 0.0
            scale_ = scale_ if scale_ > 0 else (deltas[-1] if deltas and deltas[-1] > 0 else 1.0)
            ax.set_xlim(0, len(cols))
            ax.set_ylim(len(rows_), 0)
            for y, rv in enumerate(rows_):
                for x, cv in enumerate(cols):
                    cell = grid.get(rv, {}).get(cv)
                    if cell is None:  # the pair is not run (own perturbation) or its seeds have not all finished
                        continue
                    signed = min(abs(cell["delta"]) / scale_, 1.0) * (1 if cell["better"] else -1)
                    colour = plt.get_cmap("RdYlGn")(0.5 + 0.45 * signed)
                    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=colour, edgecolor="white", linewidth=0.5))
                    if cell["beyond"]:
                        ax.add_patch(Rectangle((x + 0.04, y + 0.06), 0.92, 0.88, fill=False, edgecolor="black",
                                               linewidth=1.6))
                    ax.text(x + 0.5, y + 0.5, f"{cell['delta']:+.3g}" + ("*" if cell["beyond"] else ""),
                            ha="center", va="center", fontsize=6.5,
                            fontweight="bold" if cell["beyond"] else "normal")
            ax.set_xticks([k + 0.5 for k in range(len(cols))], cols, fontsize=8)
            ax.set_yticks([k + 0.5 for k in range(len(rows_))], rows_ if j == 0 else [], fontsize=8)
            ax.tick_params(length=0)
            title = f"{facet}: " if facet else ""
            ax.set_title(f"{title}change in {metric} vs {spec['cols']}={spec['base']}", fontsize=8)
    test_name = "paired t over common seeds" if row.seed_test()[0] == "paired" else "Welch t"
    caption = (f"{row.row} ({scale} scale): mean over seeds of the cell minus the {spec['cols']}={spec['base']} "
               f"cell of its row; green = better, red = worse for the metric; outlined and * = beyond seed noise "
               f"({test_name}, two-sided 5 %, one comparison: the claims on the page adjust for the family); "
               f"blank = not run, or not all its seeds finished.")
    path = _finish(fig, row, scale, Path(out) / f"{spec.get('name', row.row + '_delta_grid')}.png", caption)
    write_json(path.with_suffix(".json"), {"spec": spec, "scale": scale, "grid": data,
                                           "rule": f"{test_name}, two-sided 5 %, unadjusted"})
    return path


def draw_figures(row: Row, scale: str, out: Path, archive_root: Path | None = None) -> list[Path]:
    """Every figure of ``row.compare.figures`` from the runs under ``out`` (a figure without data is skipped)."""
    paths = []
    for spec in (row.compare or {}).get("figures") or []:
        kind = spec.get("kind")
        if kind not in KINDS:
            raise SpecError(f"{row.row}: compare.figures kind must be one of {KINDS}, got {kind!r}")
        draw = {"curves": draw_curves, "sweep": draw_sweep, "delta_grid": draw_delta_grid}[kind]
        path = draw(row, scale, Path(out), spec, archive_root=archive_root)
        if path is not None:
            paths.append(path)
    return paths
