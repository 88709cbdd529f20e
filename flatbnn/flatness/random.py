"""Random SAM (Ujvary et al.): the gradient at w + eps, eps ~ N(0, sigma^2 I), one pass, no ascent.

``sigma`` defaults to rho / sqrt(P), P = number of perturbed weights (so E||eps|| ~ rho, the
paper's and official code's choice). Noise comes from the engine's per-rank generator, which is
checkpointed, so runs resume exactly. The official code also adds the prior's gradient to the
update; here that is the optimiser's weight decay (kept separate, as for every method).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from flatbnn.flatness.base import Flatness, scaled


class RandomSAM(Flatness):
    name = "random"
    passes = 1

    def __init__(self, rho: float = 0.05, sigma: float | None = None, m: int = 1,
                 rho_schedule: str = "constant"):
        super().__init__(rho=rho, m=m, rho_schedule=rho_schedule)
        if sigma is not None and sigma < 0:
            raise ValueError(f"flatness.sigma must be >= 0, got {sigma}")
        self.sigma = None if sigma is None else float(sigma)

    def std(self, params, perturb) -> float:
        if self.sigma is not None:
            return self.sigma * self.rho_scale
        count = sum(p.numel() for p, on in zip(params, perturb) if on)
        return self.radius / math.sqrt(max(count, 1))

    @torch.no_grad()
    def perturbation(self, params, perturb=None) -> list[torch.Tensor]:
        perturb = perturb or [True] * len(params)
        # the std as a device tensor (refilled by set_lr_ratio outside a captured graph); one multiply for all
        # draws, the same products as `randn * float` (the float is rounded to the tensor dtype either way)
        std = self.device_scalar("std", lambda: self.std(params, perturb), params[0].device)
        noise = [torch.randn(p.shape, generator=self.generator, device=p.device, dtype=p.dtype)
                 for p, on in zip(params, perturb) if on]
        if noise:
            torch._foreach_mul_(noise, std.to(noise[0].dtype))
        it = iter(noise)
        return [next(it) if on else torch.zeros_like(p) for p, on in zip(params, perturb)]

    def chunk_gradient(self, params, names, loss_fn, chunk, backprop, scaling, perturb, *, share, sync):
        eps = self.perturbation(params, perturb)
        with torch.no_grad():
            saved = self.saved_buffers(params)
            torch._foreach_copy_(saved, params)
            torch._foreach_add_(params, eps)
        with nullcontext() if sync else backprop.no_sync():
            loss = backprop.forward(loss_fn, chunk)
            backprop.backward(scaled(loss, share))
        with torch.no_grad():
            torch._foreach_copy_(params, saved)
        return loss.detach()  # the loss at the perturbed point (the only one computed)

    def describe(self) -> dict:
        return {**super().describe(), "sigma": self.sigma}
