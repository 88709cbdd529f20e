"""Reliability diagrams (PNG) built on :func:`flatbnn.metrics.calibration_bins`.

:func:`reliability_diagram`: one predictive (bars + gap + counts). :func:`reliability_overlay`:
several runs on one plot (flat_seeking_bnn Fig. 2: SWAG vs F-SWAG, 20 bins), each legend entry
with its ECE under the same binning convention as results.json's ``ece``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Sequence

from torch import Tensor

from flatbnn.metrics.classification import _ece_from_bins, calibration_bins


def reliability_diagram(
    probs: Tensor,
    targets: Tensor,
    path: str | os.PathLike,
    n_bins: int = 20,
    title: str | None = None,
    binning: str = "width",
    edges: str = "right",
) -> str:
    """Write a reliability diagram to ``path`` (PNG) and return the path as a string.

    Top panel: accuracy per bin (bars) against the diagonal (perfect calibration), with the gap
    between each bin's accuracy and its mean confidence shaded; the legend states the ECE with
    its bins / binning / edge rule. Bottom panel: number of examples per bin. Bins as in
    :func:`flatbnn.metrics.calibration_bins` (default: ``n_bins`` equal-width bins, ``(lo, hi]``).
    Uses matplotlib's Agg canvas directly (no pyplot state, no backend switch); matplotlib is
    imported only when this function runs.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    import torch

    finite = torch.isfinite(torch.as_tensor(probs)).all(dim=1)
    dropped = int((~finite).sum())
    if dropped:  # diverged weights: draw the rest and say so (results.json has null metrics then)
        probs, targets = torch.as_tensor(probs)[finite], torch.as_tensor(targets)[finite]
        title = f"{title + ' -- ' if title else ''}{dropped} non-finite predictions left out"
    bins = calibration_bins(probs, targets, n_bins=n_bins, binning=binning, edges=edges)
    e = bins["edges"].cpu().numpy()
    acc = bins["accuracy"].cpu().numpy()
    conf = bins["confidence"].cpu().numpy()
    count = bins["count"].cpu().numpy()
    nonempty = count > 0
    lo, hi = e[:-1], e[1:]
    width = hi - lo
    ece_value = _ece_from_bins(bins)

    fig = Figure(figsize=(5.0, 6.0), dpi=100)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 1, height_ratios=[3, 1], hspace=0.08)
    ax = fig.add_subplot(gs[0])
    axc = fig.add_subplot(gs[1], sharex=ax)

    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1, label="perfect calibration")
    ax.bar(lo[nonempty], acc[nonempty], width=width[nonempty], align="edge",
           color="tab:blue", edgecolor="black", linewidth=0.5, alpha=0.85, label="accuracy")
    gap_bottom = [min(a, c) for a, c in zip(acc[nonempty], conf[nonempty])]
    gap_height = [abs(a - c) for a, c in zip(acc[nonempty], conf[nonempty])]
    ax.bar(lo[nonempty], gap_height, bottom=gap_bottom, width=width[nonempty], align="edge",
           color="tab:red", edgecolor="tab:red", alpha=0.3, hatch="//", linewidth=0.5,
           label="gap to confidence")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel("accuracy")
    ax.legend(loc="upper left", fontsize=8,
              title=f"ECE = {ece_value:.4f} ({n_bins} {binning} bins, edges={edges})",
              title_fontsize=8)
    ax.tick_params(labelbottom=False)
    if title:
        ax.set_title(title)

    axc.bar(lo, count, width=width, align="edge", color="tab:gray", edgecolor="black", linewidth=0.5)
    axc.set_xlabel("confidence (max predictive probability)")
    axc.set_ylabel("count")

    return save_png(fig, path)


def save_png(fig, path: str | os.PathLike, dpi: float | None = None) -> str:
    """Write ``fig`` as a PNG at ``path`` (parent folders created, atomically: a reader never sees half a
    PNG); ``dpi`` None = matplotlib's default. Returns the path as a string."""
    from flatbnn.atomic_io import write_bytes  # the one atomic writer (temp file removed on failure)

    path = os.fspath(path)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png", bbox_inches="tight")
    write_bytes(Path(path), buf.getvalue())
    return path


OVERLAY_STYLES = ("gap", "accuracy")


def legend_label(label: str, ece_value: float) -> str:
    """The legend text of one run in :func:`reliability_overlay` (4 decimals, a fraction)."""
    return f"{label}: ECE = {ece_value:.4f}"


def reliability_overlay_figure(runs: dict[str, tuple[Tensor, Tensor]], n_bins: int = 20, binning: str = "width",
                               edges: str = "right", style: str = "gap", title: str | None = None,
                               colors: Sequence[str] | None = None):
    """The :class:`matplotlib.figure.Figure` of :func:`reliability_overlay` and its per-run numbers
    (``(figure, stats)``; nothing written). See :func:`reliability_overlay`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if style not in OVERLAY_STYLES:
        raise ValueError(f"style must be one of {OVERLAY_STYLES}, got {style!r}")
    if not runs:
        raise ValueError("no runs to plot")
    fig = Figure(figsize=(6.0, 6.0), dpi=100)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 1, height_ratios=[3, 1], hspace=0.08)
    ax = fig.add_subplot(gs[0])
    axc = fig.add_subplot(gs[1], sharex=ax)
    if style == "gap":
        ax.axhline(0.0, linestyle="--", color="black", linewidth=1.2, label="perfect calibration")
        ax.set_ylabel("confidence - accuracy")
    else:
        ax.plot([0, 1], [0, 1], linestyle="--", color="black", linewidth=1.2, label="perfect calibration")
        ax.set_ylim(0.0, 1.0)
        ax.set_ylabel("accuracy")
    stats = {}
    for i, (label, (probs, targets)) in enumerate(runs.items()):
        bins = calibration_bins(probs, targets, n_bins=n_bins, binning=binning, edges=edges)
        ece_value = _ece_from_bins(bins)
        count = bins["count"].cpu()
        ne = count > 0
        conf = bins["confidence"].cpu()[ne].numpy()
        acc = bins["accuracy"].cpu()[ne].numpy()
        color = colors[i % len(colors)] if colors else f"C{i}"
        y = conf - acc if style == "gap" else acc
        text = legend_label(label, ece_value)
        ax.plot(conf, y, marker="o", markersize=3.5, linewidth=1.5, color=color, label=text)
        e = bins["edges"].cpu().numpy()
        frac = (count.double() / max(bins["n_total"], 1)).numpy()
        axc.stairs(frac, e, color=color, linewidth=1.2)
        stats[label] = {"ece": ece_value, "legend": text, "n": int(bins["n_total"]),
                        "edges": bins["edges"].tolist(), "confidence": bins["confidence"].tolist(),
                        "accuracy": bins["accuracy"].tolist(), "count": bins["count"].tolist()}
    ax.set_xlim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8, title=f"{n_bins} {binning} bins, edges={edges}", title_fontsize=8)
    ax.tick_params(labelbottom=False)
    if title:
        ax.set_title(title)
    axc.set_xlabel("confidence (max predictive probability)")
    axc.set_ylabel("fraction")
    axc.grid(alpha=0.3)
    return fig, stats


def reliability_overlay(runs: dict[str, tuple[Tensor, Tensor]], path: str | os.PathLike, n_bins: int = 20,
                        binning: str = "width", edges: str = "right", style: str = "gap",
                        title: str | None = None, colors: Sequence[str] | None = None) -> dict:
    """Reliability diagrams of several runs overlaid in one PNG; returns the per-run numbers.

    ``runs``: ``{label: (probs [N, C], targets [N])}`` -- predictive probabilities (for a posterior:
    the mean over samples, e.g. ``exp`` of evaluate()'s predictive log-probs; pass them in the dtype
    evaluate() used, float32, to reproduce results.json's ECE bit for bit). Bins exactly as
    :func:`flatbnn.metrics.calibration_bins` / :func:`flatbnn.metrics.ece` with the same
    ``n_bins`` / ``binning`` / ``edges`` (flat_seeking_bnn Fig. 2: 20 width bins, ``"right"``).
    ``style="gap"`` (the paper's): per non-empty bin, mean confidence minus accuracy against mean
    confidence, zero = perfect calibration (black dashed); ``"accuracy"``: accuracy against mean
    confidence with the diagonal. Bottom panel: fraction of examples per bin. Each legend entry is
    :func:`legend_label` (label and ECE, 4 decimals); the legend title states the bins.

    Returns ``{label: {"ece", "legend", "n", "edges", "confidence", "accuracy", "count"}}``
    (``ece`` is the float :func:`flatbnn.metrics.ece` returns for the same options).
    """
    fig, stats = reliability_overlay_figure(runs, n_bins=n_bins, binning=binning, edges=edges, style=style,
                                            title=title, colors=colors)
    save_png(fig, path)
    return stats
