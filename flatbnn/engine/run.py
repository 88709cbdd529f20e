"""Compose a run from a resolved config: data x model x method x flatness -> fit -> evaluate -> results.json.

:func:`build` is the one place a config becomes data, model, method and flatness (used by :func:`run`
and by ``evaluate.py``, which re-evaluates a finished run from its checkpoint without retraining);
:func:`final_evaluate` and :func:`results_meta` are the final evaluation and the results.json meta
both write.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
import types
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from flatbnn import keyroles
from flatbnn.engine import distributed as D
from flatbnn.engine import graphed
from flatbnn.engine.backprop import Backprop, seed_everything
from flatbnn.engine.checkpoint import (CheckpointError, RunDirLock, RunDirLocked, checkpoint_problem,
                                      load_checkpoint, remove_stale_temp_files, write_bytes, write_json)
from flatbnn.engine.compiling import compile_model, save_compile_cache
from flatbnn.engine.loggers import JsonlLogger
from flatbnn.engine.provenance import git_commit, hardware
from flatbnn.engine.report import RunReport, report_final, report_start
from flatbnn.engine.trainer import Trainer, ignore_stop_signals, position_problem
from flatbnn.methods.base import RunContext
from flatbnn.utils import flatten  # {'a': {'b': 1}} -> {'a.b': 1}
from flatbnn.metrics.evaluate import EvalConfig, dataset_targets, evaluate


def run_dir_from_hydra() -> Path:
    from hydra.core.hydra_config import HydraConfig
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()


def _loader(dataset, batch_size, sampler, num_workers, device, seed, shuffle=False):
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=shuffle if sampler is None else False,
                      num_workers=num_workers, pin_memory=device.type == "cuda", drop_last=False,
                      generator=torch.Generator().manual_seed(seed), persistent_workers=False,
                      worker_init_fn=ignore_stop_signals if num_workers else None)


def smallest_batch(n_samples: int, per_rank: int, steps_per_epoch: int) -> int:
    """The smallest batch one process trains on in an epoch of ``n_samples`` (its share of the train set)
    cut into batches of ``per_rank`` (no drop_last), ``steps_per_epoch`` of them taken."""
    full, rest = divmod(n_samples, per_rank)
    return rest if rest and steps_per_epoch > full else min(per_rank, n_samples)


@dataclass
class Built:
    """Everything :func:`build` makes from a config: what ``run`` trains and what ``evaluate.py`` re-evaluates."""

    cfg: DictConfig
    device: torch.device
    info: D.DistInfo
    run_dir: Path
    bundle: object
    method: object
    flatness: object
    module: torch.nn.Module          # the raw backbone (as the method prepared it)
    model: torch.nn.Module           # the forward module (DDP-wrapped / compiled)
    ddp: DistributedDataParallel | None
    generator: torch.Generator       # per-rank noise generator (checkpointed)
    train_loader: object
    sampler: object
    eval_loaders: dict               # "test", "ood/<name>", "shift/<corruption>/<severity>"
    val_loader: object
    test_targets: torch.Tensor
    val_targets: torch.Tensor | None
    shift_targets: dict
    steps_per_epoch: int
    total_epochs: int                # trainer.epochs * method.epoch_multiplier
    ctx: RunContext
    backprop: Backprop
    eval_cfg: EvalConfig
    resume_ckpt: Path | None = None  # the checkpoint ``run`` resumes from (training builds only)
    init_from: dict | None = None    # what trainer.init_from loaded (results.json meta)

    def gather(self, local: torch.Tensor, n: int) -> torch.Tensor:
        return D.gather_shards(local, n, self.info, self.device)


def build(cfg: DictConfig, run_dir: Path | None = None, *, training: bool = True) -> Built:
    """Data, model, method and flatness of ``cfg``, set up exactly as a training run sets them up.

    ``training=True`` (``run``): resolves ``trainer.resume`` and, when the run does not resume, loads
    ``trainer.init_from`` weights into the freshly built model (before the method sets up, DDP and
    compile). ``training=False`` (``evaluate.py``): neither; the caller restores a checkpoint."""
    tc = cfg.trainer
    device = D.resolve_device(tc.device)
    info = D.init_distributed(device)
    run_dir = Path(D.broadcast_object(str(run_dir or run_dir_from_hydra()), info))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = not tc.deterministic
    if tc.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)

    seed_everything(cfg.seed)
    bundle = instantiate(cfg.dataset)
    method = instantiate(cfg.method)

    # resume wins over init_from: a resumed run already has its weights
    resume_ckpt = _resume_path(tc.resume, run_dir / "checkpoints" / "last.pt") if training else None
    init = None
    if training and tc.get("init_from") not in (None, ""):
        init = InitWeights.load(tc.init_from, tc.get("init_key")) if resume_ckpt is None else None

    def model_factory(seed: int | None = None, init: InitWeights | None = None) -> torch.nn.Module:
        if seed is not None:
            torch.manual_seed(seed)
        backbone = instantiate(cfg.model)
        # init_from weights of a plain backbone (MAP, SGLD, SWAG, ... checkpoints) go in before the
        # method rebuilds layers (Bayesian mu/sigma layers take mu from them); weights of an already
        # prepared model (an SGVB checkpoint) go in after
        raw = init is not None and init.load_into(backbone, try_only=True)
        # a method may rebuild layers (Bayesian mu/sigma layers) -- before DDP / compile wrap them
        m = method.prepare_model(backbone)
        if init is not None and not raw:
            init.load_into(m, also_tried=backbone)
        m = m.to(device)
        return m.to(memory_format=torch.channels_last) if tc.channels_last else m

    module = model_factory(init=init)
    init_info = init_record(tc, init, resume_ckpt) if training else None
    if info.enabled and tc.sync_bn:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if info.rank > 0:  # ranks draw different dropout / noise; rank 0 keeps the single-process stream
        seed_everything(cfg.seed + 7919 * info.rank)
    ddp = None
    model = module
    if info.enabled:
        ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
        model = ddp
    if tc.get("cuda_graph") and graphed.refusal(device) is not None:
        raise ValueError(graphed.refusal(device))
    if tc.compile:  # with the Inductor workarounds of this torch and the cache of earlier runs
        model = compile_model(model, device, tc.get("compile_cache"))
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + info.rank)

    # ---------------------------------------------------------------- data
    if tc.batch_size % info.world_size:
        raise ValueError(f"trainer.batch_size={tc.batch_size} (global) must be divisible by the "
                         f"{info.world_size} processes")
    per_rank = tc.batch_size // info.world_size
    if cfg.dataset.get("loader", "cpu") == "device":
        # whole train set on the device, batched crop/flip there (equal in distribution to the CPU path)
        from flatbnn.data.device_loader import DeviceLoader
        train_loader = DeviceLoader(bundle.train, per_rank, device=device, seed=cfg.seed,
                                    num_replicas=info.world_size, rank=info.rank)
        sampler = train_loader.sampler
    else:
        sampler = D.ResumableSampler(bundle.train, num_replicas=info.world_size, rank=info.rank,
                                     shuffle=True, seed=cfg.seed)
        train_loader = _loader(bundle.train, per_rank, sampler, tc.num_workers, device, cfg.seed)
    eval_bs = tc.eval_batch_size
    eval_loaders = {"test": _loader(bundle.test, eval_bs, D.eval_sampler(bundle.test, info),
                                    tc.num_workers, device, cfg.seed)}
    for name, ds in (bundle.ood or {}).items():
        eval_loaders[f"ood/{name}"] = _loader(ds, eval_bs, D.eval_sampler(ds, info), tc.num_workers, device, cfg.seed)
    shift_targets = {}
    for name, ds in (getattr(bundle, "shift", None) or {}).items():
        eval_loaders[f"shift/{name}"] = _loader(ds, eval_bs, D.eval_sampler(ds, info), tc.num_workers, device, cfg.seed)
        shift_targets[f"shift/{name}"] = dataset_targets(ds)
    val_loader = None
    if bundle.val is not None and len(bundle.val) > 0:
        val_loader = _loader(bundle.val, eval_bs, D.eval_sampler(bundle.val, info), tc.num_workers, device, cfg.seed)
    steps_per_epoch = len(train_loader) if tc.limit_train_batches is None else min(
        len(train_loader), tc.limit_train_batches)
    # m-sharpness cuts every batch into flatness.m chunks: a short last batch with fewer images than m would
    # stop the run at the epoch's last step, before its checkpoint, on every rerun
    m = int(cfg.flatness.get("m", 1) or 1)
    shortest = smallest_batch(len(sampler), per_rank, steps_per_epoch)
    if m > 1 and shortest < m:
        from flatbnn.engine.validate import ConfigError
        raise ConfigError(
            f"flatness.m={m} exceeds the smallest batch of an epoch ({shortest} images: {len(sampler)} train images "
            f"per process in batches of {per_rank}); use flatness.m<={shortest}, or a trainer.batch_size / "
            f"dataset.train_subset that leaves no last batch smaller than m")

    # ---------------------------------------------------------------- method x flatness
    flatness = instantiate(cfg.flatness)

    def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
        if info.enabled:
            torch.distributed.all_reduce(t)
            t /= info.world_size
        return t

    ctx = RunContext(
        model=model, module=module, device=device, n_train=len(bundle.train), steps_per_epoch=steps_per_epoch,
        epochs=tc.epochs, optimizer_factory=instantiate(cfg.optimizer),
        scheduler_factory=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
        label_smoothing=tc.label_smoothing, rank=info.rank, world_size=info.world_size, generator=generator,
        channels_last=tc.channels_last, model_factory=model_factory, train_loader=train_loader,
        all_reduce_mean=all_reduce_mean, seed=cfg.seed, eval_sample_chunk=tc.get("eval_sample_chunk", 1))
    method.setup(ctx)
    flatness.setup(ctx, method)
    total_epochs = tc.epochs * method.epoch_multiplier
    backprop = Backprop(module, device, precision=tc.precision, grad_clip=tc.grad_clip, ddp=ddp)
    eval_cfg = EvalConfig(**OmegaConf.to_container(cfg.metrics, resolve=True))
    return Built(cfg=cfg, device=device, info=info, run_dir=run_dir, bundle=bundle, method=method,
                 flatness=flatness, module=module, model=model, ddp=ddp, generator=generator,
                 train_loader=train_loader, sampler=sampler, eval_loaders=eval_loaders, val_loader=val_loader,
                 test_targets=dataset_targets(bundle.test),
                 val_targets=dataset_targets(bundle.val) if val_loader is not None else None,
                 shift_targets=shift_targets, steps_per_epoch=steps_per_epoch, total_epochs=total_epochs,
                 ctx=ctx, backprop=backprop, eval_cfg=eval_cfg, resume_ckpt=resume_ckpt, init_from=init_info)


class InitWeights:
    """``trainer.init_from``: the MODEL WEIGHTS (only) of another run, to train on from them.

    Accepts a run directory (its ``checkpoints/last.pt``), a flatbnn checkpoint (the method's
    ``state_dict()["model"]``: the current weights of MAP, SGLD, the SWAG family, ... -- the optimiser,
    schedule, step and posterior state are not taken) or a plain ``torch.save(state_dict)`` file, the
    state dict at its top level or under ``trainer.init_key`` (dotted for nested keys, e.g.
    ``state_dict`` or ``method.model``). DDP / compile prefixes (``module.``, ``_orig_mod.``) are
    dropped. Loading is strict: a mismatch is one line naming the first missing / unexpected keys."""

    def __init__(self, path: Path, key: str | None, state: dict, source: str):
        self.path, self.key, self.state, self.source = path, key, state, source
        self.loaded_into: str | None = None

    @classmethod
    def load(cls, spec, key: str | None = None) -> "InitWeights":
        path = Path(str(spec)).expanduser()
        if path.is_dir():
            if not (path / "checkpoints" / "last.pt").exists():
                raise FileNotFoundError(f"trainer.init_from={spec}: a directory without checkpoints/last.pt")
            path = path / "checkpoints" / "last.pt"
        if not path.exists():
            raise FileNotFoundError(f"trainer.init_from={spec}: no such checkpoint file or run directory")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"trainer.init_from={path} is unreadable ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
        ours = isinstance(obj, dict) and "format" in obj and isinstance(obj.get("method"), dict)
        key = None if key in (None, "") else str(key)
        if key is not None:
            state = _dig(obj, key)
            if state is None:
                top = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"trainer.init_key={key}: no such key in {path} (top-level keys: {top})")
        elif ours:
            state, key = obj["method"]["model"], "method.model"
        else:
            state = obj
        if not _is_state_dict(state):
            top = ", ".join(map(str, list(state)[:8])) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"trainer.init_from={path}{f' [{key}]' if key else ''} is not a state dict of "
                             f"tensors (has: {top}); name the entry holding the weights with trainer.init_key=...")
        state = dict(state)
        for prefix in ("module.", "_orig_mod."):
            if state and all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
        source = (f"flatbnn checkpoint (epoch {obj.get('epoch')}, global step {obj.get('global_step')})"
                  if ours else "state dict")
        return cls(path, key, state, source)

    def mismatch(self, module: torch.nn.Module) -> list[str]:
        """What keeps ``module`` from loading these weights strictly (empty: it fits)."""
        target = module.state_dict()
        missing = [k for k in target if k not in self.state]
        unexpected = [k for k in self.state if k not in target]
        shapes = [f"{k} {list(self.state[k].shape)} vs model {list(target[k].shape)}" for k in target
                  if k in self.state and hasattr(target[k], "shape") and hasattr(self.state[k], "shape")
                  and tuple(self.state[k].shape) != tuple(target[k].shape)]
        out = []
        for what, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", shapes)):
            if keys:
                more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
                out.append(f"{what}: {', '.join(keys[:3])}{more}")
        return out

    def load_into(self, module: torch.nn.Module, *, try_only: bool = False,
                  also_tried: torch.nn.Module | None = None) -> bool:
        problems = self.mismatch(module)
        if problems:
            if try_only:
                return False
            if also_tried is not None:  # report against whichever form of the model it is closer to
                other = self.mismatch(also_tried)
                problems = min(problems, other, key=lambda p: sum(len(x) for x in p))
            raise ValueError(f"trainer.init_from={self.path}{f' [{self.key}]' if self.key else ''} does not fit "
                             f"the model: {'; '.join(problems)} (same model.* settings as the run it comes from?)")
        module.load_state_dict(self.state, strict=True)
        self.loaded_into = "backbone" if try_only else "prepared model"
        return True


def _dig(obj, key: str):
    """``obj[key]``, or a nested ``obj[a][b]`` for ``key = "a.b"`` (state-dict keys contain dots too)."""
    if not isinstance(obj, dict):
        return None
    if key in obj:
        return obj[key]
    for i, ch in enumerate(key):
        if ch == "." and key[:i] in obj:
            found = _dig(obj[key[:i]], key[i + 1:])
            if found is not None:
                return found
    return None


def _is_state_dict(obj) -> bool:
    return (isinstance(obj, dict) and len(obj) > 0 and all(isinstance(k, str) for k in obj)
            and any(torch.is_tensor(v) for v in obj.values()))


def init_record(tc, init: InitWeights | None, resume_ckpt: Path | None) -> dict | None:
    """results.json ``meta.init_from``: where the starting weights came from (None: a fresh init)."""
    if tc.get("init_from") in (None, ""):
        return None
    if init is None:  # resumed: the weights come from the run's own checkpoint
        return {"path": str(tc.init_from), "key": tc.get("init_key"), "resumed_from": str(resume_ckpt)}
    return {"path": str(init.path), "key": init.key, "source": init.source, "loaded_into": init.loaded_into}


def final_evaluate(b: Built) -> tuple[dict, dict]:
    """The run's final evaluation: ``(metrics, predictive log-probs per set)``.

    The training data stand at the last epoch (augmentation and order), whether the run just trained
    it or resumed / was re-evaluated from the final checkpoint: BatchNorm refreshes of sampled weights
    (SWAG, HWA) see the same batches either way."""
    last = b.total_epochs - 1
    if last >= 0:
        if hasattr(b.bundle.train, "set_epoch"):
            b.bundle.train.set_epoch(last)
        b.sampler.set_epoch(last)
    metrics = evaluate(b.method, b.eval_loaders, b.test_targets, b.eval_cfg, gather=b.gather,
                       keep_predictive=True, shift_targets=b.shift_targets)
    predictive = metrics.pop("_predictive")
    return metrics, predictive


def results_meta(b: Built, *, steps: int, train_seconds: float, wall_seconds: float, overrides: list,
                 model_name: str, run_dir: Path, world_size: int | None = None,
                 git_segments: list[dict] | None = None) -> dict:
    """results.json's ``meta`` (train.py and evaluate.py write the same structure).

    ``git_segments``: the commit of each process that trained this run (``{"global_step", "commit", "dirty"}``,
    read when that process started, not when it wrote results -- a commit made during a 3-hour run must not
    relabel it). ``meta.git`` is the first; all of them are kept under ``git_segments`` when they differ."""
    cfg, tc, eval_cfg = b.cfg, b.cfg.trainer, b.eval_cfg
    return {
        "dataset": cfg.dataset.name, "model": model_name, "method": b.method.describe(),
        "flatness": b.flatness.describe(), "seed": cfg.seed, "epochs": b.total_epochs,
        "budget": {"epochs": b.total_epochs, "steps": steps, "steps_per_epoch": b.steps_per_epoch,
                   "train_size": len(b.bundle.train), "test_size": len(b.bundle.test),
                   # what a step trained on: the configured batch, or the whole train set where that is smaller
                   "global_batch": min(tc.batch_size, len(b.bundle.train)),
                   "world_size": b.info.world_size if world_size is None else world_size,
                   "precision": tc.precision},
        "metric_conventions": {"ece_bins": eval_cfg.ece_bins, "ece_binning": eval_cfg.ece_binning,
                               "ece_edges": eval_cfg.ece_edges, "auroc_misclassification":
                               f"positives = correct, score = {eval_cfg.misclass_score}"
                               + (f", {eval_cfg.auroc_thresholds}-threshold grid" if eval_cfg.auroc == "thresholds"
                                  else ""),
                               "auroc_ood": f"positives = in-distribution, score = {eval_cfg.ood_score}",
                               "nll": "-log mean_k p_k(y|x), mean over examples"},
        "hardware": hardware(b.device, b.info.world_size),
        "git": ({k: git_segments[0][k] for k in ("commit", "dirty")} if git_segments else git_commit()),
        "train_seconds": train_seconds, "wall_seconds": wall_seconds,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "overrides": overrides, "run_dir": str(run_dir),
        "init_from": b.init_from,
        "paper_reproduction": False,
        **({"git_segments": git_segments} if git_segments and len({(g["commit"], g["dirty"]) for g in git_segments}) > 1
           else {}),
    }


# ---------------------------------------------------------------------------------------------- run dir
# Keys a resume may change without being asked (how a run is watched, where its data are read from, how fast it
# goes -- not what it computes): their roles are declared in flatbnn/keyroles.py. Any other difference between the
# config a run dir was started with and the rerun's is refused (the rerun would continue the old run under the new
# label); listing the key in trainer.resume_overrides applies the change deliberately instead.
RESUME_EXEMPT = keyroles.declared("resume_may_change")
# Keys whose change alters the lr schedule's shape: a resume applying one rebuilds the schedule (at the
# current step) instead of restoring the old one's parameters
_SCHEDULE_KEYS = ("trainer.epochs", "trainer.limit_train_batches", "scheduler")
_HYDRA_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")
# keys whose change alters the steps per epoch (a checkpoint's position is then checked against epochs only)
_STEP_KEYS = ("trainer.limit_train_batches", "trainer.batch_size", "dataset")


class ResumeConfigMismatch(CheckpointError):
    pass


@dataclass
class Claim:
    """What :func:`claim_run_dir` established: the lock, the checkpoint to resume (loaded once), this
    run's resolved config and the values a resume changes deliberately ``{key: (old, new)}``."""

    lock: RunDirLock | None
    state: dict | None
    config: dict
    changes: dict


def _covered(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def config_changes(reference: dict, current: dict) -> dict:
    """``{dotted key: (reference value, current value)}`` for every key both configs have that differs,
    exempt keys left out. A key only one side has (a config key added or removed by a code update) is not
    a change: group switches also change ``_target_`` / ``name``, which both sides have."""
    ref, cur = flatten(reference or {}), flatten(current or {})
    return {k: (ref[k], cur[k]) for k in cur if k in ref and not _same(ref[k], cur[k])
            and not keyroles.resume_may_change(k)}


def claim_run_dir(b: Built) -> Claim:
    """Before a training run writes anything into its run dir: lock it (rank 0; one process per run dir),
    then make sure the run it resumes -- the checkpoint, or a finished run's ``config_resolved.yaml`` -- was
    started with this config (up to :data:`RESUME_EXEMPT` and ``trainer.resume_overrides``). A refusal
    puts back the ``.hydra/*.yaml`` that Hydra rewrote before this code ran. Once claimed: the run dir's
    ``config_resolved.yaml`` and the kept copy of the Hydra files become this run's, and temp files of
    killed checkpoint writers are removed."""
    cfg, info, run_dir = b.cfg, b.info, b.run_dir
    lock = RunDirLock(run_dir) if info.is_main else None
    error = None
    if lock is not None:
        try:
            lock.acquire()
        except RunDirLocked as e:
            error = str(e)
    error = D.broadcast_object(error, info)  # every rank stops, not only the one that tried
    if error is not None:
        if info.is_main:
            _restore_hydra_files(run_dir)
        raise RunDirLocked(error)
    try:
        current = OmegaConf.to_container(cfg, resolve=True)
        allowed = list(cfg.trainer.get("resume_overrides") or [])
        keys = flatten(current or {})
        for k in allowed:
            if not any(_covered(key, [k]) for key in keys):
                raise ValueError(f"trainer.resume_overrides: {k} is not a config key (e.g. optimizer.lr)")
        state = load_checkpoint(b.resume_ckpt) if b.resume_ckpt is not None else None
        if state is not None:  # structure and position, before anything is written or moved
            problem = checkpoint_problem(state, info.world_size) or position_problem(
                state, b.total_epochs, b.steps_per_epoch, _steps_changed(state, config_changes(
                    state.get("config"), OmegaConf.to_container(cfg, resolve=True)) if state.get("config") else {}))
            if problem is not None:
                raise CheckpointError(f"{b.resume_ckpt}: {problem}; delete it to start over, or set "
                                      f"trainer.resume=false")
        reference, source = None, None
        resolved = run_dir / "config_resolved.yaml"
        if state is not None:
            reference, source = state.get("config"), f"checkpoint {b.resume_ckpt}"
            if reference is None and info.is_main:
                print(f"note: {b.resume_ckpt} predates config checks; resuming it without comparing configs",
                      file=sys.stderr)
        elif (cfg.trainer.resume not in (False, None, "false", "none") and (run_dir / "results.json").exists()
              and resolved.exists()):  # a finished run without a checkpoint (trainer.checkpoint_every=0)
            reference, source = yaml.safe_load(resolved.read_text()), f"finished run, {resolved.name}"
        changes = config_changes(reference, current) if reference is not None else {}
        refused = {k: v for k, v in changes.items() if not _covered(k, allowed)}
        if refused:
            shown = ", ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in list(refused.items())[:6])
            more = f" (+{len(refused) - 6} more)" if len(refused) > 6 else ""
            raise ResumeConfigMismatch(
                f"{run_dir} holds a run with another config ({source}): {shown}{more}; nothing was overwritten. "
                f"Start the new run elsewhere (hydra.run.dir=...), or start this dir over (trainer.resume=false), "
                f"or continue this run with the change applied (trainer.resume_overrides=[{','.join(refused)}])")
        if info.is_main:
            _keep_run_dir_config(run_dir, current)
            for d in (run_dir, run_dir / "checkpoints"):  # results.json's and the checkpoints' temp files
                for p in remove_stale_temp_files(d):
                    print(f"removed {p} (left by a killed write)", file=sys.stderr)
    except BaseException:
        if lock is not None:
            _restore_hydra_files(run_dir)
            lock.release()
        raise
    return Claim(lock=lock, state=state, config=current, changes=changes)


def _hydra_output(run_dir: Path) -> Path | None:
    """``<run dir>/.hydra`` when Hydra wrote it for this process (so it may have replaced another run's)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        if not HydraConfig.initialized():
            return None
        hc = HydraConfig.get()
        if hc.output_subdir is None or Path(hc.runtime.output_dir).resolve() != Path(run_dir).resolve():
            return None
        return Path(run_dir) / hc.output_subdir
    except Exception:
        return None


def _keep_run_dir_config(run_dir: Path, container: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(container, sort_keys=False).encode()
    write_bytes(run_dir / "config_resolved.yaml", text)
    hydra_dir = _hydra_output(run_dir)
    if hydra_dir is not None:
        for name in _HYDRA_FILES:
            if (hydra_dir / name).exists():
                write_bytes(run_dir / ".flatbnn" / "hydra" / name, (hydra_dir / name).read_bytes())


def _restore_hydra_files(run_dir: Path) -> None:
    """Put back the Hydra files of the run that owns ``run_dir`` (a refused rerun's Hydra replaced them)."""
    hydra_dir, kept = _hydra_output(run_dir), Path(run_dir) / ".flatbnn" / "hydra"
    if hydra_dir is None or not kept.is_dir():
        return
    for name in _HYDRA_FILES:
        if (kept / name).exists():
            write_bytes(hydra_dir / name, (kept / name).read_bytes())


def _optimizer_snapshot(method) -> dict | None:
    """The freshly built optimiser's hyperparameters and schedule parameters (this run's config)."""
    opt, sched = getattr(method, "optimizer", None), getattr(method, "scheduler", None)
    if opt is None:
        return None
    lambdas = [copy.deepcopy(fn.__dict__) if not isinstance(fn, types.FunctionType) else None
               for fn in getattr(sched, "lr_lambdas", [])]
    return {"groups": [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "lambdas": lambdas}


def _apply_resume_overrides(method, fresh: dict | None, keys: list[str]) -> None:
    """Write the values of ``trainer.resume_overrides`` that live in the restored optimiser / schedule
    into them: ``optimizer.<field>`` or ``method.<field>`` sets that param-group field (lr: the schedule's
    base lr, the current lr rescaled to it); a schedule-shaping key keeps this config's schedule at the
    restored step. Other keys take effect where the run reads them from the config (flatness.*, ...)."""
    opt, sched = getattr(method, "optimizer", None), getattr(method, "scheduler", None)
    if not keys or fresh is None or opt is None or len(fresh["groups"]) != len(opt.param_groups):
        return
    fields = {k.rsplit(".", 1)[-1] for k in keys if k.startswith(("optimizer.", "method."))}
    for group, new in zip(opt.param_groups, fresh["groups"]):
        for field in fields - {"lr"}:
            if field in group and field in new:
                group[field] = new[field]
        if "lr" in fields:
            new0, old0 = new.get("initial_lr", new["lr"]), group.get("initial_lr", group["lr"])
            group["lr"] = group["lr"] * new0 / old0 if old0 else new0
            if "initial_lr" in group:
                group["initial_lr"] = new0
    if sched is None or not hasattr(sched, "base_lrs"):
        return
    if "lr" in fields:
        sched.base_lrs = [g.get("initial_lr", g["lr"]) for g in opt.param_groups]
    if any(_covered(k, _SCHEDULE_KEYS) for k in keys) and hasattr(sched, "lr_lambdas"):
        for fn, d in zip(sched.lr_lambdas, fresh["lambdas"]):
            if d is not None:
                fn.__dict__.update(d)
        for g, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * fn(sched.last_epoch)
    sched._last_lr = [g["lr"] for g in opt.param_groups]


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict | None:
    """Train and evaluate one configuration. Returns the results dict on rank 0 (None elsewhere)."""
    t_start = time.perf_counter()
    git_start = git_commit()  # the code this process trains with (read now: the tree may change while it runs)
    from flatbnn.engine.validate import validate_config
    validate_config(cfg, run_dir or run_dir_from_hydra())  # types, ranges, device, writable run dir: before any data
    b = build(cfg, run_dir, training=True)
    claim = claim_run_dir(b)  # nothing in the run dir is written before this passed
    try:
        done = finished_results(b, claim)
        if done is not None:
            if b.info.is_main:
                print(f"{b.run_dir} is already finished ({b.total_epochs} epochs, results.json); nothing to do "
                      f"(evaluate.py re-evaluates it, trainer.resume=false trains it again)", file=sys.stderr)
            D.barrier(b.info)
            D.cleanup(b.info)
            return done if b.info.is_main else None
        return _train_and_evaluate(b, claim, t_start, git_start)
    finally:
        if claim.lock is not None:
            claim.lock.release()


def _steps_changed(state: dict, changes: dict) -> bool:
    """Did this resume, or an earlier one of the run, change the steps per epoch (resume_overrides)?"""
    changed = list(changes) + [k for h in (state.get("resume_changes") or []) for k in h.get("changes", {})]
    return any(_covered(k, _STEP_KEYS) for k in changed)


def _same_path(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def finished_results(b: Built, claim: Claim) -> dict | None:
    """results.json of a run this rerun would only repeat: it resumes (``trainer.resume`` true) a run dir
    whose checkpoint stands at the end of this config's epochs -- or that has results.json and no checkpoint
    (``trainer.checkpoint_every=0``, or one removed after the run finished) and nothing changed."""
    results = b.run_dir / "results.json"
    if b.cfg.trainer.resume not in (True, "auto") or not results.exists():
        return None
    if claim.state is not None:
        finished = claim.state.get("epoch") == b.total_epochs and not claim.state.get("step_in_epoch")
    else:
        finished = not claim.changes
    return json.loads(results.read_text()) if finished else None


# what a run writes into its run dir: an earlier run's copy must not stand beside a new run (aggregate.py would
# show its numbers under the new config, reproduce would take the dir for done)
FINAL_OUTPUTS = ("results.json", "reliability.png", "failed.txt")
RUN_STATE = ("metrics.jsonl", "checkpoints", "wandb_id.txt")  # also an earlier run's, unless this one resumes it


def move_aside_earlier_outputs(run_dir: Path, *, resuming: bool) -> Path | None:
    """Before the first step: move the outputs of an earlier run in ``run_dir`` (a finished run restarted with
    ``trainer.resume=false``, one whose epochs were extended) to ``.flatbnn/replaced/<UTC time>/`` and say so;
    ``results.json`` becomes ``results.json.replaced`` there, so no tool reads it as a run."""
    names = FINAL_OUTPUTS + (() if resuming else RUN_STATE)
    found = [n for n in names if (run_dir / n).exists()]
    if not found:
        return None
    aside = run_dir / ".flatbnn" / "replaced" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside.mkdir(parents=True, exist_ok=True)
    for n in found:
        os.replace(run_dir / n, aside / (f"{n}.replaced" if n == "results.json" else n))
    print(f"moved the earlier run's {', '.join(found)} to {aside} (this run starts "
          f"{'from its checkpoint' if resuming else 'over'}; they are not this run's)", file=sys.stderr)
    return aside


def _train_and_evaluate(b: Built, claim: "Claim", t_start: float, git_start: dict | None = None) -> dict | None:
    cfg, tc = b.cfg, b.cfg.trainer
    info, run_dir, method = b.info, b.run_dir, b.method

    # ---------------------------------------------------------------- resume
    trainer = Trainer(epochs=b.total_epochs, run_dir=run_dir, info=info, device=b.device,
                      checkpoint_every=tc.checkpoint_every, eval_every=tc.eval_every, progress=tc.progress,
                      limit_train_batches=tc.limit_train_batches, channels_last=tc.channels_last)
    if tc.get("cuda_graph"):  # captured on the first step of this process: after any resume below
        trainer.train_step = graphed.GraphedStep(
            method, b.flatness, b.backprop, log=lambda line: info.is_main and print(line, file=sys.stderr))
    ckpt = b.resume_ckpt
    if ckpt is not None:
        fresh = _optimizer_snapshot(method)  # this config's hyperparameters, before the checkpoint's replace them
        trainer.restore(claim.state, method, b.backprop, b.generator, path=ckpt, steps_per_epoch=b.steps_per_epoch,
                        schedule_changed=_steps_changed(claim.state, claim.changes))
        _apply_resume_overrides(method, fresh, list(claim.changes))
        if info.is_main:  # the numbering of the stop line: epoch (1-based) in progress, steps done in it
            where = (f"after its {trainer.epoch} epochs (the final evaluation)" if trainer.epoch >= b.total_epochs
                     else f"at epoch {trainer.epoch + 1}, step {trainer.step_in_epoch} of {b.steps_per_epoch}")
            RunReport(run_dir).note(
                f"resuming from {ckpt} {where}"
                + (f", with {', '.join(f'{k}={v[1]}' for k, v in claim.changes.items())} applied (was "
                   f"{', '.join(str(v[0]) for v in claim.changes.values())})" if claim.changes else ""))
    elif b.init_from is not None and info.is_main:
        RunReport(run_dir).note(f"initialised the model from {b.init_from['path']}")
    if info.is_main:  # the checkpoint restored (or none): from here on this run writes its outputs
        move_aside_earlier_outputs(run_dir, resuming=ckpt is not None and _same_path(
            ckpt, run_dir / "checkpoints" / "last.pt"))
        run_dir.mkdir(parents=True, exist_ok=True)
        trainer.loggers = [JsonlLogger(run_dir, resume_epoch=trainer.epoch)]
        container = OmegaConf.to_container(cfg, resolve=True)
        for lg_cfg in (cfg.logger or {}).values():
            if lg_cfg is not None and "_target_" in lg_cfg:
                trainer.loggers.append(instantiate(lg_cfg, _partial_=True)(run_dir=run_dir, run_config=container))
    report = RunReport(run_dir, enabled=info.is_main)  # start / final lines and warnings, also in train.log
    report_start(report, b, _model_name(cfg))

    def evaluate_epoch() -> dict:
        name, loader, targets = (("val", b.val_loader, b.val_targets) if b.val_loader is not None
                                 else ("test", b.eval_loaders["test"], b.test_targets))
        m = evaluate(method, {"test": loader}, targets, b.eval_cfg, gather=b.gather, predict=method.monitor)
        keys = ("accuracy", "nll", "ece")
        return {f"{name}/{k}": m[k] for k in keys}

    history = list((claim.state or {}).get("resume_changes") or [])
    if claim.changes:
        history.append({"global_step": trainer.global_step,
                        "changes": {k: list(v) for k, v in claim.changes.items()}})
    git_segments = list((claim.state or {}).get("git_segments") or [])  # earlier processes of this run
    git_segments.append({"global_step": trainer.global_step, **(git_start or git_commit())})
    with report:  # training's warnings (flatbnn's and Python's) go to train.log too
        trainer.fit(method, b.flatness, b.backprop, b.train_loader, b.sampler, b.bundle.train,
                    evaluate_epoch=evaluate_epoch if tc.eval_every else None, generator=b.generator,
                    checkpoint_extra={"config": claim.config, "resume_changes": history,
                                      "git_segments": git_segments})

    if tc.compile and info.is_main:
        save_compile_cache(b.device, tc.get("compile_cache"))

    # ---------------------------------------------------------------- final evaluation
    with report:  # the final evaluation's warnings too
        metrics, predictive = final_evaluate(b)
    results = None
    if info.is_main:
        meta = results_meta(b, steps=trainer.global_step, train_seconds=trainer.elapsed,
                            wall_seconds=time.perf_counter() - t_start, overrides=_overrides(),
                            model_name=_model_name(cfg), run_dir=run_dir, git_segments=git_segments)
        if history:  # values changed on a resume (trainer.resume_overrides): where and what
            meta["resume_changes"] = history
        results = {"metrics": metrics, "meta": meta}
        from flatbnn.engine.preemption import check_stop
        check_stop()  # a stop signal during the final evaluation whose Preempted was swallowed: exit 75, not 0
        write_json(run_dir / "results.json", results)
        report_final(report, b, results, run_dir / "results.json")
        for lg in trainer.loggers:
            lg.log_results(results)
            lg.finish()
        if tc.reliability_diagram:
            _reliability(predictive["test"].exp(), b.test_targets, run_dir / "reliability.png", b.eval_cfg)
    D.barrier(info)
    D.cleanup(info)
    return results


def _resume_path(resume, default: Path) -> Path | None:
    if resume is True or resume == "auto":
        return default if default.exists() else None
    if resume in (False, None, "false", "none"):
        return None
    p = Path(str(resume))
    if not p.exists():
        raise FileNotFoundError(f"trainer.resume={resume}: no such checkpoint")
    return p


def _model_name(cfg) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig
        return HydraConfig.get().runtime.choices.get("model", cfg.model.name)
    except Exception:
        return cfg.model.get("name", "unknown")


def _overrides() -> list:
    try:
        from hydra.core.hydra_config import HydraConfig
        return list(HydraConfig.get().overrides.task)
    except Exception:
        return []


def _reliability(probs, targets, path, eval_cfg: EvalConfig):
    # matplotlib is a declared dependency: a run asked for the diagram (trainer.reliability_diagram) gets it or fails
    from flatbnn.metrics.reliability import reliability_diagram
    # the binning of results.json's ece, so the diagram's ECE label is that number
    reliability_diagram(probs, targets, path, n_bins=eval_cfg.ece_bins, binning=eval_cfg.ece_binning,
                        edges=eval_cfg.ece_edges)


__all__ = ["Built", "Claim", "InitWeights", "RESUME_EXEMPT", "ResumeConfigMismatch", "build", "claim_run_dir",
           "config_changes", "final_evaluate", "results_meta", "run"]
