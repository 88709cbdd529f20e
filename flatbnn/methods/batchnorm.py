"""BatchNorm statistics for sampled or averaged weights (SWA, SWAG, ...).

Uses ``torch.optim.swa_utils.update_bn`` -- reset running stats, one pass over the training data in
train mode with momentum=None, i.e. an exact cumulative average (momentum=0 would give ~0 accuracy,
Lightning#14866). Batches are ``(x, y)``; only ``x`` is fed (pytorch#49082). Under DDP each rank
refreshes on its shard and the stats are averaged over ranks.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.optim.swa_utils import update_bn


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class _Inputs:
    """Iterable of inputs only, on the device, optionally the first ``n`` batches."""

    def __init__(self, loader, device, n_batches: int | None, channels_last: bool):
        self.loader, self.device, self.n, self.cl = loader, device, n_batches, channels_last

    def __iter__(self):
        it = iter(self.loader) if self.n is None else itertools.islice(self.loader, self.n)
        for x, _ in it:
            x = x.to(self.device, non_blocking=True)
            yield x.contiguous(memory_format=torch.channels_last) if self.cl and x.dim() == 4 else x


@torch.no_grad()
def refresh_batchnorm(module: nn.Module, loader, device, fraction: float = 1.0, all_reduce_mean=None,
                      channels_last: bool = False) -> None:
    """Recompute running mean/var of every BatchNorm in ``module`` on ``fraction`` of ``loader``."""
    if not has_batchnorm(module):
        return  # e.g. ResNet-20-FRN: nothing to refresh
    if loader is None:  # before any weight is written or statistic reset
        raise ValueError("the network has BatchNorm and its statistics are refreshed for each weight sample, which "
                         "needs the training batches: flatbnn.attach(..., train_loader=loader), or the method's "
                         "bn_refresh=False to keep the statistics it has")
    n = None if fraction >= 1.0 else max(1, math.ceil(fraction * len(loader)))
    was_training = module.training
    update_bn(_Inputs(loader, device, n, channels_last), module, device=None)
    if all_reduce_mean is not None:
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                all_reduce_mean(m.running_mean)
                all_reduce_mean(m.running_var)
    module.train(was_training)
