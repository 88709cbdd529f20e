"""Robustness to adversarial parameter perturbation (Sun et al. 2021; Fisher SAM, Kim et al. 2022, Fig. 4).

The trained weights theta are moved along the normalised gradient of the loss,

    theta_alpha = theta + alpha * g / ||g||,    g = grad L(theta),

and the perturbed network is evaluated for each strength ``alpha``. ``g`` is the gradient of the example-weighted
mean loss over ``grad_batches`` (the full clean training set in ``scripts/analyze.py perturb``, or any given
batches), taken once at theta; ``||g||`` is ONE global L2 norm over every perturbed parameter (default: all
parameters with ``requires_grad``, ``model.parameters()`` order), so ``||theta_alpha - theta|| = alpha`` exactly up
to rounding. Each theta_alpha is set from a saved copy of theta (never incrementally). The network runs in
``mode="eval"`` by default (BatchNorm running statistics of the trained model, no dropout): the perturbation is of
the parameters only, buffers do not move. Parameters, buffers and modes are restored bit for bit afterwards
(:func:`flatbnn.metrics.sharpness.preserved_state`).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from flatbnn.metrics.sharpness import _batches, _device, _loss_and_grad, _trainable, _weights, preserved_state

__all__ = ["gradient_direction", "adversarial_perturbation_curve", "plot_perturbation_curves"]

LossFn = Callable[[Tensor, Tensor], Tensor]


def gradient_direction(model: nn.Module, loss_fn: LossFn, batches, params: Sequence[Tensor] | None = None
                       ) -> tuple[list[Tensor], float, float]:
    """``(g / ||g||, ||g||, L(theta))`` of the mean loss over ``batches`` in the model's current mode."""
    params = _trainable(model, params)
    batches = _batches(batches, _device(model))
    loss, grads = _loss_and_grad(model, loss_fn, batches, _weights(batches), params)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    if not norm > 0.0:
        raise ValueError("the loss gradient is zero: no perturbation direction")
    return [g / norm for g in grads], norm, loss


@torch.no_grad()
def _evaluate(model: nn.Module, loss_fn: LossFn, batches) -> tuple[float, float | None]:
    """Example-weighted mean loss and accuracy (``None`` unless the outputs are [N, C > 1] logits)."""
    total, correct, n, classify = 0.0, 0, 0, True
    for x, y in batches:
        out = model(x)
        total += float(loss_fn(out, y).double()) * int(y.shape[0])
        if out.ndim == 2 and out.shape[1] > 1 and not y.is_floating_point():
            correct += int((out.argmax(1) == y).sum())
        else:
            classify = False
        n += int(y.shape[0])
    return total / n, (correct / n if classify else None)


def adversarial_perturbation_curve(model: nn.Module, loss_fn: LossFn, grad_batches, eval_batches,
                                   alphas: Sequence[float], params: Sequence[Tensor] | None = None,
                                   mode: str = "eval") -> dict:
    """Loss and accuracy on ``eval_batches`` at ``theta + alpha g/||g||`` for each alpha.

    Returns ``{"alphas", "loss", "accuracy", "delta_norm" (the measured ||theta_alpha - theta|| per alpha),
    "grad_norm", "grad_loss" (L(theta) on grad_batches)}``; weights, buffers and modes are restored."""
    device = _device(model)
    grad_batches = _batches(grad_batches, device)
    eval_batches = _batches(eval_batches, device)
    with preserved_state(model, mode):
        params = _trainable(model, params)
        direction, grad_norm, grad_loss = gradient_direction(model, loss_fn, grad_batches, params)
        theta = [p.detach().clone() for p in params]
        out = {"alphas": [float(a) for a in alphas], "loss": [], "accuracy": [], "delta_norm": [],
               "grad_norm": grad_norm, "grad_loss": grad_loss}
        for a in alphas:
            with torch.no_grad():
                for p, t, d in zip(params, theta, direction):
                    p.copy_(t + float(a) * d)
                delta = math.sqrt(sum(float((p.double() - t.double()).pow(2).sum()) for p, t in zip(params, theta)))
            loss, acc = _evaluate(model, loss_fn, eval_batches)
            out["loss"].append(loss)
            out["accuracy"].append(acc)
            out["delta_norm"].append(delta)
    return out


def plot_perturbation_curves(curves: dict[str, dict], path, metric: str = "accuracy", title: str | None = None,
                             bands: dict[str, list[float]] | None = None) -> None:
    """The paper's Fig. 4: ``metric`` (accuracy in percent, or loss) against alpha, one line per method
    (``curves[label] = {"alphas": [...], metric: [...]}``; ``bands[label]`` = a std per alpha, drawn shaded)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from flatbnn.metrics.reliability import save_png

    fig = Figure(figsize=(5.2, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    scale = 100.0 if metric == "accuracy" else 1.0
    for i, (label, c) in enumerate(curves.items()):
        ys = [scale * v for v in c[metric]]
        ax.plot(c["alphas"], ys, "o-", color=f"C{i}", label=label, ms=3)
        if bands and bands.get(label):
            sd = [scale * s for s in bands[label]]
            ax.fill_between(c["alphas"], [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)],
                            color=f"C{i}", alpha=0.2, lw=0)
    ax.set_xlabel("perturbation strength α  (θ + α ∇L/‖∇L‖)")
    ax.set_ylabel("test accuracy (%)" if metric == "accuracy" else f"test {metric}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=8)
    save_png(fig, path)
