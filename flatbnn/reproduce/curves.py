"""Derived metrics: one number per run (per seed) summarising a curve the run recorded, so that a claim about a
curve ("better convergence", "the least degradation" under a perturbation sweep) is judged over seeds like any other
metric (flatbnn/reproduce/claims.py; docs/reproduce.md, Claims).

A paper file declares such a metric with ``curve:`` in its ``metrics:``::

    loss_curve: {unit: null, better: lower, curve: {x: epoch, y: "test/nll|val/nll", summary: mean}}
    degradation: {unit: percent, better: higher, curve: {x: alphas, y: accuracy, summary: mean_change}}

Where the curve is read (compare.py): a train / eval run's ``metrics.jsonl`` (one line per epoch; ``x`` and ``y``
are keys of a line, ``a|b`` the first of them a line has; the committed run records keep the file), or a script
row's per-run record in the JSON the script wrote (``compare.cells_from.runs``; ``x`` and ``y`` name parallel lists).
The value is in the run's own unit; compare.py converts it to the paper file's ``unit`` as any other value.

Summaries (:data:`SUMMARIES`), over the whole recorded range of x, points sorted by x, trapezoidal:

- ``mean``: the area under y over [x_first, x_last] divided by the range -- the curve's mean height (a test-loss
  curve's: lower for a run that reaches a low loss sooner and stays there);
- ``mean_change``: the same of y(x) - y(x_first) -- the mean change from the curve's first point (accuracy under a
  parameter perturbation of strength alpha minus the unperturbed accuracy at alpha = 0: the degradation).

A curve with fewer than 2 points, or with a point that is no number, has no summary (the metric is not recorded for
that run); a non-finite y gives NaN (the run diverged: the NaN policy of stats.py counts it against its method).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

SUMMARIES = ("mean", "mean_change")
_KEYS = ("x", "y", "summary")


def declared(metrics: dict | None) -> dict:
    """The paper file's curve metrics: ``{name: its curve: spec}``."""
    return {m: spec["curve"] for m, spec in (metrics or {}).items() if isinstance(spec, dict) and spec.get("curve")}


def problems(metrics: dict | None) -> list[str]:
    """What is wrong with the ``curve:`` specs of a paper file's metrics (empty = nothing)."""
    out = []
    for m, spec in (metrics or {}).items():
        curve = (spec or {}).get("curve") if isinstance(spec, dict) else None
        if curve is None:
            continue
        if not isinstance(curve, dict) or any(k not in curve for k in _KEYS) or set(curve) - set(_KEYS):
            out.append(f"metric {m!r}: curve must be {{x: <key>, y: <key>[|<key>...], summary: "
                       f"{'|'.join(SUMMARIES)}}}, got {curve!r}")
        elif curve["summary"] not in SUMMARIES:
            out.append(f"metric {m!r}: curve summary {curve['summary']!r} is not one of {', '.join(SUMMARIES)}")
        elif spec.get("better") not in ("higher", "lower"):
            out.append(f"metric {m!r}: a curve metric needs better: higher|lower")
    return out


def summarize(xs: list, ys: list, summary: str) -> float | None:
    """The ``summary`` of the curve y(x) (module docstring); None with fewer than 2 points."""
    if summary not in SUMMARIES:
        raise ValueError(f"curve summary {summary!r} is not one of {', '.join(SUMMARIES)}")
    try:
        points = sorted(dict(zip((float(x) for x in xs), ys)).items())  # one y per x (the last recorded), by x
    except (TypeError, ValueError):
        return None
    if len(points) < 2:
        return None
    x = [p[0] for p in points]
    if not all(isinstance(p[1], (int, float)) and not isinstance(p[1], bool) for p in points):
        return None  # a point without a number: not recorded, not a divergence
    y = [float(p[1]) for p in points]
    if not all(math.isfinite(v) for v in y):
        return math.nan
    if summary == "mean_change":
        y = [v - y[0] for v in y]
    area = sum((x[i + 1] - x[i]) * (y[i] + y[i + 1]) / 2.0 for i in range(len(x) - 1))
    return area / (x[-1] - x[0]) if x[-1] > x[0] else None


def _first(line: dict, keys: str):
    return next((line[k] for k in str(keys).split("|") if k in line), None)


def from_record(record: dict, curve: dict) -> float | None:
    """The summary of the curve a script wrote as parallel lists (``record[x]``, ``record[y]``)."""
    xs, ys = _first(record, curve["x"]), _first(record, curve["y"])
    if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys):
        return None
    return summarize(xs, ys, curve["summary"])


def from_jsonl(path: Path, curve: dict) -> float | None:
    """The summary of the curve a run logged in ``metrics.jsonl`` (one JSON object a line; lines without x or y are
    skipped: epochs without an evaluation). None when the file is absent or the curve has fewer than 2 points."""
    path = Path(path)
    if not path.is_file():
        return None
    xs, ys = [], []
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        x, y = _first(line, curve["x"]), _first(line, curve["y"])
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return summarize(xs, ys, curve["summary"])


__all__ = ["SUMMARIES", "declared", "from_jsonl", "from_record", "problems", "summarize"]
