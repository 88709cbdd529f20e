"""SAM's m-sharpness on a network whose parameters are all ``nn.Linear`` weights and biases (the MNIST MLP), in two
passes over the whole batch and without forming any chunk's gradient or moved weights (issue 52: the loop's 2m small
passes cost 8.5x an SGD step on a CPU, the vmap path 13x; this path ~2.5x).

For a Linear layer with input rows ``a`` and output gradients ``d`` (one row per example), chunk k's gradient is
``g_k(W) = d_k^T a_k`` and ``g_k(b) = sum_i d_k,i``: a rank-(chunk size) matrix. So, with ``c_k = rho / ||g_k||``:

* ``||g_k||^2`` is, summed over layers, ``sum((a_k a_k^T) * (d_k d_k^T)) + ||sum_i d_k,i||^2`` -- chunk-size^2 Grams
  instead of the m x P gradients (the per-example-norm trick of Goodfellow 2015, per chunk);
* the moved layer's output on the second pass's input ``x_k`` is ``x_k (W + eps_k)^T + b + eps_b,k``
  ``= x_k W^T + b + c_k ((x_k a_k^T) d_k + sum_i d_k,i)``: one GEMM of the whole batch at W plus two small batched
  products per layer, added by a forward hook;
* the second pass's weight gradient at the moved weights, summed over chunks, is then one backward of the whole batch
  (eps_k is a constant, as in SAM).

The first pass needs the output gradients only (no weight-gradient GEMMs). The values are the loop's up to the order
of the sums (~1e-15 relative in float64; tests/test_low_rank_sam.py). ``flatness.batched_chunks=true`` takes this path
wherever it applies (flatbnn/flatness/batched.py) and the vmap path elsewhere; the run's describe() names which.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class _Taps:
    """Forward hooks on the layers: ``record`` keeps each layer's input (detached) and output (for its gradient) and
    counts the calls; ``moved`` adds the chunk's low-rank perturbation term to each output."""

    def __init__(self, layers, m: int):
        self.layers, self.m = layers, m
        self.inputs: dict[nn.Module, torch.Tensor] = {}
        self.outputs: dict[nn.Module, tuple[torch.Tensor, int]] = {}
        self.calls = dict.fromkeys(layers, 0)
        self.terms: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}  # moved()

    def record(self, mod, inputs, out):
        self.calls[mod] += 1
        self.inputs[mod] = inputs[0].detach()
        self.outputs[mod] = (out, out._version)  # an in-place op on it later (ReLU(inplace=True)) is refused

    def moved(self, mod, inputs, out):
        a, d, one = self.terms[mod]  # [m, b, in] first-pass inputs, [m, b, out] c_k d_k, 1 (a bias) or None
        x, at = inputs[0].reshape(self.m, -1, inputs[0].shape[-1]), a.mT
        gram = torch.bmm(x, at) if one is None else torch.baddbmm(one, x, at)
        return out + torch.bmm(gram, d).view(out.shape)

    def usable(self, rows: int) -> bool:
        """Every layer called once on [rows, features] and its output left as it was (not modified in place)."""
        return all(self.calls[mod] == 1 and self.inputs[mod].dim() == 2 and self.inputs[mod].shape[0] == rows
                   and self.outputs[mod][0]._version == self.outputs[mod][1] for mod in self.layers)

    @contextmanager
    def hooked(self, hook):
        handles = [mod.register_forward_hook(hook) for mod in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def low_rank_sam_gradient(flatness, layers, params, module, owner, xs, ys, backprop, parts_losses):
    """Leave sum_k g'_k / m in ``p.grad`` and return the mean first-pass loss, or None (nothing touched but the first
    forward) where a layer was not called exactly once on [batch, features] rows: weight sharing or sequence inputs,
    which the caller sends down the vmap path. ``xs``, ``ys``: the batch as [m, b, ...] chunks."""
    m, b = xs.shape[0], xs.shape[1]
    x, y = xs.reshape(m * b, *xs.shape[2:]), ys
    criterion, smoothing = owner.ctx.criterion, owner.ctx.label_smoothing
    taps = _Taps(layers, m)
    with torch.enable_grad(), taps.hooked(taps.record):
        logits = backprop.forward(module, x)
        losses = parts_losses(logits.view(m, b, *logits.shape[1:]), y, criterion, smoothing)
    if not taps.usable(m * b):
        return None
    deltas = torch.autograd.grad(losses.sum(), [taps.outputs[mod][0] for mod in layers])
    with torch.no_grad():
        # the norm and the scaled d in float32 at least: under bf16 autocast the rows are bf16 (and of mixed dtypes:
        # the first layer's input is the float32 batch); float64 stays float64
        wide = lambda t: t if t.dtype in (torch.float32, torch.float64) else t.float()  # noqa: E731
        inputs = [taps.inputs[mod].view(m, b, -1) for mod in layers]
        deltas = [wide(d).view(m, b, -1) for d in deltas]
        # a bias is a weight on a constant input 1: its Gram term is the all-ones matrix, added by baddbmm
        one = torch.ones((1, 1, 1), dtype=deltas[0].dtype, device=deltas[0].device)
        input_grams = [torch.bmm(a, a.mT) if mod.bias is None else torch.baddbmm(one, a, a.mT)
                       for mod, a in zip(layers, (wide(a).to(one.dtype) for a in inputs))]
        # ||g_k||^2 = sum over layers of <a_k a_k^T (+ 1), d_k d_k^T>: one multi-tensor multiply, one sum
        products = torch._foreach_mul(input_grams, [torch.bmm(d, d.mT) for d in deltas])
        sq = torch.cat([t.view(m, -1) for t in products], dim=1).sum(1)
        norm = sq.clamp_min(0).sqrt()  # a sum of products of two PSD Grams: >= 0 but for rounding
        radius = flatness.radius_tensor(norm.device).to(norm.dtype)
        # c_k = rho / (||g_k|| + eps), 0 for a non-finite chunk (torch.where: inf * 0 is NaN). A non-finite chunk's
        # d_k has an inf or NaN, so its term is NaN where the loop's eps_k is 0; either way the step's gradient is
        # not finite (the second pass at w meets the same inf), and no batched precision scales the loss (fp16)
        c = torch.where(norm < float("inf"), torch.reciprocal(norm + flatness.eps) * radius, 0.0).view(m, 1, 1)
        # c_k d_k for every layer at once: one [m, b, sum of widths] tensor, views per layer
        scaled = torch.cat(deltas, dim=2).mul_(c).split([d.shape[2] for d in deltas], dim=2)
        for mod, a, d in zip(layers, inputs, scaled):
            taps.terms[mod] = (a, d.to(a.dtype), None if mod.bias is None else one.to(a.dtype))
    with torch.enable_grad(), taps.hooked(taps.moved):
        moved = backprop.forward(module, x)
        loss2 = parts_losses(moved.view(m, b, *moved.shape[1:]), y, criterion, smoothing).sum() / m
    grads = torch.autograd.grad(loss2, params)
    with torch.no_grad():
        leave_step(params, grads, owner, logits[:b].detach(), ys[0])
    return losses.detach().sum() / m


def leave_step(params, grads, owner, logits0, y0) -> None:
    """Both batched paths' end: the step's gradient into ``p.grad`` (added to earlier chunks', as the loop does) and
    the train accuracy on chunk 0's first pass (the loop counts it there too)."""
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.to(p.dtype)
        else:
            p.grad.add_(g)
    if owner._record:
        owner.count_correct(logits0, y0)
        owner._seen += y0.numel()
        owner._record = False
