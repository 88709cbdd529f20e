"""Estimate the GPU cost of every paper row at paper scale (the table in docs/cluster.md).

    python scripts/estimate_cost.py                       # Markdown table on stdout (every train row)
    python scripts/estimate_cost.py --rows bsam_t6,fsam_t4 --tflops 40
    python scripts/estimate_cost.py --write-docs          # replace the table in docs/cluster.md

Per train row (rows/<row>.yaml at paper scale; blocked cells, eval rows and script rows are skipped) and per cell
(each composed as train.py would, via flatbnn.reproduce.launch.compose_cell):

    run FLOPs = 3 x F x N_train x epochs x passes x members  +  F x N_test x samples

F = the network's forward FLOPs for one image at the data set's input size (torch.utils.flop_counter on a batch of
one; multiply-adds count 2); 3 x F = forward + backward; passes = 2 for the SAM family (flatness sam / asam / fsam /
geometry, and the presets that compose them: f_*, sam_adam) and for methods bsam / vsam, else 1; members = the deep
ensemble's method.num_members (trained one after the other in one run); samples = the predictive samples of the
final evaluation (method.num_samples; an ensemble's members; at least 1). N_train / N_test come from dataset.train_subset / test_subset where the config sets them, else the
standard sizes in SPLIT_SIZES below. Every run of a cell (one per seed) costs the same.

GPU-hours = FLOPs / --tflops (default 25 TFLOP/s: an assumed sustained rate of one A100 in bf16 on these
ResNet / WRN-sized networks, about 8 % of its 312 TFLOP/s dense peak; replace it by a measured one, `make bench`).
Not counted: data loading, BatchNorm refreshes of SWAG samples, SWAG / SGLD bookkeeping, retries.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flatbnn.cli import EXIT_CONFIG  # noqa: E402

DOCS = ROOT / "docs" / "cluster.md"
START, END = "<!-- cost-table:start -->", "<!-- cost-table:end -->"
LONGEST_SHOWN = 4  # rows whose longest run is listed under the table
HEADER = ("row", "runs (cells × seeds)", "networks (forward GFLOPs / image)", "two-pass share", "est. PFLOP",
          "est. A100-hours")

# (train, test) images of each data set's standard split, for configs that do not subset it.
SPLIT_SIZES = {
    "cifar10": (50_000, 10_000),
    "cifar100": (50_000, 10_000),
    "mnist": (60_000, 10_000),
    "fashion_mnist": (60_000, 10_000),
    "svhn": (73_257, 26_032),
    "tinyimagenet": (100_000, 10_000),        # the labelled validation set is the test set
    "imagenet": (1_281_167, 50_000),
    "stanford_cars": (8_144, 8_041),
    "flowers102": (2_040, 6_149),             # train_split=trainval (trnid + valid); `train` halves it
    "digits": (1_437, 360),
}
# flatness configs (by _target_ class) and methods that take two forward/backward passes per step
TWO_PASS_FLATNESS = {"SAM", "ASAM", "FisherSAM", "Geometry"}
TWO_PASS_METHODS = {"BSAM", "VariationalSAM"}


class CostError(ValueError):
    """Bad input (unknown row, missing markers, a cell that does not compose): one line, exit 2."""


# ---------------------------------------------------------------------------------------------- counting
def forward_flops(model: nn.Module, input_shape) -> int:
    """FLOPs of one forward pass of ``model`` on one input of ``input_shape`` (no batch dimension)."""
    model.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, *input_shape))
    return int(counter.get_total_flops())


@functools.cache
def _network_flops(model_json: str, shape: tuple[int, ...]) -> int:
    # keyed on the resolved model config: cells of a row share networks, and WRN-28-10 / ViT-B take seconds to build
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    return forward_flops(instantiate(OmegaConf.create(json.loads(model_json))), shape)


def _target_class(group_cfg) -> str:
    return str((group_cfg or {}).get("_target_", "")).rsplit(".", 1)[-1]


@dataclass
class RunCost:
    """The cost of one run (one cell, one seed) and what it was computed from."""
    network: str
    dataset: str
    forward_flops: int
    train_images: int
    test_images: int
    epochs: int
    passes: int
    members: int
    samples: int

    @property
    def train_flops(self) -> float:
        return 3.0 * self.forward_flops * self.train_images * self.epochs * self.passes * self.members

    @property
    def eval_flops(self) -> float:
        return float(self.forward_flops) * self.test_images * self.samples

    @property
    def flops(self) -> float:
        return self.train_flops + self.eval_flops


def run_cost(cfg) -> RunCost:
    """The cost of one run of a composed config."""
    from omegaconf import OmegaConf

    ds = cfg.dataset
    size = ds.get("image_size")
    shape = tuple(int(s) for s in ds.input_shape)
    if size:  # served at S x S (e.g. CIFAR at 224 for a ViT)
        shape = (shape[0], int(size), int(size))
    model_json = json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True)
    standard = SPLIT_SIZES.get(ds.name)
    if standard is None and not (ds.get("train_subset") and ds.get("test_subset")):
        raise CostError(f"no standard split size for dataset {ds.name!r}: add it to SPLIT_SIZES in "
                        f"scripts/estimate_cost.py")
    n_train = ds.get("train_subset") or standard[0]
    if ds.name == "flowers102" and ds.get("train_split") == "train" and not ds.get("train_subset"):
        n_train = 1_020
    n_train -= int(ds.get("val_split") or 0)
    n_test = ds.get("test_subset") or standard[1]
    method = cfg.method
    two_pass = (_target_class(cfg.get("flatness")) in TWO_PASS_FLATNESS
                or _target_class(method) in TWO_PASS_METHODS)
    return RunCost(network=str(cfg.model.get("name", _target_class(cfg.model))), dataset=str(ds.name),
                   forward_flops=_network_flops(model_json, shape), train_images=int(n_train),
                   test_images=int(n_test), epochs=int(cfg.trainer.epochs), passes=2 if two_pass else 1,
                   members=int(method.get("num_members") or 1),
                   # a deep ensemble predicts with each member once (its num_samples is its num_members)
                   samples=max(1, int(method.get("num_samples") or method.get("num_members") or 1)))


@dataclass
class RowCost:
    row: str
    runs: int = 0
    two_pass_runs: int = 0
    flops: float = 0.0
    networks: set = field(default_factory=set)  # (network, GFLOPs, dataset)
    longest: tuple[float, str] = (0.0, "")      # (FLOPs, cell id) of the row's most expensive single run

    def gpu_hours(self, tflops: float) -> float:
        return self.flops / (tflops * 1e12) / 3600.0


def row_cost(name: str) -> RowCost | None:
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
        out.runs += seeds
        out.two_pass_runs += seeds if cost.passes == 2 else 0
        out.flops += seeds * cost.flops
        out.networks.add((cost.network, cost.forward_flops / 1e9, cost.dataset))
        out.longest = max(out.longest, (cost.flops, cell.id))
    return out


# ---------------------------------------------------------------------------------------------- output
def _hours(h: float) -> str:
    return f"~{h:,.0f}"


def markdown_table(costs: list[RowCost], tflops: float) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for c in costs:
        nets = ", ".join(f"{n} {g:.3g} ({d})" for n, g, d in sorted(c.networks))
        share = f"{100 * c.two_pass_runs / c.runs:.0f}%" if c.runs else "-"
        lines.append(f"| `{c.row}` | {c.runs} | {nets} | {share} | {c.flops / 1e15:,.0f} | "
                     f"{_hours(c.gpu_hours(tflops))} |")
    total_runs = sum(c.runs for c in costs)
    total_hours = sum(c.gpu_hours(tflops) for c in costs)
    lines.append(f"| **all** | **{total_runs}** | | | **{sum(c.flops for c in costs) / 1e15:,.0f}** | "
                 f"**{_hours(total_hours)}** |")
    # the runs a job's wall-clock limit must cover (timeout_min x (max_num_timeout + 1), docs/cluster.md)
    longest = sorted(costs, key=lambda c: c.longest, reverse=True)[:LONGEST_SHOWN]
    runs = "; ".join(f"`{c.row}` {c.longest[1]} ~{c.longest[0] / (tflops * 1e12) / 3600:,.1f}" for c in longest)
    lines += ["", f"Longest single runs (A100-hours at {tflops:g} TFLOP/s): {runs}."]
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
        costs = [c for c in (row_cost(n) for n in names) if c is not None]
        if not costs:
            raise CostError(f"no train row with a paper scale among: {', '.join(names)}")
        table = markdown_table(costs, args.tflops)
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
