"""Sum over the examples of the squared per-example gradients, sum_i g_i^2, of ``nn.Linear`` and ``nn.Conv2d`` weights
and biases from the batch's one backward pass, without per-example gradients of the whole network (VOGN's diagonal
Gauss-Newton estimate, flatbnn/methods/vogn.py).

Linear, z_i = W a_i + b, in a loss L = (1/B) sum_i l_i: the backward hands the layer d_i = dL/dz_i = (1/B) dl_i/dz_i,
so the per-example gradient is g_i = B d_i a_i^T and, element-wise,

    sum_i g_i^2 = B^2 (d^2)^T (a^2)          one GEMM of the squares;    bias: B^2 sum_i d_i^2.

Inputs with more than one row per example ([B, T, I]) and Conv2d (U_i the unfolded input [C k k, L], d_i [O, L]) sum
over the positions of one example FIRST: g_i = B d_i U_i^T, then squared -- not a square per position. That is one
batched GEMM into [B, weight size] (this layer's per-example gradients, one layer at a time) and a sum of squares over
B; their plain sum over B is the weight's gradient, so the usual backward skips that product; bias:
B^2 sum_i (sum_l d_i,l)^2.

How the sums come out: every supported module's forward is swapped (``tapped``) for a custom autograd Function whose
backward returns the layer's usual gradients plus sum_i (d_i a_i^T)^2 as the gradient of an extra input, a zero
"phantom" of the weight's shape. ``torch.autograd.grad`` or ``torch.func.grad`` of the loss w.r.t. the phantoms
gives the sums, also under ``torch.func.vmap`` (vmap rule generated; the batched m-sharpness step), and the caller
multiplies by B^2 (B: the examples the loss averages). What a phantom gets is a sum of squares only where the
module runs once per forward on examples along dim 0; ``tap_plan`` names the parameters this cannot cover (another
module type, a grouped or non-zero-padded conv, a module called twice), which the caller takes from per-example
gradients instead.

Why not BackPACK's ``SumGradSquared`` (backpack-for-pytorch 1.7.1, MIT; the same rules): measured 2026-11-28 on this
2-core machine, one thread, loaded (load average 7-8), interleaved rounds in one process, the MNIST MLP 784-500-300-10
on one part of 25 examples, gradient + sums: ours 15-18 ms (median of two runs), BackPACK 20-26 ms, the vmap
per-example path 109-116 ms; ours and BackPACK's sums equal to the bit. And BackPACK keeps its results in module
attributes set by backward hooks, which neither ``torch.func.vmap`` over the parts (the batched step a GPU needs) nor
a CUDA-graph capture can carry; it would be a new dependency for ~100 lines.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


def square_sum_rows(d: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """sum_i (d_i a_i^T)^2 for d [B, O], a [B, I]: (d^2)^T (a^2)."""
    return d.square().t().mm(a.square())


def _per_example_sums(d: torch.Tensor, a: torch.Tensor, with_sum: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(sum_i g_i where ``with_sum``, else None; sum_i g_i^2) for g_i = d_i a_i^T, d [B, O, L], a [B, I, L]: each
    example's sum over L first, one batched product; the squares taken in place after the sum (``mul_``: ``square_``
    has no vmap rule)."""
    per_example = torch.bmm(d, a.transpose(1, 2))  # [B, O, I]
    total = per_example.sum(0) if with_sum else None
    return total, per_example.mul_(per_example).sum(0)


class _LinearSq(torch.autograd.Function):
    """``F.linear(x, w, b)``; backward: the usual gradients and, for the phantoms pw, pb: sum_i (d_i a_i^T)^2, sum_i d_i^2
    (d: this call's output gradient)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, pw, pb):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, _, _ = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        d, a = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # every row of every example
        gx = grad.matmul(weight) if need[0] else None
        gb = d.sum(0) if ctx.has_bias and need[2] else None
        gw = sw = sb = None
        if x.dim() <= 2:  # one row per example
            sw = square_sum_rows(d, a) if need[3] else None
            sb = d.square().sum(0) if ctx.has_bias and need[4] else None
        else:  # [B, ..., features]: sum over the rows of one example first
            d_ex = grad.reshape(grad.shape[0], -1, grad.shape[-1]).transpose(1, 2)
            a_ex = x.reshape(x.shape[0], -1, x.shape[-1]).transpose(1, 2)
            if need[3]:  # the weight's gradient (where asked) is the per-example products' sum, as the conv below
                gw, sw = _per_example_sums(d_ex, a_ex, with_sum=need[1])
            sb = d_ex.sum(2).square().sum(0) if ctx.has_bias and need[4] else None
        if need[1] and gw is None:
            gw = d.t().mm(a)
        return gx, gw, gb, sw, sb


class _Conv2dSq(torch.autograd.Function):
    """``F.conv2d`` (zeros padding, groups 1); backward: ``convolution_backward`` and, for the phantoms, the sums of
    squares of the per-example gradients (each example's sum over output positions first)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, pw, pb, stride, padding, dilation):
        return F.conv2d(x, weight, bias, stride, padding, dilation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, _, _, stride, padding, dilation = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.conv = (stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.conv
        need = ctx.needs_input_grad
        # where the phantom asks for the per-example gradients, the weight's gradient is their sum (no second
        # product of the whole batch in convolution_backward: VOGN's conv backward a quarter cheaper)
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad, x, weight, [weight.shape[0]] if ctx.has_bias else None, stride, padding, dilation, False, [0, 0], 1,
            [need[0], need[1] and not need[3], ctx.has_bias and need[2]])
        sw = sb = None
        d = grad.reshape(grad.shape[0], grad.shape[1], -1)  # [B, O, L]
        if need[3]:
            u = F.unfold(x, weight.shape[2:], dilation=dilation, padding=padding, stride=stride)  # [B, C k k, L]
            total, sw = _per_example_sums(d, u, with_sum=need[1])
            sw = sw.view(weight.shape)
            if need[1]:
                gw = total.view(weight.shape)
        if ctx.has_bias and need[4]:
            sb = d.sum(2).square().sum(0)
        return gx, gw, gb, sw, sb, None, None, None


def supported(module: nn.Module) -> bool:
    """Whether ``tapped`` gives ``module``'s parameters their sums of squares (as long as it runs once per forward)."""
    if type(module) is nn.Linear:
        return True
    return (type(module) is nn.Conv2d and module.groups == 1 and module.padding_mode == "zeros"
            and not isinstance(module.padding, str))


def tap_plan(module: nn.Module, names: list[str], calls: dict[str, int] | None = None) -> tuple[list[str], dict]:
    """(tapped parameter names, {other parameter name: why}) for ``module``'s parameters ``names``. ``calls``: how often
    each submodule ran in one forward (``count_calls``); a module run more than once shares its weight between calls,
    whose per-example gradients are summed before squaring: not covered."""
    owner = {}
    for mname, mod in module.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = (mname, mod)
    tapped, other = [], {}
    for n in names:
        mname, mod = owner[n]
        if not supported(mod):
            other[n] = type(mod).__name__
        elif calls is not None and calls.get(mname, 0) != 1:
            other[n] = f"{type(mod).__name__} run {calls.get(mname, 0)} times per forward"
        else:
            tapped.append(n)
    return tapped, other


@contextmanager
def count_calls(module: nn.Module):
    """Yields {submodule name: calls} filled while inside (forward hooks)."""
    calls: dict[str, int] = {}
    hooks = []
    for mname, mod in module.named_modules():
        def hook(_mod, _inp, _out, mname=mname):
            calls[mname] = calls.get(mname, 0) + 1
        hooks.append(mod.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def tapped(module: nn.Module, phantoms: dict[str, torch.Tensor]):
    """Inside: each supported submodule whose weight (and bias) has a phantom in ``phantoms`` ({parameter name: zero
    tensor of its shape}, ``requires_grad`` for autograd or an input of ``torch.func.grad``) runs through the Function
    above, so the gradient of a loss w.r.t. a phantom is that parameter's sum_i (d_i a_i^T)^2. The module's forward
    reads its weights as it always does (``functional_call`` swaps them as usual)."""
    swapped = []
    for mname, mod in module.named_modules():
        key = f"{mname}.weight" if mname else "weight"
        if key not in phantoms or not supported(mod):
            continue
        pw = phantoms[key]
        pb = phantoms.get(f"{mname}.bias" if mname else "bias")
        if isinstance(mod, nn.Linear):
            def forward(x, mod=mod, pw=pw, pb=pb):
                return _LinearSq.apply(x, mod.weight, mod.bias, pw, pb)
        else:
            def forward(x, mod=mod, pw=pw, pb=pb):
                return _Conv2dSq.apply(x, mod.weight, mod.bias, pw, pb, mod.stride, mod.padding, mod.dilation)
        mod.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
        swapped.append(mod)
    try:
        yield
    finally:
        for mod in swapped:
            del mod.forward
