"""What the optimisers that keep a Gaussian posterior in their state share (bSAM and VOGN: a precision per weight,
``precision.py``; IVON: a Hessian estimate per weight, ``ivon.py``)."""

from __future__ import annotations

import torch
from torch.optim import Optimizer


class PosteriorStateOptimizer(Optimizer):
    """The per-weight state is made when the optimiser is (``_init_state``, given by the subclass), not at the first
    step: a step draws its noise from the posterior before it updates anything. The methods read the parameters as
    one flat list (``params()``) or with their group (``_groups()``)."""

    #: ``lr`` may be a device tensor (trainer.cuda_graph sets one; the scheduler fills it in place): the step then
    #: reads it on the device, never as a host float baked into a captured graph
    device_lr = True

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        for p, group in self._groups():
            self._init_state(p, group)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        raise NotImplementedError

    def params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _groups(self):
        for group in self.param_groups:
            for p in group["params"]:
                yield p, group
