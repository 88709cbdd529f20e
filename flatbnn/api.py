"""flatbnn's parts inside your own training loop (docs/examples/own_loop.py, README "Inside your own loop").

The classes are the ones ``train.py`` composes -- ``flatbnn.SAM`` is ``flatbnn.flatness.SAM``, the class
``configs/flatness/sam.yaml`` names -- so a step in your loop is the engine's step (tested to the last bit).
The one piece of glue is :func:`attach`, which hands a posterior method (SWAG, ...) *your* model and optimiser
instead of the ones the engine would build.
"""

from __future__ import annotations

import torch
from torch import nn

from flatbnn.methods.base import Method, RunContext


def attach(method: Method, model: nn.Module, optimizer: torch.optim.Optimizer, *, train_loader=None,
           n_train: int = 0, epochs: int = 1, steps_per_epoch: int = 1) -> Method:
    """Set ``method`` up on ``model`` (trained in place) with ``optimizer`` (stepped by you or by
    ``method.train_step``); nothing is rebuilt or copied. ``train_loader`` (batches of ``(x, y)``): what a
    BatchNorm refresh after each weight sample reads (SWAG with ``bn_refresh=True`` on a net with BatchNorm).
    ``n_train`` / ``epochs`` / ``steps_per_epoch``: only for methods that scale by them (VI's KL, SWAG's
    ``swa_start`` when you call ``method.on_epoch_end``). Returns ``method``."""
    device = next(model.parameters()).device
    ctx = RunContext(model=model, module=model, device=device, n_train=n_train, steps_per_epoch=steps_per_epoch,
                     epochs=epochs, optimizer_factory=lambda params: optimizer, scheduler_factory=None,
                     train_loader=train_loader)
    method.setup(ctx)
    return method


__all__ = ["attach"]
