"""What one run of a composed cell config costs: its FLOPs (an estimate) and its wall time on a device -- from a
MEASURED throughput where one matches, else from the FLOPs at an ASSUMED sustained rate, and it says which.

Used by the cost table (scripts/estimate_cost.py), the dry runs (`scripts/reproduce.py run ... --dry-run`) and the
campaign's queue (flatbnn/reproduce/campaign.py).

Measured throughputs (images/s of training, both passes of a two-pass method included) come from
  * ``results/bench/*.json`` (scripts/benchmark.py: the training step of a network x method x flatness on one
    device; the newest file of each device/network/pair wins), and
  * finished runs' records ``results/reproduce/<row>/<scale>/runs/**/results.json``: train images x epochs /
    train_seconds, the whole training loop (per-epoch evaluation included), per device -- those that finished
    after the newest benchmark of their step on their device (an older run measured older code).
A measurement matches a run when the network (name, depth, width), the method and flatness classes, the
m-sharpness split m and the precision agree; the run's own batch size may differ (said in the basis).
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from flatbnn.bench.variants import target_class, work_class
from flatbnn.resources import CONFIGS_DIR
from flatbnn.reproduce.spec import REPO

BENCH_DIR = REPO / "results" / "bench"
RECORDS_ROOT = REPO / "results" / "reproduce"
# assumed sustained rates where nothing was measured: one A100 in bf16 on CIFAR-sized nets, ~8 % of its 312 TFLOP/s
# dense peak (docs/cluster.md); 2 CPU cores: the MNIST MLP's measured 5,990 images/s x 3 x 1.09 MFLOP ~ 20 GFLOP/s
ASSUMED_TFLOPS = {"gpu": 25.0, "cpu": 0.02}
# ... and on a GPU no step is quicker than its launch overhead, whatever its FLOPs: an eager forward/backward +
# update took 2.75 ms on the H100 window of 2026-11-27 (MNIST MLP, batch 200: 36,000 steps in 99 s, results/
# reproduce/bsam_t6/paper/runs/mnist/mlp/sgd/seed1), where the FLOP rate said ~1 s for the run. Each pass of each
# sub-batch (SAM / bSAM / VOGN's m) pays it; without this the window queued bSAM m=8 MLP runs as '~2 s' (each ~25 min).
GPU_PASS_FLOOR_S = 2.75e-3
# A captured step (trainer.cuda_graph) still pays per pass and sub-batch, only less: bSAM m = 8 on the MNIST MLP
# replayed at a median 8,029 images/s (24.9 ms per step of 2 x 8 passes, 2 processes at once) in the H100 window of
# commit c942193 (outputs of bsam_t3 mnist/mlp/bsam_no_noise seed 0, 23 epochs). The 0.5 ms per whole step assumed
# before had queued those runs as '~18 s' (each ~15 min).
GPU_GRAPH_PASS_FLOOR_S = 1.55e-3

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


class CostError(ValueError):
    """Bad input (unknown row, missing markers, a cell that does not compose): one line, exit 2."""


# ---------------------------------------------------------------------------------------------- FLOPs
def forward_flops(model, input_shape) -> int:
    """FLOPs of one forward pass of ``model`` on one input of ``input_shape`` (no batch dimension)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

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


@functools.cache
def _linear_only(model_json: str, shape: tuple[int, ...]) -> bool:
    """Whether every parameter of the network is a Linear's run once on rows (the parts-Linear path of bSAM / VOGN,
    flatbnn/nn/parts_linear.py; ``batched_parts=auto`` takes it on a CPU)."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from flatbnn.nn.parts_linear import row_linear_layers

    module = instantiate(OmegaConf.create(json.loads(model_json)))
    params = [p for p in module.parameters() if p.requires_grad]
    return row_linear_layers(module, params, torch.zeros(2, *shape)) is not None


def passes_per_step(cfg) -> int:
    """Forward/backward passes of one training step of a composed config: what its flatness and method classes
    declare (``passes``: SAM and its subclasses 2, bSAM and VSAM 2, the rest 1). A method that perturbs the weights
    itself runs with flatness none, so the two never multiply; the larger is the step's."""
    from hydra.utils import get_class

    return max(int(getattr(get_class(str(node._target_)), "passes", 1))
               for node in (cfg.get("flatness"), cfg.method) if node is not None and node.get("_target_"))


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


def split_sizes(ds) -> tuple[int, int]:
    """(train, test) images a run of data-set config ``ds`` uses: its subsets where set, else the standard split."""
    standard = SPLIT_SIZES.get(ds.name)
    if standard is None and not (ds.get("train_subset") and ds.get("test_subset")):
        raise CostError(f"no standard split size for dataset {ds.name!r}: add it to SPLIT_SIZES in "
                        f"flatbnn/reproduce/cost.py")
    n_train = ds.get("train_subset") or standard[0]
    if ds.name == "flowers102" and ds.get("train_split") == "train" and not ds.get("train_subset"):
        n_train = 1_020
    n_train -= int(ds.get("val_split") or 0)
    return int(n_train), int(ds.get("test_subset") or standard[1])


def run_cost(cfg) -> RunCost:
    """The cost of one run of a composed config."""
    from omegaconf import OmegaConf

    ds = cfg.dataset
    size = ds.get("image_size")
    shape = tuple(int(s) for s in ds.input_shape)
    if size:  # served at S x S (e.g. CIFAR at 224 for a ViT)
        shape = (shape[0], int(size), int(size))
    model_json = json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True)
    n_train, n_test = split_sizes(ds)
    method = cfg.method
    return RunCost(network=str(cfg.model.get("name", target_class(cfg.model))), dataset=str(ds.name),
                   forward_flops=_network_flops(model_json, shape), train_images=n_train,
                   test_images=n_test, epochs=int(cfg.trainer.epochs), passes=passes_per_step(cfg),
                   members=int(method.get("num_members") or 1),
                   # a deep ensemble predicts with each member once (its num_samples is its num_members)
                   samples=max(1, int(method.get("num_samples") or method.get("num_members") or 1)))


# ---------------------------------------------------------------------------------------------- measured rates
def device_slug(name: str | None) -> str:
    """'cpu', or a GPU's name in lower case with words joined by '-' (as results/bench/ file names)."""
    if not name or name == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def this_device() -> str:
    """This machine's device slug: its first GPU's, else 'cpu'."""
    import torch

    return device_slug(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"


NETWORK_KEYS = ("depth", "widen_factor", "hidden", "variant", "stage_blocks")  # the size keys of configs/model/


def _network(model: dict, input_shape) -> str:
    """A network's identity across configs: name, size keys, input shape (e.g. 'wrn-28-2@3x32x32')."""
    parts = [str(model.get("name") or target_class(model))]
    parts += [str(model[k]) for k in NETWORK_KEYS if model.get(k) is not None]
    return "-".join(parts).replace(" ", "") + "@" + "x".join(str(int(s)) for s in input_shape or [])


def _input_shape(ds: dict) -> list:
    shape = list(ds.get("input_shape") or [])
    size = ds.get("image_size")
    return [shape[0], size, size] if size and shape else shape


def work_key(cfg: dict) -> tuple:
    """What a throughput depends on, of a run config (a composed config as a dict, or a config_resolved.yaml):
    (network, method class, flatness class, m-sharpness split, precision), the classes with the keys that change a
    step's cost within one (bench/variants.work_class: SGVB's estimator)."""
    method, flat = cfg.get("method") or {}, cfg.get("flatness") or {}
    m = flat.get("m") or method.get("m") or 1
    return (_network(cfg.get("model") or {}, _input_shape(cfg.get("dataset") or {})), work_class(method), work_class(flat), int(m),
            str((cfg.get("trainer") or {}).get("precision", "fp32")))


def parts_path(cfg: dict, device: str) -> str:
    """How a step with m-sharpness parts (m > 1) runs them on ``device`` (a slug): "batched" or "loop"; "" for m = 1.
    A method that perturbs the weights itself (bSAM, VOGN) says it (``batched_parts``; auto: batched on a GPU, on a
    CPU where the network is Linear-only, methods/diag_gaussian.batched_by_default), a flatness variant by
    ``batched_chunks``. The two paths of one pair differ up to 3.6x (SAM m = 8 on the MNIST MLP, one CPU thread:
    78 vs 22 ms), so a benchmark row prices only the runs that take its path."""
    method, flat = cfg.get("method") or {}, cfg.get("flatness") or {}
    if int(flat.get("m") or method.get("m") or 1) <= 1:
        return ""
    if "batched_parts" in method:
        want = method["batched_parts"]
        if str(want) == "auto":  # the methods' own rule, on the device the slug names
            import torch

            from flatbnn.methods.diag_gaussian import batched_by_default
            try:  # the model's interpolations (${dataset.num_classes}, ...) resolved against the whole config (the
                # class count, where a partial config lacks it, does not change which layers hold the parameters)
                from omegaconf import OmegaConf

                whole = {**cfg, "dataset": {"num_classes": 10, **(cfg.get("dataset") or {})}}
                model = OmegaConf.to_container(OmegaConf.create(whole).model, resolve=True)
                linear = _linear_only(json.dumps(model, sort_keys=True),
                                      tuple(int(s) for s in _input_shape(cfg.get("dataset") or {})))
            except Exception:  # noqa: BLE001 - no model, or one that no longer builds: priced as not Linear-only
                linear = False
            want = batched_by_default(torch.device("cpu" if device == "cpu" else "cuda"), linear)
        return "batched" if want is True or str(want).lower() == "true" else "loop"
    return "batched" if flat.get("batched_chunks") in (True, "true", "True") else "loop"


def taken_path(recorded: str | None) -> str | None:
    """The path a measured step or run DID take ("loop" / "batched"), from what it recorded (a benchmark row's or
    results.json's ``parts_path``: loop, linear, vmap, comma-joined); None where it recorded none or took both (a
    resume across a rule change). It beats :func:`parts_path`, which applies TODAY's rule to the config: an ``auto``
    measured under an older rule may have taken the other path."""
    taken = set(filter(None, str(recorded or "").split(",")))
    if taken == {"loop"}:
        return "loop"
    return "batched" if taken and "loop" not in taken else None


@dataclass(frozen=True)
class Rate:
    images_per_s: float
    basis: str          # where the number came from, e.g. "measured: results/bench/<file> map+sam_m8 (batch 200)"
    measured: bool


def _bench_pairs() -> dict[str, tuple[tuple[str, str, int], dict]]:
    """scripts/benchmark.py's row labels -> ((method class, flatness class, m), {"method": keys, "flatness": keys}):
    what each row builds (flatbnn/bench/variants.py, read from configs/)."""
    from flatbnn.bench import variants

    keys = variants.pair_keys()
    return {label: (cls, keys[label]) for label, cls in variants.pair_classes().items()}


def measured_rates(bench_dir: Path | None = None, records_root: Path | None = None) -> dict[tuple, list[Rate]]:
    """{(device slug, work key, parts path): [Rate, ...]} from every benchmark file and every finished run's record."""
    return _measured_rates(Path(bench_dir or BENCH_DIR), Path(records_root or RECORDS_ROOT))


@functools.lru_cache(maxsize=4)
def _measured_rates(bench_dir: Path, records_root: Path) -> dict[tuple, list[Rate]]:
    rates: dict[tuple, list[Rate]] = {}
    bench_files = sorted(Path(bench_dir).glob("*.json"))
    pairs = _bench_pairs() if bench_files else {}
    newest: dict[tuple, tuple[str, Rate]] = {}
    for f in bench_files:
        try:
            b = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        st = b.get("settings") or {}
        model_file = CONFIGS_DIR / "model" / f"{st.get('model')}.yaml"
        if not model_file.is_file() or (b.get("device") or {}).get("type") != "cuda" and st.get("smoke"):
            continue
        # the model as benchmarked: its option's keys with the run's --set keywords (LeNet-5's variant=bsam)
        model = {**(yaml.safe_load(model_file.read_text()) or {}), **(st.get("model_overrides") or {})}
        net = _network(model, st.get("input_shape"))
        # what the rows' batched_parts=auto took depends on the network (parts_path): the benchmarked one (parts_path
        # resolves the model's ${dataset.*} against this)
        bench_model = {"model": model, "dataset": {"input_shape": st.get("input_shape")}}
        slug = (b.get("device") or {}).get("slug") or "cpu"
        for label, r in (b.get("rows") or {}).items():
            if r.get("kind") != "step" or label not in pairs or not r.get("images_per_s"):
                continue
            cls, keys = pairs[label]
            key = (slug, (net, *cls, str(st.get("precision", "fp32"))),
                   taken_path(r.get("parts_path")) or parts_path({**keys, **bench_model}, slug))
            rate = Rate(float(r["images_per_s"]), f"measured: {f.relative_to(REPO) if f.is_relative_to(REPO) else f} "
                        f"{label} step, batch {st.get('batch_size')}", True)
            if key not in newest or str(b.get("date")) >= newest[key][0]:
                newest[key] = (str(b.get("date")), rate)
    for key, (_, rate) in newest.items():
        rates.setdefault(key, []).append(rate)
    for res in sorted(Path(records_root).glob("*/*/runs/**/results.json")):
        cfg_file = res.parent / "config_resolved.yaml"
        try:
            meta = json.loads(res.read_text())["meta"]
            cfg = yaml.safe_load(cfg_file.read_text()) or {}
            b, secs = meta["budget"], float(meta["train_seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if secs <= 0 or meta.get("evaluated_from"):
            continue
        hw = meta.get("hardware") or {}
        slug = device_slug(hw.get("gpu") if hw.get("device") == "cuda" else "cpu")
        key = (slug, work_key(cfg), taken_path((meta.get("method") or {}).get("parts_path")) or parts_path(cfg, slug))
        # a run that finished before the newest benchmark of its step on its device is superseded by it: the step
        # may have been made faster since (VOGN's 607 -> 88 ms a step on the MNIST MLP), and a stale whole-run rate
        # would price today's cells at yesterday's code; runs after it join its median
        if key in newest and str(meta.get("finished_at") or "") < newest[key][0]:
            continue
        # the budget's epochs are every member's (engine/results.py: trainer.epochs x a deep ensemble's members)
        images = float(b["train_size"]) * float(b["epochs"])
        where = res.parent.relative_to(records_root) if res.is_relative_to(records_root) else res.parent
        rates.setdefault(key, []).append(Rate(images / secs, f"measured: {_cores(hw)}cpu run {where}"
                                         if hw.get("device") != "cuda" else f"measured: run {where}", True))
    return rates


def _cores(hw: dict) -> str:
    return f"{hw['cpu_count']}-" if hw.get("cpu_count") else ""


def rate_for(cfg: dict, device: str) -> Rate:
    """The measured training throughput of run config ``cfg`` on ``device`` (a slug): the median of the matching
    measurements (CostError if none: then ``estimate`` assumes a FLOP rate)."""
    found = measured_rates().get((device, work_key(cfg), parts_path(cfg, device)))
    if not found:
        raise CostError(f"no measured throughput on {device} for {work_key(cfg)}")
    bases = sorted({r.basis for r in found})
    basis = bases[0] if len(bases) == 1 else \
        f"measured: median of {len(found)}, e.g. {bases[0].removeprefix('measured: ')}"
    return Rate(statistics.median(r.images_per_s for r in found), basis, True)


@dataclass(frozen=True)
class Estimate:
    seconds: float
    rate: Rate

    def describe(self) -> str:
        return f"~{fmt_duration(self.seconds)} ({self.rate.basis})"


def estimate(cfg, device: str) -> Estimate:
    """The wall time of one run of composed config ``cfg`` (DictConfig) on ``device``. Measured rate: its training
    images x epochs (x ensemble members) at that rate, plus the final evaluation at a third of a training step per
    image and predictive sample (one forward instead of forward + backward). Assumed rate: its FLOPs (run_cost:
    training and evaluation) at the device kind's assumed TFLOP/s -- the cost table's A100-hours."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=False)
    found = measured_rates().get((device, work_key(plain), parts_path(plain, device)))
    n_train, n_test = split_sizes(cfg.dataset)
    members = int(cfg.method.get("num_members") or 1)
    if found:
        rate = rate_for(plain, device)
        samples = max(1, int(cfg.method.get("num_samples") or members))
        work = n_train * int(cfg.trainer.epochs) * members + n_test * samples / 3.0
        return Estimate(work / rate.images_per_s, rate)
    rc = run_cost(cfg)
    kind = "cpu" if device == "cpu" else "gpu"
    seconds = rc.flops / (ASSUMED_TFLOPS[kind] * 1e12)
    basis = f"assumed: {ASSUMED_TFLOPS[kind]:g} TFLOP/s on {device}"
    if kind == "gpu":
        floor = gpu_overhead_floor(cfg, rc)
        if floor > seconds:
            per = (f"{GPU_GRAPH_PASS_FLOOR_S * 1e3:g} ms per graphed pass" if _graphed(cfg)
                   else f"{GPU_PASS_FLOOR_S * 1e3:g} ms per pass")
            seconds, basis = floor, f"assumed: {per} on {device} (launch-bound)"
    return Estimate(seconds, Rate(rc.train_images * rc.epochs * rc.members / seconds, basis, False))


def _graphed(cfg) -> bool:
    return bool((cfg.get("trainer") or {}).get("cuda_graph"))


def gpu_overhead_floor(cfg, rc: RunCost) -> float:
    """Seconds a run cannot beat on a GPU: its steps x passes x sub-batches at GPU_PASS_FLOOR_S each, or at
    GPU_GRAPH_PASS_FLOOR_S when the step is captured."""
    steps = -(-rc.train_images // int(cfg.trainer.get("batch_size") or 128)) * rc.epochs * rc.members
    chunks = max([1] + [int(node.get("m") or 1) for node in (cfg.get("flatness"), cfg.method)
                        if node is not None and not node.get("batched_chunks")])
    return steps * rc.passes * chunks * (GPU_GRAPH_PASS_FLOOR_S if _graphed(cfg) else GPU_PASS_FLOOR_S)


def fmt_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# the GPU kind the lent windows have been (docs/cluster.md "The GPU window"): what a paper page prices its open cells on
WINDOW_GPU = "nvidia-h100-80gb-hbm3"


def latest_selfcheck(device: str, bench_dir: Path | None = None) -> tuple[Path, dict] | None:
    """The newest GPU window self-check (flatbnn/bench/selfcheck.py) run on ``device`` under ``results/bench/``
    (by the date it records; dry runs left out), or None."""
    found = []
    for f in Path(bench_dir or BENCH_DIR).glob(f"{device}-*-selfcheck-*.json"):
        try:
            report = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        v = report.get("versions") or {}
        if not v.get("dry_run") and device_slug(v.get("device")) == device:
            found.append((str(v.get("date") or ""), f.name, f, report))
    return max(found, key=lambda x: x[:2])[2:] if found else None


def window_estimate(overrides: list[str], device: str, cfg=None, bench_dir: Path | None = None) -> Estimate:
    """One run of the cell composed from ``overrides`` (``cfg``: already composed) on GPU ``device``, with the step
    path a window's campaign gives it: the graph / batched chunks / compile that the newest self-check on that
    device passed (selfcheck.step_overrides), which the basis names; eager where none applies or none was run."""
    from flatbnn.reproduce.launch import compose_cell

    cfg = cfg if cfg is not None else compose_cell(list(overrides))
    found = latest_selfcheck(device, bench_dir)
    if found is None:
        return estimate(cfg, device)
    from flatbnn.bench.selfcheck import step_overrides

    path, report = found
    extras = step_overrides(cfg, report, cuda=True)
    if not extras:
        return estimate(cfg, device)
    e = estimate(compose_cell(list(overrides) + extras), device)
    return Estimate(e.seconds, Rate(e.rate.images_per_s, f"{e.rate.basis}; {' '.join(extras)}, which {path.name} "
                                                         f"passed", e.rate.measured))


def cost_left(row, scale: str, jobs: dict[str, dict[str, str]], devices=("cpu", WINDOW_GPU)) -> list[dict]:
    """Each cell of ``row`` at ``scale`` with seeds not done (``jobs``: cell -> {seed: state}, a comparison's),
    blocked cells left out: ``{"cell", "runs_left", "each": {device: [seconds, basis]}}`` -- what a paper page says
    is still to run and what one run costs (measured rate where a record or benchmark has one, else assumed)."""
    from flatbnn.reproduce.launch import compose_cell

    out = []
    for cell in row.cells_for(scale):
        if cell.blocked:
            continue
        states = jobs.get(cell.id) or {}
        left = sum(states.get(str(s), "pending") != "done" for s in cell.seeds)
        if not left:
            continue
        try:
            cfg = compose_cell(list(cell.overrides))
            each = {d: [round(e.seconds, 1), e.rate.basis] for d in devices
                    for e in [estimate(cfg, d) if d == "cpu" else window_estimate(list(cell.overrides), d, cfg)]}
        except Exception as e:  # noqa: BLE001 -- a cell that does not compose still shows as left, without a price
            each = {"error": [None, " ".join(str(e).split())[:200]]}
        out.append({"cell": cell.id, "runs_left": left, "each": each})
    return out


def job_estimates(row, scale: str, config_names: list[str], extra: list[str], device: str) -> list[tuple[str, Estimate]]:
    """``[(cell/seed<k>, Estimate)]`` for the launcher's generated cell configs ``config_names`` of a train row
    (the dry run of ``scripts/reproduce.py run``): each cell composed once with the command-line extras."""
    from flatbnn.reproduce.launch import cell_config_name, compose_cell

    out, by_cell = [], {}
    for cell in row.cells_for(scale):
        for seed in cell.seeds:
            if cell_config_name(cell.id, seed) not in config_names:
                continue
            if cell.id not in by_cell:
                by_cell[cell.id] = estimate(compose_cell(list(cell.overrides) + list(extra)), device)
            out.append((f"{cell.id}/seed{seed}", by_cell[cell.id]))
    return out
