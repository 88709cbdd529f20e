"""Sharpness-Aware Minimisation (Foret et al., ICLR 2021) -- the perturbation lives here.

Per step:  g = grad L(w);  eps = rho * D g / ||D g||  (D = I for SAM);  take grad L(w + eps);
restore w; the method steps with that gradient *at w*. ASAM, Fisher-SAM and geometry subclass
this and override :meth:`direction` only.

Design choices (each against a failure reported for other SAM implementations, e.g. davda54/sam#17, #30:
BatchNorm updated twice; #78: DDP all-reducing the ascent gradient; #80: rho = 0 not the base optimiser):
* every parameter with a gradient is perturbed (biases and norm layers included) with one global
  L2 norm, as in the JAX original and the flat_seeking_bnn code;
* weights are restored by copy, not by subtracting eps, so rho = 0 reproduces the base optimiser
  bit for bit;
* BatchNorm running statistics are updated on the first pass only by default (``bn_stats``);
  under m-sharpness ``bn_chunks`` says which chunks may update them: ``all`` (default) or
  ``first`` -- the official bSAM code's SAM threads the BN state through both passes of every
  sub-batch and keeps the first sub-batch's (``bn_stats=both bn_chunks=first``);
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

from flatbnn.flatness.base import Flatness, scaled

BN_POLICIES = ("first", "second", "both", "none")
BN_CHUNK_POLICIES = ("all", "first")


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of a list of tensors; half precision is normed in fp32 (squares overflow), fp64 stays."""
    if not tensors:
        return torch.zeros(())
    if any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors):
        tensors = [t.float() for t in tensors]
    # one fused kernel per dtype/device group instead of one per tensor (matters for 100s of tensors)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(tensors))))


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A device bool: every element of every tensor is finite (the max-abs per tensor: inf or NaN stays so,
    and unlike a 2-norm it never overflows on finite values). No host read."""
    return torch.isfinite(torch.stack(torch._foreach_norm(list(tensors), ord=float("inf")))).all()


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
        m: int = 1,
        rho_schedule: str = "constant",
        bn_chunks: str = "all",
        batched_chunks: bool = False,
    ):
        super().__init__(rho=rho, m=m, rho_schedule=rho_schedule)
        self.batched_chunks = bool(batched_chunks)
        # batched_chunks: which algorithm the first batched step found usable (flatbnn/flatness/batched.py);
        # None until then. Recorded in describe(), so a run says which path made its steps
        self.chunk_algorithm: str | None = None
        if bn_stats not in BN_POLICIES:
            raise ValueError(f"flatness.bn_stats must be one of {BN_POLICIES}, got {bn_stats!r}")
        if bn_chunks not in BN_CHUNK_POLICIES:
            raise ValueError(f"flatness.bn_chunks must be one of {BN_CHUNK_POLICIES}, got {bn_chunks!r}")
        self.bn_stats = bn_stats
        self.bn_chunks = bn_chunks
        self._chunk_index = 0
        self.same_noise = same_noise
        self.sync_ascent = sync_ascent
        self.eps = eps

    # ------------------------------------------------------------------ the perturbation
    def direction(self, params, grads, scaling, names):
        """Unnormalised ascent direction and the vector whose norm normalises it.

        SAM: D = I, or the method's per-parameter scaling (e.g. geometry diag(|mu|/sigma)).
        Returns ``(numerators, norm_terms)``; eps = rho * numerator / ||norm_terms||.
        """
        if scaling is None:
            return list(grads), list(grads)
        d = torch._foreach_mul(list(scaling), list(grads))
        return d, d

    @torch.no_grad()
    def perturbation(self, params, grads, scaling=None, names=None, perturb=None) -> list[torch.Tensor]:
        """eps for every parameter (zeros where ``perturb`` is False).

        The scaling acts on ONE flat vector (one multiply, one ``where``) instead of two kernels per tensor: the
        same element-wise products, so the same bits as per tensor (tests/test_capturable_step.py)."""
        idx = [i for i in range(len(params)) if perturb is None or perturb[i]]
        sub = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        numer, norm_terms = self.direction(sub(params), sub(grads), sub(scaling), sub(names))
        norm = global_norm(norm_terms)
        # a non-finite gradient gives no ascent (eps = 0); decided on the device, since `if` on a tensor is a
        # host sync every step. torch.where, not a zero factor: inf * 0 is NaN. reciprocal * radius is what
        # `float / tensor` computes (Tensor.__rtruediv__); the radius is a device tensor (CUDA graphs)
        finite = torch.isfinite(norm)
        radius = self.radius_tensor(norm.device).to(norm.dtype)
        factor = torch.where(finite, torch.reciprocal(norm + self.eps) * radius, torch.zeros_like(norm))
        eps: list[torch.Tensor | None] = [None] * len(params)
        if numer and all(n.dtype == params[i].dtype for n, i in zip(numer, idx)) \
                and len({n.dtype for n in numer}) == 1:
            flat = torch.cat([n.reshape(-1) for n in numer])
            flat = torch.where(finite, flat * factor, 0.0)
            for i, e in zip(idx, flat.split([n.numel() for n in numer])):
                eps[i] = e.view(params[i].shape)
        else:  # mixed dtypes (never in a run: params share one dtype): per tensor, cast to each parameter's
            for i, n in zip(idx, torch._foreach_mul(numer, factor)):
                eps[i] = torch.where(finite, n, torch.zeros_like(n)).to(params[i].dtype)
        return [torch.zeros_like(p) if e is None else e for p, e in zip(params, eps)]

    @torch.no_grad()
    def move(self, params, eps, perturb=None) -> None:
        """w -> w + eps on the parameters ``perturb`` marks (all when None), keeping w for :meth:`restore`. Shared by
        the two-pass step below and davda54/sam's first_step (``flatbnn.optim.sam_optimizer.SAMOptimizer``)."""
        torch._foreach_copy_(self.saved_buffers(params), params)  # restoring by copy keeps rho=0 exact
        moved = [i for i in range(len(params)) if perturb is None or perturb[i]]
        torch._foreach_add_([params[i] for i in moved], [eps[i] for i in moved])

    @torch.no_grad()
    def restore(self, params) -> None:
        """Back to the w that the last :meth:`move` of these ``params`` kept, bit for bit."""
        torch._foreach_copy_(params, self._saved)

    # ------------------------------------------------------------------ the two passes
    def gradient(self, params, loss_fn, batch, backprop, scaling=None, perturb=None) -> torch.Tensor:
        self._chunk_index = 0  # chunk_gradient counts the m-sharpness chunks of this step (bn_chunks)
        if self.batched_chunks and self.m > 1 and batch[0].shape[0] % self.m == 0:
            # (a short last batch that m does not divide takes the loop below: its exact step)
            from flatbnn.flatness.batched import batched_sam_gradient
            owner = getattr(loss_fn, "__self__", None)  # the method whose loss this is (Method.has_plain_loss)
            return batched_sam_gradient(self, params, loss_fn, batch, backprop, scaling, perturb,
                                        plain_sam=type(self).direction is SAM.direction,
                                        plain_loss=bool(getattr(owner, "has_plain_loss", False)))
        return super().gradient(params, loss_fn, batch, backprop, scaling=scaling, perturb=perturb)

    def _bn_pass(self, passes: tuple[str, ...]) -> bool:
        """Whether this pass of the current chunk updates BatchNorm running statistics."""
        return self.bn_stats in passes and (self.bn_chunks == "all" or self._chunk_index == 0)

    def chunk_gradient(self, params, names, loss_fn, chunk, backprop, scaling, perturb, *, share, sync):
        accumulated = [p.grad for p in params]
        for p in params:
            p.grad = None
        rng = backprop.rng_state() if self.same_noise else None
        with (nullcontext() if self.sync_ascent else backprop.no_sync()), \
                backprop.bn_updates(self._bn_pass(("first", "both"))):
            loss = backprop.forward(loss_fn, chunk)
            backprop.backward(loss)
        grads = backprop.unscaled_grads(params)
        eps = self.perturbation(params, grads, scaling, names, perturb)

        self.move(params, eps, perturb)
        with torch.no_grad():
            for p, g in zip(params, accumulated):
                p.grad = g  # the second pass accumulates onto earlier chunks' gradients
        if rng is not None:
            backprop.set_rng_state(rng)
        with (nullcontext() if sync else backprop.no_sync()), \
                backprop.bn_updates(self._bn_pass(("second", "both"))):
            backprop.backward(scaled(backprop.forward(loss_fn, chunk), share))
        self.restore(params)
        self._chunk_index += 1
        return loss.detach()

    def describe(self) -> dict:
        d = {**super().describe(), "bn_stats": self.bn_stats, "bn_chunks": self.bn_chunks,
             "sync_ascent": self.sync_ascent, "effective_m": self.effective_m}
        if self.batched_chunks:  # a speed switch (the same step up to float rounding): recorded only when on
            d["batched_chunks"] = True
            if self.chunk_algorithm is not None:
                d["chunk_algorithm"] = self.chunk_algorithm
        return d

    @property
    def effective_m(self) -> int:
        """How many independent ascents a global batch gets: m per process, times the processes unless the
        ascent gradient is all-reduced (sync_ascent) -- k GPUs under no_sync() turn SAM into m-sharpness, m = k."""
        return self.m * (1 if self.sync_ascent else self.world_size)
