"""Sharpness-Aware Minimisation (Foret et al., ICLR 2021) -- the perturbation lives here.

Per step:  g = grad L(w);  eps = rho * D g / ||D g||  (D = I for SAM);  take grad L(w + eps);
restore w; the method steps with that gradient *at w*.

Design choices (see PITFALLS.md):
* every parameter with a gradient is perturbed (biases and norm layers included) with one global
  L2 norm, as in the JAX original and the flat_seeking_bnn code; subclasses (ASAM, Fisher-SAM)
  override :meth:`direction` only;
* weights are restored by copy, not by subtracting eps, so rho = 0 reproduces the base optimiser
  bit for bit;
* BatchNorm running statistics are updated on the first pass only by default (``bn_stats``);
* the second pass replays the first pass's RNG state (``same_noise``) so dropout masks match and
  rho = 0 is exactly the base step;
* under DDP the ascent pass runs inside ``no_sync()`` (forward *and* backward), i.e. each worker
  perturbs with its own gradient (m-sharpness per worker); ``sync_ascent=true`` all-reduces it;
* with fp16 the ascent gradient is unscaled before its norm is taken; a non-finite ascent
  gradient gives eps = 0 (the GradScaler then skips the step if the second pass overflows too).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import torch

from flatbnn.flatness.base import Flatness

BN_POLICIES = ("first", "second", "both", "none")


class SAM(Flatness):
    name = "sam"
    passes = 2

    def __init__(
        self,
        rho: float = 0.05,
        bn_stats: str = "first",
        same_noise: bool = True,
        sync_ascent: bool = False,
        eps: float = 1e-12,
    ):
        if rho < 0:
            raise ValueError(f"flatness.rho must be >= 0, got {rho}")
        if bn_stats not in BN_POLICIES:
            raise ValueError(f"flatness.bn_stats must be one of {BN_POLICIES}, got {bn_stats!r}")
        self.rho = float(rho)
        self.bn_stats = bn_stats
        self.same_noise = same_noise
        self.sync_ascent = sync_ascent
        self.eps = eps

    # ------------------------------------------------------------------ the perturbation
    def direction(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  scaling: Sequence[torch.Tensor] | None):
        """Unnormalised ascent direction and the vector whose norm normalises it.

        SAM: D = I, or the method's per-parameter scaling (e.g. geometry diag(|mu|/sigma)).
        Returns ``(numerators, norm_terms)``; eps = rho * numerator / ||norm_terms||.
        """
        if scaling is None:
            return list(grads), list(grads)
        scaled = [s * g for s, g in zip(scaling, grads)]
        return scaled, scaled

    @torch.no_grad()
    def perturbation(self, params, grads, scaling=None) -> list[torch.Tensor]:
        numer, norm_terms = self.direction(params, grads, scaling)
        # half-precision gradients are normed in fp32 (their squares overflow); fp64 stays fp64
        norm = torch.linalg.vector_norm(torch.stack([
            torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32))
            for t in norm_terms]))
        if not torch.isfinite(norm):
            return [torch.zeros_like(p) for p in params]
        scale = self.rho / (norm + self.eps)
        return [(n * scale).to(p.dtype) for n, p in zip(numer, params)]

    # ------------------------------------------------------------------ the two passes
    def gradient(self, params, loss_fn, batch, backprop, scaling=None):
        params = [p for p in params if p.requires_grad]
        rng = backprop.rng_state() if self.same_noise else None
        sync = nullcontext() if self.sync_ascent else backprop.no_sync()
        with sync, backprop.bn_updates(self.bn_stats in ("first", "both")):
            loss = backprop.forward(loss_fn, batch)
            backprop.backward(loss)
        grads = backprop.unscaled_grads(params)
        eps = self.perturbation(params, grads, scaling)

        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            for p, e in zip(params, eps):
                p.add_(e)
                p.grad = None
        if rng is not None:
            backprop.set_rng_state(rng)
        with backprop.bn_updates(self.bn_stats in ("second", "both")):
            backprop.backward(backprop.forward(loss_fn, batch))
        with torch.no_grad():
            for p, w in zip(params, saved):
                p.copy_(w)
        return loss.detach()

    def describe(self) -> dict:
        return {"name": self.name, "rho": self.rho, "bn_stats": self.bn_stats,
                "sync_ascent": self.sync_ascent}
