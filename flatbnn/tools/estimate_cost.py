"""Estimate the GPU cost of every paper row at paper scale (the table in docs/cluster.md).

    python scripts/estimate_cost.py                       # Markdown table on stdout (every train row)
    python scripts/estimate_cost.py --rows bsam_t6,fsam_t4 --tflops 40
    python scripts/estimate_cost.py --write-docs          # replace the table in docs/cluster.md

Per train row (rows/<row>.yaml at paper scale; blocked cells, eval rows and script rows are skipped) and per cell
(each composed as train.py would, via flatbnn.reproduce.launch.compose_cell):

    run FLOPs = 3 x F x N_train x epochs x passes x members  +  F x N_test x samples

F = the network's forward FLOPs for one image at the data set's input size (torch.utils.flop_counter on a batch of
one; multiply-adds count 2); 3 x F = forward + backward; passes = what the cell's flatness and method classes declare
(their ``passes`` attribute: 2 for the SAM family -- sam / asam / fsam / geometry, also through presets such as
f_*, sam_adam -- and for methods bsam / vsam, else 1); members = the deep
ensemble's method.num_members (trained one after the other in one run); samples = the predictive samples of the
final evaluation (method.num_samples; an ensemble's members; at least 1). N_train / N_test come from dataset.train_subset / test_subset where the config sets them, else the
standard sizes in SPLIT_SIZES below. Every run of a cell (one per seed) costs the same.

GPU-hours = FLOPs / --tflops (default 25 TFLOP/s: an assumed sustained rate of one A100 in bf16 on these
ResNet / WRN-sized networks, about 8 % of its 312 TFLOP/s dense peak; replace it by a measured one, `make bench`).
Not counted: data loading, BatchNorm refreshes of SWAG samples, SWAG / SGLD bookkeeping, retries.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flatbnn import resources
from flatbnn.cli import EXIT_CONFIG
# the per-run formula lives with the measured rates (the dry runs and the campaign use both); names kept here
from flatbnn.reproduce.cost import (SPLIT_SIZES, CostError, RunCost, estimate, forward_flops,  # noqa: E402,F401
                                    run_cost)

DOCS = resources.project_root() / "docs" / "cluster.md"  # --write-docs: a checkout's
START, END = "<!-- cost-table:start -->", "<!-- cost-table:end -->"
LONGEST_SHOWN = 4  # rows whose longest run is listed under the table
HEADER = ("row", "runs (cells × seeds)", "networks (forward GFLOPs / image)", "two-pass share", "est. PFLOP",
          "est. A100-hours", "est. hours on {device} (runs at a measured rate)")
MEASURED_DEVICE = "nvidia-h200"  # the device results/bench/ has measurements of (flatbnn/reproduce/cost.py)

@dataclass
class RowCost:
    row: str
    runs: int = 0
    two_pass_runs: int = 0
    flops: float = 0.0
    networks: set = field(default_factory=set)  # (network, GFLOPs, dataset)
    longest: tuple[float, str] = (0.0, "")      # (FLOPs, cell id) of the row's most expensive single run
    device_seconds: float = 0.0                 # wall time on the --device: measured rate where one matches
    measured_runs: int = 0                      # ... for this many of the runs; the others at the assumed rate

    def gpu_hours(self, tflops: float) -> float:
        return self.flops / (tflops * 1e12) / 3600.0


def row_cost(name: str, device: str = MEASURED_DEVICE) -> RowCost | None:
    """The row's cost at paper scale, or None for rows that train nothing there (eval / script / no paper scale)."""
    from flatbnn.reproduce import launch, spec

    try:
        row = spec.load_row(name)
    except (FileNotFoundError, spec.SpecError) as e:
        raise CostError(f"row {name!r}: {' '.join(str(e).split())}") from None
    if row.kind != "train" or row.scale("paper") is None:
        return None
    out = RowCost(name)
    for cell in row.cells_for("paper"):
        if cell.blocked:
            continue
        try:
            cfg = launch.compose_cell(list(cell.overrides))
        except Exception as e:  # a spec that no longer composes: the table would be wrong, not just rough
            raise CostError(f"{name} / {cell.id} does not compose: {' '.join(str(e).split())[:200]}") from None
        cost = run_cost(cfg)
        seeds = len(cell.seeds)
        est = estimate(cfg, device)
        out.device_seconds += seeds * est.seconds
        out.measured_runs += seeds if est.rate.measured else 0
        out.runs += seeds
        out.two_pass_runs += seeds if cost.passes == 2 else 0
        out.flops += seeds * cost.flops
        out.networks.add((cost.network, cost.forward_flops / 1e9, cost.dataset))
        out.longest = max(out.longest, (cost.flops, cell.id))
    return out


# ---------------------------------------------------------------------------------------------- output
def _hours(h: float) -> str:
    return f"~{h:,.0f}"


def markdown_table(costs: list[RowCost], tflops: float, device: str = MEASURED_DEVICE) -> str:
    header = [h.format(device=device) for h in HEADER]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in costs:
        nets = ", ".join(f"{n} {g:.3g} ({d})" for n, g, d in sorted(c.networks))
        share = f"{100 * c.two_pass_runs / c.runs:.0f}%" if c.runs else "-"
        lines.append(f"| `{c.row}` | {c.runs} | {nets} | {share} | {c.flops / 1e15:,.0f} | "
                     f"{_hours(c.gpu_hours(tflops))} | {_hours(c.device_seconds / 3600)} ({c.measured_runs}/{c.runs}) |")
    total_runs = sum(c.runs for c in costs)
    total_hours = sum(c.gpu_hours(tflops) for c in costs)
    lines.append(f"| **all** | **{total_runs}** | | | **{sum(c.flops for c in costs) / 1e15:,.0f}** | "
                 f"**{_hours(total_hours)}** | **{_hours(sum(c.device_seconds for c in costs) / 3600)}** "
                 f"({sum(c.measured_runs for c in costs)}/{total_runs}) |")
    # the runs a job's wall-clock limit must cover (timeout_min x (max_num_timeout + 1), docs/cluster.md)
    longest = sorted(costs, key=lambda c: c.longest, reverse=True)[:LONGEST_SHOWN]
    runs = "; ".join(f"`{c.row}` {c.longest[1]} ~{c.longest[0] / (tflops * 1e12) / 3600:,.1f}" for c in longest)
    lines += ["", f"Longest single runs (A100-hours at {tflops:g} TFLOP/s): {runs}.", "",
              f"Last column: each run's wall time on {device} from a measured throughput where one matches its network, "
              f"method, flatness, m and precision (results/bench/*.json, finished runs' records), else its FLOPs at the "
              f"assumed rate; the parenthesis counts the runs at a measured rate (flatbnn/reproduce/cost.py)."]
    return "\n".join(lines) + "\n"


def replace_table(text: str, table: str) -> str:
    """``text`` with everything between the cost-table markers replaced by ``table``."""
    pattern = re.compile(re.escape(START) + r"\n.*?" + re.escape(END), re.S)
    if len(pattern.findall(text)) != 1:
        raise CostError(f"expected exactly one {START} ... {END} pair in the docs file; add them around the table")
    return pattern.sub(lambda _: f"{START}\n{table}{END}", text)


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="comma-separated row names (default: every train row)")
    ap.add_argument("--tflops", type=float, default=25.0,
                    help="assumed sustained TFLOP/s of one GPU (default 25: an A100 in bf16 on CIFAR-sized nets)")
    ap.add_argument("--device", default=MEASURED_DEVICE,
                    help="the device of the last column (a results/bench/ slug, or cpu)")
    ap.add_argument("--write-docs", action="store_true",
                    help=f"replace the table between {START} and {END} in --docs (atomically)")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the Markdown file --write-docs edits")
    args = ap.parse_args(argv)
    try:
        if not args.tflops > 0:
            raise CostError(f"--tflops must be > 0, got {args.tflops}")
        from flatbnn.reproduce import spec

        names = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else spec.list_rows()
        if not names:
            raise CostError("--rows names no row")
        docs_text = args.docs.read_text() if args.write_docs else None  # fail on a bad path before minutes of work
        if docs_text is not None:
            replace_table(docs_text, "")
        costs = [c for c in (row_cost(n, args.device) for n in names) if c is not None]
        if not costs:
            raise CostError(f"no train row with a paper scale among: {', '.join(names)}")
        table = markdown_table(costs, args.tflops, args.device)
        sys.stdout.write(table)
        if docs_text is not None:
            write_atomic(args.docs, replace_table(docs_text, table))
            print(f"wrote {args.docs}", file=sys.stderr)
    except (CostError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
