"""Reliability diagram (PNG) built on :func:`flatbnn.metrics.calibration_bins`."""

from __future__ import annotations

import os
from typing import Optional

from torch import Tensor

from flatbnn.metrics.classification import _ece_from_bins, calibration_bins


def reliability_diagram(
    probs: Tensor,
    targets: Tensor,
    path: str | os.PathLike,
    n_bins: int = 20,
    title: Optional[str] = None,
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

    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path
