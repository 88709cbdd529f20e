"""flatbnn's parts inside your own training loop (docs/examples/own_loop.py, README "Inside your own loop").

The classes are the ones ``train.py`` composes -- ``flatbnn.SAM`` is ``flatbnn.flatness.SAM``, the class
``configs/flatness/sam.yaml`` names -- so a step in your loop is the engine's step (tested to the last bit).
The glue: :func:`attach` hands a posterior method (SWAG, ...) *your* model and optimiser instead of the ones the engine
would build; :class:`SWAGModel` is SWAG in ``torch.optim.swa_utils.AveragedModel``'s idiom; :func:`keep_bn_stats` is
the engine's BatchNorm policy for the second pass of a SAM step written by hand (``flatbnn.SAMOptimizer``).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.methods.base import Method, RunContext
from flatbnn.methods.param_vector import copy_flat_, flatten
from flatbnn.methods.swag import SWAG


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


@contextmanager
def keep_bn_stats(model: nn.Module):
    """Inside, BatchNorm layers normalise with the batch's statistics as usual; on exit every BN buffer (running
    mean, variance, ``num_batches_tracked``) is what it was before -- ``flatbnn.SAM``'s default ``bn_stats="first"``
    for the second pass of a loop of your own. davda54/sam's ``disable_running_stats`` / ``enable_running_stats``
    give the same running mean and variance but count the pass in ``num_batches_tracked``."""
    with Backprop(model, next(model.parameters()).device).bn_updates(False):
        yield


class SWAGModel(nn.Module):
    """SWAG in ``torch.optim.swa_utils.AveragedModel``'s idiom: a copy of ``model`` whose weights are the SWA mean
    after every :meth:`update_parameters` and a posterior sample after :meth:`sample`; refresh BatchNorm with
    ``torch.optim.swa_utils.update_bn(loader, swag_model)`` after either, then call it like the model::

        swag_model = SWAGModel(model, max_rank=20)        # flatbnn.SWAG's arguments: mode, max_rank, scale, ...
        swag_model.update_parameters(model)                # whenever you choose (e.g. each epoch after a burn-in)
        swag_model.sample(generator=g)                     # scale=0.0: the mean (swa_gaussian's sample(0.0))
        update_bn(train_loader, swag_model)
        logits = swag_model(x)

    The moments and the samples are ``flatbnn.SWAG``'s own (``self.swag``, set up by :func:`attach` on the copy);
    ``state_dict()`` carries them (as the module's extra state), so ``load_state_dict`` restores the posterior."""

    def __init__(self, model: nn.Module, device: torch.device | str | None = None, **swag_kwargs):
        super().__init__()
        self.module = copy.deepcopy(model)
        if device is not None:
            self.module = self.module.to(device)
        self.swag = attach(SWAG(**swag_kwargs), self.module, None)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Add ``model``'s current weights to the moments (``SWAG.collect``); this copy then holds their mean."""
        weights = [p for p in model.parameters() if p.requires_grad]
        mine = self.swag.parameters()
        if [w.shape for w in weights] != [w.shape for w in mine]:
            raise ValueError(f"SWAGModel.update_parameters: the model's {len(weights)} trained parameter tensors do "
                             f"not match the {len(mine)} of the model this SWAGModel was made from")
        self.swag.collect(flatten(weights).to(self.swag.mean))
        copy_flat_(mine, self.swag.mean)

    @torch.no_grad()
    def sample(self, generator: torch.Generator | None = None, scale: float | None = None) -> None:
        """Write one posterior sample into this copy (``SWAG.sample_vector``: the mode's scale unless ``scale``);
        its BatchNorm statistics are stale until ``update_bn``."""
        if self.swag.n_collected == 0:
            raise RuntimeError("SWAGModel.sample: no weights collected yet; call update_parameters(model) first")
        copy_flat_(self.swag.parameters(), self.swag.sample_vector(generator, scale))

    def get_extra_state(self) -> dict:
        return self.swag.posterior_state()

    def set_extra_state(self, state: dict) -> None:
        self.swag.load_posterior_state(state)


__all__ = ["SWAGModel", "attach", "keep_bn_stats"]
