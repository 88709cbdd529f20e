"""A network of ``nn.Linear`` layers (the MNIST MLP) run on m parts of a batch at once, part k at its own weights, in
one forward and one backward -- bSAM's and VOGN's m-sharpness step without m small passes or ``torch.func.vmap``
(issue 52: on one CPU thread the vmap path cost bSAM 2x its loop).

The batch's rows are part-major (rows k b .. (k + 1) b - 1 are part k, as ``split_batch`` cuts them) and every module
but the Linear layers sees them as one batch of m b rows (ReLU, ELU, Flatten, the loss: per-row work). Each Linear is
swapped (``parts_weights``) for a Function that multiplies part k's rows by part k's weights (one ``baddbmm``), and
whose backward gives, as the gradients of extra inputs, what a method asks for:

* ``w_parts`` requiring grad: each part's own weight gradient d_k^T a_k ([m, out, in]; bSAM's first pass);
* a "sum" phantom (a zero of the weight's shape): sum_k d_k^T a_k = d^T a, ONE GEMM over all rows -- the parts'
  gradients summed without forming any of them (VOGN, bSAM's second pass);
* a "square" phantom: sum_i (d_i a_i^T)^2 = (d^2)^T (a^2), the sum of squared per-example gradients
  (flatbnn/nn/sum_grad_squared.py's rule, here over every part's rows at once: VOGN's h).

d is the output gradient of the loss the caller differentiates (sum over parts of each part's mean loss: d carries
1 / b). The values are the loop's up to the order of float sums (tests/test_parts_linear.py). Which networks qualify
(``row_linear_layers``): every trainable parameter a Linear's, each Linear run once per forward on [rows, features]
(a probe forward says so before the first step; the others take the vmap path). ``NotPartRows`` guards the same in
every forward.

What it costs (MNIST MLP 784-500-300-10, batch 200, m = 8, one CPU thread): a per-part product of the first layer
runs at ~2.6 ms against 1.6 ms for the same FLOPs as one batch-200 GEMM (each part reads its own weights), so bSAM's
step (two passes at per-part weights, each part's gradient formed once) stays above the issue's floor of 2 SGD steps +
the noise; VOGN (one pass, sums only) reaches its floor's 1.3x (results/bench/cpu-2026-11-29-mnist-mlp-b200-partslinear.md).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from flatbnn.nn.sum_grad_squared import square_sum_rows


class NotPartRows(RuntimeError):
    """A Linear layer ran on inputs this path does not cover (not [m b, features] rows, or twice in one forward)."""


class _PartsLinear(torch.autograd.Function):
    """y[k b + i] = x[k b + i] w_parts[k]^T + b_parts[k]; backward: x's gradient, each part's weight gradient (for
    w_parts / b_parts), their sum (for the sum phantoms) and the sums of squared per-row gradients (the square
    phantoms), each only where asked for."""

    @staticmethod
    def forward(x, w_parts, b_parts, w_sum, b_sum, w_sq, b_sq):
        m = w_parts.shape[0]
        rows = x.view(m, -1, x.shape[-1])
        out = torch.bmm(rows, w_parts.mT) if b_parts is None else torch.baddbmm(b_parts.unsqueeze(1), rows,
                                                                                 w_parts.mT)
        return out.view(x.shape[0], -1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w_parts, b_parts = inputs[:3]
        ctx.save_for_backward(x, w_parts)
        ctx.has_bias = b_parts is not None

    @staticmethod
    def backward(ctx, grad):
        x, w_parts = ctx.saved_tensors
        need = ctx.needs_input_grad
        m = w_parts.shape[0]
        d, a = grad.view(m, -1, grad.shape[-1]), x.view(m, -1, x.shape[-1])  # [m, b, out], [m, b, in]
        gx = torch.bmm(d, w_parts).view(x.shape) if need[0] else None
        gw_parts = torch.bmm(d.mT, a) if need[1] else None
        gb_parts = d.sum(1) if ctx.has_bias and need[2] else None
        gw_sum = grad.t().mm(x) if need[3] else None
        gb_sum = grad.sum(0) if ctx.has_bias and need[4] else None
        gw_sq = square_sum_rows(grad, x) if need[5] else None  # the tapped Linear's rule, over every part's rows
        gb_sq = grad.square().sum(0) if ctx.has_bias and need[6] else None
        return gx, gw_parts, gb_parts, gw_sum, gb_sum, gw_sq, gb_sq


def linear_layers(module: nn.Module, params) -> list[nn.Linear] | None:
    """The ``nn.Linear`` layers that hold ``params`` -- every weight and bias of each exactly -- or None where any of
    ``params`` is not a Linear's, or a Linear holds only part of its parameters in ``params`` (those cases take the
    vmap path)."""
    ids = {id(p) for p in params}
    layers, covered = [], set()
    for mod in module.modules():
        if type(mod) is not nn.Linear:
            continue
        own = [mod.weight] + ([] if mod.bias is None else [mod.bias])
        inside = [id(p) in ids for p in own]
        if any(inside) and not all(inside):
            return None
        if all(inside):
            layers.append(mod)
            covered.update(id(p) for p in own)
    return layers if layers and covered == ids else None


def row_linear_layers(module: nn.Module, params, x: torch.Tensor) -> list[nn.Linear] | None:
    """:func:`linear_layers` where each runs once per forward on [rows, features] (a probe forward of two examples of
    ``x`` in eval mode, no grad): the layers :func:`parts_weights` covers, else None."""
    layers = linear_layers(module, params)
    if layers is None:
        return None
    seen: dict[nn.Module, list[int]] = {mod: [] for mod in layers}
    hooks = [mod.register_forward_hook(lambda mod, inp, out: seen[mod].append(inp[0].dim())) for mod in layers]
    training = module.training
    try:
        module.eval()
        with torch.no_grad():
            module(x[:2])
    finally:
        module.train(training)
        for h in hooks:
            h.remove()
    return None if any(dims != [2] for dims in seen.values()) else layers


def phantom(like: torch.Tensor) -> torch.Tensor:
    """A zero of ``like``'s shape (an expanded scalar: no memory) that requires grad: the input whose gradient is a
    sum or a sum of squares."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape).requires_grad_(True)


@contextmanager
def parts_weights(layers: list[nn.Linear], parts: int, rows: int, weights: list[tuple], sums=None, squares=None):
    """Inside: each of ``layers`` multiplies part k's rows by part k's weights ``weights[i] = (w [parts, out, in],
    b [parts, out] or None)``; ``sums[i]`` / ``squares[i]`` (pairs of phantoms or None) receive the summed gradients /
    the sums of squares. Raises ``NotPartRows`` in the forward where a layer's input is not [rows, features] or a
    layer runs twice."""
    sums = sums or [(None, None)] * len(layers)
    squares = squares or [(None, None)] * len(layers)
    calls = dict.fromkeys(range(len(layers)), 0)
    for i, (mod, (w, b), (ws, bs), (wq, bq)) in enumerate(zip(layers, weights, sums, squares)):
        def forward(x, i=i, w=w, b=b, ws=ws, bs=bs, wq=wq, bq=bq):
            calls[i] += 1
            if calls[i] > 1 or x.dim() != 2 or x.shape[0] != rows:
                raise NotPartRows(f"a Linear layer ran on {tuple(x.shape)} (call {calls[i]}), not once on "
                                  f"[{rows}, features] rows")
            return _PartsLinear.apply(x, w, b, ws, bs, wq, bq)
        mod.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        yield
    finally:
        for mod in layers:
            del mod.forward


def param_views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per parameter a view [parts, *shape] of ``flat`` [parts, P], whose columns are ``params`` in order (each
    tensor's elements in logical order)."""
    parts, views, start = flat.shape[0], [], 0
    for p in params:
        views.append(flat[:, start:start + p.numel()].view(parts, *p.shape))
        start += p.numel()
    return views


def phantom_pairs(layers: list[nn.Linear]) -> list[tuple]:
    """Per layer (a phantom of its weight, one of its bias or None): the inputs that receive the layer's summed
    gradients or sums of squares in :func:`parts_weights`."""
    return [(phantom(mod.weight), None if mod.bias is None else phantom(mod.bias)) for mod in layers]


def pair_leaves(pairs) -> list[torch.Tensor]:
    """The tensors of per-layer (weight, bias or None) pairs in the layers' order, the Nones left out: what
    ``torch.autograd.grad`` takes."""
    return [t for pair in pairs for t in pair if t is not None]


def in_param_order(layers: list[nn.Linear], params: list[torch.Tensor], tensors) -> list[torch.Tensor]:
    """``tensors`` given in the layers' order (as :func:`pair_leaves` lists each layer's weight and bias) -> in
    ``params``' order."""
    at = {id(t): i for i, t in enumerate(pair_leaves((mod.weight, mod.bias) for mod in layers))}
    return [tensors[at[id(p)]] for p in params]


def layer_views(flat: torch.Tensor, params: list[torch.Tensor], layers: list[nn.Linear]) -> list[tuple]:
    """Per layer (weight [parts, out, in], bias [parts, out] or None): :func:`param_views` of ``flat``."""
    at = {id(p): v for p, v in zip(params, param_views(flat, params))}
    return [(at[id(mod.weight)], None if mod.bias is None else at[id(mod.bias)]) for mod in layers]
