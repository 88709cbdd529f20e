"""The flatness seam: *where* the gradient a method uses is evaluated.

A ``Flatness`` receives the parameters to perturb, a forward-only ``loss_fn(batch)`` and the
engine's ``Backprop`` helper, and leaves in ``p.grad`` the gradient the method should step with.
Methods never know which variant they are composed with (F-SWAG = SWAG x SAM).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

LossFn = Callable[[object], torch.Tensor]


class Flatness:
    """Base class of the flatness variants (``none.py``, ``sam.py``, ...)."""

    name = "base"
    #: number of forward/backward passes per step (the benchmark reports cost relative to 1)
    passes = 1

    def gradient(
        self,
        params: Sequence[torch.Tensor],
        loss_fn: LossFn,
        batch,
        backprop,
        scaling: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> dict:
        """Hyperparameters recorded in results.json."""
        return {"name": self.name}
