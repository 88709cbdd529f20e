"""``flatness.batched_chunks=true``: SAM's m-sharpness as two ``torch.func.vmap`` passes over the m chunks instead of
2m small forward/backward passes (issue 33 item 4: on a GPU each small pass is bound by kernel launches). Where every
parameter is an ``nn.Linear``'s (the MNIST MLP) the two passes are cheaper still, over the whole batch with a low-rank
term per chunk (flatbnn/flatness/low_rank.py); the vmap passes below are the general path.

Per chunk k (equal chunks of the batch, stacked along a new leading dim):

    g_k = grad L_k(w);   eps_k = rho g_k / ||g_k||  (0 if not finite);   g'_k = grad L_k(w + eps_k)

and the step's gradient is sum_k g'_k / m, the loss sum_k L_k(w) / m -- the loop's values up to the order of
the sums (3e-15 in float64 on ResNet-20-FRN; tests/test_batched_chunks.py). Supported where the loop and the batch
are exchangeable without extra state, each refusal one line:
* plain SAM (D = I) on a method with the plain loss (``Method.loss_fn``: MAP, SWAG, SGLD, ...);
* no BatchNorm (batched running statistics are not implemented) and no active dropout (the loop replays each
  chunk's masks in its second pass; vmap would draw new ones);
* the per-process batch size divisible by m, fp32 / bf16 (fp16's loss scaling is not threaded through), no DDP.
What the config alone decides is refused before anything is built (``config_refusal``, from engine/validate.py);
the rest at the first step. A short last batch that m does not divide runs through the loop (``SAM.gradient``): the loop's
step exactly, instead of a refusal after a whole epoch (issue 41).
The train accuracy is counted on chunk 0's first pass, as the loop does."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from flatbnn.flatness.low_rank import leave_step, low_rank_sam_gradient
from flatbnn.nn.parts_linear import linear_layers


def config_refusal(*, flatness_name: str, plain_sam: bool, method_name: str, plain_loss: bool, m: int,
                   batch_size: int | None, precision: str, compiled: bool, processes: int) -> str | None:
    """What a config alone says the batched path cannot do (one line), or None: checked before any data is
    loaded, so a run does not train an epoch before it stops (``batch_size``: per process; None: not checked).
    ``refusal`` asks the same of the built objects at the first step."""
    if not plain_sam:
        return f"flatness.batched_chunks=true supports plain SAM (D = I) only, not flatness={flatness_name}"
    if not plain_loss:
        return (f"flatness.batched_chunks=true needs a method with the plain loss (map, swag, sgld, ...), not "
                f"method={method_name}")
    if compiled or processes > 1:
        return "flatness.batched_chunks=true does not combine with trainer.compile or DDP-wrapped models"
    if precision == "fp16":
        return "flatness.batched_chunks=true supports fp32 / bf16 on one process (not fp16, not DDP)"
    if batch_size is not None and batch_size % m:
        return (f"flatness.batched_chunks=true needs the per-process batch size ({batch_size}) divisible by "
                f"flatness.m={m} (only an epoch's short last batch runs through the loop)")
    return None


def refusal(flatness, loss_fn, batch, backprop, scaling, perturb, *, plain_sam: bool, plain_loss: bool) -> str | None:
    """Why the batched path cannot give the loop's step here (one line), or None. ``plain_sam``: the flatness
    has SAM's own direction; ``plain_loss``: ``loss_fn`` is a method's inherited ``Method.loss_fn`` -- both
    decided by the caller (sam.py), so this module imports neither SAM (a cycle) nor the methods (a layer up)."""
    owner = getattr(loss_fn, "__self__", None)
    module = backprop.module
    why = config_refusal(flatness_name=flatness.name, plain_sam=plain_sam and scaling is None,
                         method_name=getattr(owner, "name", owner), plain_loss=plain_loss, m=flatness.m,
                         batch_size=None, precision="fp16" if backprop.scaler is not None else "fp32",
                         compiled=plain_loss and owner.model is not module,
                         processes=1 if backprop.ddp is None else 2)
    if why is not None:
        return why
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return ("flatness.batched_chunks=true: BatchNorm needs batched running statistics (not implemented); "
                "use an FRN / norm-free model or flatness.batched_chunks=false")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in module.modules()):
        return "flatness.batched_chunks=true cannot replay per-chunk dropout masks; use flatness.batched_chunks=false"
    if perturb is not None and not all(perturb):
        return "flatness.batched_chunks=true perturbs every parameter (no perturb mask)"
    n = batch[0].shape[0]
    if n % flatness.m:
        return f"flatness.batched_chunks=true needs the batch ({n}) divisible by flatness.m={flatness.m}"
    return None


def _matmul_linear(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = torch.matmul(x, mod.weight.mT)
    return out if mod.bias is None else out + mod.bias


@contextmanager
def _linear_as_matmul(module: nn.Module):
    """Inside: every ``nn.Linear`` (not already swapped, e.g. by VOGN's taps) computes x W^T + b as a matmul and an add.
    Why: under vmap with per-part weights, ``F.linear``'s batching rule takes addmm's beta * bias, a multiply more in
    the forward and in the backward of every layer (kernel launches, issue 52); the same values up to rounding."""
    swapped = [mod for mod in module.modules() if type(mod) is nn.Linear and "forward" not in vars(mod)]
    for mod in swapped:
        mod.forward = functools.partial(_matmul_linear, mod)
    try:
        yield
    finally:
        for mod in swapped:
            del mod.forward


def parts_forward(module: nn.Module, names: list[str], weights, x: torch.Tensor) -> torch.Tensor:
    """Logits of every part at its own weights, ``torch.func.vmap`` over the parts (forward only: the caller's one
    autograd backward then gives each part's gradient w.r.t. its own weights): ``weights`` [parts, *shape] per tensor
    named ``names`` (the others and the buffers as they are), ``x`` [parts, part size, ...]."""
    def one(w, xk):
        return functional_call(module, {n: t for n, t in zip(names, w)}, (xk,), strict=False)
    with _linear_as_matmul(module):
        return vmap(one, in_dims=(0, 0))(list(weights), x)


def parts_losses(logits: torch.Tensor, y: torch.Tensor, criterion=None, label_smoothing: float = 0.0) -> torch.Tensor:
    """[parts] mean loss of each part, as ``Method.loss_fn`` gives it per part: the criterion per part (vmap), or the
    cross-entropy of every example at once (no vmap: its batching rule would take ~10 kernels more), averaged per
    part."""
    if criterion is not None:
        return vmap(criterion)(logits, y)
    per_example = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1), reduction="none",
                                  label_smoothing=label_smoothing)
    return per_example.view(logits.shape[0], -1).mean(1)


def part_leaves(flat: torch.Tensor, params) -> list[torch.Tensor]:
    """[parts, P] (or [P]) -> per parameter a view [parts, *shape] (or [*shape]) detached and requiring grad: the leaves
    whose gradients are the parts' own."""
    lead = flat.shape[:-1]
    return [t.view(*lead, *p.shape).detach().requires_grad_(True)
            for t, p in zip(flat.split([p.numel() for p in params], dim=-1), params)]


def batched_sam_gradient(flatness, params, loss_fn, batch, backprop, scaling=None, perturb=None, *,
                         plain_sam: bool, plain_loss: bool) -> torch.Tensor:
    """Leave sum_k g'_k / m in ``p.grad``; return the mean first-pass loss (see the module docstring). Both passes
    are a vmap-ed forward over the chunks and one autograd backward; the ascent is one [m, P] row per chunk."""
    from flatbnn.flatness.base import unzip_named

    _, params = unzip_named(params)
    params = [p for p in params if p.requires_grad]
    why = refusal(flatness, loss_fn, batch, backprop, scaling, perturb, plain_sam=plain_sam, plain_loss=plain_loss)
    if why is not None:
        raise ValueError(why)
    module, owner, m = backprop.module, loss_fn.__self__, flatness.m
    ids = {id(p): n for n, p in module.named_parameters()}
    names = [ids[id(p)] for p in params]
    x, y = batch
    xs, ys = x.reshape(m, -1, *x.shape[1:]), y.reshape(m, -1, *y.shape[1:])
    criterion, smoothing = owner.ctx.criterion, owner.ctx.label_smoothing
    if flatness.chunk_algorithm != "vmap":  # the two-pass low-rank path where every parameter is a Linear's
        layers = linear_layers(module, params)
        loss = None if layers is None else low_rank_sam_gradient(flatness, layers, params, module, owner, xs, ys,
                                                                 backprop, parts_losses)
        if loss is not None:
            flatness.chunk_algorithm = "low_rank"
            return loss
        flatness.chunk_algorithm = "vmap"  # decided once: the model's shape does not change between steps

    def grads_at(flat):  # [m, P] weights -> ([m, P] each chunk's gradient of its mean loss, losses [m], logits)
        leaves = part_leaves(flat, params)
        with torch.enable_grad():
            logits = backprop.forward(lambda xk: parts_forward(module, names, leaves, xk), xs)
            losses = parts_losses(logits, ys, criterion, smoothing)
        grads = torch.autograd.grad(losses.sum(), leaves)  # chunk k's loss depends on its own weights only
        return torch.cat([g.reshape(m, -1) for g in grads], dim=1), losses.detach(), logits.detach()

    with torch.no_grad():
        mean = torch.cat([p.detach().reshape(-1) for p in params])
    g, loss, logits = grads_at(mean.expand(m, -1))
    with torch.no_grad():
        norm = torch.linalg.vector_norm(g, dim=1, keepdim=True)  # [m, 1]: each chunk's global L2 norm
        finite = norm < float("inf")  # isfinite for a norm (>= 0 or NaN) in one kernel instead of four
        radius = flatness.radius_tensor(norm.device).to(norm.dtype)
        # eps_k = rho g_k / (||g_k|| + eps), 0 for a non-finite chunk: torch.where, since inf * 0 is NaN
        moved = torch.where(finite, g * (torch.reciprocal(norm + flatness.eps) * radius), 0.0).add_(mean)
    g2, _, _ = grads_at(moved)
    with torch.no_grad():
        leave_step(params, [gk.view(p.shape) for p, gk in zip(params, g2.sum(0).div_(m).split(
            [p.numel() for p in params]))], owner, logits[0], ys[0])
    return loss.sum() / m
