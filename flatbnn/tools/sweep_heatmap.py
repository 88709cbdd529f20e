#!/usr/bin/env python
"""Heat map of a metric over a two-key sweep (e.g. Fisher-SAM's rho x eta, FSAM paper Fig. 5).

    python train.py --multirun flatness=fsam flatness.rho=0.01,0.05,0.1 flatness.eta=0,0.1,1 ...
    python scripts/sweep_heatmap.py multirun/DATE/TIME --x flatness.rho --y flatness.eta \
        --metric accuracy --out results/fsam_sweep/heatmap.png

Keys are read from each run's results.json (``meta.<section>.<key>``, e.g. ``flatness.rho``); cells
average over seeds. The runs must differ ONLY in the two swept keys and the seed (their whole saved config,
budget and hardware kind are compared as ``scripts/aggregate.py`` groups runs): otherwise the map would
average different experiments, so the script stops naming the keys that differ (exit 2), or with ``--split``
draws one map per distinct rest-of-config (``<out stem>_1.png``, ...). The title states the budget (data set,
model, epochs, train and test size, hardware, commit) so the figure is never mistaken for a paper number. Every
cell shows its mean and its number of seeds. Differences inside the noise are greyed out: a cell's standard error
is sqrt(sd_seeds^2 / k + p(1-p) / n_test) (the second term for accuracy only: the test set's binomial error; the
first needs k >= 2 seeds), and the cells within 2 sqrt(se_best^2 + se_cell^2) of the best cell -- the best among
them -- are drawn grey: the map cannot rank them. The text grid has a column header. Writes ``<out>.json`` beside
each PNG (means, seeds and standard error per cell, which cells tie with the best).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from flatbnn.metrics.reliability import save_png  # noqa: E402
from flatbnn.engine.checkpoint import write_json  # noqa: E402
from flatbnn.reproduce.aggregate import load_runs  # noqa: E402


def lookup(meta: dict, dotted: str):
    node = meta
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"{dotted!r} not in results.json meta (have: {sorted(meta)})")
        node = node[part]
    return node


def grid(results: list[dict], x: str, y: str, metric: str):
    cells = defaultdict(list)
    for r in results:
        value = r["metrics"].get(metric)
        if isinstance(value, (int, float)):
            cells[(lookup(r["meta"], x), lookup(r["meta"], y))].append(value)
    xs = sorted({k[0] for k in cells})
    ys = sorted({k[1] for k in cells})
    mean = [[statistics.fmean(cells[(a, b)]) if (a, b) in cells else float("nan") for a in xs] for b in ys]
    count = [[len(cells.get((a, b), [])) for a in xs] for b in ys]
    return xs, ys, mean, count, cells


LOWER_IS_BETTER = ("nll", "ece", "brier", "fpr95")
NOISE_Z = 2.0  # a difference counts when it exceeds NOISE_Z standard errors of the difference


def standard_error(values: list[float], metric: str, n_test: int | None) -> float | None:
    """sqrt(sd_seeds^2 / k + p(1-p)/n_test): seed noise (k >= 2) plus, for accuracy, the test set's binomial
    error; None when neither is known (one seed of a metric other than accuracy)."""
    var, known = 0.0, False
    if len(values) >= 2:
        var += statistics.variance(values) / len(values)
        known = True
    if metric == "accuracy" and n_test:
        p = statistics.fmean(values)
        var += p * (1.0 - p) / n_test
        known = True
    return var ** 0.5 if known else None


def ties_with_best(xs, ys, mean, cells, metric: str, n_test: int | None):
    """``(se grid, tie grid)``: a cell ties when its difference from the best cell is within NOISE_Z standard
    errors of that difference (the best cell ties with itself); None where the noise is unknown."""
    se = [[standard_error(cells[(a, b)], metric, n_test) if (a, b) in cells else None for a in xs] for b in ys]
    filled = [(j, i) for j, row in enumerate(mean) for i, v in enumerate(row) if v == v]
    if not filled:
        return se, [[None] * len(xs) for _ in ys]
    pick = min if metric in LOWER_IS_BETTER else max
    bj, bi = pick(filled, key=lambda ji: mean[ji[0]][ji[1]])
    tie = [[None] * len(xs) for _ in ys]
    for j, i in filled:
        if se[j][i] is None or se[bj][bi] is None:
            continue
        tie[j][i] = abs(mean[j][i] - mean[bj][bi]) <= NOISE_Z * (se[j][i] ** 2 + se[bj][bi] ** 2) ** 0.5
    return se, tie


def _swept(key: str, swept: tuple[str, ...]) -> bool:
    """A group-key entry that belongs to a swept key (its config key, its meta copy or its override)."""
    return any(key == k or key.startswith(k + ".") for s in swept for k in (s, f"meta.{s}", f"override.{s}"))


def split_by_rest(runs, swept: tuple[str, ...]) -> list[tuple[dict, list]]:
    """``[(rest key, runs)]``: runs grouped by everything in their group key except the swept keys
    (flatbnn.reproduce.aggregate.run_key: saved config without seed/paths, budget, hardware kind)."""
    groups: dict[tuple, tuple[dict, list]] = {}
    for r in runs:
        rest = {k: v for k, v in r.key.items() if not _swept(k, swept)}
        groups.setdefault(tuple(sorted(rest.items())), (rest, []))[1].append(r)
    return list(groups.values())


def differing_keys(rests: list[dict]) -> dict[str, list[str]]:
    keys = sorted(set().union(*rests))
    return {k: sorted({r.get(k, "<absent>") for r in rests}) for k in keys if len({r.get(k, "<absent>") for r in rests}) > 1}


def test_size(results: list[dict]) -> int | None:
    sizes = {r["meta"].get("budget", {}).get("test_size") for r in results}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def budget_line(results: list[dict]) -> str:
    m = results[0]["meta"]
    b, hw = m["budget"], m["hardware"]
    device = hw.get("gpu") or f"{hw.get('device', 'cpu')} ({hw.get('cpu_count', '?')} cores)"
    commits = sorted({r["meta"]["git"]["commit"][:8] for r in results})
    seeds = sorted({r["meta"]["seed"] for r in results})
    return (f"{m['dataset']} (train n={b['train_size']}, test n={test_size(results) or '?'}), {m['model']}, "
            f"{m['method']['name']}, {b['epochs']} ep, seeds {','.join(map(str, seeds))}, {b['world_size']}x {device}, "
            f"commit {','.join(commits)}")


def _label(metric: str, v: float) -> str:
    return (f"{100 * v:.2f}" if metric == "accuracy" else f"{v:.3f}") if v == v else "–"


def plot(xs, ys, mean, count, tie, x, y, metric, title, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2.5, 1.0 * len(ys) + 2.0))
    scale = 100 if metric == "accuracy" else 1
    values = np.array(mean, dtype=float) * scale
    n_tied = sum(bool(t) for row in tie for t in row)
    grey = np.array([[bool(t) and n_tied > 1 for t in row] for row in tie])
    im = ax.imshow(np.ma.masked_where(grey, values), origin="lower", cmap="viridis", aspect="auto",
                   vmin=np.nanmin(values), vmax=np.nanmax(values))  # the scale of every cell, greyed ones too
    if grey.any():  # ties with the best: one colour, the map cannot rank them
        ax.imshow(np.ma.masked_where(~grey, np.ones_like(values)), origin="lower", cmap="Greys", vmin=0, vmax=2.5,
                  aspect="auto")
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    ax.set_xlabel(f"{x} (columns)")
    ax.set_ylabel(f"{y} (rows)")
    for j, row in enumerate(mean):
        for i, v in enumerate(row):
            seeds = f"\n{count[j][i]} seed{'s' if count[j][i] != 1 else ''}" if count[j][i] else ""
            ax.text(i, j, _label(metric, v) + seeds, ha="center", va="center", fontsize=8,
                    color="k" if grey[j][i] else "w")
    fig.colorbar(im, ax=ax, label=f"{metric}{' (%)' if metric == 'accuracy' else ''}")
    ax.set_title(title, fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="sweep or run directories (searched for results.json)")
    ap.add_argument("--x", default="flatness.rho")
    ap.add_argument("--y", default="flatness.eta")
    ap.add_argument("--metric", default="accuracy")
    ap.add_argument("--out", required=True, help="PNG path (a .json with the grid is written beside it)")
    ap.add_argument("--split", action="store_true",
                    help="runs that differ in more than the swept keys: one map per distinct config instead of an error")
    args = ap.parse_args(argv)
    runs = load_runs(args.paths)[0]
    if not runs:
        print(f"no results.json under {args.paths}", file=sys.stderr)
        return 1
    groups = split_by_rest(runs, (args.x, args.y))
    if len(groups) > 1 and not args.split:
        diff = differing_keys([rest for rest, _ in groups])
        shown = "; ".join(f"{k} in {{{', '.join(v)}}}" for k, v in list(diff.items())[:6])
        print(f"sweep_heatmap: error: the runs differ in more than {args.x} x {args.y} ({len(groups)} configs: "
              f"{shown}{' ...' if len(diff) > 6 else ''}); pass only one sweep's runs, or --split for one map each",
              file=sys.stderr)
        return 2
    rc = 0
    for i, (rest, members) in enumerate(groups, 1):
        out = Path(args.out)
        if len(groups) > 1:
            out = out.with_name(f"{out.stem}_{i}{out.suffix}")
            diff = differing_keys([r for r, _ in groups])
            print(f"config {i} -> {out}: " + ", ".join(f"{k}={rest.get(k, '<absent>')}" for k in diff))
        rc = max(rc, _one_map([r.results for r in members], args, out))
    return rc


def _one_map(results: list[dict], args, out: Path) -> int:
    try:
        xs, ys, mean, count, cells = grid(results, args.x, args.y, args.metric)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    n_test = test_size(results)
    se, tie = ties_with_best(xs, ys, mean, cells, args.metric, n_test)
    n_tied = sum(bool(t) for row in tie for t in row)
    noise = (f"grey: {n_tied} cells within seed / test-set noise of the best ({NOISE_Z:g} se)" if n_tied > 1 else
             "noise unknown (one seed; only accuracy has a test-set error)" if all(t is None for r in tie for t in r)
             else "the best cell is beyond noise of every other")
    title = f"{args.metric} over {args.x} x {args.y}; {noise}\n{budget_line(results)}"
    plot(xs, ys, mean, count, tie, args.x, args.y, args.metric, title, out)
    write_json(out.with_suffix(".json"),  # atomic
               {"x": args.x, "y": args.y, "metric": args.metric, "x_values": xs, "y_values": ys,
                "mean": mean, "runs_per_cell": count, "seeds_per_cell": count, "se_per_cell": se,
                "ties_with_best": tie, "noise_rule": f"|mean - best| <= {NOISE_Z:g} sqrt(se^2 + se_best^2), "
                "se^2 = sd_seeds^2/k (k >= 2) + p(1-p)/n_test (accuracy)", "test_size": n_test,
                "budget": budget_line(results), "note": "our runs, not the paper's numbers"})
    print(f"{args.metric} ({args.y} rows x {args.x} columns; per cell: mean [seeds], '~' ties with the best "
          f"within noise), {budget_line(results)}")
    width = 14
    corner = f"{args.y} \\ {args.x}"  # rows \ columns
    print(f"{corner:>{width}} " + " ".join(f"{v!s:>{width}}" for v in xs))
    for yv, row, nrow, trow in zip(ys, mean, count, tie):
        print(f"{yv!s:>{width}} " + " ".join(
            f"{(f'{v:.4f} [{n}]' + ('~' if t and n_tied > 1 else ' ')) if v == v else '-':>{width}}"
            for v, n, t in zip(row, nrow, trow)))
    print(f"{noise}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
