#!/usr/bin/env python
"""Per-step training cost of method x flatness combinations, side by side in one process.

    python scripts/benchmark.py --model resnet20_frn --batch-size 128 --steps 20 [--device cuda]
    python scripts/benchmark.py --configs map+none,map+sam,swag+none,swag+sam,sgld+none

Prints images/s and the step time relative to plain SGD (map+none) measured in the same run; SWAG
collects every step here (worst case; normally once per epoch) and its per-collection time is shown.
Synthetic inputs: this measures compute, not data loading. Not a timed test: numbers are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbnn.engine.backprop import Backprop  # noqa: E402
from flatbnn.flatness import SAM, NoFlatness  # noqa: E402
from flatbnn.methods import MAP, SGLD, SWAG, MCDropout, RunContext  # noqa: E402
from flatbnn.models import create_model  # noqa: E402

FLATNESS = {"none": lambda: NoFlatness(), "sam": lambda: SAM(rho=0.05)}
METHODS = {
    "map": lambda: MAP(),
    "swag": lambda: SWAG(mode="swag", swa_start=0, collect_unit="step", collect_every=1),
    "swag_diag": lambda: SWAG(mode="swag_diag", swa_start=0, collect_unit="step", collect_every=1),
    "sgld": lambda: SGLD(burn_in=10**9),
    "mc_dropout": lambda: MCDropout(),
}
DEFAULT = "map+none,map+sam,swag+none,swag+sam,swag_diag+none,sgld+none,sgld+sam,mc_dropout+none"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(method_name: str, flat_name: str, args, device) -> dict:
    torch.manual_seed(0)
    shape = (1, 28, 28) if args.model == "mlp" else (3, 32, 32)
    kw = {"dropout": 0.05} if method_name == "mc_dropout" else {}
    module = create_model(args.model, 10, shape, **kw).to(device)
    method = METHODS[method_name]()
    momentum = 0.0 if method_name == "sgld" else 0.9  # textbook SGLD has no momentum
    method.setup(RunContext(model=module, module=module, device=device, n_train=50_000,
                            steps_per_epoch=args.steps, epochs=1,
                            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01, momentum=momentum),
                            scheduler_factory=None))
    bp = Backprop(module, device, precision=args.precision)
    flat = FLATNESS[flat_name]()
    x = torch.randn(args.batch_size, *shape, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    method.train()
    for _ in range(args.warmup):
        method.train_step((x, y), flat, bp)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        method.train_step((x, y), flat, bp)
    _sync(device)
    out = {"images_per_s": args.steps * args.batch_size / (time.perf_counter() - t0)}
    if isinstance(method, SWAG):
        t0 = time.perf_counter()
        for _ in range(5):
            method.collect()
        _sync(device)
        out["collect_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet20_frn")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--configs", default=DEFAULT, help="comma-separated method+flatness pairs")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = {}
    for pair in args.configs.split(","):
        m, f = pair.split("+")
        try:
            rows[pair] = bench(m, f, args, device)
        except (TypeError, ValueError) as e:  # e.g. mc_dropout on a backbone without dropout
            print(f"skipping {pair}: {e}", file=sys.stderr)
    base = rows.get("map+none", {}).get("images_per_s")
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"model={args.model} batch={args.batch_size} steps={args.steps} precision={args.precision} device={hw}")
    print(f"{'method+flatness':<20}{'images/s':>12}{'step time vs map+none':>24}{'collect ms':>12}")
    for pair, r in rows.items():
        ratio = f"{base / r['images_per_s']:.2f}x" if base else "-"
        col = f"{r['collect_ms']:.2f}" if "collect_ms" in r else ""
        print(f"{pair:<20}{r['images_per_s']:>12.1f}{ratio:>24}{col:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": hw, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
