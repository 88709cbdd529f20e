#!/usr/bin/env python
"""Training throughput of flatness variants side by side, in one process (not a timed test).

    python scripts/benchmark.py --model resnet20_frn --batch-size 128 --steps 20 [--device cuda]

Prints images/s per configuration and the overhead ratio relative to plain SGD measured in the
same run (SAM should be ~2x: two forward/backward passes). Synthetic inputs: measures compute only.
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
from flatbnn.methods import MAP, RunContext  # noqa: E402
from flatbnn.models import create_model  # noqa: E402

VARIANTS = {"sgd": lambda: NoFlatness(), "sam": lambda: SAM(rho=0.05)}


def bench(variant: str, args, device) -> float:
    torch.manual_seed(0)
    shape = (1, 28, 28) if args.model == "mlp" else (3, 32, 32)
    module = create_model(args.model, 10, shape).to(device)
    method = MAP()
    method.setup(RunContext(model=module, module=module, device=device, n_train=50_000, steps_per_epoch=args.steps,
                            epochs=1, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                            scheduler_factory=None))
    bp = Backprop(module, device, precision=args.precision)
    flat = VARIANTS[variant]()
    x = torch.randn(args.batch_size, *shape, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    method.train()
    for _ in range(args.warmup):
        method.train_step((x, y), flat, bp)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        method.train_step((x, y), flat, bp)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return args.steps * args.batch_size / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet20_frn")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = {v: bench(v, args, device) for v in args.variants.split(",")}
    base = rows.get("sgd")
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    print(f"model={args.model} batch={args.batch_size} steps={args.steps} precision={args.precision} device={hw}")
    print(f"{'variant':<10}{'images/s':>12}{'step time vs sgd':>20}")
    for v, ips in rows.items():
        ratio = f"{base / ips:.2f}x" if base else "-"
        print(f"{v:<10}{ips:>12.1f}{ratio:>20}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": hw, "images_per_s": rows}, indent=2))


if __name__ == "__main__":
    main()
