"""Loss landscapes along random filter-normalised directions (Li et al. 2018, "Visualizing the
Loss Landscape of Neural Nets"; flat_seeking_bnn Fig. 1: sampled SWAG vs F-SWAG models).

A direction ``d`` has one tensor per trainable parameter (``model.parameters()`` order), drawn
i.i.d. N(0, 1) on the CPU from ``seed`` (so the raw direction is the same on every device and for
every model of the same architecture), then, as in Li et al.'s ``net_plotter.py``:

* ``norm="filter"`` (default): each *filter* ``d_i`` -- a slice along the first dimension (a conv
  output channel, a Linear row) -- is rescaled to the norm of the corresponding weight filter,
  ``d_i <- d_i * ||w_i|| / (||d_i|| + 1e-10)``; ``norm="layer"``: the whole tensor to ``||w||``;
  ``norm="none"``: raw Gaussian;
* tensors with ``dim <= 1`` (biases, BatchNorm weight/bias) get a zero direction
  (``one_dim="zero"``, Li et al.'s ``ignore='biasbn'``) or the weights themselves (``"weights"``).

BatchNorm running statistics are buffers and do not move. The network is evaluated at
``theta + alpha d1 (+ beta d2)`` (set from a saved copy of theta, not incrementally) in
``mode="eval"`` by default (running statistics, no dropout; Li et al. evaluate in eval mode too),
with the example-weighted mean loss of :mod:`flatbnn.metrics.sharpness`; weights, buffers and
modes are restored bit for bit afterwards. Accuracy is reported when the outputs are
``[N, C > 1]`` logits and the targets integers.

Plots (matplotlib's Agg canvas, no pyplot state): :func:`plot_curves_1d` overlays several 1-D
curves (several runs x sampled models), :func:`plot_surfaces_2d` draws one contour panel per
surface with shared levels.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from flatbnn.metrics.sharpness import _batches, _device, _trainable, _weights, preserved_state
from flatbnn.metrics.reliability import save_png

__all__ = ["random_direction", "loss_surface_1d", "loss_surface_2d", "plot_curves_1d", "plot_surfaces_2d"]

LossFn = Callable[[Tensor, Tensor], Tensor]
NORMS = ("filter", "layer", "none")
ONE_DIM = ("zero", "weights")


@torch.no_grad()
def random_direction(model: nn.Module, seed: int = 0, norm: str = "filter", one_dim: str = "zero",
                     params: Sequence[Tensor] | None = None,
                     generator: torch.Generator | None = None) -> list[Tensor]:
    """One random direction shaped like ``params`` (default: trainable parameters), normalised as
    in the module docstring. ``generator`` (a CPU generator) overrides ``seed`` to draw several
    directions from one stream (:func:`loss_surface_2d` draws d1 then d2)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if one_dim not in ONE_DIM:
        raise ValueError(f"one_dim must be one of {ONE_DIM}, got {one_dim!r}")
    params = _trainable(model, params)
    gen = generator if generator is not None else torch.Generator().manual_seed(int(seed))
    out = []
    for p in params:
        w = p.detach()
        d = torch.randn(w.shape, generator=gen, dtype=torch.float64).to(device=w.device, dtype=w.dtype)
        if w.dim() <= 1:
            d = torch.zeros_like(w) if one_dim == "zero" else w.clone()
        elif norm == "filter":
            wn = w.reshape(w.shape[0], -1).norm(dim=1)
            dn = d.reshape(d.shape[0], -1).norm(dim=1)
            d = d * (wn / (dn + 1e-10)).reshape(-1, *([1] * (w.dim() - 1)))
        elif norm == "layer":
            d = d * (w.norm() / (d.norm() + 1e-10))
        out.append(d)
    return out


def _is_classification(out: Tensor, y: Tensor) -> bool:
    return out.dim() == 2 and out.shape[1] > 1 and not torch.is_floating_point(y)


@torch.no_grad()
def _evaluate(model, loss_fn, batches, weights) -> tuple[float, float | None]:
    loss, correct, classify = 0.0, 0.0, True
    for w, (x, y) in zip(weights, batches):
        out = model(x)
        loss += w * float(loss_fn(out, y).double())
        classify = classify and _is_classification(out, y)
        if classify:
            correct += w * float((out.argmax(1) == y).double().mean())
    return loss, (correct if classify else None)


@torch.no_grad()
def _set_point(params, base, dirs, coefs) -> None:
    for i, p in enumerate(params):
        w = base[i]
        for d, c in zip(dirs, coefs):
            if c != 0.0:
                w = torch.add(w, d[i], alpha=c)
        p.copy_(w)


def _as_floats(xs) -> list[float]:
    return [float(a) for a in (xs.tolist() if isinstance(xs, Tensor) else xs)]


def loss_surface_1d(model: nn.Module, loss_fn: LossFn, batches, alphas, seed: int = 0,
                    direction: list[Tensor] | None = None, norm: str = "filter", one_dim: str = "zero",
                    mode: str = "eval", params: Sequence[Tensor] | None = None) -> dict:
    """Loss (and accuracy) at ``theta + alpha d`` for every ``alpha`` (``alpha = 0`` is theta itself).

    ``direction`` (tensors shaped like ``params``) replaces the random filter-normalised one.
    Returns ``alphas``, ``loss``, ``accuracy`` (list, or None when not a classifier), ``seed``,
    ``norm``, ``one_dim``, ``mode``, ``direction_norm``, ``weight_norm``.
    """
    batches = _batches(batches, _device(model))
    weights = _weights(batches)
    params = _trainable(model, params)
    alphas = _as_floats(alphas)
    d = direction if direction is not None else random_direction(model, seed, norm, one_dim, params)
    losses, accs = [], []
    with preserved_state(model, mode):
        base = [p.detach().clone() for p in params]
        for a in alphas:
            _set_point(params, base, [d], [a])
            loss, acc = _evaluate(model, loss_fn, batches, weights)
            losses.append(loss)
            accs.append(acc)
    return {"alphas": alphas, "loss": losses, "accuracy": None if None in accs else accs,
            "seed": int(seed), "norm": norm if direction is None else "given", "one_dim": one_dim, "mode": mode,
            "direction_norm": math.sqrt(sum(float(t.double().pow(2).sum()) for t in d)),
            "weight_norm": math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in params))}


def loss_surface_2d(model: nn.Module, loss_fn: LossFn, batches, alphas, betas=None, seed: int = 0,
                    directions: tuple[list[Tensor], list[Tensor]] | None = None, norm: str = "filter",
                    one_dim: str = "zero", mode: str = "eval", params: Sequence[Tensor] | None = None) -> dict:
    """Loss (and accuracy) on the grid ``theta + alpha_i d1 + beta_j d2``; ``loss[i][j]``.

    ``d1`` then ``d2`` are drawn from one CPU generator seeded with ``seed`` (so ``d1`` equals
    :func:`loss_surface_1d`'s direction for the same seed); ``betas`` defaults to ``alphas``.
    Returns ``alphas``, ``betas``, ``loss`` (list of rows), ``accuracy`` (or None), ``seed``, ``norm``,
    ``one_dim``, ``mode``.
    """
    batches = _batches(batches, _device(model))
    weights = _weights(batches)
    params = _trainable(model, params)
    alphas = _as_floats(alphas)
    betas = alphas if betas is None else _as_floats(betas)
    if directions is None:
        gen = torch.Generator().manual_seed(int(seed))
        directions = (random_direction(model, norm=norm, one_dim=one_dim, params=params, generator=gen),
                      random_direction(model, norm=norm, one_dim=one_dim, params=params, generator=gen))
    d1, d2 = directions
    losses, accs = [], []
    with preserved_state(model, mode):
        base = [p.detach().clone() for p in params]
        for a in alphas:
            row_l, row_a = [], []
            for b in betas:
                _set_point(params, base, [d1, d2], [a, b])
                loss, acc = _evaluate(model, loss_fn, batches, weights)
                row_l.append(loss)
                row_a.append(acc)
            losses.append(row_l)
            accs.append(row_a)
    has_acc = all(a is not None for row in accs for a in row)
    return {"alphas": alphas, "betas": betas, "loss": losses, "accuracy": accs if has_acc else None,
            "seed": int(seed), "norm": norm, "one_dim": one_dim, "mode": mode}


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------
def _figure(figsize):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=100)
    FigureCanvasAgg(fig)
    return fig


def plot_curves_1d(curves: dict[str, dict], path: str | os.PathLike, title: str | None = None,
                   styles: dict[str, dict] | None = None, log_loss: bool = False) -> str:
    """Overlay 1-D curves ``{label: loss_surface_1d result}`` in one PNG: loss (left) and, when
    every curve has it, accuracy (right). ``styles[label]`` are extra ``Axes.plot`` kwargs
    (e.g. one colour per run, one line style per sampled model). Returns the path."""
    styles = styles or {}
    with_acc = all(c.get("accuracy") is not None for c in curves.values())
    fig = _figure((10.0 if with_acc else 5.5, 4.0))
    axes = [fig.add_subplot(1, 2 if with_acc else 1, i + 1) for i in range(2 if with_acc else 1)]
    for label, c in curves.items():
        kw = {"linewidth": 1.5, **styles.get(label, {})}
        axes[0].plot(c["alphas"], c["loss"], label=label, **kw)
        if with_acc:
            axes[1].plot(c["alphas"], c["accuracy"], label=label, **kw)
    axes[0].set_ylabel("loss")
    if log_loss:
        axes[0].set_yscale("log")
    if with_acc:
        axes[1].set_ylabel("accuracy")
    for ax in axes:
        ax.set_xlabel("alpha (filter-normalised direction)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return save_png(fig, path)


def plot_surfaces_2d(surfaces: dict[str, dict], path: str | os.PathLike, levels: int = 20,
                     title: str | None = None, log_loss: bool = True) -> str:
    """One contour panel of the loss per ``{label: loss_surface_2d result}``, with the same contour
    levels on every panel, evenly spaced between the smallest and largest value over all surfaces
    of log10(loss) (default: far from theta the loss grows by orders of magnitude and linear levels
    leave the basin empty) or, with ``log_loss=False``, of the loss. Returns the path."""
    import numpy as np

    n = len(surfaces)
    if n == 0:
        raise ValueError("no surfaces to plot")
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = _figure((4.4 * cols, 3.8 * rows))
    fig.subplots_adjust(wspace=0.4, hspace=0.35)

    def values(s):
        z = np.asarray(s["loss"], dtype=float)
        return np.log10(np.maximum(z, 1e-12)) if log_loss else z

    zs = [values(s) for s in surfaces.values()]
    lo = min(float(np.nanmin(z)) for z in zs)
    hi = max(float(np.nanmax(z)) for z in zs)
    lv = np.linspace(lo, hi if hi > lo else lo + 1e-12, levels)
    for i, ((label, s), z) in enumerate(zip(surfaces.items(), zs)):
        ax = fig.add_subplot(rows, cols, i + 1)
        b, a = np.meshgrid(np.asarray(s["betas"]), np.asarray(s["alphas"]))
        cs = ax.contour(a, b, z, levels=lv, cmap="viridis", linewidths=0.8)
        ax.clabel(cs, inline=True, fontsize=6, fmt="%.2g")
        ax.plot([0.0], [0.0], marker="*", color="red", markersize=8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("alpha (d1)")
        ax.set_ylabel("beta (d2)")
        ax.set_aspect("equal", adjustable="box")
    if title:
        fig.suptitle(title + (" (log10 loss)" if log_loss else ""))
    return save_png(fig, path)
