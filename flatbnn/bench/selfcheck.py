"""The GPU window's self-check (issue 41): each step path the campaign may use, 5 steps against eager, each path in
its own subprocess under its own time cap, the JSON rewritten after each section.

    python -m flatbnn.bench.selfcheck --out selfcheck.json [--dry-run]    # every path (the window calls this)
    python -m flatbnn.bench.selfcheck --path cuda_graph --out one.json     # one path (what the parent runs)

A path passes when it ran on its own step (a graphed path that fell back to eager fails with the fallback's line)
and, after ``CHECK_STEPS`` steps from the same seed, its weights drifted from the eager step's by no more than
rounding can explain: ``drift`` = ||w_path - w_eager|| / ||w_eager - w_0|| (all weights as one vector: the
difference per distance trained) is at most ``max(TOLERANCE[dtype], FLOOR_FACTOR * floor)``, where ``floor`` is the
drift of eager itself from weights scaled by (1 + 2^-23) -- one ulp -- measured in the same process. Why: five steps
of ResNet-20-FRN at lr 0.1 amplify rounding ~1e4-fold (on a CPU the one-ulp floor is 2.3e-3, and 2.5e-2 on the
worst single tensor, an FRN tau), so a path that merely reorders sums (batched SAM chunks: 1.2e-3; compiled
kernels; a tensor lr) can never meet a fixed 1e-4, while a graph whose lr stays put drifts 0.18, 77 x the floor
(full-size CPU measurements, 2026-11-27). On a GPU every run is under :func:`exact_math` (TF32 off, deterministic
kernels; under the defaults eager disagreed with eager itself, 4.4e-2 on the worst tensor of an H100). Each step
runs the real lr scheduler (configs/scheduler/cosine.yaml, lr falling every step) and optimiser config. A path that
failed, timed out or drifted is never used by the campaign (``usable``); its one-line reason is kept. Images/s is
timed under exact_math for every path (a fair ratio; training's own TF32 default may be faster).
``--throughput NAME`` times one path from a common start instant: the 1 vs 2 vs 4 process test."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flatbnn.bench.variants import target_class

CHECK_STEPS = 5
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}  # drift (module docstring) always allowed, whatever the floor
FLOOR_FACTOR = 10.0  # drift allowed per unit of the one-ulp floor (CPU, full size: rounding 0.5x, a frozen lr 77x)
ULP = 2.0 ** -23
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class StepPath:
    """One way the campaign may run a training step: network, batch, precision, method x flatness, how it runs."""
    name: str
    what: str
    model: str = "frn"           # frn: ResNet-20-FRN; wrn: WRN-28-2 (the dry run shrinks both)
    batch: int = 200
    precision: str = "fp32"
    method: str = "map"          # map | bsam | vogn (no path of its own yet: each path costs window time)
    flatness: str = "none"       # none | sam_m8
    optimizer: str = "sgd"       # sgd | adam (configs/optimizer/<name>.yaml)
    graphed: bool = True         # through trainer.cuda_graph's GraphedStep
    batched: bool = False        # flatness.batched_chunks; bSAM / VOGN: method.batched_parts
    compiled: bool = False       # trainer.compile's backbone inside the step
    cap_s: float = 45.0          # this path's subprocess time cap (cold start + 2 x 5 steps + timing)


PATHS = (
    StepPath("eager", "today's eager step, SGD", graphed=False),
    StepPath("cuda_graph", "trainer.cuda_graph, SGD"),
    StepPath("cuda_graph_bf16", "trainer.cuda_graph, WRN-28-2 bf16 autocast inside the capture", model="wrn",
             batch=128, precision="bf16"),
    StepPath("sam_m8_batched", "trainer.cuda_graph + flatness.batched_chunks, SAM m=8", flatness="sam_m8",
             batched=True),
    # the parts batched (method.batched_parts=auto on a GPU; the dry run asks for them on the CPU too)
    StepPath("bsam_m8", "trainer.cuda_graph, bSAM m=8, parts batched", method="bsam", batched=True),
    StepPath("adam_capturable", "trainer.cuda_graph, Adam (capturable=True on CUDA)", optimizer="adam"),
    StepPath("compiled", "trainer.compile backbone inside trainer.cuda_graph, SGD", compiled=True, cap_s=100.0),
)
BY_NAME = {p.name: p for p in PATHS}


# ------------------------------------------------------------------------------------------ one path (child)
def _config(group: str, name: str):
    from omegaconf import OmegaConf

    return OmegaConf.load(REPO / "configs" / group / f"{name}.yaml")


def build(path: StepPath, device, dry: bool):
    """(method, flatness, backprop, batch), seeded: the same weights, data and schedule every call."""
    import torch
    from hydra.utils import instantiate

    from flatbnn.engine.backprop import Backprop
    from flatbnn.flatness import SAM, NoFlatness
    from flatbnn.methods import MAP, RunContext
    from flatbnn.methods.bsam import BSAM
    from flatbnn.methods.vogn import VOGN
    from flatbnn.models import create_model
    from flatbnn.models.resnet_frn import ResNetFRN

    torch.manual_seed(0)
    side = 8 if dry else 32
    if path.model == "frn":
        net = ResNetFRN(10, in_channels=3, depth=8, width=2) if dry else create_model("resnet20_frn", 10, (3, 32, 32))
    else:
        depth, widen = (10, 1) if dry else (28, 2)
        net = create_model("wrn", 10, (3, side, side), depth=depth, widen_factor=widen)
    method = {"bsam": lambda: BSAM(m=8, num_samples=1, batched_parts=path.batched),
              "vogn": lambda: VOGN(m=8, num_samples=1, batched_parts=path.batched), "map": MAP}[path.method]()
    module = method.prepare_model(net).to(device)
    precision = path.precision if device.type == "cuda" else "fp32"
    if precision == "bf16":
        module = module.to(memory_format=torch.channels_last)
    opt_cfg = _config("optimizer", path.optimizer)
    factory = instantiate(opt_cfg)
    if path.optimizer == "adam" and device.type == "cuda":
        base = factory
        factory = lambda params: base(params, capturable=True)  # noqa: E731
    sched_cfg = _config("scheduler", "cosine")
    ctx = RunContext(model=module, module=module, device=device, n_train=50_000, steps_per_epoch=CHECK_STEPS,
                     epochs=2, optimizer_factory=factory, scheduler_factory=instantiate(sched_cfg),
                     generator=torch.Generator(device=device).manual_seed(0))
    method.setup(ctx)
    flat = SAM(rho=0.05, m=8, batched_chunks=path.batched) if path.flatness == "sam_m8" else NoFlatness()
    flat.setup(ctx, method)
    if path.compiled:
        backend = "inductor" if device.type == "cuda" else "aot_eager"  # the dry run: the plumbing, not Inductor
        if backend == "inductor":
            from flatbnn.engine.compiling import compile_model
            method.model = compile_model(method.module, device)
        else:
            method.model = torch.compile(method.module, backend=backend)
    bp = Backprop(module, device, precision=precision)
    method.train()
    batch = 16 if dry else path.batch
    x = torch.randn(batch, 3, side, side, device=device)
    return method, flat, bp, (x, torch.randint(0, 10, (batch,), device=device)), precision


def _stepper(path: StepPath, method, flat, bp, device):
    from flatbnn.engine import graphed

    if not path.graphed:
        return lambda batch: method.train_step(batch, flat, bp), None
    backend = graphed.EagerReplay() if device.type != "cuda" else None  # the CPU stand-in for a CUDA graph
    step = graphed.GraphedStep(method, flat, bp, capture=backend, log=lambda s: None)
    return step, step


def exact_math(device) -> None:
    """fp32 as fp32 and the same kernels run to run on CUDA: what a rounding-level comparison needs (module docstring).
    CUBLAS_WORKSPACE_CONFIG must be in the environment before CUDA starts: :func:`main` sets it."""
    import torch

    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns, runs


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_path(path: StepPath, device, dry: bool) -> dict:
    """Run ``path`` CHECK_STEPS steps against eager from the same seed; then time it. One path's record."""
    import torch

    exact_math(device)
    method, flat, bp, batch, precision = build(path, device, dry)
    step, graphed_step = _stepper(path, method, flat, bp, device)
    if graphed_step is not None:
        reason = graphed_step.fallback_reason(batch)
        if reason is not None:
            return {"ok": False, "reason": f"eager fallback: {reason}", "dtype": precision}
    lrs = []
    for _ in range(CHECK_STEPS):
        step(batch)
        lrs.append(float(method.optimizer.param_groups[0]["lr"]))
    eager_path = StepPath(**{**asdict(path), "graphed": False, "compiled": False, "batched": False})
    w0, ref = _eager_run(eager_path, device, dry)
    _, nudged = _eager_run(eager_path, device, dry, scale=1.0 + ULP)
    mine = {n: t.detach() for n, t in method.module.named_parameters()}
    drift, floor = _drift(mine, ref, w0), _drift(nudged, ref, w0)
    rels = {n: float((a.double() - ref[n].double()).norm() / ref[n].double().norm().clamp_min(1e-30))
            for n, a in mine.items()}
    worst = max(rels, key=rels.get)
    finite = all(bool(torch.isfinite(a).all()) for a in mine.values())
    allowed = judge_limit(precision, floor)
    out = {"dtype": precision, "drift": drift, "floor": floor, "allowed": allowed,
           "worst_tensor": worst, "worst_tensor_rel": rels[worst], "lr_per_step": lrs,
           "img_s": images_per_s(step, batch, device, 2 if dry else 20),
           "math": "TF32 off, deterministic kernels" if device.type == "cuda" else "cpu"}
    if not finite:
        out.update(ok=False, reason="non-finite weights after the check steps")
    elif not drift <= allowed:
        out.update(ok=False, reason=f"drifted from eager by {drift:.2e} > {allowed:.2e} = max({TOLERANCE[precision]:g}, "
                                    f"{FLOOR_FACTOR:g} x the one-ulp floor {floor:.1e}) ({precision}; worst {worst})")
    else:
        out["ok"] = True
    return out


def judge_limit(precision: str, floor: float) -> float:
    """The drift a path may show: what rounding alone produced (FLOOR_FACTOR x the one-ulp floor), at least TOLERANCE."""
    return max(TOLERANCE[precision], FLOOR_FACTOR * floor)


def _eager_run(path: StepPath, device, dry: bool, scale: float = 1.0):
    """(initial weights, weights after CHECK_STEPS eager steps), every weight first multiplied by ``scale``."""
    import torch

    method, flat, bp, batch, _ = build(path, device, dry)
    if scale != 1.0:
        with torch.no_grad():
            for t in method.module.parameters():
                t.mul_(scale)
    w0 = {n: t.detach().clone() for n, t in method.module.named_parameters()}
    for _ in range(CHECK_STEPS):
        method.train_step(batch, flat, bp)
    _sync(device)
    return w0, {n: t.detach() for n, t in method.module.named_parameters()}


def _drift(w: dict, ref: dict, w0: dict) -> float:
    """||w - ref|| / ||ref - w0|| over all weights as one vector (float64)."""
    num = sum(float((w[n].double() - ref[n].double()).square().sum()) for n in ref)
    den = sum(float((ref[n].double() - w0[n].double()).square().sum()) for n in ref)
    return (num / max(den, 1e-300)) ** 0.5


def images_per_s(step, batch, device, n: int) -> float:
    """Images/s over ``n`` steps after one untimed (CUDA events on a GPU)."""
    import torch

    step(batch)
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            step(batch)
        end.record()
        end.synchronize()
        sec = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(n):
            step(batch)
        sec = time.perf_counter() - t0
    return batch[0].shape[0] * n / sec


def throughput(path: StepPath, device, dry: bool, start_at: float, seconds: float, rank: int,
               counts: list[int], gap: float = 1.0) -> dict:
    """Images/s of this process (``rank``) in each round of ``counts``: round r runs from the wall-clock instant
    ``start_at + r * (seconds + gap)`` for ``seconds``, with the processes of rank < counts[r] stepping together (the
    others wait): one start-up for all rounds. ``ready_late_s`` > 0: built after ``start_at`` (the rounds don't count)."""
    method, flat, bp, batch, _ = build(path, device, dry)
    step, _ = _stepper(path, method, flat, bp, device)
    step(batch)
    _sync(device)
    out = {"ready_late_s": round(max(0.0, time.time() - start_at), 2), "img_s": {}}
    for r, k in enumerate(counts):
        begin = start_at + r * (seconds + gap)
        if rank >= k:
            continue
        while time.time() < begin:
            time.sleep(0.002)
        images, end = 0, begin + seconds
        while time.time() < end:
            step(batch)
            _sync(device)
            images += batch[0].shape[0]
        out["img_s"][str(k)] = images / seconds
    return out


# ------------------------------------------------------------------------------------------ all paths (parent)
def write_json(path: Path, data: dict) -> None:
    """Atomic: a reader (or a window killed now) sees the previous or the new file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def versions(dry: bool) -> dict:
    import platform

    import torch

    cuda = torch.cuda.is_available() and not dry
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=REPO).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "commit": os.environ.get(
                "FLATBNN_COMMIT") or commit, "dry_run": dry, "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def _child(args: list[str], cap_s: float, env: dict | None = None) -> tuple[dict | None, str]:
    """Run ``python -m flatbnn.bench.selfcheck <args>`` under ``cap_s``: (its JSON, '') or (None, one line why)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "one.json"
        try:
            pr = subprocess.run([sys.executable, "-m", "flatbnn.bench.selfcheck", *args, "--out", str(out)],
                                cwd=REPO, capture_output=True, text=True, timeout=max(1.0, cap_s),
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        except subprocess.TimeoutExpired:
            return None, f"timed out after its {cap_s:.0f} s cap"
        if out.is_file():
            return json.loads(out.read_text()), ""
        lines = [ln for ln in (pr.stderr or "").strip().splitlines() if ln.strip()]
        return None, f"exit {pr.returncode}: {lines[-1][:300] if lines else 'no output'}"


def _timed_child(path: StepPath, cap: float, dry: bool) -> dict:
    s0 = time.monotonic()
    got, why = _child(["--path", path.name] + (["--dry-run"] if dry else []), cap)
    rec = got if got is not None else {"ok": False, "reason": why}
    rec["seconds"] = round(time.monotonic() - s0, 1)
    return rec


def run_selfcheck(out: Path, *, dry: bool, budget_s: float = 180.0, caps: dict[str, float] | None = None,
                  names: list[str] | None = None, parallel: bool = False, log=print,
                  skip_reason: str | None = None) -> dict:
    """Every path in its own subprocess; ``out`` rewritten after each. Paths after the budget: skipped (unused).
    ``parallel``: the children run side by side (CPU dry run only: a GPU's timings must not overlap)."""
    t0 = time.monotonic()
    report = {"versions": versions(dry), "tolerance": TOLERANCE, "floor_factor": FLOOR_FACTOR,
              "check_steps": CHECK_STEPS, "paths": {},
              "usable": []}
    write_json(out, report)
    paths = [BY_NAME[n] for n in (names or [p.name for p in PATHS])]
    if parallel:  # the dry run: CPU timings mean nothing, so the children overlap (CI minutes)
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(len(paths))
        futures = {p.name: pool.submit(_timed_child, p, min((caps or {}).get(p.name, p.cap_s), budget_s), dry)
                   for p in paths}
    for path in paths:
        if parallel:
            rec = futures[path.name].result()
        else:
            left = budget_s - (time.monotonic() - t0)
            rec = _timed_child(path, min((caps or {}).get(path.name, path.cap_s), left), dry) if left >= 5 else {
                "ok": False, "reason": skip_reason or f"skipped: the self-check's {budget_s:.0f} s were spent"}
        rec["what"] = path.what
        report["paths"][path.name] = rec
        report["usable"] = [n for n, r in report["paths"].items() if r.get("ok")]
        write_json(out, report)
        log(f"self-check {path.name}: " + (f"ok, {rec.get('img_s', 0):.0f} img/s, drift {rec.get('drift', 0):.1e} "
                                            f"(allowed {rec.get('allowed', 0):.1e})"
                                            if rec.get("ok") else f"NOT USED: {rec['reason']}"))
    report["seconds"] = round(time.monotonic() - t0, 1)
    write_json(out, report)
    return report


def measure_procs(report: dict, out: Path, *, dry: bool, counts=(1, 2, 4), seconds: float = 6.0,
                  gain: float = 1.1, log=print) -> int:
    """Aggregate images/s of 1, 2, 4 processes stepping side by side (``throughput``: max(counts) processes started
    once, rounds at common instants) on the fastest usable SGD path (the graph, else eager); returns the count with
    the highest aggregate, moving up only for a rise above ``gain`` x. Recorded in ``report["procs"]`` (and ``out``)."""
    # eager is what every cell runs when nothing else passed, so it is timed even where its own check failed
    name = next((n for n in ("cuda_graph", "eager") if n in report["usable"]), "eager")
    rec = {"path": name, "seconds_per_round": seconds, "aggregate_img_s": {}, "chosen": 1}
    report["procs"] = rec
    # every process built and warm by then: twice the self-check child's own seconds (start-up, build, 10 steps)
    ready_s = min(2.0 * float((report["paths"].get(name) or {}).get("seconds") or 15.0) + 3.0, 90.0 if dry else 60.0)
    start_at = time.time() + ready_s
    n = max(counts)
    mps = False
    if not dry:
        from flatbnn.bench.mps import start_mps
        mps = start_mps()
    files = [out.with_name(f".procs.{i}.json") for i in range(n)]
    pr = [subprocess.Popen([sys.executable, "-m", "flatbnn.bench.selfcheck", "--throughput", name, "--rank", str(i),
                            "--counts", ",".join(map(str, counts)), "--start-at", str(start_at), "--seconds",
                            str(seconds), "--out", str(files[i])] + (["--dry-run"] if dry else []), cwd=REPO,
                           env=dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n))),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(n)]
    got = []
    try:
        for p, f in zip(pr, files):
            try:
                p.wait(timeout=max(1.0, start_at - time.time()) + len(counts) * (seconds + 1.0) + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if f.is_file():
                got.append(json.loads(f.read_text()))
                f.unlink()
    finally:
        if mps:
            from flatbnn.bench.mps import stop_mps
            stop_mps()
    late = [g["ready_late_s"] for g in got]
    if len(got) < n or any(late):
        rec["reason"] = f"{len(got)} of {n} processes reported, late by {late} s: not measured, 1 process"
    else:
        for k in counts:
            rec["aggregate_img_s"][str(k)] = round(sum(g["img_s"][str(k)] for g in got[:k]), 1)
    best, best_rate = 1, rec["aggregate_img_s"].get("1") or 0.0
    for k in counts[1:]:
        r = rec["aggregate_img_s"].get(str(k))
        if r is not None and r > best_rate * gain:
            best, best_rate = k, r
    rec["chosen"] = best
    write_json(out, report)
    log(f"procs: aggregate img/s {rec['aggregate_img_s'] or rec.get('reason')}: {best} at once")
    return best


# ------------------------------------------------------------------------------------------ what the campaign uses
COMPILE_GAIN = 1.2  # trainer.compile only where its path beat the graphed SGD step by this much (each job recompiles)


def _img_s(report: dict, name: str) -> float:
    return float((report["paths"].get(name) or {}).get("img_s") or 0.0)


def cpu_step_overrides(cfg) -> list[str]:
    """A CPU campaign cell's step path (no self-check needed: the rule is measured on the CPU). SAM m > 1 on a net of
    nn.Linear layers only, without dropout, takes ``flatness.batched_chunks=true``: there that is the low-rank path
    (flatbnn/flatness/low_rank.py), 2.5x an SGD step on the MNIST MLP against the loop's 8.5x, in one process
    (results/bench/cpu-2026-11-28-mnist-mlp-b200-lowrank.md). Any other net would take the vmap path, which measured
    slower than the loop on a CPU (135 ms against 89 ms, results/bench/cpu-2026-11-28-mnist-mlp-b200.md), so it keeps
    the loop; so does whatever the batched path refuses (flatness/batched.py ``config_refusal``)."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from torch import nn

    from flatbnn.engine.validate import refusal_of_config
    from flatbnn.nn.parts_linear import linear_layers

    flat = cfg.get("flatness") or {}
    if target_class(flat) != "SAM" or int(flat.get("m", 1) or 1) <= 1 or "batched_chunks" not in flat \
            or flat.get("batched_chunks"):
        return []
    try:
        if refusal_of_config(cfg) is not None:
            return []
        with torch.device("meta"):  # the layers, no memory: a WRN-28-10 costs nothing here
            module = instantiate(OmegaConf.to_container(cfg.model, resolve=True))
    except Exception:  # a class that does not import, a model that does not build: the run reports it
        return []
    params = [p for p in module.parameters() if p.requires_grad]
    if linear_layers(module, params) is None or any(
            isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()):
        return []
    return ["flatness.batched_chunks=true"]


def step_overrides(cfg, report: dict, cuda: bool, compile_cache: str | None = None) -> list[str]:
    """A campaign cell's step-path overrides: only what a passing path of ``report`` covers. The graph for MAP
    cells with SGD (``cuda_graph`` / ``cuda_graph_bf16`` by precision) or Adam (``adam_capturable``) and for bSAM
    (``bsam_m8``), where the graphed SGD step beat eager; ``flatness.batched_chunks`` for SAM m > 1
    (``sam_m8_batched``); trainer.compile with the graph where ``compiled`` beat it by COMPILE_GAIN. Every other cell
    keeps its eager step. Graph and compile need CUDA; batched chunks run anywhere (the dry run's jobs use them)."""
    usable = set(report.get("usable") or [])
    method, optimizer, flat = target_class(cfg.get("method")), target_class(cfg.get("optimizer")), cfg.get("flatness") or {}
    flat_cls = target_class(flat)
    out = []
    if flat_cls == "SAM" and int(flat.get("m", 1) or 1) > 1 and "batched_chunks" in flat and "sam_m8_batched" in usable:
        out.append("flatness.batched_chunks=true")
    if not cuda or flat_cls not in ("NoFlatness", "SAM"):
        return out
    if flat_cls == "SAM" and not out:
        return out  # SAM through the graph was checked only as m = 8 with batched chunks
    need = None
    if method == "BSAM":
        need = "bsam_m8"
    elif method == "MAP" and optimizer == "Adam":
        need = "adam_capturable"
    elif method == "MAP" and optimizer == "SGD":
        need = {"fp32": "cuda_graph", "bf16": "cuda_graph_bf16"}.get(str(cfg.trainer.get("precision", "fp32")))
    if need in usable and _img_s(report, "cuda_graph") > _img_s(report, "eager"):
        out.append("trainer.cuda_graph=true")
        if need == "cuda_graph" and "compiled" in usable and \
                _img_s(report, "compiled") > COMPILE_GAIN * _img_s(report, "cuda_graph"):
            out.append("trainer.compile=true")
            if compile_cache:
                out.append(f"trainer.compile_cache={compile_cache}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (CI)")
    ap.add_argument("--path", choices=sorted(BY_NAME), help="run this one path (the child of the full check)")
    ap.add_argument("--throughput", choices=sorted(BY_NAME), help="time this path from --start-at for --seconds")
    ap.add_argument("--start-at", type=float, default=0.0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--counts", default="1,2,4")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--budget", type=float, default=180.0, help="seconds for all paths together")
    args = ap.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # exact_math's cuBLAS: before CUDA starts
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type != "cuda" and not args.dry_run:
        print("selfcheck: no CUDA device; use --dry-run on a CPU", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.path:
        write_json(args.out, check_path(BY_NAME[args.path], device, args.dry_run))
    elif args.throughput:
        write_json(args.out, throughput(BY_NAME[args.throughput], device, args.dry_run, args.start_at, args.seconds,
                                        args.rank, [int(c) for c in args.counts.split(",")]))
    else:
        run_selfcheck(args.out, dry=args.dry_run, budget_s=args.budget, parallel=args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
