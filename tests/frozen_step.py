"""Frozen copies of the step code as it was before the capturable rewrites (issue 33, commit 8e4a55e), so that
tests/test_capturable_step.py can check that every rewrite gives the same bits. Do not "fix" or modernise these:
they are the reference. Each class overrides only the rewritten methods of today's class."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import ASAM, SAM, FisherSAM, Geometry, RandomSAM
from flatbnn.flatness.base import scaled
from flatbnn.methods.bsam import BSAM
from flatbnn.methods.rsam import RandomSAMMethod
from flatbnn.methods.sgvb import SGVB


def old_global_norm(tensors):
    if not tensors:
        return torch.zeros(())
    if any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors):
        tensors = [t.float() for t in tensors]
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(tensors))))


class OldBackprop(Backprop):
    @torch.no_grad()
    def unscaled_grads(self, params):
        inv = 1.0 / self.scaler.get_scale() if self.scaler is not None else None
        out = []
        for p in params:
            g = torch.zeros_like(p) if p.grad is None else p.grad
            out.append(g * inv if inv is not None else g)
        return out

    @contextmanager
    def bn_updates(self, enabled: bool):
        if enabled or not self._bn:
            yield
            return
        saved = [(m, {k: b.clone() for k, b in m.named_buffers(recurse=False)}) for m in self._bn]
        try:
            yield
        finally:
            with torch.no_grad():
                for m, bufs in saved:
                    for k, b in m.named_buffers(recurse=False):
                        b.copy_(bufs[k])


class _OldSAMPasses:
    @torch.no_grad()
    def perturbation(self, params, grads, scaling=None, names=None, perturb=None):
        idx = [i for i in range(len(params)) if perturb is None or perturb[i]]
        sub = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        numer, norm_terms = self.direction(sub(params), sub(grads), sub(scaling), sub(names))
        norm = old_global_norm(norm_terms)
        eps = [torch.zeros_like(p) for p in params]
        finite = torch.isfinite(norm)
        factor = torch.where(finite, self.radius / (norm + self.eps), torch.zeros_like(norm))
        for i, n in zip(idx, torch._foreach_mul(numer, factor)):
            eps[i] = torch.where(finite, n, torch.zeros_like(n)).to(params[i].dtype)
        return eps

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
        with torch.no_grad():
            saved = torch._foreach_mul(params, 1.0)
            torch._foreach_add_(params, eps)
            for p, g in zip(params, accumulated):
                p.grad = g
        if rng is not None:
            backprop.set_rng_state(rng)
        with (nullcontext() if sync else backprop.no_sync()), \
                backprop.bn_updates(self._bn_pass(("second", "both"))):
            backprop.backward(scaled(backprop.forward(loss_fn, chunk), share))
        with torch.no_grad():
            torch._foreach_copy_(params, saved)
        self._chunk_index += 1
        return loss.detach()


class OldSAM(_OldSAMPasses, SAM):
    pass


class OldASAM(_OldSAMPasses, ASAM):
    pass


class OldFisherSAM(_OldSAMPasses, FisherSAM):
    pass


class OldGeometry(_OldSAMPasses, Geometry):
    pass


class OldRandomSAM(RandomSAM):
    @torch.no_grad()
    def perturbation(self, params, perturb=None):
        perturb = perturb or [True] * len(params)
        std = self.std(params, perturb)
        return [torch.randn(p.shape, generator=self.generator, device=p.device, dtype=p.dtype) * std
                if on else torch.zeros_like(p) for p, on in zip(params, perturb)]

    def chunk_gradient(self, params, names, loss_fn, chunk, backprop, scaling, perturb, *, share, sync):
        eps = self.perturbation(params, perturb)
        with torch.no_grad():
            saved = torch._foreach_mul(params, 1.0)
            torch._foreach_add_(params, eps)
        with nullcontext() if sync else backprop.no_sync():
            loss = backprop.forward(loss_fn, chunk)
            backprop.backward(scaled(loss, share))
        with torch.no_grad():
            torch._foreach_copy_(params, saved)
        return loss.detach()


class OldSGVB(SGVB):
    def add_kl_gradient(self, backprop):
        params = [p for pair in self.pairs for p in pair]
        with torch.enable_grad():
            term = self.kl_term()
            grads = torch.autograd.grad(term, params)
        scale = backprop.scaler.get_scale() if getattr(backprop, "scaler", None) is not None else 1.0
        with torch.no_grad():
            for p, g in zip(params, grads):
                g = g if scale == 1.0 else g * scale
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
        return float(term.detach())


class OldRandomSAMMethod(RandomSAMMethod):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.perturbation = OldRandomSAM(rho=self.perturbation.rho, sigma=self.perturbation.sigma)

    def train_step(self, batch, flatness, backprop):
        self.check_flatness(flatness)
        self.optimizer.zero_grad(set_to_none=True)
        self._record = True
        loss = self.perturbation.gradient(self.named_parameters(), self.loss_fn, batch, backprop)
        if self.prior_coef:
            scale = backprop.scaler.get_scale() if getattr(backprop, "scaler", None) is not None else 1.0
            with torch.no_grad():
                for p in self.parameters():
                    if p.grad is not None:
                        p.grad.add_(p, alpha=self.prior_coef * scale)
        backprop.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": loss}


class OldBSAM(BSAM):
    """Only the fp16 branches changed (the host-side finiteness checks)."""

    def train_step(self, batch, flatness, backprop):
        from flatbnn.flatness.base import split_batch
        from flatbnn.methods.diag_gaussian import batch_size

        self.check_flatness(flatness)
        opt = self.optimizer
        params = opt.params()
        chunks = split_batch(batch, min(self.m, batch_size(batch)))
        with torch.no_grad():
            mean = [p.detach().clone() for p in params]
        g_p = [torch.zeros_like(p) for p in params]
        h = [torch.zeros_like(p) for p in params]
        loss_sum = torch.zeros((), device=mean[0].device)
        try:
            for k, (chunk, share) in enumerate(chunks):
                first = k == 0
                # the one change to this frozen copy (issue 52): the noise of all parts comes from one draw, as today's
                # step draws it (tests here compare the fp16 branches, not the noise stream)
                if k == 0:
                    draws = self.noise_parts(len(chunks), params) if self.noise else None
                noise = None if draws is None else [d.view(p.shape) for d, p in zip(
                    draws[k].split([p.numel() for p in params]), params)]
                with torch.no_grad():
                    self._assign(params, mean if noise is None else torch._foreach_add(mean, noise))
                self._record = True
                loss, g = self._grad(params, chunk, backprop, first and self.bn_stats in ("first", "both"))
                ascent, curv = old_bsam_ascent(opt, g), old_bsam_curvature(opt, g)
                if backprop.scaler is not None and not all(torch.isfinite(a).all() for a in ascent):
                    ascent = [torch.zeros_like(a) for a in ascent]
                with torch.no_grad():
                    self._assign(params, torch._foreach_add(mean, ascent))
                _, gp = self._grad(params, chunk, backprop, first and self.bn_stats in ("second", "both"))
                with torch.no_grad():
                    torch._foreach_add_(g_p, gp, alpha=share)
                    torch._foreach_add_(h, curv, alpha=share)
                loss_sum = loss_sum + loss.float() * share
        finally:
            self._assign(params, mean)
        g_p = self._all_reduce(g_p)
        h = self._all_reduce(h)
        if backprop.scaler is not None and not all(torch.isfinite(t).all() for t in g_p + h):
            backprop.scaler.update(new_scale=backprop.scaler.get_scale() * backprop.scaler.get_backoff_factor())
        else:
            self.apply_update(params, g_p, h, backprop)
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": loss_sum}


@torch.no_grad()
def old_bsam_ascent(opt, grads):
    """BSAMOptimizer.ascent before the per-step scales: rho * g / s, the official code's order."""
    rho_g = torch._foreach_mul(list(grads), [group["rho"] for _, group in opt._groups()])
    return torch._foreach_div(rho_g, opt.precisions())


@torch.no_grad()
def old_bsam_curvature(opt, grads):
    """BSAMOptimizer.curvature before sqrt(s) was taken once a step: sqrt(s * g * g) per part."""
    grads = list(grads)
    sg = torch._foreach_mul(opt.precisions(), grads)
    torch._foreach_mul_(sg, grads)
    torch._foreach_sqrt_(sg)
    return sg


@torch.no_grad()
def old_precision_step(opt, curvature):
    """PrecisionOptimizer.step per tensor (BSAMOptimizer / VOGNOptimizer), as before the foreach form."""
    from flatbnn.optim.bsam import BSAMOptimizer

    for (p, group), h in zip(opt._groups(), list(curvature), strict=True):
        state = opt._init_state(p, group)
        delta = opt.delta(group)
        m, s = state["momentum"], state["precision"]
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        m.mul_(group["betas"][0]).add_(g + delta * p, alpha=1.0 - group["betas"][0])
        if isinstance(opt, BSAMOptimizer):
            p.addcdiv_(m, s, value=-group["lr"])
            s.mul_(group["betas"][1]).add_(h + (group["damping"] + delta), alpha=1.0 - group["betas"][1])
        else:
            s.mul_(group["betas"][1]).add_(h, alpha=1.0 - group["betas"][1])
            p.addcdiv_(m, s + (delta + group["damping"]), value=-group["lr"])
