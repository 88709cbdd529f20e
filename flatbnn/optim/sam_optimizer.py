"""davda54/sam's optimiser interface on flatbnn's SAM family: a loop written for it changes one import.

    optimizer = SAMOptimizer(model.parameters(), torch.optim.SGD, rho=0.05, adaptive=False, lr=0.1, momentum=0.9)
    loss_fn(model(x), y).backward()
    optimizer.first_step(zero_grad=True)       # w -> w + eps(grad at w)
    with keep_bn_stats(model):                 # flatbnn.keep_bn_stats: BatchNorm running stats from the first pass
        loss_fn(model(x), y).backward()
    optimizer.second_step(zero_grad=True)      # back to w; the base optimiser steps with the gradient at w + eps

``eps`` is the flatness variant's own (``SAM.perturbation``, ``SAM.move`` / ``SAM.restore``), not a second copy:
``adaptive=False`` is ``flatbnn.SAM``, ``adaptive=True`` is ``flatbnn.ASAM(eta=0, only_weights=False)`` -- T = |w| on
every tensor, biases and BatchNorm included (davda54's ``adaptive``; the official ASAM is eta = 0.01 on weights only)
-- and :class:`FisherSAMOptimizer` is ``flatbnn.FisherSAM``. The radius and the variant are read from the param
groups at every ``first_step`` (a schedule may set ``group["rho"]``); the groups must agree on them, since eps has one
global norm and one radius.

What the optimiser leaves to the loop, as davda54's does: the two forward/backward passes (so dropout draws new masks
on the second pass: flatbnn's ``SAM(same_noise=False)``) and BatchNorm. flatbnn's own loop keeps the running statistics
of the first pass (``SAM(bn_stats="first")``); in a loop of your own, run the second pass inside
``flatbnn.keep_bn_stats(model)``. davda54's example sets the BN momentum to 0 for the second pass instead
(``disable_running_stats`` / ``enable_running_stats``): the same running mean and variance, but
``num_batches_tracked`` still counts the second pass, which changes the statistics of a BN layer with
``momentum=None`` (a cumulative average); ``keep_bn_stats`` puts every buffer back.

Beyond davda54's: ``state_dict()`` holds the base optimiser's state (momentum buffers: davda54/sam#34), a
``first_step`` without any gradient or a ``second_step`` without a ``first_step`` is one clear error, and
``step(closure)`` returns what the closure returned.
"""

from __future__ import annotations

import torch

from flatbnn.flatness.asam import ASAM
from flatbnn.flatness.fsam import FisherSAM
from flatbnn.flatness.sam import SAM


class SAMOptimizer(torch.optim.Optimizer):
    """``SAMOptimizer(params, base_optimizer, rho=0.05, adaptive=False, **kwargs)``: ``base_optimizer`` is a
    ``torch.optim`` class, built here on the same param groups with ``**kwargs`` (lr, momentum, ...)."""

    #: the param-group keys that choose the flatness variant (all groups must agree on them)
    flatness_keys: tuple[str, ...] = ("rho", "adaptive")

    def __init__(self, params, base_optimizer, rho: float = 0.05, adaptive: bool = False, **kwargs):
        self._setup(params, base_optimizer, {"rho": rho, "adaptive": bool(adaptive)}, kwargs)

    def flatness_of(self, settings: dict) -> SAM:
        """flatbnn's variant for these group settings."""
        if settings["adaptive"]:
            return ASAM(rho=settings["rho"], eta=0.0, only_weights=False)
        return SAM(rho=settings["rho"])

    # ---------------------------------------------------------------- construction
    def _setup(self, params, base_optimizer, settings: dict, kwargs: dict) -> None:
        self._flatness, self._settings = self.flatness_of(settings), settings  # a bad rho is refused here
        super().__init__(params, {**settings, **kwargs})
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self._link_base()
        self.defaults.update(self.base_optimizer.defaults)
        self._moved: tuple[SAM, list[torch.Tensor]] | None = None

    def _link_base(self) -> None:
        """One set of groups (schedulers set lr here, the base optimiser reads it) and one state (momentum buffers
        land in this optimiser's state_dict)."""
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # rebinds param_groups and state: hand them to the base optimiser
        self.base_optimizer.param_groups = self.param_groups
        self.base_optimizer.state = self.state

    def _current_flatness(self) -> SAM:
        first = {k: self.param_groups[0][k] for k in self.flatness_keys}
        for i, group in enumerate(self.param_groups[1:], 1):
            other = {k: group[k] for k in self.flatness_keys}
            if other != first:
                raise ValueError(f"{type(self).__name__}: param group {i} has {other}, group 0 {first}; the "
                                 f"perturbation has one radius and one norm over all groups, so they must agree")
        if first != self._settings:
            self._flatness, self._settings = self.flatness_of(first), first
        return self._flatness

    # ---------------------------------------------------------------- davda54's three methods
    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        """w -> w + eps from the gradients in ``p.grad`` (parameters without a gradient stay where they are)."""
        if self._moved is not None:
            raise RuntimeError(f"{type(self).__name__}.first_step called twice without second_step")
        flatness = self._current_flatness()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            raise RuntimeError(f"{type(self).__name__}.first_step: no parameter has a gradient; run the first "
                               f"forward and backward pass (at w) before it")
        flatness.move(params, flatness.perturbation(params, [p.grad for p in params]))
        self._moved = (flatness, params)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        """Back to w (by copy: bit-exact), then the base optimiser's step with the gradient now in ``p.grad``."""
        if self._moved is None:
            raise RuntimeError(f"{type(self).__name__}.second_step without first_step: nothing to restore")
        flatness, params = self._moved
        flatness.restore(params)
        self._moved = None
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        """davda54's closure form: the first pass (forward and backward at w) is yours, before ``step``; the closure
        runs the second one at w + eps (forward and backward). Returns what the closure returned."""
        if closure is None:
            raise ValueError(f"{type(self).__name__}.step needs a closure (forward and backward pass); or call "
                             f"first_step() and second_step() around your second pass")
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            out = closure()
        self.second_step()
        return out


class FisherSAMOptimizer(SAMOptimizer):
    """Fisher-SAM (``flatbnn.FisherSAM``) behind the same interface: ``FisherSAMOptimizer(params, base_optimizer,
    rho=None, eta=None, **kwargs)``, None meaning FisherSAM's own default."""

    flatness_keys = ("rho", "eta")

    def __init__(self, params, base_optimizer, rho: float | None = None, eta: float | None = None, **kwargs):
        given = FisherSAM(**{k: v for k, v in (("rho", rho), ("eta", eta)) if v is not None})
        self._setup(params, base_optimizer, {"rho": given.rho, "eta": given.eta}, kwargs)

    def flatness_of(self, settings: dict) -> SAM:
        return FisherSAM(rho=settings["rho"], eta=settings["eta"])


__all__ = ["FisherSAMOptimizer", "SAMOptimizer"]
