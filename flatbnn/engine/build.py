"""Compose a run from a resolved config: data x model x method x flatness, set up as a training run sets them up.

:func:`build` is the one place a config becomes data, model, method and flatness (used by ``engine/run.py``
and by ``evaluate.py`` / ``scripts/analyze.py``, which re-evaluate a finished run from its checkpoint without
retraining); :class:`Built` is what it makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from flatbnn.data.fingerprint import fingerprint as data_fingerprint
from flatbnn.engine import distributed as D
from flatbnn.engine import graphed
from flatbnn.engine.backprop import Backprop, seed_everything
from flatbnn.engine.compiling import compile_model
from flatbnn.engine.trainer import ignore_stop_signals
from flatbnn.engine.warm_start import InitWeights, init_record
from flatbnn.methods.base import RunContext
from flatbnn.metrics.evaluate import EvalConfig, dataset_targets


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
    data: dict | None = None         # the data fingerprint (flatbnn/data/fingerprint.py): checkpoints, results.json

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
        val_loader=val_loader,
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
                 ctx=ctx, backprop=backprop, eval_cfg=eval_cfg, resume_ckpt=resume_ckpt, init_from=init_info,
                 data=data_fingerprint(bundle))


def _resume_path(resume, default: Path) -> Path | None:
    if resume is True or resume == "auto":
        return default if default.exists() else None
    if resume in (False, None, "false", "none"):
        return None
    p = Path(str(resume))
    if not p.exists():
        raise FileNotFoundError(f"trainer.resume={resume}: no such checkpoint")
    return p
