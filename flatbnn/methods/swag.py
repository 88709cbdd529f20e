"""SWA, SWAG and SWAG-Diag (Izmailov et al. 2018; Maddox et al. 2019).

Training is the base optimiser's (with any flatness variant: F-SWAG = SWAG x SAM). From epoch
``swa_start`` on, every ``collect_every`` epochs (or steps) the flattened weights w are collected:

    mean   <- (n mean + w) / (n + 1)          sq_mean <- (n sq_mean + w^2) / (n + 1)
    D      <- last ``max_rank`` columns of (w - mean), mean updated first (as the reference code)

Sampling (never forming the covariance, swa_gaussian#22):

    w~ = mean + sqrt(scale) * (sqrt(var) * z1 + D^T z2 / sqrt(K - 1)),   var = max(sq_mean - mean^2, 1e-30)

``mode=swag``: both terms, scale 0.5 (Sigma = (Sigma_diag + Sigma_lowrank)/2, the paper's
convention); ``mode=swag_diag``: the diagonal term only, scale 1.0; ``mode=swa``: the mean, one
"sample". K is the number of deviation columns actually collected (= max_rank once the buffer is
full; the reference code always divides by max_rank - 1, which only differs before that).
Every sample is followed by a BatchNorm refresh on the training data (skipped for BN-free nets such
as ResNet-20-FRN). Sampling uses a fixed evaluation seed, so results do not depend on resume.
"""

from __future__ import annotations

import math

import torch

from flatbnn.methods.base import Method
from flatbnn.methods.batchnorm import refresh_batchnorm
from flatbnn.methods.param_vector import copy_flat_, flatten

MODES = {"swa": 0.0, "swag": 0.5, "swag_diag": 1.0}


class SWAG(Method):
    name = "swag"
    # the sample's width, the BN refresh per sample and the samples' seed shape only the predictive
    predict_keys = Method.predict_keys + ("scale", "bn_refresh", "bn_refresh_fraction", "eval_seed")
    capturable = False  # counts steps and collects moments on the host inside its step (collect_unit=step)

    def __init__(self, mode: str = "swag", swa_start: float = 0.5, collect_every: int = 1,
                 collect_unit: str = "epoch", max_rank: int = 20, scale: float | None = None,
                 num_samples: int = 30, bn_refresh: bool = True, bn_refresh_fraction: float = 1.0,
                 eval_seed: int = 1):
        if mode not in MODES:
            raise ValueError(f"method.mode must be one of {list(MODES)}, got {mode!r}")
        if collect_unit not in ("epoch", "step"):
            raise ValueError(f"method.collect_unit must be 'epoch' or 'step', got {collect_unit!r}")
        super().__init__(num_samples=1 if mode == "swa" else num_samples)
        self.name = mode
        self.mode = mode
        self.swa_start = swa_start
        self.collect_every = int(collect_every)
        self.collect_unit = collect_unit
        self.max_rank = int(max_rank)
        self.scale = MODES[mode] if scale is None else float(scale)
        self.bn_refresh = bn_refresh
        self.bn_refresh_fraction = bn_refresh_fraction
        self.eval_seed = eval_seed
        self.n_collected = 0
        self.mean = self.sq_mean = self._dev = None
        self._steps = 0
        self._epoch = 0  # epochs completed

    # ---------------------------------------------------------------- collection
    def setup(self, ctx) -> None:
        super().setup(ctx)
        p = flatten(self.parameters())
        self.mean = torch.zeros_like(p)
        self.sq_mean = torch.zeros_like(p)
        # ring buffer of the last max_rank deviations (no per-collection reallocation)
        rows = self.max_rank if self.mode == "swag" else 0
        self._dev = torch.zeros(rows, p.numel(), dtype=p.dtype, device=p.device)
        self._dev_count = 0
        # swa_start < 1 is a fraction of the epochs; >= 1 an epoch number (flat_seeking_bnn: 161 of 300)
        self.start_epoch = (int(round(self.swa_start * ctx.epochs)) if self.swa_start < 1
                            else int(self.swa_start))

    @torch.no_grad()
    def collect(self, weights: torch.Tensor | None = None) -> None:
        """Add the current weights (or ``weights``, a flat vector in ``parameters()`` order) to the moments."""
        w = flatten(self.parameters()) if weights is None else weights
        n = self.n_collected
        self.mean.mul_(n / (n + 1)).add_(w / (n + 1))
        self.sq_mean.mul_(n / (n + 1)).add_(w * w / (n + 1))
        if self.mode == "swag":
            self._dev[self._dev_count % self.max_rank] = w - self.mean
            self._dev_count += 1
        self.n_collected += 1

    @property
    def deviations(self) -> torch.Tensor:
        """The last min(n, max_rank) deviation columns as rows, oldest first."""
        k = min(self._dev_count, self._dev.shape[0])
        if k < self._dev.shape[0] or k == 0:
            return self._dev[:k]
        start = self._dev_count % self._dev.shape[0]
        return torch.cat([self._dev[start:], self._dev[:start]])

    def train_step(self, batch, flatness, backprop) -> dict:
        out = super().train_step(batch, flatness, backprop)
        self._steps += 1
        if (self.collect_unit == "step" and self._epoch >= self.start_epoch
                and self._steps % self.collect_every == 0):
            self.collect()
        return out

    def on_epoch_end(self, epoch: int) -> None:
        self._epoch = epoch + 1
        if (self.collect_unit == "epoch" and epoch + 1 > self.start_epoch
                and (epoch + 1 - self.start_epoch) % self.collect_every == 0):
            self.collect()

    # ---------------------------------------------------------------- sampling
    @property
    def variance(self) -> torch.Tensor:
        return torch.clamp(self.sq_mean - self.mean ** 2, min=1e-30)

    @torch.no_grad()
    def sample_vector(self, generator: torch.Generator | None, scale: float | None = None) -> torch.Tensor:
        """One flat weight sample; ``scale`` overrides the mode's (0: the mean, as swa_gaussian's sample(0.0))."""
        scale = self.scale if scale is None else float(scale)
        if self.mode == "swa" or scale == 0.0:
            return self.mean.clone()
        z1 = torch.randn(self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype)
        w = self.variance.sqrt() * z1
        k = min(self._dev_count, self._dev.shape[0])
        if self.mode == "swag" and k > 1:
            z2 = torch.randn(k, generator=generator, device=self.mean.device, dtype=self.mean.dtype)
            w = w + (self._dev[:k].T @ z2) / math.sqrt(k - 1)
        return self.mean + math.sqrt(scale) * w

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        if self.n_collected == 0:
            raise RuntimeError(f"method={self.mode}: no weights were collected (swa_start={self.swa_start} "
                               f"-> epoch {self.start_epoch} of {self.ctx.epochs}); lower method.swa_start")
        k = 1 if self.mode == "swa" else int(num_samples or self.num_samples)
        current = flatten(self.parameters())
        buffers = {n: b.clone() for n, b in self.module.named_buffers()}
        g = torch.Generator(device=self.mean.device).manual_seed(self.eval_seed)
        try:
            for _ in range(k):
                copy_flat_(self.parameters(), self.sample_vector(g))
                if self.bn_refresh:
                    refresh_batchnorm(self.module, self.ctx.train_loader, self.ctx.device,
                                      self.bn_refresh_fraction, self.ctx.all_reduce_mean, self.ctx.channels_last)
                self.module.eval()
                yield self.log_probs_on(loaders)
        finally:  # leave the training state untouched (resume, further training)
            copy_flat_(self.parameters(), current)
            for n, b in self.module.named_buffers():
                b.copy_(buffers[n])

    # ---------------------------------------------------------------- state
    def posterior_state(self) -> dict:
        """The moments a sample is drawn from (no training state: ``flatbnn.SWAGModel`` saves only these)."""
        return {"n_collected": self.n_collected, "mean": self.mean, "sq_mean": self.sq_mean,
                "deviations": self._dev, "dev_count": self._dev_count}

    def load_posterior_state(self, state: dict) -> None:
        self.n_collected = state["n_collected"]
        self.mean, self.sq_mean = state["mean"].to(self.mean), state["sq_mean"].to(self.sq_mean)
        self._dev, self._dev_count = state["deviations"].to(self.mean), state["dev_count"]

    def state_dict(self) -> dict:
        return {**super().state_dict(), **self.posterior_state(), "steps": self._steps, "epoch": self._epoch}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.load_posterior_state(state)
        self._steps, self._epoch = state["steps"], state["epoch"]

    def describe(self) -> dict:
        return {"name": self.mode, "num_samples": self.num_samples, "swa_start_epoch": self.start_epoch,
                "collect_every": self.collect_every, "collect_unit": self.collect_unit,
                "max_rank": self.max_rank, "scale": self.scale, "n_collected": self.n_collected,
                "bn_refresh": self.bn_refresh, "bn_refresh_fraction": self.bn_refresh_fraction}
