"""``flatness.batched_chunks=true``: SAM's m-sharpness as two ``torch.func.vmap`` passes over the m chunks instead of
2m small forward/backward passes (issue 33 item 4: on a GPU each small pass is bound by kernel launches).

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

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


class _LossOf(nn.Module):
    """``loss_fn(batch)`` as a module whose only child is the backbone, so ``functional_call`` can swap its weights."""

    def __init__(self, net: nn.Module, loss_fn):
        super().__init__()
        self.net = net
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(batch)


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


def batched_sam_gradient(flatness, params, loss_fn, batch, backprop, scaling=None, perturb=None, *,
                         plain_sam: bool, plain_loss: bool) -> torch.Tensor:
    """Leave sum_k g'_k / m in ``p.grad``; return the mean first-pass loss (see the module docstring)."""
    from flatbnn.flatness.base import unzip_named

    _, params = unzip_named(params)
    params = [p for p in params if p.requires_grad]
    why = refusal(flatness, loss_fn, batch, backprop, scaling, perturb, plain_sam=plain_sam, plain_loss=plain_loss)
    if why is not None:
        raise ValueError(why)
    module, owner, m = backprop.module, loss_fn.__self__, flatness.m
    names = {id(p): n for n, p in module.named_parameters()}
    keys = [f"net.{names[id(p)]}" for p in params]
    wrapper = _LossOf(module, loss_fn)
    x, y = batch
    xs, ys = x.reshape(m, -1, *x.shape[1:]), y.reshape(m, -1, *y.shape[1:])

    logits_of_chunk = []
    hook = module.register_forward_hook(lambda mod, inp, out: logits_of_chunk.append(out))

    def chunk_loss(weights, xk, yk):
        logits_of_chunk.clear()
        loss = backprop.forward(lambda b: functional_call(wrapper, dict(zip(keys, weights)), (b,)), (xk, yk))
        return loss, (loss.detach(), logits_of_chunk[-1])

    record, owner._record = owner._record, False  # counted below from chunk 0's logits, as the loop counts
    try:
        weights = tuple(p.detach() for p in params)
        g, (loss, logits) = vmap(grad(chunk_loss, has_aux=True), in_dims=(None, 0, 0))(weights, xs, ys)
        with torch.no_grad():
            norm = torch.linalg.vector_norm(torch.stack([t.reshape(m, -1).norm(dim=1) for t in g]), dim=0)  # [m]
            finite = torch.isfinite(norm)
            radius = flatness.radius_tensor(norm.device).to(norm.dtype)
            factor = torch.where(finite, torch.reciprocal(norm + flatness.eps) * radius, torch.zeros_like(norm))
            moved = tuple(w + torch.where(finite.view(-1, *[1] * w.dim()), gk * factor.view(-1, *[1] * w.dim()), 0.0)
                          for w, gk in zip(weights, g))
        g2, _ = vmap(grad(chunk_loss, has_aux=True), in_dims=(0, 0, 0))(moved, xs, ys)
    finally:
        hook.remove()
        owner._record = record
    with torch.no_grad():
        for p, gk in zip(params, g2):
            mean = gk.sum(0) / m
            if p.grad is None:
                p.grad = mean.to(p.dtype)
            else:
                p.grad.add_(mean)
        if record:
            owner.count_correct(logits[0], ys[0])
            owner._seen += ys[0].numel()
            owner._record = False
    return loss.sum() / m
