#!/usr/bin/env python
"""The GPU probe of issue 33: one call on a fresh GPU machine (<= 8 minutes), every section time-capped.

    python scripts/gpu_probe.py --out $OUT                 # on the GPU (H100 / H200)
    python scripts/gpu_probe.py --dry-run --out /tmp/probe  # CPU, tiny sizes: every section runs (CI)

Sections (each records status ok | failed: <one line> | skipped: <why>, its seconds, and its numbers):
  versions     torch, CUDA, device, clocks (nvidia-smi), the commit
  eager        images/s of today's eager step: ResNet-20-FRN b200 fp32 SGD, SAM m=8, bSAM m=8; WRN-28-2 b128
               bf16 SGD, SAM, VSAM
  graphed      the same steps through trainer.cuda_graph's GraphedStep: eager fallback reason if any, else the
               max relative weight difference to eager after 5 steps and images/s over 20 replays (CUDA events)
  rng          MC-Dropout + SAM and bSAM's noise, graphed vs eager (fallback reasons today)
  inductor     torch.compile with mix_order_reduction off: compile seconds, gradient vs eager fp32; SAM m=8 with the
               compiled backbone inside the graphed step: images/s and weights vs eager
  vmap         SAM m=8 as the loop vs flatness.batched_chunks (vmap): max relative gradient difference and time
  mps          1 vs 4 graphed processes under MPS: not implemented yet (skipped)

Writes <out>/gpu_probe.json and <out>/gpu_probe.md (a summary table, also printed last). The goals of the issue
are in GOALS; a row says met / not met against them only on a GPU (a dry run measures nothing)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbnn.engine import graphed  # noqa: E402
from flatbnn.engine.backprop import Backprop  # noqa: E402
from flatbnn.engine.compiling import inductor_workarounds  # noqa: E402
from flatbnn.flatness import SAM, NoFlatness  # noqa: E402
from flatbnn.methods import MAP, MCDropout, RunContext  # noqa: E402
from flatbnn.methods.bsam import BSAM  # noqa: E402
from flatbnn.methods.vsam import VariationalSAM  # noqa: E402
from flatbnn.models import create_model  # noqa: E402

# issue 33's goals (img/s on one H100 / H200), by row name
GOALS = {"frn_b200/sgd": 60_000, "frn_b200/sam_m8": 15_000, "frn_b200/bsam_m8": 12_000, "wrn28x2_bf16/sgd": 40_000}

# (row, model name, model kwargs, batch, precision, method, flatness); the dry run shrinks models and batches
ROWS = [
    ("frn_b200/sgd", "resnet20_frn", {}, 200, "fp32", "map", "none"),
    ("frn_b200/sam_m8", "resnet20_frn", {}, 200, "fp32", "map", "sam_m8"),
    ("frn_b200/bsam_m8", "resnet20_frn", {}, 200, "fp32", "bsam", "none"),
    ("wrn28x2_bf16/sgd", "wrn", {"depth": 28, "widen_factor": 2}, 128, "bf16", "map", "none"),
    ("wrn28x2_bf16/sam", "wrn", {"depth": 28, "widen_factor": 2}, 128, "bf16", "map", "sam"),
    ("wrn28x2_bf16/vsam", "wrn", {"depth": 28, "widen_factor": 2}, 128, "bf16", "vsam", "none"),
]
DRY = {"wrn": ("wrn", {"depth": 10, "widen_factor": 1})}  # and ResNet-8-FRN of width 2 (``_model``)


class Section:
    """Times a section, records its status and stops loops at its deadline."""

    def __init__(self, name: str, budget_s: float, report: dict):
        self.name, self.deadline, self.report = name, time.perf_counter() + budget_s, report
        self.data: dict = {}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, kind, err, tb):
        status = "ok" if err is None else f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        self.report[self.name] = {"status": status, "seconds": round(time.perf_counter() - self.t0, 2), **self.data}
        print(f"[{self.name}] {status} ({self.report[self.name]['seconds']} s)", flush=True)
        return True  # a failed section does not stop the probe


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(name, kw, args, dropout=0.0):
    if args.dry_run and name == "resnet20_frn":
        from flatbnn.models.resnet_frn import ResNetFRN
        return ResNetFRN(10, in_channels=3, depth=8, width=2)
    if args.dry_run:
        name, kw = DRY[name]
    extra = {"dropout": dropout} if dropout else {}
    return create_model(name, 10, (3, 32 if not args.dry_run else 8, 32 if not args.dry_run else 8), **kw, **extra)


def build(row, args, device, dropout=0.0):
    """(method, flatness, backprop, batch) of one row, seeded: the same weights and data every time."""
    _, model, kw, batch, precision, method_name, flat_name = row
    batch = 16 if args.dry_run else batch
    torch.manual_seed(0)
    method = {"map": MAP, "bsam": lambda: BSAM(m=8, num_samples=1), "vsam": VariationalSAM,
              "mc_dropout": MCDropout}[method_name]()
    module = method.prepare_model(_model(model, kw, args, dropout)).to(device)
    if precision == "bf16" and device.type == "cuda":
        module = module.to(memory_format=torch.channels_last)
    ctx = RunContext(model=module, module=module, device=device, n_train=50_000, steps_per_epoch=100, epochs=1,
                     optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), scheduler_factory=None,
                     generator=torch.Generator(device=device).manual_seed(0))
    method.setup(ctx)
    flat = {"none": NoFlatness, "sam": lambda: SAM(rho=0.05), "sam_m8": lambda: SAM(rho=0.05, m=8)}[flat_name]()
    flat.setup(ctx, method)
    bp = Backprop(module, device, precision=precision if device.type == "cuda" else "fp32")
    method.train()
    shape = (3, 8, 8) if args.dry_run else (3, 32, 32)
    x = torch.randn(batch, *shape, device=device)
    return method, flat, bp, (x, torch.randint(0, 10, (batch,), device=device))


def time_per_step(step, n: int, device) -> float:
    """Seconds per step, CUDA events on a GPU (perf_counter on the CPU), after one untimed step."""
    step()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)) for x, y in zip(a, b))


def _weights(method):
    return [p.detach().clone() for p in method.module.parameters()]


def graphed_step(method, flat, bp, device):
    backend = graphed.EagerReplay() if device.type != "cuda" else None
    return graphed.GraphedStep(method, flat, bp, capture=backend, log=lambda s: None)


def section_versions(report, args, device):
    with Section("versions", 20, report) as s:
        s.data.update(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                      device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      dry_run=args.dry_run)
        try:
            s.data["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                              timeout=5, cwd=Path(__file__).parents[1]).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            s.data["commit"] = None
        if device.type == "cuda":
            q = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu"
            out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True,
                                 text=True, timeout=10)
            s.data["nvidia_smi"] = out.stdout.strip()


def section_eager_and_graphed(report, args, device):
    n, checks = (1, 2) if args.dry_run else (20, 5)
    with Section("eager", args.budget * 0.25, report) as s:
        for row in ROWS:
            if s.left() < 0:
                s.data[row[0]] = "skipped: section time cap"
                continue
            method, flat, bp, batch = build(row, args, device)
            sec = time_per_step(lambda: method.train_step(batch, flat, bp), n, device)
            s.data[row[0]] = {"img_s": batch[0].shape[0] / sec, "step_ms": sec * 1e3}
    with Section("graphed", args.budget * 0.3, report) as s:
        for row in ROWS:
            if s.left() < 0:
                s.data[row[0]] = "skipped: section time cap"
                continue
            method, flat, bp, batch = build(row, args, device)
            step = graphed_step(method, flat, bp, device)
            reason = step.fallback_reason(batch)
            if reason is not None:
                s.data[row[0]] = {"eager_fallback": reason}
                continue
            for _ in range(checks):
                step(batch)
            eager = build(row, args, device)
            for _ in range(checks):
                eager[0].train_step(eager[3], eager[1], eager[2])
            rel = max_rel(_weights(method), _weights(eager[0]))
            sec = time_per_step(lambda: step(batch), n, device)
            s.data[row[0]] = {"img_s": batch[0].shape[0] / sec, "step_ms": sec * 1e3, f"max_rel_vs_eager_{checks}_steps": rel}


def section_rng(report, args, device):
    with Section("rng", args.budget * 0.1, report) as s:
        cases = {"mc_dropout+sam": (("mc_dropout+sam", "wrn", {}, 128, "fp32", "mc_dropout", "sam"), 0.1),
                 "bsam_noise": (ROWS[2], 0.0)}
        for name, (row, dropout) in cases.items():
            method, flat, bp, batch = build(row, args, device, dropout=dropout)
            step = graphed_step(method, flat, bp, device)
            reason = step.fallback_reason(batch)
            if reason is not None:
                s.data[name] = {"eager_fallback": reason}
                continue
            for _ in range(3):
                step(batch)
            eager = build(row, args, device, dropout=dropout)
            for _ in range(3):
                eager[0].train_step(eager[3], eager[1], eager[2])
            s.data[name] = {"max_rel_vs_eager_3_steps": max_rel(_weights(method), _weights(eager[0]))}


def section_inductor(report, args, device):
    with Section("inductor", args.budget * 0.2, report) as s:
        s.data["flags"] = inductor_workarounds()
        row = ROWS[0]
        method, flat, bp, batch = build(row, args, device)
        module = method.module
        if args.dry_run:  # the plumbing, not Inductor: a one-layer model through aot_eager
            module = create_model("mlp", 10, (3, 8, 8), hidden=[4])
        backend = "aot_eager" if args.dry_run else "inductor"
        compiled = torch.compile(module, backend=backend)
        t0 = time.perf_counter()
        out = compiled(batch[0]).float().logsumexp(1).mean()
        grads = torch.autograd.grad(out, list(module.parameters()))
        _sync(device)
        s.data["compile_s"] = time.perf_counter() - t0
        ref = torch.autograd.grad(module(batch[0]).float().logsumexp(1).mean(), list(module.parameters()))
        s.data["backend"] = backend
        s.data["grad_max_rel_vs_eager"] = max_rel(list(grads), list(ref))
        # compiled AND captured: SAM m=8 with the compiled backbone inside GraphedStep, vs the eager step
        row = ROWS[1]
        method, flat, bp, batch = build(row, args, device)
        method.model = torch.compile(method.module, backend=backend)
        step = graphed_step(method, flat, bp, device)
        checks = 2 if args.dry_run else 5
        for _ in range(checks):
            step(batch)
        eager = build(row, args, device)
        for _ in range(checks):
            eager[0].train_step(eager[3], eager[1], eager[2])
        rel = max_rel(_weights(method), _weights(eager[0]))  # before the timed steps move the weights on
        sec = time_per_step(lambda: step(batch), 1 if args.dry_run else 20, device)
        s.data["compiled_graphed_sam_m8"] = {"img_s": batch[0].shape[0] / sec, f"max_rel_vs_eager_{checks}_steps": rel}


def section_vmap(report, args, device):
    with Section("vmap", args.budget * 0.1, report) as s:
        row = ROWS[1]
        out = {}
        for batched in (False, True):
            method, flat, bp, batch = build(row, args, device)
            flat.batched_chunks = batched
            method.optimizer.zero_grad(set_to_none=True)
            flat.gradient(method.named_parameters(), method.loss_fn, batch, bp)
            out[batched] = [p.grad.clone() for p in method.parameters()]

            def grad_only():
                method.optimizer.zero_grad(set_to_none=True)
                flat.gradient(method.named_parameters(), method.loss_fn, batch, bp)
            out[f"t{batched}"] = time_per_step(grad_only, 1 if args.dry_run else 5, device)
        s.data.update(grad_max_rel=max_rel(out[True], out[False]), loop_ms=out["tFalse"] * 1e3,
                      vmap_ms=out["tTrue"] * 1e3)


def summary(report: dict) -> str:
    lines = ["| row | eager img/s | graphed img/s | graphed vs eager | goal img/s | goal |", "|---|---|---|---|---|---|"]
    for row in ROWS:
        name = row[0]
        e = report.get("eager", {}).get(name, {})
        g = report.get("graphed", {}).get(name, {})
        e_img = f"{e['img_s']:.0f}" if isinstance(e, dict) and "img_s" in e else "-"
        if isinstance(g, dict) and "img_s" in g:
            rel = next(v for k, v in g.items() if k.startswith("max_rel"))
            g_img, diff, best = f"{g['img_s']:.0f}", f"{rel:.1e}", g["img_s"]
        else:
            g_img = "eager: " + (g.get("eager_fallback", "-") if isinstance(g, dict) else str(g))
            diff, best = "-", e.get("img_s") if isinstance(e, dict) else None
        goal = GOALS.get(name)
        verdict = "-" if goal is None or best is None or report["versions"].get("dry_run") else (
            "met" if best >= goal else "not met")
        lines.append(f"| {name} | {e_img} | {g_img} | {diff} | {goal or '-'} | {verdict} |")
    lines.append("")
    lines.append("| section | status | seconds |")
    lines.append("|---|---|---|")
    for name, sec in report.items():
        lines.append(f"| {name} | {sec.get('status')} | {sec.get('seconds')} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_probe.json and gpu_probe.md")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: every section runs (CI)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all sections together")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"))
    if device.type != "cuda" and not args.dry_run:
        print("gpu_probe.py: no CUDA device; use --dry-run on a CPU", file=sys.stderr)
        sys.exit(2)
    report: dict = {}
    section_versions(report, args, device)
    section_eager_and_graphed(report, args, device)
    section_rng(report, args, device)
    section_inductor(report, args, device)
    section_vmap(report, args, device)
    report["mps"] = {"status": "skipped: 1 vs 4 graphed processes under MPS is not implemented yet", "seconds": 0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = summary(report)
    for name, text in (("gpu_probe.json", json.dumps(report, indent=2, default=str)), ("gpu_probe.md", table + "\n")):
        tmp = out / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    print(table)
    return report


if __name__ == "__main__":
    main()
