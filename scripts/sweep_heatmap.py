#!/usr/bin/env python
"""Heat map of a metric over a two-key sweep (e.g. Fisher-SAM's rho x eta, FSAM paper Fig. 5).

    python train.py --multirun flatness=fsam flatness.rho=0.01,0.05,0.1 flatness.eta=0,0.1,1 ...
    python scripts/sweep_heatmap.py multirun/DATE/TIME --x flatness.rho --y flatness.eta \
        --metric accuracy --out results/fsam_sweep/heatmap.png

Keys are read from each run's results.json (``meta.<section>.<key>``, e.g. ``flatness.rho``); cells
average over seeds. The title states the budget (data set, model, epochs, train size, hardware,
commit) so the figure is never mistaken for a paper number. Writes ``<out>.json`` beside the PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aggregate import find_results  # noqa: E402


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
    return xs, ys, mean, count


def budget_line(results: list[dict]) -> str:
    m = results[0]["meta"]
    b, hw = m["budget"], m["hardware"]
    device = hw.get("gpu") or f"{hw.get('device', 'cpu')} ({hw.get('cpu_count', '?')} cores)"
    commits = sorted({r["meta"]["git"]["commit"][:8] for r in results})
    seeds = sorted({r["meta"]["seed"] for r in results})
    return (f"{m['dataset']} (n={b['train_size']}), {m['model']}, {m['method']['name']}, {b['epochs']} ep, "
            f"seeds {','.join(map(str, seeds))}, {b['world_size']}x {device}, commit {','.join(commits)}")


def plot(xs, ys, mean, x, y, metric, title, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2.5, 1.0 * len(ys) + 2.0))
    im = ax.imshow(mean, origin="lower", cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    scale = 100 if metric == "accuracy" else 1
    for j, row in enumerate(mean):
        for i, v in enumerate(row):
            label = (f"{scale * v:.2f}" if metric == "accuracy" else f"{v:.3f}") if v == v else "–"
            ax.text(i, j, label, ha="center", va="center", color="w", fontsize=9)
    fig.colorbar(im, ax=ax, label=metric)
    ax.set_title(title, fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="sweep or run directories (searched for results.json)")
    ap.add_argument("--x", default="flatness.rho")
    ap.add_argument("--y", default="flatness.eta")
    ap.add_argument("--metric", default="accuracy")
    ap.add_argument("--out", required=True, help="PNG path (a .json with the grid is written beside it)")
    args = ap.parse_args(argv)
    results = find_results(args.paths)
    if not results:
        print(f"no results.json under {args.paths}", file=sys.stderr)
        return 1
    try:
        xs, ys, mean, count = grid(results, args.x, args.y, args.metric)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    title = f"{args.metric} over {args.x} x {args.y}\n{budget_line(results)}"
    out = Path(args.out)
    plot(xs, ys, mean, args.x, args.y, args.metric, title, out)
    out.with_suffix(".json").write_text(json.dumps(
        {"x": args.x, "y": args.y, "metric": args.metric, "x_values": xs, "y_values": ys,
         "mean": mean, "runs_per_cell": count, "budget": budget_line(results),
         "note": "our runs, not the paper's numbers"}, indent=2))
    print(f"{args.metric} ({args.y} rows x {args.x} columns), {budget_line(results)}")
    for yv, row in zip(ys, mean):
        print(f"{yv!s:>8} " + " ".join(f"{v:8.4f}" for v in row))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
