"""Sharpness of a trained network at its weights theta (flat_seeking_bnn section 4.2).

Three measures of the mean loss ``L(theta) = sum_b (n_b / N) loss_fn(model(x_b), y_b)`` over a
fixed list of batches (``n_b`` examples in batch b, ``N`` in all: the mean over *examples*, also
for unequal batch sizes; ``loss_fn`` returns the batch mean, e.g. ``F.cross_entropy``):

* :func:`max_loss_in_ball` -- ``max_{||eps||_2 <= rho} L(theta + eps) - L(theta)``, the paper's
  sharpness, estimated by projected normalised gradient ascent on ``eps`` (the first step is
  SAM's ``rho g / ||g||``; every iterate is feasible, so the estimate is a lower bound of the true
  maximum and grows with ``steps``);
* :func:`hessian_top_eigenvalue` -- power iteration on Hessian-vector products (double backward);
* :func:`hessian_trace` -- Hutchinson's estimator with Rademacher probes.

``eps`` / the Hessian range over ``params`` (default: every parameter with ``requires_grad``, as
SAM perturbs them), flattened in ``model.parameters()`` order; the L2 norm is over all of them.

Mode (BatchNorm, dropout): ``mode="eval"`` (default) evaluates the network in eval mode --
BatchNorm uses its running statistics, dropout is off -- so ``L`` is a deterministic function of
the weights (for sampled SWAG weights: of the running statistics refreshed for that sample).
``mode="train"`` uses batch statistics (and active dropout); ``mode="keep"`` leaves the modules'
flags as they are. Whatever the mode, every parameter, every buffer (BN running statistics and
``num_batches_tracked``) and every module's ``training`` flag are restored *bit for bit* on exit
(copied back from clones, never "theta + eps - eps"), also when an exception is raised;
``.grad`` is never touched (gradients come from ``torch.autograd.grad``). Losses are accumulated
in float64; tensors stay in the model's dtype and device (batches are moved to the device of the
first parameter).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["max_loss_in_ball", "hessian_top_eigenvalue", "hessian_trace", "mean_loss", "preserved_state"]

LossFn = Callable[[Tensor, Tensor], Tensor]
MODES = ("eval", "train", "keep")


# --------------------------------------------------------------------------------------------
# shared helpers (also used by flatbnn.metrics.landscape)
# --------------------------------------------------------------------------------------------
@contextmanager
def preserved_state(model: nn.Module, mode: str = "eval"):
    """Set the modules' mode, then restore parameters, buffers and ``training`` flags exactly."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    params = [(p, p.detach().clone()) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    flags = [(m, m.training) for m in model.modules()]
    if mode == "eval":
        model.eval()
    elif mode == "train":
        model.train()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in params:
                p.copy_(saved)
            for b, saved in buffers:
                b.copy_(saved)
        for m, flag in flags:
            m.training = flag


def _trainable(model: nn.Module, params: Sequence[Tensor] | None) -> list[Tensor]:
    ps = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    if not ps:
        raise ValueError("no parameters to perturb (none requires grad)")
    return ps


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _batches(batches, device) -> list[tuple[Tensor, Tensor]]:
    """A list of ``(x, y)`` on ``device``; a single ``(x, y)`` pair of tensors is one batch."""
    if isinstance(batches, (tuple, list)) and len(batches) == 2 and isinstance(batches[0], Tensor):
        batches = [batches]
    out = [(x.to(device), y.to(device)) for x, y in batches]
    if not out:
        raise ValueError("need at least one batch")
    return out


def _weights(batches: list) -> list[float]:
    sizes = [int(y.shape[0]) for _, y in batches]
    n = sum(sizes)
    if n == 0:
        raise ValueError("the batches hold no examples")
    return [s / n for s in sizes]


@torch.no_grad()
def _loss(model, loss_fn, batches, weights) -> float:
    return float(sum(w * float(loss_fn(model(x), y).double()) for w, (x, y) in zip(weights, batches)))


def _loss_and_grad(model, loss_fn, batches, weights, params) -> tuple[float, list[Tensor]]:
    total = 0.0
    grads = [torch.zeros_like(p) for p in params]
    for w, (x, y) in zip(weights, batches):
        with torch.enable_grad():
            loss = loss_fn(model(x), y)
            gs = torch.autograd.grad(loss, params, allow_unused=True)
        total += w * float(loss.detach().double())
        for acc, g in zip(grads, gs):
            if g is not None:
                acc.add_(g, alpha=w)
    return total, grads


def _hvp(model, loss_fn, batches, weights, params, vec: list[Tensor]) -> list[Tensor]:
    """``H v`` of the mean loss (double backward, batch by batch: memory of one batch's graph)."""
    out = [torch.zeros_like(p) for p in params]
    for w, (x, y) in zip(weights, batches):
        with torch.enable_grad():
            loss = loss_fn(model(x), y)
            gs = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
            pairs = [(g, v) for g, v in zip(gs, vec) if g is not None]
            if not pairs:
                continue
            dot = sum((g * v).sum() for g, v in pairs)
            if not dot.requires_grad:  # loss linear in the parameters: H = 0
                continue
            hv = torch.autograd.grad(dot, params, allow_unused=True)
        for acc, h in zip(out, hv):
            if h is not None:
                acc.add_(h, alpha=w)
    return out


def _dot(a: list[Tensor], b: list[Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def _norm(a: list[Tensor]) -> float:
    return math.sqrt(_dot(a, a))


def _random_like(params: list[Tensor], generator: torch.Generator, kind: str) -> list[Tensor]:
    """Gaussian or Rademacher tensors shaped like ``params``, drawn on the CPU (device-independent)."""
    out = []
    for p in params:
        if kind == "rademacher":
            r = torch.randint(0, 2, p.shape, generator=generator).to(p.dtype).mul_(2).sub_(1)
        else:
            r = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)
        out.append(r.to(p.device))
    return out


@torch.no_grad()
def _set(params: list[Tensor], base: list[Tensor], delta: list[Tensor]) -> None:
    for p, b, d in zip(params, base, delta):
        torch.add(b, d, out=p)


def mean_loss(model: nn.Module, loss_fn: LossFn, batches, mode: str = "eval") -> float:
    """``L(theta)``: the example-weighted mean of ``loss_fn`` over ``batches`` (float, float64 sum)."""
    batches = _batches(batches, _device(model))
    with preserved_state(model, mode):
        return _loss(model, loss_fn, batches, _weights(batches))


# --------------------------------------------------------------------------------------------
# sharpness
# --------------------------------------------------------------------------------------------
def max_loss_in_ball(model: nn.Module, loss_fn: LossFn, batches, rho: float, steps: int = 1,
                     step_size: float | None = None, mode: str = "eval",
                     params: Sequence[Tensor] | None = None, seed: int = 0) -> dict:
    """Sharpness ``max_{||eps||_2 <= rho} L(theta + eps) - L(theta)`` by projected gradient ascent.

    Step 1 is SAM's: ``eps_1 = rho g / ||g||`` with ``g = grad L(theta)`` (if ``g = 0``, a Gaussian
    direction from ``seed``, scaled to norm ``rho``). Step k > 1:
    ``eps_k = P(eps_{k-1} + step_size * g_k / ||g_k||)`` with ``g_k = grad L(theta + eps_{k-1})``
    and ``P`` the projection onto the ball (``step_size`` defaults to ``rho``); its fixed points are
    the KKT points of the constrained maximum (``g`` parallel to ``eps`` on the sphere). Each
    iterate is feasible: the result is ``max_k L(theta + eps_k) - L(theta)`` (a lower bound of the
    true maximum; ``steps=1`` is SAM's first-order estimate).

    Returns a dict: ``sharpness``, ``loss`` (L(theta)), ``max_loss``, ``grad_norm`` (``||g||`` at
    theta), ``eps_norm`` (of the maximising ``eps``), ``history`` (L at every iterate), ``rho``,
    ``steps``, ``step_size``, ``mode``, ``n_params``. Weights, buffers and modes are restored exactly.
    """
    if rho < 0:
        raise ValueError(f"rho must be >= 0, got {rho}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    step_size = float(rho if step_size is None else step_size)
    batches = _batches(batches, _device(model))
    weights = _weights(batches)
    params = _trainable(model, params)
    with preserved_state(model, mode):
        base = [p.detach().clone() for p in params]
        loss0, g = _loss_and_grad(model, loss_fn, batches, weights, params)
        gnorm = _norm(g)
        if gnorm == 0.0:  # e.g. exactly at a minimum: start from a random direction
            g = _random_like(params, torch.Generator().manual_seed(int(seed)), "gaussian")
        eps = [t * (rho / _norm(g)) for t in g]
        history: list[float] = []
        best, best_norm = -math.inf, 0.0
        for k in range(steps):
            _set(params, base, eps)
            if k < steps - 1:
                lk, gk = _loss_and_grad(model, loss_fn, batches, weights, params)
            else:
                lk, gk = _loss(model, loss_fn, batches, weights), None
            history.append(lk)
            if lk > best:
                best, best_norm = lk, _norm(eps)
            if gk is not None:
                n = _norm(gk)
                if n == 0.0:
                    break  # a stationary point of L: the ascent cannot move
                eps = [e + t * (step_size / n) for e, t in zip(eps, gk)]
                en = _norm(eps)
                if en > rho:
                    eps = [e * (rho / en) for e in eps]
    return {"sharpness": best - loss0, "loss": loss0, "max_loss": best, "grad_norm": gnorm,
            "eps_norm": best_norm, "history": history, "rho": float(rho), "steps": int(steps),
            "step_size": step_size, "mode": mode, "n_params": sum(p.numel() for p in params)}


# --------------------------------------------------------------------------------------------
# Hessian
# --------------------------------------------------------------------------------------------
def hessian_top_eigenvalue(model: nn.Module, loss_fn: LossFn, batches, iters: int = 20, seed: int = 0,
                           tol: float | None = None, mode: str = "eval",
                           params: Sequence[Tensor] | None = None) -> dict:
    """Largest-magnitude eigenvalue of the Hessian of ``L`` at theta, by power iteration.

    ``v_0`` Gaussian (``seed``, drawn on the CPU), then ``iters`` times: ``Hv`` (double backward),
    ``lambda = v . Hv`` (Rayleigh quotient, ``||v|| = 1``), ``v <- Hv / ||Hv||``; stops early when
    ``|lambda_k - lambda_{k-1}| <= tol |lambda_k|``. At a minimum this is the top eigenvalue; where the
    Hessian has a negative eigenvalue of larger magnitude, that one (negative) is returned.
    Returns ``eigenvalue``, ``residual`` (``||Hv - lambda v||`` at the last ``v``, 0 for an exact
    eigenvector), ``iters`` (done), ``history`` (lambda per iteration), ``mode``.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    batches = _batches(batches, _device(model))
    weights = _weights(batches)
    params = _trainable(model, params)
    gen = torch.Generator().manual_seed(int(seed))
    history: list[float] = []
    with preserved_state(model, mode):
        v = _random_like(params, gen, "gaussian")
        n = _norm(v)
        v = [t / n for t in v]
        lam, residual, done = 0.0, math.nan, 0
        for i in range(iters):
            hv = _hvp(model, loss_fn, batches, weights, params, v)
            lam = _dot(v, hv)
            history.append(lam)
            residual = math.sqrt(max(_dot(hv, hv) - 2 * lam * _dot(v, hv) + lam * lam * _dot(v, v), 0.0))
            done = i + 1
            hn = _norm(hv)
            if hn == 0.0:
                break  # H v = 0: the Hessian vanishes on v (lambda = 0)
            if tol is not None and i > 0 and abs(lam - history[-2]) <= tol * abs(lam):
                break
            v = [t / hn for t in hv]
    return {"eigenvalue": lam, "residual": residual, "iters": done, "history": history, "mode": mode}


def hessian_trace(model: nn.Module, loss_fn: LossFn, batches, samples: int = 10, seed: int = 0,
                  mode: str = "eval", params: Sequence[Tensor] | None = None) -> dict:
    """Hutchinson's estimate of ``tr H``: the mean of ``v . Hv`` over Rademacher probes ``v``.

    Unbiased; the variance of one probe is ``2 sum_{i != j} H_ij^2`` (exact for a diagonal ``H``).
    Probes are drawn on the CPU from ``seed``. Returns ``trace`` (the mean), ``std_error``
    (sample std / sqrt(samples); NaN for one probe), ``samples``, ``estimates`` (per probe), ``mode``.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    batches = _batches(batches, _device(model))
    weights = _weights(batches)
    params = _trainable(model, params)
    gen = torch.Generator().manual_seed(int(seed))
    est: list[float] = []
    with preserved_state(model, mode):
        for _ in range(samples):
            v = _random_like(params, gen, "rademacher")
            est.append(_dot(v, _hvp(model, loss_fn, batches, weights, params, v)))
    mean = sum(est) / len(est)
    if len(est) > 1:
        var = sum((e - mean) ** 2 for e in est) / (len(est) - 1)
        se = math.sqrt(var / len(est))
    else:
        se = math.nan
    return {"trace": mean, "std_error": se, "samples": int(samples), "estimates": est, "mode": mode}
