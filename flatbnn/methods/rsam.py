"""RandomSAM as a method (Ujvary et al., variational_sam Alg. 1, Table 1): MFVI with mu only.

q = N(w, Sigma) with a FIXED isotropic Sigma; ``noise_scale`` names its size: ``paper`` = ``sigma^2 I``
with the paper's sigma = 5e-5 (App. D, "we have set this to 5e-5"; also the authors' notebook-era
RandomSAM, whose noise is its init_scale_M = 5e-5), ``official`` = (rho^2 / P) I, P = number of trained
weights (the later official RandomSAM: rho / sqrt(P), rho = 0.05); sigma is not learned, so the only KL term left is the
prior's on the mean. Per step:

    grad = d/dw mean NLL(w + sqrt(Sigma) z)  +  prior_coef * w,       z ~ N(0, I)

``prior_coef * w`` is the official code's prior term 2 w kl_weight / sigma_prior^2 (0.02 with its
defaults); ``optimizer.weight_decay`` still applies on top, as for every method. The perturbation
is exactly ``flatness=random`` (:class:`flatbnn.flatness.random.RandomSAM`, same generator, same
draws), so ``method=rsam`` == ``method=map flatness=random`` with ``optimizer.weight_decay`` raised
by ``prior_coef``; this method exists so the VSAM paper's RSAM row is one config. It has its own
perturbation, hence refuses any flatness but ``none``.

Prediction: the mean w (``num_samples=1``, the paper's evaluation); ``num_samples > 1`` samples
N(w, Sigma) from a fixed evaluation seed.
"""

from __future__ import annotations

import torch

from flatbnn.flatness.random import RandomSAM as RandomPerturbation
from flatbnn.methods.base import Method


class RandomSAMMethod(Method):
    name = "rsam"
    own_perturbation = True
    predict_keys = Method.predict_keys + ("eval_seed",)

    def __init__(self, rho: float = 0.05, sigma: float | None = None, prior_coef: float = 0.02,
                 num_samples: int = 1, eval_seed: int = 1, noise_scale: str | None = None):
        super().__init__(num_samples=num_samples)
        if noise_scale not in (None, "paper", "official"):
            raise ValueError(f"method.noise_scale must be paper or official, got {noise_scale!r}")
        if noise_scale == "paper" and sigma is None:
            raise ValueError("method.noise_scale=paper needs method.sigma (the paper: 5e-5)")
        if noise_scale == "official":
            sigma = None  # rho / sqrt(P)
        self.noise_scale = noise_scale or ("official" if sigma is None else "paper")
        self.perturbation = RandomPerturbation(rho=rho, sigma=sigma)
        self.prior_coef = float(prior_coef)
        self.eval_seed = int(eval_seed)

    def setup(self, ctx) -> None:
        super().setup(ctx)
        self.perturbation.generator = ctx.generator

    def train_step(self, batch, flatness, backprop) -> dict:
        self.check_flatness(flatness)
        self.optimizer.zero_grad(set_to_none=True)
        self._record = True
        loss = self.perturbation.gradient(self.named_parameters(), self.loss_fn, batch, backprop)
        if self.prior_coef:
            with torch.no_grad():
                have = [p for p in self.parameters() if p.grad is not None]
                if getattr(backprop, "scaler", None) is None:
                    torch._foreach_add_([p.grad for p in have], have, alpha=self.prior_coef)
                else:  # fp16: scaled like the data term, by the scale on the device (no get_scale() host read)
                    coef = backprop.loss_scale() * self.prior_coef
                    torch._foreach_add_([p.grad for p in have], torch._foreach_mul(have, coef))
        backprop.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": loss}

    def std(self) -> float:
        params = self.parameters()
        return self.perturbation.std(params, [True] * len(params))

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        k = int(num_samples or self.num_samples)
        self.module.eval()
        if k == 1:
            yield self.log_probs_on(loaders)
            return
        std = self.std()
        yield from self.predict_at_samples(loaders, k, lambda g, mean: [
            w + std * torch.randn(w.shape, generator=g, device=g.device, dtype=w.dtype).to(w.device) for w in mean])

    def describe(self) -> dict:
        d = {"name": self.name, "num_samples": self.num_samples, "rho": self.perturbation.rho,
             "sigma": self.perturbation.sigma, "noise_scale": self.noise_scale, "prior_coef": self.prior_coef}
        if self.ctx is not None:
            d["noise_std"] = self.std()
        return d
