#!/usr/bin/env python
"""Aggregate run directories (each with a results.json) into a table: mean ± std over seeds.

    python scripts/aggregate.py multirun/2026-11-22/12-00-00 [more dirs...] [--markdown] [--out table.md]

Rows are grouped by (dataset, model, method, flatness and its radius); every row states its budget
(epochs, train size, world size, hardware) so a short CPU run is never mistaken for a paper number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

METRICS = ["accuracy", "nll", "ece", "brier", "auroc_misclassification", "auroc_ood"]


def find_results(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        p = Path(p)
        files = [p] if p.name == "results.json" else sorted(p.rglob("results.json"))
        for f in files:
            try:
                out.append(json.loads(f.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                print(f"skipping {f}: {e}", file=sys.stderr)
    return out


def row_key(meta: dict) -> tuple:
    fl = meta["flatness"]
    flat = fl["name"] + (f"(rho={fl['rho']})" if "rho" in fl else "")
    return (meta["dataset"], meta["model"], meta["method"]["name"], flat)


def aggregate(results: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[row_key(r["meta"])].append(r)
    rows = []
    for key, runs in sorted(groups.items()):
        row = {"dataset": key[0], "model": key[1], "method": key[2], "flatness": key[3],
               "seeds": sorted(r["meta"]["seed"] for r in runs)}
        for m in METRICS:
            vals = [r["metrics"][m] for r in runs if isinstance(r["metrics"].get(m), (int, float))]
            if vals:
                row[m] = (statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)
        b, hw = runs[0]["meta"]["budget"], runs[0]["meta"]["hardware"]
        row["budget"] = (f"{b['epochs']} ep, n={b['train_size']}, batch {b['global_batch']}, "
                         f"{b['world_size']}x{hw.get('gpu', hw['device'])}")
        row["commits"] = sorted({r["meta"]["git"]["commit"][:8] for r in runs})
        rows.append(row)
    return rows


def fmt(v, m) -> str:
    mean, std = v
    if m == "accuracy":
        return f"{100 * mean:.2f} ± {100 * std:.2f}"
    return f"{mean:.4f} ± {std:.4f}"


def to_markdown(rows: list[dict]) -> str:
    metrics = [m for m in METRICS if any(m in r for r in rows)]
    head = ["dataset", "model", "method", "flatness", "seeds", *[("acc %" if m == "accuracy" else m) for m in metrics],
            "budget", "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["dataset"], r["model"], r["method"], r["flatness"], ",".join(map(str, r["seeds"]))]
        cells += [fmt(r[m], m) if m in r else "–" for m in metrics]
        cells += [r["budget"], ",".join(r["commits"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="run or sweep directories (searched for results.json)")
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--json", help="also write the aggregated rows as JSON here")
    args = ap.parse_args(argv)
    results = find_results(args.paths)
    if not results:
        print(f"no results.json under {args.paths}", file=sys.stderr)
        return 1
    rows = aggregate(results)
    table = to_markdown(rows)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
