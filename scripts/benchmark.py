#!/usr/bin/env python
"""Per-step training cost of method x flatness combinations, side by side in one process.

    python scripts/benchmark.py --model resnet20_frn --batch-size 128 --steps 20 [--device cuda]
    python scripts/benchmark.py --configs map+none,map+sam,swag+none,swag+sam,sgld+none
    python scripts/benchmark.py --smoke                  # tiny model, 2 steps: the pipeline in seconds (CI)
    python scripts/benchmark.py --reference              # + minimal loops of the reference codes, same data

The pairs' methods and flatness variants are the options of configs/method and configs/flatness, built as a run
builds them (flatbnn/bench/variants.py: the labels, the default rows, what the benchmark changes of a config); a new
method or variant is in the default rows without being named here.

Every pair (and, with ``--reference``, every reference loop) is timed in interleaved rounds
(``--repeats``): round r times all of them once, so drifting clocks or a busy neighbour hit every
pair alike; the median step time over rounds is reported with its spread (min, max), and every ratio
is the ratio of two reported median step times of this one process run. SWAG collects every step
here (worst case; normally once per epoch) and its per-collection time is shown. Synthetic inputs:
this measures compute, not data loading.

Floors (``--floors``): a hand-written eager SGD step of the same model (``floor:sgd``: forward, cross-entropy,
backward, momentum SGD written out), one draw of the m parts' posterior noise (``floor:noise_m8``: one ``normal_``
of [8, P] and its multiply, as bSAM / VOGN draw it), the 2 x 8 forward + backward passes of batch / 8 that an m = 8
loop runs and nothing else (``floor:passes_m8``: the eager floor of the loops), bSAM m = 8's arithmetic on the batched
parts-Linear path written out for Flatten / Linear / ReLU nets (``floor:parts_bsam_m8``: the noise, per-part products,
ascent and |g|, no autograd and no update), a square GEMM (``floor:gemm``: the GEMM rate of this process),
and the FLOP floor of an SGD step computed from it (forward FLOPs x 3 at that rate). ``cpu_targets`` then puts each
m = 8 row beside its floor (issue 52: SAM <= 3 x SGD, bSAM <= 1.3 x (2 SGD + noise), VOGN <= 1.3 x (1.5 SGD + noise),
SGD <= 4 x its FLOP floor), every number from this one process.

Writes ``<out>/<device>-<date>[-smoke].json`` (device, torch, precision, batch, model, per row the
step times of every round, median, spread and images/s, the ratios with the issue's GPU targets,
git commit) and a Markdown table beside it (same name, ``.md``). Not a timed test: numbers are data.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbnn.cli import EXIT_CONFIG  # noqa: E402
from flatbnn.engine.backprop import Backprop  # noqa: E402
from flatbnn.engine.checkpoint import write_json, write_text  # noqa: E402
from flatbnn.engine.provenance import git_commit, hardware  # noqa: E402
from flatbnn.bench import variants  # noqa: E402
from flatbnn.methods import SWAG, RunContext  # noqa: E402
from flatbnn.methods.bsam import BSAM  # noqa: E402
from flatbnn.models import create_model, list_models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# row labels -> what each side builds (configs/method, configs/flatness and the measurement variants)
METHODS = variants.methods()
FLATNESS = variants.flatness()
DEFAULT = ",".join(variants.default_pairs())


# (name, numerator row, denominator row, issue 17's target on one H100 in bf16 -- a GPU target, not a CPU one)
RATIOS = [
    ("SAM/SGD", "map+sam", "map+none", 2.05),
    ("FSAM/SAM", "map+fsam", "map+sam", 1.02),
    ("ASAM/SAM", "map+asam", "map+sam", 1.03),
    ("SWAG/SGD", "swag+none", "map+none", 1.02),
    ("bSAM/SAM-Adam", "bsam+none", "map_adam+sam_m8", 1.05),
]
# ours / reference loop on the same model, batch and data (target: faster, i.e. < 1)
REFERENCE_RATIOS = [
    ("SAM ours/ref", "map+sam", "ref:sam", 1.0),
    ("ASAM ours/ref", "map+asam", "ref:asam", 1.0),
    ("SWAG ours/ref", "swag+none", "ref:swag", 1.0),
    ("SWAG collect ours/ref", "collect:swag", "ref:collect:swag", 1.0),
    ("SWAG sample ours/ref", "sample:swag", "ref:sample:swag", 1.0),
    ("bSAM ours/ref", "bsam+none", "ref:bsam", 1.0),
]
REFERENCE_ROWS = ("ref:sam", "ref:asam", "ref:swag", "ref:collect:swag", "ref:sample:swag", "ref:bsam")
SMOKE = {"model": "mlp", "model_overrides": {"hidden": [64]}, "batch_size": 16, "steps": 2, "warmup": 1, "repeats": 3,
         "eval_samples": 4, "eval_chunk": 4,
         "configs": "map+none,map+sam,map+asam,map+fsam,swag+none,map_adam+sam_m8,bsam+none"}
SWAG_RANK = 20


class BadInput(ValueError):
    pass


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


INPUT_SHAPE: tuple[int, ...] | None = None  # --input-shape (main sets it); else by model


def _input_shape(model: str) -> tuple[int, ...]:
    if INPUT_SHAPE is not None:
        return INPUT_SHAPE
    return (1, 28, 28) if model == "mlp" else (3, 32, 32)


def model_spec(name: str) -> tuple[str, dict]:
    """Builder name and keyword arguments: ``configs/model/<name>.yaml``'s if it exists (``--model wrn28x10`` is
    the runs' WRN-28-10, not the builder's defaults), else ``name`` in the model registry."""
    from omegaconf import OmegaConf

    path = REPO / "configs" / "model" / f"{name}.yaml"
    if path.exists():
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        skip = ("_target_", "name", "num_classes", "input_shape")
        return cfg["name"], {k: v for k, v in cfg.items() if k not in skip}
    if name not in list_models():
        raise BadInput(f"--model {name!r}: neither configs/model/{name}.yaml nor a registered model")
    return name, {}


def create(args, **overrides):
    name, kw = model_spec(args.model)
    return create_model(name, 10, _input_shape(args.model), **{**kw, **args.model_overrides, **overrides})


def _prepare(module, args, device):
    """Model on the device in the requested layout; the forward module (compiled or not)."""
    module = module.to(device)
    if args.channels_last:
        module = module.to(memory_format=torch.channels_last)
    return module, (torch.compile(module) if args.compile else module)


def _data(args, shape, device):
    x = torch.randn(args.batch_size, *shape, device=device)
    if args.channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 10, (args.batch_size,), device=device)


def build(method_name: str, flat_name: str, args, device, graph: bool = False):
    """A closure running one training step of the pair, plus the method (for SWAG's collect)."""
    if method_name not in METHODS or flat_name not in FLATNESS:
        raise BadInput(f"unknown pair {method_name}+{flat_name}: methods {sorted(METHODS)}, "
                       f"flatness {sorted(FLATNESS)}")
    torch.manual_seed(0)  # the same initial weights and data for every row (and the reference loops)
    shape = _input_shape(args.model)
    spec = METHODS[method_name]
    method = variants.build("method", spec)
    module, model = _prepare(method.prepare_model(create(args, **spec.model)), args, device)
    ctx = RunContext(model=model, module=module, device=device, n_train=50_000,
                     steps_per_epoch=args.steps, epochs=1,
                     optimizer_factory=(lambda p: torch.optim.Adam(p, lr=1e-3)) if spec.optimizer == "adam"
                     else (lambda p: torch.optim.SGD(p, lr=0.01, momentum=spec.momentum)),
                     scheduler_factory=None, generator=torch.Generator(device=device).manual_seed(0),
                     channels_last=args.channels_last,
                     # a deep ensemble's next member (its step is one member's: it is never reached here)
                     model_factory=lambda seed=None, init=None: method.prepare_model(create(args, **spec.model)))
    method.setup(ctx)
    flat = variants.build("flatness", FLATNESS[flat_name])
    flat.setup(ctx, method)
    bp = Backprop(module, device, precision=args.precision)
    x, y = _data(args, shape, device)
    method.train()
    step = (lambda: method.train_step((x, y), flat, bp))
    if graph:  # trainer.cuda_graph's GraphedStep (on a CPU: the protocol through EagerReplay, not a speed number)
        from flatbnn.engine.graphed import EagerReplay, GraphedStep
        graphed = GraphedStep(method, flat, bp, capture=None if device.type == "cuda" else EagerReplay(),
                              log=lambda line: None)
        reason = graphed.fallback_reason((x, y))
        if reason is not None:
            raise ValueError(f"eager fallback: {reason}")
        step = (lambda: graphed((x, y)))
    for _ in range(args.warmup):
        step()
    return step, method


def build_reference(name: str, args, device):
    """A closure running one step of a reference loop (flatbnn/bench/reference.py) on the same
    initial weights and data as ``build``; the same hyperparameters as our rows."""
    from flatbnn.bench import reference as R
    from flatbnn.engine.backprop import PRECISIONS

    torch.manual_seed(0)
    shape = _input_shape(args.model)
    module, model = _prepare(create(args), args, device)
    x, y = _data(args, shape, device)
    dtype = PRECISIONS[args.precision]
    model.train()
    if name in ("ref:sam", "ref:asam"):
        opt = (R.ReferenceSAM(module.parameters(), torch.optim.SGD, rho=0.05, lr=0.01, momentum=0.9)
               if name == "ref:sam" else
               R.ReferenceSAM(module.parameters(), torch.optim.SGD, rho=0.5, adaptive=True, lr=0.01, momentum=0.9))
        step = lambda: R.reference_sam_step(model, opt, x, y, dtype)  # noqa: E731
    elif name in ("ref:swag", "ref:collect:swag", "ref:sample:swag"):
        opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
        swag = R.ReferenceSWAG(module.parameters(), max_num_models=SWAG_RANK)
        if name == "ref:swag":
            def step():
                R.reference_sgd_step(model, opt, x, y, dtype)
                swag.collect_model()
        else:
            for _ in range(SWAG_RANK + 1):  # a full deviation buffer: the steady state
                swag.collect_model()
            g = torch.Generator(device=device).manual_seed(0)
            step = swag.collect_model if name == "ref:collect:swag" else (lambda: swag.sample(0.5, True, g))
    elif name == "ref:bsam":
        bsam = R.ReferenceBSAM(model, n_data=50_000, generator=torch.Generator(device=device).manual_seed(0))
        step = lambda: bsam.step(x, y, dtype)  # noqa: E731
    else:
        raise BadInput(f"unknown reference loop {name!r}: {list(REFERENCE_ROWS)}")
    for _ in range(args.warmup):
        step()
    return step


def build_floor(name: str, args, device):
    """A closure of one floor row (module docstring), on the same initial weights and data as ``build``."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    if name == "floor:gemm":
        n = 1024
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        step = lambda: torch.mm(a, b)  # noqa: E731
    else:
        module, model = _prepare(create(args), args, device)
        x, y = _data(args, _input_shape(args.model), device)
        params = [p for p in module.parameters() if p.requires_grad]
        if name == "floor:sgd":
            bufs = [torch.zeros_like(p) for p in params]
            model.train()

            def step():  # zero, forward, loss, backward, momentum SGD: nothing a method or the engine adds
                for p in params:
                    p.grad = None
                F.cross_entropy(model(x), y).backward()
                with torch.no_grad():
                    torch._foreach_mul_(bufs, 0.9)
                    torch._foreach_add_(bufs, [p.grad for p in params])
                    torch._foreach_add_(params, bufs, alpha=-0.01)
        elif name == "floor:passes_m8":
            xs, ys = x.chunk(8), y.chunk(8)
            model.train()

            def step():  # the m = 8 loop's eager arithmetic: 2 forward + backward passes of each batch / 8, nothing else
                for _ in range(2):
                    for xc, yc in zip(xs, ys):
                        F.cross_entropy(model(xc), yc).backward()
        elif name == "floor:parts_bsam_m8":
            step = _parts_bsam_floor(model, params, x, y, device)
            if step is None:
                return None
        elif name == "floor:noise_m8":
            noise = torch.empty(8, sum(p.numel() for p in params), device=device)
            std = torch.full((noise.shape[1],), 0.01, device=device)
            g = torch.Generator(device=device).manual_seed(0)
            step = lambda: noise.normal_(generator=g).mul_(std)  # noqa: E731
        else:
            raise BadInput(f"unknown floor row {name!r}: {list(FLOOR_ROWS)}")
    for _ in range(args.warmup):
        step()
    return step


def _parts_bsam_floor(model, params, x, y, device, m: int = 8):
    """bSAM m = 8's arithmetic on the parts-Linear path (flatbnn/nn/parts_linear.py) written out, for a Sequential of
    Flatten / Linear / ReLU (the MNIST MLP; None for any other network): the [m, P] noise draw and its multiply-add
    onto the mean, per-part forward products, a hand-written backward forming each part's weight gradient, the ascent
    points and the sum of |g_k|, the second forward at them and a backward forming only the summed gradient --
    no autograd, no optimiser update, nothing a method or the engine adds."""
    import torch.nn.functional as F
    from torch import nn

    from flatbnn.nn.parts_linear import param_views

    seq = list(model)
    if not seq or any(type(mod) not in (nn.Flatten, nn.Linear, nn.ReLU) for mod in seq) or \
            any(type(mod) is nn.Linear and mod.bias is None for mod in seq):
        return None
    b = x.shape[0] // m
    mean = torch.cat([p.detach().reshape(-1) for p in params])
    std = torch.full_like(mean, 0.01)
    ros = torch.full_like(mean, 0.05)
    points = torch.empty(m, mean.numel(), device=device)
    g = torch.Generator(device=device).manual_seed(0)
    onehot = F.one_hot(y, int(model(x[:1]).shape[-1])).view(m, b, -1).to(x.dtype)
    mean_views = [t.view(p.shape) for t, p in zip(mean.split([p.numel() for p in params]), params)]
    ros_views = [t.view(p.shape) for t, p in zip(ros.split([p.numel() for p in params]), params)]
    index = {id(p): i for i, p in enumerate(params)}
    linear = [(index[id(mod.weight)], index[id(mod.bias)]) for mod in seq if type(mod) is nn.Linear]

    def passes(views):  # forward: the inputs of each Linear [m, b, in] and the ReLU masks; d of the mean loss per part
        h, inputs, masks = x.view(m, b, -1), [], []
        for mod in seq:
            if type(mod) is nn.Linear:
                wi, bi = linear[len(inputs)]
                inputs.append(h)
                h = torch.baddbmm(views[bi].unsqueeze(1), h, views[wi].mT)
            elif type(mod) is nn.ReLU:
                masks.append(h > 0)
                h = h.clamp_min(0)
        return inputs, masks, (torch.softmax(h, -1) - onehot) / b

    def backward(views, inputs, masks, d, per_part):
        out = []
        for j in reversed(range(len(inputs))):
            wi, _ = linear[j]
            a = inputs[j]
            out.append((torch.bmm(d.mT, a), d.sum(1)) if per_part else
                       (d.reshape(-1, d.shape[-1]).t().mm(a.reshape(-1, a.shape[-1])), d.sum((0, 1))))
            if j:
                d = torch.bmm(d, views[wi]).mul_(masks[j - 1])
        return out[::-1]

    def step():
        points.normal_(generator=g)
        torch.addcmul(mean, points, std, out=points)
        views = param_views(points, params)
        grads = backward(views, *passes(views), per_part=True)
        per_param = [None] * len(params)
        for (wi, bi), (gw, gb) in zip(linear, grads):
            per_param[wi], per_param[bi] = gw, gb
        for view, gk, w, r in zip(views, per_param, mean_views, ros_views):
            torch.addcmul(w, gk, r, out=view)  # the ascent points w + rho g_k / s
        abs_g = [gk.abs_().sum(0) for gk in per_param]
        summed = backward(views, *passes(views), per_part=False)
        return abs_g, summed

    return step


FLOOR_ROWS = ("floor:sgd", "floor:passes_m8", "floor:noise_m8", "floor:parts_bsam_m8", "floor:gemm")


def forward_flops(args, device) -> float:
    """FLOPs of one forward of the model on one batch (torch's FlopCounterMode: 2 per multiply-add)."""
    from torch.utils.flop_counter import FlopCounterMode

    module, model = _prepare(create(args), args, device)
    x, _ = _data(args, _input_shape(args.model), device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return float(counter.get_total_flops())


# issue 52's CPU targets: (name, row, floor as {floor: weight}, target); floor "sgd" and "noise" are the floor rows'
# median step times, "flop" the SGD step's FLOP floor
CPU_TARGETS = [
    ("SAM m=8 / SGD floor", "map+sam_m8", {"sgd": 1.0}, 3.0),
    ("SAM m=8 batched / SGD floor", "map+sam_m8_batched", {"sgd": 1.0}, 3.0),
    # bsam+none / vogn_m8+none: batched_parts=auto, the path a run takes on this device; _loop / _batched: each path
    ("bSAM m=8 / (2 SGD + m noise)", "bsam+none", {"sgd": 2.0, "noise": 1.0}, 1.3),
    ("bSAM m=8 loop / (2 SGD + m noise)", "bsam_loop+none", {"sgd": 2.0, "noise": 1.0}, 1.3),
    ("bSAM m=8 batched / (2 SGD + m noise)", "bsam_batched+none", {"sgd": 2.0, "noise": 1.0}, 1.3),
    ("VOGN m=8 / (1.5 SGD + m noise)", "vogn_m8+none", {"sgd": 1.5, "noise": 1.0}, 1.3),
    ("VOGN m=8 loop / (1.5 SGD + m noise)", "vogn_m8_loop+none", {"sgd": 1.5, "noise": 1.0}, 1.3),
    ("VOGN m=8 batched / (1.5 SGD + m noise)", "vogn_m8_batched+none", {"sgd": 1.5, "noise": 1.0}, 1.3),
    ("SGD (map+none) / FLOP floor", "map+none", {"flop": 1.0}, 4.0),
    ("hand-written SGD / FLOP floor", "floor:sgd", {"flop": 1.0}, 4.0),
    # no target: where the m = 8 loops stand against the eager arithmetic of their 16 small passes (batch / 8), which
    # on a CPU costs more than the issue's floors assume (2 SGD steps' FLOPs at small-GEMM efficiency)
    ("16 passes of batch / 8 / SGD floor", "floor:passes_m8", {"sgd": 1.0}, None),
    ("SAM m=8 / 16 passes", "map+sam_m8", {"passes": 1.0}, None),
    ("bSAM m=8 / (16 passes + m noise)", "bsam+none", {"passes": 1.0, "noise": 1.0}, None),
    ("bSAM m=8 loop / (16 passes + m noise)", "bsam_loop+none", {"passes": 1.0, "noise": 1.0}, None),
    ("VOGN m=8 / (8 passes + m noise)", "vogn_m8+none", {"passes": 0.5, "noise": 1.0}, None),  # one pass a part
    # no target: bSAM's own per-part arithmetic (Linear / ReLU nets): where its floor stands, and bSAM beside it
    ("bSAM per-part arithmetic / (2 SGD + m noise)", "floor:parts_bsam_m8", {"sgd": 2.0, "noise": 1.0}, None),
    ("bSAM m=8 / its per-part arithmetic", "bsam+none", {"parts_bsam": 1.0}, None),
]


def cpu_targets(rows: dict, floors: dict) -> dict:
    out = {}
    for name, row, weights, target in CPU_TARGETS:
        if row in rows and all(k in floors for k in weights):
            floor_ms = sum(w * floors[k] for k, w in weights.items())
            value = rows[row]["step_ms_median"] / floor_ms
            out[name] = {"value": value, "row": row, "floor_ms": floor_ms, "floor": weights, "target": target,
                         "meets_target": None if target is None else value <= target}
    return out


def build_swag_parts(method: SWAG, device):
    """Our SWAG collection and sampling alone, with a full deviation buffer (the steady state)."""
    for _ in range(method.max_rank + 1):
        method.collect()
    g = torch.Generator(device=device).manual_seed(0)
    return method.collect, (lambda: method.sample_vector(g))


def build_predict(args, device, chunk: int):
    """One K-sample bSAM predictive over a batch (``--eval-samples K``) with ``chunk`` weight samples per
    vmapped forward (trainer.eval_sample_chunk; 1 = the one-by-one loop)."""
    torch.manual_seed(0)
    method = BSAM(num_samples=args.eval_samples)
    module, model = _prepare(create(args), args, device)
    ctx = RunContext(model=model, module=module, device=device, n_train=50_000, steps_per_epoch=1, epochs=1,
                     optimizer_factory=None, scheduler_factory=None,
                     generator=torch.Generator(device=device).manual_seed(0), channels_last=args.channels_last,
                     eval_sample_chunk=chunk)
    method.setup(ctx)
    x, y = _data(args, _input_shape(args.model), device)
    loaders = {"test": [(x, y)]}

    def predict():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            for _ in method.predict(loaders):
                pass
    for _ in range(args.warmup):
        predict()
    return predict


def time_steps(step, steps: int, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return time.perf_counter() - t0


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"


def device_slug(device: torch.device) -> str:
    """The file-name part: 'cpu' or the GPU's name, lower case, words joined by '-'."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def summarise(times: dict[str, list[float]], kinds: dict[str, str], args) -> dict:
    """Per row: step times of every round (ms), median, min, max, spread and images/s."""
    rows = {}
    for name, rounds in times.items():
        ms = [t / args.steps * 1e3 for t in rounds]
        med = statistics.median(ms)
        row = {"kind": kinds[name], "step_ms": ms, "step_ms_median": med, "step_ms_min": min(ms),
               "step_ms_max": max(ms), "spread": (max(ms) - min(ms)) / med if med > 0 else None}
        if kinds[name] in ("step", "predict"):  # collection / sampling rows process no images
            row.update(images_per_s=args.batch_size / med * 1e3,
                       images_per_s_min=args.batch_size / max(ms) * 1e3,
                       images_per_s_max=args.batch_size / min(ms) * 1e3)
        rows[name] = row
    return rows


def ratios(rows: dict, spec) -> dict:
    """Every ratio is numerator median step time / denominator median step time of THIS run."""
    out = {}
    for name, num, den, target in spec:
        if num in rows and den in rows:
            value = rows[num]["step_ms_median"] / rows[den]["step_ms_median"]
            out[name] = {"value": value, "numerator": num, "denominator": den, "target": target,
                         "meets_target": value <= target}
    return out


def markdown(result: dict) -> str:
    s, dev = result["settings"], result["device"]
    git = result["git"]
    lines = [f"# Benchmark: {s['model']}, batch {s['batch_size']}, {s['precision']}"
             + (", channels_last" if s["channels_last"] else "") + (", compiled" if s["compile"] else ""),
             "", f"**{result['label']}**", "",
             f"device: {dev['name']} | torch {result['torch']} | {result['date']} | commit "
             f"{git['commit'][:12]}{' (dirty tree)' if git.get('dirty') else ''} | {s['steps']} steps x "
             f"{s['repeats']} interleaved rounds (median; spread = (max - min) / median)", "",
             "| row | kind | step ms (median) | min | max | spread | images/s (median) | SWAG collect ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["rows"].items():
        ips = f"{r['images_per_s']:.1f}" if r.get("images_per_s") else "–"
        col = f"{r['collect_ms']:.3f}" if "collect_ms" in r else ""
        lines.append(f"| {name} | {r['kind']} | {r['step_ms_median']:.3f} | {r['step_ms_min']:.3f} | "
                     f"{r['step_ms_max']:.3f} | {r['spread']:.1%} | {ips} | {col} |")
    taken = {name: r["parts_path"] for name, r in result["rows"].items() if r.get("parts_path")}
    if taken:
        lines += ["", "m parts ran as: " + "; ".join(f"{k} {v}" for k, v in taken.items())]
    if result["ratios"]:
        lines += ["", "| ratio (median step times, this run) | value | issue-17 target (GPU) |", "|---|---:|---:|"]
        for name, r in result["ratios"].items():
            lines.append(f"| {name} = {r['numerator']} / {r['denominator']} | {r['value']:.3f} | ≤ {r['target']} |")
    if result.get("floors"):
        f = result["floors"]
        passes = f"; 16 passes of batch / 8 {f['passes']:.3f} ms" if "passes" in f else ""
        lines += ["", f"Floors: hand-written SGD step {f['sgd']:.3f} ms{passes}; m = 8 noise draws {f['noise']:.3f} ms; GEMM "
                  f"{f['gemm_gflops']:.1f} GFLOP/s; forward {f['forward_gflop']:.4f} GFLOP, FLOP floor of an SGD step "
                  f"(x 3 at that rate) {f['flop']:.3f} ms"]
    if result.get("cpu_targets"):
        lines += ["", "| CPU target (issue 52) | row ms | floor ms | ratio | target | met |", "|---|---:|---:|---:|---:|---|"]
        for name, r in result["cpu_targets"].items():
            target, met = (("–", "–") if r["target"] is None else
                           (f"≤ {r['target']}", "yes" if r["meets_target"] else "no"))
            lines.append(f"| {name} | {result['rows'][r['row']]['step_ms_median']:.3f} | {r['floor_ms']:.3f} | "
                         f"{r['value']:.2f} | {target} | {met} |")
    if result.get("note"):
        lines += ["", result["note"]]
    if result["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in result["skipped"].items())]
    if s["reference"]:
        lines += ["", "Reference rows (`ref:*`) are minimal loops written from the documented algorithms "
                  "(flatbnn/bench/reference.py), not the original repositories' code. `ref:asam` scales every "
                  "tensor by |w| (davda54/sam's adaptive mode), ours only `*weight*` tensors by |w| + eta: "
                  "the same cost class, not the same computation."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--model", default="resnet20_frn",
                    help="configs/model/<name>.yaml (e.g. wrn28x10) or a registry name")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (median used)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the backbone (ours and the reference)")
    ap.add_argument("--configs", default=None, help=f"comma-separated method+flatness pairs (default: {DEFAULT})")
    ap.add_argument("--reference", action="store_true", help="also time the reference loops (ours/ref ratios)")
    ap.add_argument("--eval-samples", type=int, default=0,
                    help="also time a K-sample bSAM predictive over one batch (0 = off)")
    ap.add_argument("--eval-chunk", type=int, default=8,
                    help="weight samples per vmapped forward for that predictive, beside the one-by-one loop")
    ap.add_argument("--graphed", action="store_true",
                    help="also time each pair through trainer.cuda_graph's GraphedStep (rows <pair>:graphed)")
    ap.add_argument("--floors", action="store_true",
                    help="also time the floor rows (hand-written SGD, m = 8 noise, GEMM) and report the CPU targets")
    ap.add_argument("--input-shape", default=None, help="C,H,W of the synthetic inputs (default: 1,28,28 for mlp, "
                    "else 3,32,32)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a model keyword (e.g. --set variant=bsam for model=lenet5 model.variant=bsam); repeatable")
    ap.add_argument("--note", default=None, help="a caveat written into the JSON and the Markdown (e.g. the load)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 steps: the whole pipeline in seconds")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--label", default=None, help="what these numbers are (default: device and 'smoke')")
    ap.add_argument("--out", default=str(REPO / "results" / "bench"),
                    help="directory for <device>-<date>[-smoke].json and .md")
    ap.add_argument("--json", default=None, help="write the JSON here instead (the .md goes beside it)")
    args = ap.parse_args(argv)
    args.model_overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--set {item!r}: expected KEY=VALUE")
        import yaml
        args.model_overrides[key] = yaml.safe_load(value)
    if args.input_shape:
        try:
            args.input_shape = tuple(int(v) for v in args.input_shape.split(","))
        except ValueError:
            raise BadInput(f"--input-shape {args.input_shape!r}: expected C,H,W integers") from None
    if args.smoke:
        for k, v in SMOKE.items():
            if k != "configs":
                setattr(args, k, v)
        args.configs = args.configs or SMOKE["configs"]
    args.configs = args.configs or DEFAULT
    for k in ("batch_size", "steps", "repeats"):
        if getattr(args, k) < 1:
            raise BadInput(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.warmup < 0:
        raise BadInput(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv=None) -> dict:
    global INPUT_SHAPE
    args = parse_args(argv)
    INPUT_SHAPE = args.input_shape
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise BadInput(f"--device {args.device!r}: {e}") from None
    steps, kinds, skipped, methods = {}, {}, {}, {}
    pairs = [p for p in args.configs.split(",") if p]
    if args.reference:  # the rows the ours/ref ratios need
        pairs += [p for p in ("map+sam", "map+asam", "swag+none", "bsam+none") if p not in pairs]
    for pair in pairs:
        if pair.count("+") != 1:
            raise BadInput(f"--configs: {pair!r} is not method+flatness (e.g. map+sam)")
        m, f = pair.split("+")
        for graph in (False, True) if args.graphed else (False,):
            name = f"{pair}:graphed" if graph else pair
            try:
                steps[name], method = build(m, f, args, device, graph=graph)
                kinds[name] = "step"
                if not graph:
                    methods[pair] = method
            except BadInput:
                raise
            except (TypeError, ValueError) as e:  # e.g. mc_dropout on a backbone without dropout
                skipped[name] = str(e).splitlines()[0]
                print(f"skipping {name}: {e}", file=sys.stderr)
    if args.reference:
        if "swag+none" in methods:
            steps["collect:swag"], steps["sample:swag"] = build_swag_parts(methods["swag+none"], device)
            kinds["collect:swag"], kinds["sample:swag"] = "collect", "sample"
        for name in REFERENCE_ROWS:
            steps[name] = build_reference(name, args, device)
            kinds[name] = "step" if name in ("ref:sam", "ref:asam", "ref:swag", "ref:bsam") else name.split(":")[1]
    if args.floors:
        for name in FLOOR_ROWS:
            step = build_floor(name, args, device)
            if step is None:  # a floor this network has no hand-written form of
                print(f"skipping {name}: not a Sequential of Flatten / Linear / ReLU", file=sys.stderr)
                continue
            steps[name], kinds[name] = step, "floor" if name != "floor:sgd" else "step"
    if args.eval_samples:  # the K-sample predictive, one by one vs eval_sample_chunk at a time
        for chunk in sorted({1, args.eval_chunk}):
            name = f"predict:k{args.eval_samples}:chunk{chunk}"
            steps[name], kinds[name] = build_predict(args, device, chunk), "predict"
    times = {name: [] for name in steps}
    for _ in range(args.repeats):  # interleaved: every row once per round
        for name, step in steps.items():
            times[name].append(time_steps(step, args.steps, device))
    rows = summarise(times, kinds, args)
    for pair, method in methods.items():
        rows[pair].update(method=pair.split("+")[0], flatness=pair.split("+")[1])
        if getattr(method, "parts_taken", None):  # how bSAM's / VOGN's m parts ran (loop / linear / vmap): what the
            rows[pair]["parts_path"] = ",".join(sorted(method.parts_taken))  # cost estimates key this row by
        if isinstance(method, SWAG):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(5):
                method.collect()
            _sync(device)
            rows[pair]["collect_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    floors = {}
    if args.floors:
        gemm_ms = rows["floor:gemm"]["step_ms_median"]
        gflops = 2 * 1024 ** 3 / (gemm_ms / 1e3) / 1e9
        fwd = forward_flops(args, device)
        floors = {"sgd": rows["floor:sgd"]["step_ms_median"], "noise": rows["floor:noise_m8"]["step_ms_median"],
                  "passes": rows["floor:passes_m8"]["step_ms_median"],
                  **({"parts_bsam": rows["floor:parts_bsam_m8"]["step_ms_median"]}
                     if "floor:parts_bsam_m8" in rows else {}),
                  "gemm_gflops": gflops, "forward_gflop": fwd / 1e9, "flop": 3 * fwd / (gflops * 1e9) * 1e3}
    now = datetime.datetime.now(datetime.timezone.utc)
    smoke_note = " -- smoke run: tiny model, 2 steps; checks the pipeline, not a performance number"
    cpu_note = " -- CPU: relative costs only, not issue 17's GPU numbers"
    label = args.label or (device_name(device) + (smoke_note if args.smoke else "")
                           + (cpu_note if device.type == "cpu" else ""))
    result = {
        "schema": "flatbnn-benchmark/1",
        "label": label,
        "date": now.isoformat(timespec="seconds"),
        "device": {"type": device.type, "name": device_name(device), "slug": device_slug(device),
                   "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git": git_commit(),
        "hardware": hardware(device, 1),
        "settings": {"model": args.model, "model_overrides": args.model_overrides,
                     "input_shape": list(_input_shape(args.model)), "floors": args.floors,
                     "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                     "repeats": args.repeats, "precision": args.precision, "channels_last": args.channels_last,
                     "compile": args.compile, "smoke": args.smoke, "reference": args.reference,
                     "graphed": args.graphed,
                     "swag_collect": "every step (worst case)", "configs": pairs,
                     "eval_samples": args.eval_samples, "eval_chunk": args.eval_chunk},
        "rows": rows,
        "ratios": {**ratios(rows, RATIOS), **ratios(rows, REFERENCE_RATIOS),
                   **ratios(rows, [(f"{p} graphed/eager", f"{p}:graphed", p, 1.0) for p in pairs
                                   if f"{p}:graphed" in rows]), **ratios(rows, [
            (f"predictive chunk{args.eval_chunk}/chunk1", f"predict:k{args.eval_samples}:chunk{args.eval_chunk}",
             f"predict:k{args.eval_samples}:chunk1", 1.0)] if args.eval_samples and args.eval_chunk > 1 else [])},
        "skipped": skipped,
        "floors": floors,
        "cpu_targets": cpu_targets(rows, floors) if floors else {},
        "note": args.note,
    }
    json_path = Path(args.json) if args.json else (
        Path(args.out) / f"{device_slug(device)}-{now.date().isoformat()}{'-smoke' if args.smoke else ''}.json")
    write_json(json_path, result)
    md = markdown(result)
    md_path = json_path.with_suffix(".md")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    write_text(md_path, md)  # atomic, as the JSON
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return result


if __name__ == "__main__":
    try:
        main()
    except BadInput as e:
        print(f"benchmark.py: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
