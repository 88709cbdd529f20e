"""Compose a run from a resolved config: data x model x method x flatness -> fit -> evaluate -> results.json."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from flatbnn.engine import distributed as D
from flatbnn.engine.backprop import Backprop, seed_everything
from flatbnn.engine.checkpoint import load_checkpoint, write_json
from flatbnn.engine.loggers import JsonlLogger
from flatbnn.engine.provenance import git_commit, hardware
from flatbnn.engine.trainer import Trainer
from flatbnn.methods.base import RunContext
from flatbnn.metrics.evaluate import EvalConfig, dataset_targets, evaluate

def run_dir_from_hydra() -> Path:
    from hydra.core.hydra_config import HydraConfig
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()


def _loader(dataset, batch_size, sampler, num_workers, device, seed, shuffle=False):
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=shuffle if sampler is None else False,
                      num_workers=num_workers, pin_memory=device.type == "cuda", drop_last=False,
                      generator=torch.Generator().manual_seed(seed), persistent_workers=False)


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict | None:
    """Train and evaluate one configuration. Returns the results dict on rank 0 (None elsewhere)."""
    t_start = time.perf_counter()
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

    def model_factory(seed: int | None = None) -> torch.nn.Module:
        if seed is not None:
            torch.manual_seed(seed)
        # a method may rebuild layers (Bayesian mu/sigma layers) -- before DDP / compile wrap them
        m = method.prepare_model(instantiate(cfg.model)).to(device)
        return m.to(memory_format=torch.channels_last) if tc.channels_last else m

    module = model_factory()
    if info.enabled and tc.sync_bn:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if info.rank > 0:  # ranks draw different dropout / noise; rank 0 keeps the single-process stream
        seed_everything(cfg.seed + 7919 * info.rank)
    ddp = None
    model = module
    if info.enabled:
        ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
        model = ddp
    if tc.compile:
        model = torch.compile(model)
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
        all_reduce_mean=all_reduce_mean, seed=cfg.seed)
    method.setup(ctx)
    flatness.setup(ctx, method)
    total_epochs = tc.epochs * method.epoch_multiplier
    backprop = Backprop(module, device, precision=tc.precision, grad_clip=tc.grad_clip, ddp=ddp)
    eval_cfg = EvalConfig(**OmegaConf.to_container(cfg.metrics, resolve=True))

    def gather(local, n):
        return D.gather_shards(local, n, info, device)

    # ---------------------------------------------------------------- resume
    trainer = Trainer(epochs=total_epochs, run_dir=run_dir, info=info, device=device,
                      checkpoint_every=tc.checkpoint_every, eval_every=tc.eval_every, progress=tc.progress,
                      limit_train_batches=tc.limit_train_batches, channels_last=tc.channels_last)
    ckpt = _resume_path(tc.resume, trainer.ckpt_path)
    if ckpt is not None:
        trainer.restore(load_checkpoint(ckpt), method, backprop, generator)
        if info.is_main:
            print(f"resuming from {ckpt} at epoch {trainer.epoch}, step {trainer.step_in_epoch}", file=sys.stderr)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        trainer.loggers = [JsonlLogger(run_dir, resume_epoch=trainer.epoch)]
        container = OmegaConf.to_container(cfg, resolve=True)
        for lg_cfg in (cfg.logger or {}).values():
            if lg_cfg is not None and "_target_" in lg_cfg:
                trainer.loggers.append(instantiate(lg_cfg, _partial_=True)(run_dir=run_dir, run_config=container))

    val_targets = dataset_targets(bundle.val) if val_loader is not None else None
    test_targets = dataset_targets(bundle.test)

    def evaluate_epoch() -> dict:
        name, loader, targets = (("val", val_loader, val_targets) if val_loader is not None
                                 else ("test", eval_loaders["test"], test_targets))
        m = evaluate(method, {"test": loader}, targets, eval_cfg, gather=gather, predict=method.monitor)
        keys = ("accuracy", "nll", "ece")
        return {f"{name}/{k}": m[k] for k in keys}

    trainer.fit(method, flatness, backprop, train_loader, sampler, bundle.train,
                evaluate_epoch=evaluate_epoch if tc.eval_every else None, generator=generator)

    # ---------------------------------------------------------------- final evaluation
    metrics = evaluate(method, eval_loaders, test_targets, eval_cfg, gather=gather, keep_predictive=True,
                       shift_targets=shift_targets)
    predictive = metrics.pop("_predictive")
    results = None
    if info.is_main:
        meta = {
            "dataset": cfg.dataset.name, "model": _model_name(cfg), "method": method.describe(),
            "flatness": flatness.describe(), "seed": cfg.seed, "epochs": total_epochs,
            "budget": {"epochs": total_epochs, "steps": trainer.global_step, "steps_per_epoch": steps_per_epoch,
                       "train_size": len(bundle.train), "test_size": len(bundle.test),
                       "global_batch": tc.batch_size, "world_size": info.world_size,
                       "precision": tc.precision},
            "metric_conventions": {"ece_bins": eval_cfg.ece_bins, "ece_binning": eval_cfg.ece_binning,
                                   "ece_edges": eval_cfg.ece_edges, "auroc_misclassification":
                                   f"positives = correct, score = {eval_cfg.misclass_score}",
                                   "auroc_ood": f"positives = in-distribution, score = {eval_cfg.ood_score}",
                                   "nll": "-log mean_k p_k(y|x), mean over examples"},
            "hardware": hardware(device, info.world_size), "git": git_commit(),
            "train_seconds": trainer.elapsed, "wall_seconds": time.perf_counter() - t_start,
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "overrides": _overrides(), "run_dir": str(run_dir),
            "paper_reproduction": False,
        }
        results = {"metrics": metrics, "meta": meta}
        write_json(run_dir / "results.json", results)
        for lg in trainer.loggers:
            lg.log_results(results)
            lg.finish()
        if tc.reliability_diagram:
            _reliability(predictive["test"].exp(), test_targets, run_dir / "reliability.png", eval_cfg.ece_bins)
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


def _reliability(probs, targets, path, n_bins):
    try:
        from flatbnn.metrics.reliability import reliability_diagram
        reliability_diagram(probs, targets, path, n_bins=n_bins)
    except ImportError as e:  # matplotlib is optional at run time
        print(f"reliability diagram skipped: {e}", file=sys.stderr)


__all__ = ["run"]
