"""Per-step learning-rate schedules as ``LambdaLR`` factories.

Each factory is called by the method as ``factory(optimizer, total_steps=..., steps_per_epoch=...)``
(Hydra builds it with ``_partial_: true``). Stepping per iteration, not per epoch, keeps
schedules identical across batch sizes and resumes.
"""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR


class _Cosine:
    """Linear warm-up, then cosine from 1 to ``final_factor`` (a picklable lambda)."""

    def __init__(self, total, warmup, final_factor):
        self.total, self.warmup, self.final = total, warmup, final_factor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.final + (1 - self.final) * 0.5 * (1 + math.cos(math.pi * t))


class _MultiStep:
    def __init__(self, boundaries, gamma):
        self.boundaries, self.gamma = boundaries, gamma

    def __call__(self, step: int) -> float:
        return self.gamma ** sum(step >= b for b in self.boundaries)


def constant(optimizer, total_steps: int, steps_per_epoch: int):
    return LambdaLR(optimizer, lambda step: 1.0)


def cosine(optimizer, total_steps: int, steps_per_epoch: int, warmup_epochs: float = 0.0,
           final_factor: float = 0.0):
    """Cosine annealing to ``final_factor`` x lr (flat_seeking_bnn's code uses 1e-3; bSAM 0)."""
    warmup = int(round(warmup_epochs * steps_per_epoch))
    return LambdaLR(optimizer, _Cosine(total_steps, warmup, final_factor))


def multistep(optimizer, total_steps: int, steps_per_epoch: int, milestones=(0.5, 0.75),
              gamma: float = 0.1):
    """Step decay at the given fractions of training (e.g. 0.5, 0.75 of the epochs)."""
    boundaries = [int(round(f * total_steps)) for f in milestones]
    return LambdaLR(optimizer, _MultiStep(boundaries, gamma))


class _SWA:
    def __init__(self, total, start, factor):
        self.total, self.start, self.factor = total, start, factor

    def __call__(self, step: int) -> float:
        t = step / max(1, self.start)
        if t <= 0.5:
            return 1.0
        if t <= 0.9:
            return 1.0 - (1.0 - self.factor) * (t - 0.5) / 0.4
        return self.factor


def swa(optimizer, total_steps: int, steps_per_epoch: int, swa_start: float = 0.5, swa_lr_factor: float = 0.05):
    """The SWAG paper's schedule: lr for the first half of [0, swa_start], linear decay to
    ``swa_lr_factor * lr`` by 0.9 * swa_start, then constant while SWA/SWAG collects.
    ``swa_start`` < 1 is a fraction of training, >= 1 an epoch number (as ``method.swa_start``)."""
    start = int(round(swa_start * total_steps)) if swa_start < 1 else int(swa_start * steps_per_epoch)
    return LambdaLR(optimizer, _SWA(total_steps, start, swa_lr_factor))


class _Cyclical:
    def __init__(self, total, cycles):
        self.per = max(1, total // cycles)

    def __call__(self, step: int) -> float:
        t = (step % self.per) / self.per
        return 0.5 * (1 + math.cos(math.pi * t))


def cyclical(optimizer, total_steps: int, steps_per_epoch: int, cycles: int = 4):
    """Cyclical cosine (Zhang et al. 2020, cSG-MCMC): ``cycles`` cosine decays from lr towards 0;
    with ``method=sgld`` keep samples near the end of each cycle (``method.sample_every``)."""
    return LambdaLR(optimizer, _Cyclical(total_steps, cycles))
