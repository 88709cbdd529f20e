"""Stochastic gradient Langevin dynamics (Welling & Teh 2011), composable with any flatness variant.

Target posterior (flat_seeking_bnn Eq. 1 with lambda = N, tempered by T):

    p(w | D) ∝ exp(-N * [L_S(w) + (wd / 2) ||w||^2] / T)

where L_S is the mean loss and ``optimizer.weight_decay`` = prior precision / N (the same Gaussian
prior as the MAP objective). The configured optimiser takes the step on the mean loss (use
``optimizer.momentum=0`` for textbook SGLD; momentum > 0 is SGHMC-like), then

    w <- w + sqrt(2 * lr_t * T / N) * xi,   xi ~ N(0, I)      (noise_mode=langevin, the default)

with lr_t the current (scheduled) learning rate, so cosine / cyclical schedules scale both.

The flat_seeking_bnn official code (``sgld/train_sgld.py`` + ``sam.py``; docs/flat_bnn_official_code.md) is
not a Langevin sampler: momentum-SGD on the mean loss plus isotropic noise that does not depend on N.
These options reproduce it (presets ``method=sgld_official`` / ``method=f_sgld_official``):

* ``noise_mode=linear``: ``std = noise_factor * lr_t`` (its plain SGLD, ``SGD_Cus``: 0.1 * lr_t);
* ``noise_mode=schedule``: ``std = noise_factor * noise_a / (noise_b + noise_offset + t) ** noise_gamma``
  with t this run's optimiser step, independent of the lr (its SAM-SGLD: 5e-4 * 38.0348 / (13928.7 + t)^0.9
  for WRN-28-10, 5e-4 * 40.304 / (15476.4 + t)^0.9 for PreResNet-164);
* ``lr_schedule`` (a dict of ``flatbnn.optim.schedulers.inverse_power`` arguments: a, b, gamma, max_lr,
  unit, offset): the method builds that absolute lr schedule itself, in place of the ``scheduler`` group
  (as HWA's ``lr_cycles``), so an experiment preset's scheduler cannot replace it; null (default) keeps
  the ``scheduler`` group.

After ``burn_in`` epochs a copy of the weights (and buffers) is kept every ``sample_every`` epochs
(or steps); the predictive averages the kept samples (at most ``max_samples``, the latest kept).
Noise comes from the method's own generator, seeded identically on every DDP rank (the weights must
stay equal across ranks) and saved in checkpoints.
"""

from __future__ import annotations

import math
import warnings

import torch

from flatbnn.methods.base import Method

NOISE_MODES = ("langevin", "linear", "schedule")


class SGLD(Method):
    name = "sgld"
    capturable = False  # noise scaled by the host lr, step counters and sample keeping inside its step

    def __init__(self, temperature: float = 1.0, burn_in: float = 0.5, sample_every: int = 1,
                 sample_unit: str = "epoch", max_samples: int = 30, noise_mode: str = "langevin",
                 noise_factor: float = 0.1, num_samples: int | None = None, samples_on_cpu: bool = True,
                 noise_a: float = 38.0348, noise_b: float = 13928.7, noise_gamma: float = 0.9,
                 noise_offset: float = 0.0, lr_schedule: dict | None = None):
        if noise_mode not in NOISE_MODES:
            raise ValueError(f"method.noise_mode must be one of {NOISE_MODES}, got {noise_mode!r}")
        if noise_mode == "schedule" and noise_b + noise_offset <= 0:
            raise ValueError("method.noise_mode=schedule needs noise_b + noise_offset > 0")
        if sample_unit not in ("epoch", "step"):
            raise ValueError(f"method.sample_unit must be 'epoch' or 'step', got {sample_unit!r}")
        super().__init__(num_samples=num_samples or max_samples)
        self.temperature = float(temperature)
        self.burn_in = burn_in
        self.sample_every = int(sample_every)
        self.sample_unit = sample_unit
        self.max_samples = int(max_samples)
        self.noise_mode = noise_mode
        self.noise_factor = float(noise_factor)
        self.noise_a, self.noise_b = float(noise_a), float(noise_b)
        self.noise_gamma, self.noise_offset = float(noise_gamma), float(noise_offset)
        self.lr_schedule = dict(lr_schedule) if lr_schedule else None
        self.samples_on_cpu = samples_on_cpu
        self.samples: list[dict] = []
        self._steps = 0
        self._epoch = 0

    def setup(self, ctx) -> None:
        if self.lr_schedule:
            from dataclasses import replace
            from functools import partial

            from flatbnn.optim.schedulers import inverse_power
            ctx = replace(ctx, scheduler_factory=partial(inverse_power, **self.lr_schedule))
        super().setup(ctx)
        self.generator = torch.Generator(device=ctx.device).manual_seed(ctx.seed * 1_000_003 + 17)
        self.burn_in_epochs = (int(round(self.burn_in * ctx.epochs)) if self.burn_in < 1 else int(self.burn_in))
        momentum = self.optimizer.param_groups[0].get("momentum", 0.0)
        if momentum and self.noise_mode == "langevin":
            warnings.warn(f"method=sgld with optimizer.momentum={momentum}: this is SGHMC-like, not "
                          "textbook SGLD; set optimizer.momentum=0", stacklevel=2)

    def noise_std(self, lr: float, step: int = 0) -> float:
        """Std of the noise added after optimiser step ``step`` (counted from 0 in this run) taken with ``lr``."""
        if self.noise_mode == "linear":
            return self.noise_factor * lr
        if self.noise_mode == "schedule":
            return self.noise_factor * self.noise_a / (self.noise_b + self.noise_offset + step) ** self.noise_gamma
        return math.sqrt(2.0 * lr * self.temperature / self.ctx.n_train)

    def train_step(self, batch, flatness, backprop) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        self._record = True
        loss = flatness.gradient(self.named_parameters(), self.loss_fn, batch, backprop)
        lr = self.lr()  # the lr this step used (before the scheduler advances)
        backprop.step(self.optimizer)
        self.add_noise(lr, self._steps)
        if self.scheduler is not None:
            self.scheduler.step()
        self._steps += 1
        if (self.sample_unit == "step" and self._epoch >= self.burn_in_epochs
                and self._steps % self.sample_every == 0):
            self.keep_sample()
        return {"loss": loss}

    @torch.no_grad()
    def add_noise(self, lr: float, step: int = 0) -> None:
        std = self.noise_std(lr, step)
        g = self.generator
        for p in self.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype), alpha=std)

    def on_epoch_end(self, epoch: int) -> None:
        self._epoch = epoch + 1
        if (self.sample_unit == "epoch" and epoch + 1 > self.burn_in_epochs
                and (epoch + 1 - self.burn_in_epochs) % self.sample_every == 0):
            self.keep_sample()

    @torch.no_grad()
    def keep_sample(self) -> None:
        dev = "cpu" if self.samples_on_cpu else None
        self.samples.append({k: v.detach().to(dev or v.device, copy=True)
                             for k, v in self.module.state_dict().items()})
        self.samples = self.samples[-self.max_samples:]

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        if not self.samples:
            raise RuntimeError(f"method=sgld kept no samples (burn_in={self.burn_in} -> epoch "
                               f"{self.burn_in_epochs} of {self.ctx.epochs}); lower method.burn_in")
        k = min(len(self.samples), int(num_samples or self.num_samples))
        current = {k_: v.clone() for k_, v in self.module.state_dict().items()}
        try:
            for sample in self.samples[-k:]:
                self.module.load_state_dict(sample)
                self.module.eval()
                yield self.log_probs_on(loaders)
        finally:
            self.module.load_state_dict(current)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "samples": self.samples, "steps": self._steps, "epoch": self._epoch,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.samples, self._steps, self._epoch = state["samples"], state["steps"], state["epoch"]
        self.generator.set_state(state["generator"])

    def describe(self) -> dict:
        return {"name": self.name, "num_samples": self.num_samples, "kept_samples": len(self.samples),
                "temperature": self.temperature, "burn_in_epochs": self.burn_in_epochs,
                "sample_every": self.sample_every, "sample_unit": self.sample_unit, "noise_mode": self.noise_mode,
                **({"noise_factor": self.noise_factor} if self.noise_mode != "langevin" else {}),
                **({"noise_schedule": {"a": self.noise_a, "b": self.noise_b, "gamma": self.noise_gamma,
                                       "offset": self.noise_offset}} if self.noise_mode == "schedule" else {}),
                **({"lr_schedule": self.lr_schedule} if self.lr_schedule else {})}
