"""Per-step learning-rate schedules as ``LambdaLR`` factories.

Each factory is called by the method as ``factory(optimizer, total_steps=..., steps_per_epoch=...)``
(Hydra builds it with ``_partial_: true``). Stepping per iteration, not per epoch, keeps
schedules identical across batch sizes and resumes.

Why not ``torch.optim.lr_scheduler``'s own classes: they compute each lr from the previous one
(chainable form) or evaluate the formula in another order, so they differ from the closed form
``base_lr * factor(step)`` here in the last bits, and committed runs would not reproduce bit for bit. Measured (torch 2.14, per-step lrs over
whole schedules, against these factories): ``CosineAnnealingLR`` (with ``LinearLR`` +
``SequentialLR`` for the warm-up) differs on 77,536 of 78,200 steps (lr 0.1, 200 x 391 steps;
max |diff| 8.6e-16, 1.3e-15 with a 5-epoch warm-up); ``MultiStepLR`` on 36 of 96 (lr, gamma,
milestones) combinations (e.g. lr 0.5, gamma 0.3, three milestones; max |diff| 1.7e-18);
``CosineAnnealingWarmRestarts`` in place of ``cyclical`` on 17,484 of 78,200 steps. The SWAG
schedule (``swa``; torch's ``SWALR`` anneals from the current lr, per epoch) and the per-group
absolute ``inverse_power`` have no torch counterpart. A factor that is a pure function of the step
also lets a resume rebuild the schedule at the restored step. ``tests/test_schedulers.py`` pins the
per-step lrs.
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


class _InversePower:
    """``lr(u) = min(max_lr, a / (b + offset + u) ** gamma)`` as a factor of ``base_lr`` (picklable).

    ``u`` is the optimiser step (``unit="step"``) or the epoch ``step // steps_per_epoch`` (``unit="epoch"``).
    """

    def __init__(self, a, b, gamma, max_lr, unit, offset, steps_per_epoch, base_lr):
        self.a, self.b, self.gamma, self.max_lr = float(a), float(b), float(gamma), max_lr
        self.unit, self.offset = unit, float(offset)
        self.steps_per_epoch, self.base_lr = int(steps_per_epoch), float(base_lr)

    def lr(self, step: int) -> float:
        u = step if self.unit == "step" else step // self.steps_per_epoch
        lr = self.a / (self.b + self.offset + u) ** self.gamma
        return lr if self.max_lr is None else min(float(self.max_lr), lr)

    def __call__(self, step: int) -> float:
        return self.lr(step) / self.base_lr


def inverse_power(optimizer, total_steps: int, steps_per_epoch: int, a: float = 0.2, b: float = 0.1,
                  gamma: float = 0.55, max_lr: float | None = 0.2, unit: str = "epoch", offset: float = 1.0):
    """Polynomially decaying ABSOLUTE learning rate ``min(max_lr, a / (b + offset + u) ** gamma)``.

    The flat_seeking_bnn code's SGLD schedules (docs/flat_bnn_official_code.md): its ``sgld/train_sgld.py``
    sets ``min(0.2, 0.2 / (0.1 + epoch) ** 0.55)`` at the start of every epoch (the defaults here; ``offset``
    = the script's epoch index of our first epoch: 1 when it starts from epoch 0, whose training it skips,
    the checkpoint's epoch with ``--fine_tune``), and its plain-SGLD optimiser ``sam.SGD_Cus`` overrides that
    with ``10 / (1000 + t) ** 0.9`` per step ``t`` (``a=10 b=1000 gamma=0.9 max_lr=null unit=step offset=0``).
    The value is absolute: ``optimizer.lr`` only has to be > 0 (each group's factor is divided by it).
    """
    if unit not in ("step", "epoch"):
        raise ValueError(f"scheduler.unit must be 'step' or 'epoch', got {unit!r}")
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    if b + offset <= 0:
        raise ValueError(f"inverse_power needs b + offset > 0, got b={b}, offset={offset}")
    lambdas = []
    for group in optimizer.param_groups:
        base = group.get("initial_lr", group["lr"])
        if base <= 0:
            raise ValueError(f"inverse_power sets an absolute lr: optimizer.lr must be > 0, got {base}")
        lambdas.append(_InversePower(a, b, gamma, max_lr, unit, offset, steps_per_epoch, base))
    return LambdaLR(optimizer, lambdas)
