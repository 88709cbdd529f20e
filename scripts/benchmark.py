#!/usr/bin/env python
"""Per-step training cost of method x flatness combinations, side by side in one process.

    python scripts/benchmark.py --model resnet20_frn --batch-size 128 --steps 20 [--device cuda]
    python scripts/benchmark.py --configs map+none,map+sam,swag+none,swag+sam,sgld+none

Prints images/s and the step time relative to plain SGD (map+none) and to SAM (map+sam) measured in
the same run; the pairs are timed in interleaved rounds (``--repeats``) and the median round is used,
so drifting clocks or a busy neighbour hit every pair alike. SWAG collects every step here (worst
case; normally once per epoch) and its per-collection time is shown. Synthetic inputs: this measures
compute, not data loading. Not a timed test: numbers are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbnn.engine.backprop import Backprop  # noqa: E402
from flatbnn.flatness import ASAM, SAM, FisherSAM, Geometry, NoFlatness, RandomSAM  # noqa: E402
from flatbnn.methods.bsam import BSAM  # noqa: E402
from flatbnn.methods.hwa import HWA  # noqa: E402
from flatbnn.methods.vogn import VOGN  # noqa: E402
from flatbnn.methods.rsam import RandomSAMMethod  # noqa: E402
from flatbnn.methods.sgvb import SGVB  # noqa: E402
from flatbnn.methods.vsam import VariationalSAM  # noqa: E402
from flatbnn.methods import MAP, SGLD, SWAG, MCDropout, RunContext  # noqa: E402
from flatbnn.models import create_model  # noqa: E402

FLATNESS = {
    "none": lambda: NoFlatness(),
    "sam": lambda: SAM(rho=0.05),
    "asam": lambda: ASAM(rho=0.5, eta=0.01),
    "fsam": lambda: FisherSAM(rho=0.1, eta=1.0),
    "random": lambda: RandomSAM(rho=0.05),
    "sam_m8": lambda: SAM(rho=0.05, m=8),
    "geometry": lambda: Geometry(rho=0.05),
}
METHODS = {
    "map": lambda: MAP(),
    "map_adam": lambda: MAP(),  # SAM-Adam's base (bSAM paper baseline): map+sam_m8 with Adam
    "swag": lambda: SWAG(mode="swag", swa_start=0, collect_unit="step", collect_every=1),
    "swag_diag": lambda: SWAG(mode="swag_diag", swa_start=0, collect_unit="step", collect_every=1),
    "sgld": lambda: SGLD(burn_in=10**9),
    "mc_dropout": lambda: MCDropout(),
    "sgvb": lambda: SGVB(),
    "sgvb_lrt": lambda: SGVB(estimator="lrt"),
    "hwa": lambda: HWA(),
    # worst case of Alg. 2 with Eq. 5: an average + restart every step, low-rank part in every training sample
    "hwa_lowrank": lambda: HWA(covariance="lowrank", start=0.0, cycle_length=1),
    "rsam": lambda: RandomSAMMethod(),
    "vsam": lambda: VariationalSAM(),
    "bsam": lambda: BSAM(),
    "vogn": lambda: VOGN(),
}
DEFAULT = ("map+none,map+sam,map+asam,map+fsam,map+random,map+sam_m8,swag+none,swag+sam,swag+fsam,"
           "swag_diag+none,sgld+none,sgld+sam,mc_dropout+none,sgvb+none,sgvb_lrt+none,sgvb+sam,sgvb+geometry,"
           "hwa+none,hwa_lowrank+none,rsam+none,vsam+none,bsam+none,vogn+none,map_adam+none,map_adam+sam_m8")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(method_name: str, flat_name: str, args, device):
    """A closure running one training step of the pair, plus the method (for SWAG's collect)."""
    torch.manual_seed(0)
    shape = (1, 28, 28) if args.model == "mlp" else (3, 32, 32)
    kw = {"dropout": 0.05} if method_name == "mc_dropout" else {}
    method = METHODS[method_name]()
    module = method.prepare_model(create_model(args.model, 10, shape, **kw)).to(device)
    momentum = 0.0 if method_name == "sgld" else 0.9  # textbook SGLD has no momentum
    ctx = RunContext(model=module, module=module, device=device, n_train=50_000,
                     steps_per_epoch=args.steps, epochs=1,
                     optimizer_factory=(lambda p: torch.optim.Adam(p, lr=1e-3)) if method_name == "map_adam"
                     else (lambda p: torch.optim.SGD(p, lr=0.01, momentum=momentum)),
                     scheduler_factory=None, generator=torch.Generator(device=device).manual_seed(0))
    method.setup(ctx)
    flat = FLATNESS[flat_name]()
    flat.setup(ctx, method)
    bp = Backprop(module, device, precision=args.precision)
    x = torch.randn(args.batch_size, *shape, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    method.train()
    for _ in range(args.warmup):
        method.train_step((x, y), flat, bp)
    return (lambda: method.train_step((x, y), flat, bp)), method


def time_steps(step, steps: int, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet20_frn")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (median used)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--configs", default=DEFAULT, help="comma-separated method+flatness pairs")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    device = torch.device(args.device)
    built = {}
    for pair in args.configs.split(","):
        m, f = pair.split("+")
        try:
            built[pair] = build(m, f, args, device)
        except (TypeError, ValueError) as e:  # e.g. mc_dropout on a backbone without dropout
            print(f"skipping {pair}: {e}", file=sys.stderr)
    times = {pair: [] for pair in built}
    for _ in range(args.repeats):
        for pair, (step, _) in built.items():
            times[pair].append(time_steps(step, args.steps, device))
    rows = {}
    for pair, (_, method) in built.items():
        rows[pair] = {"images_per_s": args.steps * args.batch_size / statistics.median(times[pair])}
        if isinstance(method, SWAG):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(5):
                method.collect()
            _sync(device)
            rows[pair]["collect_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    base = rows.get("map+none", {}).get("images_per_s")
    sam = rows.get("map+sam", {}).get("images_per_s")
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"model={args.model} batch={args.batch_size} steps={args.steps} precision={args.precision} device={hw}")
    print(f"{'method+flatness':<20}{'images/s':>12}{'vs map+none':>14}{'vs map+sam':>12}{'collect ms':>12}")
    for pair, r in rows.items():
        ratio = f"{base / r['images_per_s']:.3f}x" if base else "-"
        vs_sam = f"{sam / r['images_per_s']:.3f}x" if sam else "-"
        r["vs_map_none"] = base / r["images_per_s"] if base else None
        r["vs_map_sam"] = sam / r["images_per_s"] if sam else None
        col = f"{r['collect_ms']:.2f}" if "collect_ms" in r else ""
        print(f"{pair:<20}{r['images_per_s']:>12.1f}{ratio:>14}{vs_sam:>12}{col:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": hw, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
