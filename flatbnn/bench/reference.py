"""Minimal loops of the reference implementations, for ``scripts/benchmark.py --reference`` only.

Written here from the documented algorithms (the papers, the official READMEs and issue threads), NOT
copied from the repositories -- none can be fetched from this machine. Each loop keeps the reference's
*cost structure* (per-tensor Python loops, a wrapper optimiser with first/second step, a growing
deviation matrix, ...), since that is what the timing compares; where we were unsure of a detail we
chose the cheaper variant, so "ours is faster than the reference" is never won by a handicapped reference.

* :class:`ReferenceSAM` -- davda54/sam's interface: a wrapper optimiser; ``first_step`` moves every
  parameter with a gradient by e_w = rho * g / (||g|| + 1e-12) (adaptive: e_w = rho * w^2 g /
  (||w g|| + 1e-12), the norm over all tensors, biases included), remembering the old weights;
  ``second_step`` puts the old weights back and steps the base optimiser (both take davda54's ``zero_grad``
  flag, default False). BatchNorm running statistics are frozen on the second pass by setting momentum to 0
  (the port's documented recipe). tests/test_sam_optimizer.py uses it as the oracle of ``flatbnn.SAMOptimizer``.
* :class:`ReferenceSWAG` -- swa_gaussian's SWAG: per parameter tensor a running mean, a running
  second moment and a deviation matrix to which each collection appends one row (dropping the
  oldest beyond ``max_num_models``); sampling: mean + sqrt(scale) (sqrt(var) z1 + D^T z2 /
  sqrt(K - 1)), var = max(E[w^2] - mean^2, 1e-30), K = ``max_num_models`` (the buffer size).
* :class:`ReferenceBSAM` -- the official bSAM update (Moellenhoff & Khan 2023, Alg. 1 with the
  M-way split): per part a noisy point w + n / sqrt(N s), its gradient g, the ascent from the MEAN
  w + rho g / s, the gradient there g_p and h = sqrt(s) |g|; g_p and h averaged over the parts;
  m <- b1 m + (1 - b1)(g_p + delta w), w <- w - lr m / s (old s), s <- b2 s + (1 - b2)(h + damping
  + delta); BatchNorm state from the first part. Written per tensor in PyTorch (the original is JAX).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The same mixed precision our engine uses, so both sides compute in the same precision."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


# ---------------------------------------------------------------------------------------------- SAM
class ReferenceSAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho: float = 0.05, adaptive: bool = False, **base_kwargs):
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **base_kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        self.param_groups = self.base_optimizer.param_groups  # schedulers see one set of groups

    @torch.no_grad()
    def _grad_norm(self) -> torch.Tensor:
        norms = [((p.abs() if group["adaptive"] else 1.0) * p.grad).norm(p=2)
                 for group in self.param_groups for p in group["params"] if p.grad is not None]
        return torch.stack(norms).norm(p=2)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.detach().clone()
                p.add_((p * p if group["adaptive"] else 1.0) * p.grad * scale)
        if zero_grad:
            self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad(set_to_none=True)


@contextmanager
def frozen_bn_stats(model: nn.Module):
    """BatchNorm momentum 0 inside: batch statistics are used, running statistics stay."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, mom in zip(bns, saved):
            m.momentum = mom


def reference_sam_step(model: nn.Module, optimizer: ReferenceSAM, x, y, dtype=None) -> torch.Tensor:
    """One training step of the reference SAM loop; returns the first-pass loss."""
    with autocast(x.device, dtype):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.first_step(zero_grad=True)
    with frozen_bn_stats(model):
        with autocast(x.device, dtype):
            second = F.cross_entropy(model(x).float(), y)
        second.backward()
    optimizer.second_step(zero_grad=True)
    return loss.detach()


def reference_sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, x, y, dtype=None) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    with autocast(x.device, dtype):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


# --------------------------------------------------------------------------------------------- SWAG
class ReferenceSWAG:
    def __init__(self, params, max_num_models: int = 20, no_cov_mat: bool = False):
        self.params = [p for p in params]
        self.max_num_models = int(max_num_models)
        self.no_cov_mat = no_cov_mat
        self.n_models = 0
        self.mean = [torch.zeros_like(p) for p in self.params]
        self.sq_mean = [torch.zeros_like(p) for p in self.params]
        self.cov_mat_sqrt = [p.new_zeros((0, p.numel())) for p in self.params]

    @torch.no_grad()
    def collect_model(self) -> None:
        n = self.n_models
        for i, p in enumerate(self.params):
            w = p.detach()
            self.mean[i] = self.mean[i] * n / (n + 1.0) + w / (n + 1.0)
            self.sq_mean[i] = self.sq_mean[i] * n / (n + 1.0) + w * w / (n + 1.0)
            if not self.no_cov_mat:
                dev = (w - self.mean[i]).reshape(1, -1)  # from the mean updated first
                cov = torch.cat((self.cov_mat_sqrt[i], dev), dim=0)
                if cov.shape[0] > self.max_num_models:
                    cov = cov[1:]
                self.cov_mat_sqrt[i] = cov
        self.n_models += 1

    @torch.no_grad()
    def sample(self, scale: float = 0.5, cov: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
        """A flat weight vector (parameters in order)."""
        mean = torch.cat([m.reshape(-1) for m in self.mean])
        sq_mean = torch.cat([m.reshape(-1) for m in self.sq_mean])
        var = torch.clamp(sq_mean - mean ** 2, min=1e-30)
        rand = var.sqrt() * torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        if cov and not self.no_cov_mat:
            d = torch.cat(self.cov_mat_sqrt, dim=1)
            z2 = torch.randn(d.shape[0], generator=generator, device=d.device, dtype=d.dtype)
            rand = rand + d.t().matmul(z2) / math.sqrt(self.max_num_models - 1)
        return mean + math.sqrt(scale) * rand


# --------------------------------------------------------------------------------------------- bSAM
class ReferenceBSAM:
    def __init__(self, model: nn.Module, lr: float = 0.5, betas=(0.9, 0.999), rho: float = 0.01,
                 prior_precision: float = 40.0, n_data: float = 50_000.0, damping: float = 0.1,
                 s_init: float = 1.0, m: int = 8, generator: torch.Generator | None = None):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.lr, self.betas, self.rho, self.m = lr, betas, rho, int(m)
        self.n_data, self.damping = float(n_data), damping
        self.delta = prior_precision / self.n_data
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.precision = [torch.full_like(p, s_init) for p in self.params]
        self.generator = generator
        self._bn = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def _grads(self, x, y, dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with autocast(x.device, dtype):
            loss = F.cross_entropy(self.model(x).float(), y)
        return loss.detach(), list(torch.autograd.grad(loss, self.params))

    def step(self, x, y, dtype=None) -> torch.Tensor:
        parts = list(zip(torch.tensor_split(x, self.m), torch.tensor_split(y, self.m)))
        with torch.no_grad():
            mean = [p.detach().clone() for p in self.params]
        g_p = [torch.zeros_like(p) for p in self.params]
        h = [torch.zeros_like(p) for p in self.params]
        bn_state = None
        loss_sum = 0.0
        # the noise of all parts in one draw [parts, P] (row k: part k, split into the tensors in order): the order
        # flatbnn's bSAM draws in since issue 52, so the two see the same noise (the official code draws per tensor)
        sizes = [p.numel() for p in self.params]
        draws = torch.randn(len(parts), sum(sizes), generator=self.generator, device=mean[0].device,
                            dtype=mean[0].dtype)
        for k, (xk, yk) in enumerate(parts):
            with torch.no_grad():
                for p, w, s, noise in zip(self.params, mean, self.precision, draws[k].split(sizes)):
                    p.copy_(w + noise.view(p.shape) * torch.sqrt(1.0 / (self.n_data * s)))
            loss, g = self._grads(xk, yk, dtype)
            with torch.no_grad():
                for p, w, gi, s in zip(self.params, mean, g, self.precision):
                    p.copy_(w + self.rho * gi / s)
            _, gp = self._grads(xk, yk, dtype)
            with torch.no_grad():
                for acc, gi in zip(g_p, gp):
                    acc.add_(gi / self.m)
                for acc, gi, s in zip(h, g, self.precision):
                    acc.add_(torch.sqrt(s) * gi.abs() / self.m)
            if k == 0:  # the first part's BatchNorm state is the one kept
                bn_state = [{n: b.clone() for n, b in bn.named_buffers(recurse=False)} for bn in self._bn]
            loss_sum = loss_sum + loss / self.m
        with torch.no_grad():
            for bn, saved in zip(self._bn, bn_state or []):
                for n, b in bn.named_buffers(recurse=False):
                    b.copy_(saved[n])
            b1, b2 = self.betas
            for p, w, m, s, gpi, hi in zip(self.params, mean, self.momentum, self.precision, g_p, h):
                m.mul_(b1).add_((1 - b1) * (gpi + self.delta * w))
                p.copy_(w - self.lr * m / s)  # the old s
                s.mul_(b2).add_((1 - b2) * (hi + self.damping + self.delta))
        return loss_sum
