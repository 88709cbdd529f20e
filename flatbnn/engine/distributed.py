"""DDP plumbing: detection from torchrun's environment, samplers, gathering predictions.

Single process never needs torchrun. Under torchrun (``WORLD_SIZE`` > 1) we init NCCL on GPUs and
gloo on CPU. ``trainer.batch_size`` is the GLOBAL batch; each rank gets batch_size / world_size,
so a 2-process run sees the same samples per step as a single process with the same global batch.
A submitit job with several tasks (one per GPU) gets the same environment from its SLURM / local task
ids (:func:`export_submitit_env`). Every collective has a deadline (``trainer.dist_timeout_s``): a rank
that stalls or dies makes the others fail with one line instead of waiting for ever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def export_submitit_env() -> bool:
    """Inside a submitit job with several tasks (``tasks_per_node`` x ``nodes``, one task per GPU) and no
    torchrun: export what torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) from the
    task ids, so the run is one DDP job instead of N copies writing one run dir. True if it exported."""
    if "WORLD_SIZE" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return False
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks <= 1:
        return False
    # CUDA_VISIBLE_DEVICES stays as the scheduler set it; resolve_device maps the local rank onto it
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


def end_with_launcher() -> None:
    """Under torchrun (whose workers run in sessions of their own, out of reach of the terminal's Ctrl-C and of
    a signal to the job's process group): when the launcher dies -- killed, crashed, its terminal gone -- this
    worker gets SIGTERM and checkpoints and exits like on any stop, instead of training on as an orphan that
    holds the device and the run dir's lock (Linux: ``PR_SET_PDEATHSIG``)."""
    import signal
    import sys
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl here: the launcher stops its workers itself
        return
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def init_distributed(device: torch.device, timeout_s: float | None = None) -> DistInfo:
    """Join the process group (idempotent). ``timeout_s`` bounds the rendezvous and every collective;
    None keeps torch's default."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        if device.type == "cuda":  # before any collective: NCCL places object collectives on the current GPU
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=float(timeout_s))}
        dist.init_process_group(backend=backend, **kwargs)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def dist_failure_line(exc: BaseException, timeout_s: float | None) -> str | None:
    """One line for a failed rendezvous / collective (a peer stalled, died or never arrived); None for
    anything else. torch raises these as DistBackendError / DistStoreError / RuntimeError from gloo or
    NCCL with multi-line C++ messages."""
    text = " ".join(str(exc).split())
    markers = ("timed out", "timeout", "connection closed by peer", "connection reset", "connection refused",
               "socket timeout", "broken pipe", "nccl communicator was aborted", "watchdog")
    is_dist = isinstance(exc, (getattr(dist, "DistError", RuntimeError), RuntimeError, TimeoutError))
    if not is_dist or not any(m in text.lower() for m in markers):
        return None
    rank = os.environ.get("RANK", "?")
    limit = f"{timeout_s:g} s" if timeout_s is not None else "torch's default"
    return (f"rank {rank}: DDP rendezvous or collective failed (limit trainer.dist_timeout_s = {limit}): another "
            f"rank stalled, died or never arrived [{type(exc).__name__}: {text[:160]}]; the last checkpoint is "
            f"intact: resume from it")


def resolve_device(spec: str) -> torch.device:
    """``auto`` = this rank's GPU if there is one, else CPU. The local rank is taken modulo the visible
    GPUs: a scheduler that binds one GPU per task shows each task a single ``cuda:0``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return dev


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (also used with one replica, so single-process and DDP runs draw the
    same permutation) that can skip the first ``skip`` samples of this rank's shard once -- the
    sampler position that makes a mid-epoch resume exact."""

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=False)
        self.skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def eval_sampler(dataset, info: DistInfo):
    if not info.enabled:
        return None
    return DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=False)


def gather_shards(local: torch.Tensor, n_total: int, info: DistInfo, device: torch.device) -> torch.Tensor:
    """Inverse of ``DistributedSampler(shuffle=False)``: rank r holds indices r, r+W, ...;
    returns the full [n_total, ...] tensor in dataset order on every rank."""
    if not info.enabled:
        return local
    t = local.to(device)
    parts = [torch.empty_like(t) for _ in range(info.world_size)]
    dist.all_gather(parts, t)
    stacked = torch.stack(parts, dim=1)  # [per_rank, world, ...] -> row j*W + r
    return stacked.reshape(-1, *t.shape[1:])[:n_total].cpu()
