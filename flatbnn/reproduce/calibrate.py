"""Is the claims rule (flatbnn/reproduce/claims.py) calibrated? Every claim of the board, simulated at its real shape.

    python scripts/reproduce.py claims --calibrate [--reps 2000] [--seed 0]
    python scripts/reproduce.py claims --paper-numbers

``--calibrate``: for each claim, the comparisons it expands to over its row's cells (pairs x metrics, the cells
shared between comparisons shared in the simulation too), the row's paper-scale seeds and its declared seed test
(Welch; paired rows get a shared per-seed effect, correlation 0.5). Seed values are N(mean, 1): the unit is one
seed std, and every margin is set to 1 std. Scenarios:

- ``null``: no true difference anywhere. A better / worse claim must come out neither "holds" nor "reversed"/"mixed"
  more often than 5 %; a comparable / not_worse claim is then true and must not come out reversed / mixed.
- ``2x margin`` (comparable / not_worse): a differs from b by twice the margin (not_worse: a worse) on every
  comparison; "holds" must stay under 5 %.
- ``2 sd`` / ``3 sd`` (better / worse): a true difference the claimed way on every comparison: the power, P(holds),
  reported (not gated: at n = 3 a 48-comparison "all" claim has little).

It runs the rule's own code (``claims.p_values``, ``claims.adjust_family``, ``claims.claim_verdict``) on the simulated
tests, so a change of the rule changes its rates. Exit 1 when a false-reversal or false-holds rate exceeds 5 % by
more than two Monte Carlo standard errors (sqrt(0.05 x 0.95 / reps)).

``--paper-numbers``: every claim whose cells the paper prints, judged by the same rule on the printed mean ± std
(Welch; n = the paper file's ``seeds:``, else 3, marked assumed).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from flatbnn.reproduce import claims as C
from flatbnn.reproduce.spec import PAPER_DIR, SpecError, list_rows, load_paper_data, load_row
from flatbnn.reproduce.stats import paired_arrays, welch_arrays

ALPHA = 0.05
RHO_PAIRED = 0.5   # a paired row's per-seed shared effect: correlation between its cells' values


@dataclass
class Shape:
    row: str
    claim: dict
    pairs: list[tuple[str, str]]
    signs: dict          # metric -> +1 higher is better / -1 lower
    n: int               # seeds per cell
    paired: bool


def shapes() -> list[Shape]:
    """Every claim of the board at its real shape (rows whose spec or paper file does not load are skipped)."""
    out = []
    for name in list_rows():
        p = PAPER_DIR / f"{name}.yaml"
        if not p.exists():
            continue
        try:
            row, pd = load_row(name), load_paper_data(p)
        except SpecError:
            continue
        axes, cells = C.cell_axes(row, pd)
        sc = row.scale("paper") if row.kind in ("train", "eval") else None
        seeds = (sc or {}).get("seeds") or row.seeds
        n = max(2, len(seeds))
        metrics = pd.get("metrics") or {}
        for claim in pd.get("claims") or []:
            pairs = C.expand(claim, cells, axes) if claim["axis"] in axes else []
            if pairs:
                signs = {m: (-1.0 if (metrics.get(m) or {}).get("better") == "lower" else 1.0)
                         for m in claim["metrics"]}
                out.append(Shape(name, claim, pairs, signs, n, row.seed_test()[0] == "paired"))
    return out


def _potentials(pairs: list[tuple[str, str]], step: float) -> dict:
    """Cell means that put every pair's a ``step`` above its b (a chain mc2 > mc1, mc4 > mc2 ... climbs): breadth-first
    over the pair graph; a cycle's contradicting pair keeps the first assignment."""
    adj: dict = {}
    for a, b in pairs:
        adj.setdefault(a, []).append((b, -step))
        adj.setdefault(b, []).append((a, step))
    pot: dict = {}
    for root in adj:
        if root in pot:
            continue
        pot[root] = 0.0
        queue = deque([root])
        while queue:
            u = queue.popleft()
            for v, d in adj[u]:
                if v not in pot:
                    pot[v] = pot[u] + d
                    queue.append(v)
    return pot


def simulate(shape: Shape, scenario: str, reps: int, rng: np.random.Generator) -> dict:
    """Verdict frequencies of one claim under one scenario (module docstring)."""
    claim = {**shape.claim, "margins": {m: {"abs": 1.0} for m in shape.claim["metrics"]}}
    direction = claim["direction"]
    want = -1.0 if direction == "worse" else 1.0
    step = {"null": 0.0, "2 sd": 2.0, "3 sd": 3.0, "2x margin": -2.0}[scenario]
    if direction == "comparable" and scenario == "2x margin":
        step = 2.0  # a differs by twice the margin (either way is the same for equivalence)
    pot = _potentials(shape.pairs, step * (want if direction in ("better", "worse") else 1.0))
    cells = sorted(pot)
    idx = {c: i for i, c in enumerate(cells)}
    metrics = claim["metrics"]
    # values[rep, cell, metric, seed]: cell mean (in the metric's good direction) + noise
    shape_ = (reps, len(cells), len(metrics), shape.n)
    if shape.paired:
        seed_effect = rng.standard_normal((reps, 1, len(metrics), shape.n))
        noise = math.sqrt(RHO_PAIRED) * seed_effect + math.sqrt(1 - RHO_PAIRED) * rng.standard_normal(shape_)
    else:
        noise = rng.standard_normal(shape_)
    means = np.array([pot[c] for c in cells])[None, :, None, None]
    signs = np.array([shape.signs[m] for m in metrics])[None, None, :, None]
    values = means * signs + noise   # a metric whose lower is better: 'a better' = a lower
    mean, sd = values.mean(-1), values.std(-1, ddof=1)
    per = []  # per comparison: (p_agree, p_reverse, toward) arrays over reps
    for a, b in shape.pairs:
        ia, ib = idx[a], idx[b]
        for k, m in enumerate(metrics):
            if shape.paired:
                t = paired_arrays(values[:, ia, k] - values[:, ib, k])
            else:
                t = welch_arrays(mean[:, ia, k], sd[:, ia, k], shape.n, mean[:, ib, k], sd[:, ib, k], shape.n)
            per.append(C.p_values(direction, t, shape.signs[m], 1.0))
    counts = dict.fromkeys(C.VERDICTS, 0)
    quantifier = claim.get("quantifier", "overall")
    for r in range(reps):
        comps = [{"direction": direction, "p_agree": float(pa[r]), "p_reverse": float(pr[r]), "toward": int(tw[r])}
                 for pa, pr, tw in per]
        C.adjust_family(comps, quantifier=quantifier)
        counts[C.claim_verdict(quantifier, comps)[0]] += 1
    return {v: c / reps for v, c in counts.items()}


def calibrate(reps: int = 2000, seed: int = 0, log=print) -> int:
    """The table of every claim's error rates and power; 1 when a gated rate is above 5 % beyond Monte Carlo error."""
    rng = np.random.default_rng(seed)
    limit = ALPHA + 2.0 * math.sqrt(ALPHA * (1 - ALPHA) / reps)
    log(f"claims calibration: {reps} simulated replicates per claim and scenario; a rate fails above "
        f"{limit:.3f} (5 % + 2 Monte Carlo se); seed values N(mean, 1), margins 1 sd")
    log(f"{'row / claim':48s} {'dir':10s} {'quant':7s} {'K':>3s} {'n':>2s} {'test':6s} "
        f"{'false rev':>9s} {'false holds':>11s} {'power 2sd':>9s} {'power 3sd':>9s}")
    worst, failed = 0.0, []
    for s in shapes():
        d = s.claim["direction"]
        k = len(s.pairs) * len(s.claim["metrics"])
        null = simulate(s, "null", reps, rng)
        false_rev = null["reversed"] + null["mixed"]
        if d in ("better", "worse"):
            false_holds = null["holds"] + null["mixed"]
            p2, p3 = simulate(s, "2 sd", reps, rng)["holds"], simulate(s, "3 sd", reps, rng)["holds"]
            power = f"{p2:9.3f} {p3:9.3f}"
        else:
            false_holds = simulate(s, "2x margin", reps, rng)["holds"]
            power = f"{null['holds']:9.3f} {'(at 0)':>9s}"
        bad = [w for w, r in (("false reversal", false_rev), ("false holds", false_holds)) if r > limit]
        worst = max(worst, false_rev, false_holds)
        if bad:
            failed.append(f"{s.row}/{s.claim['id']}: {', '.join(bad)}")
        log(f"{s.row + ' / ' + s.claim['id']:48.48s} {d:10s} {s.claim.get('quantifier', 'overall'):7s} {k:3d} "
            f"{s.n:2d} {'paired' if s.paired else 'Welch':6s} {false_rev:9.3f} {false_holds:11.3f} {power}"
            + ("   <- " + ", ".join(bad) if bad else ""))
    log(f"worst false rate {worst:.3f} (limit {limit:.3f}); " +
        ("all claims calibrated" if not failed else f"{len(failed)} claims above it: " + "; ".join(failed)))
    return 1 if failed else 0


def paper_records(pd: dict) -> list[dict]:
    """Comparison-table records holding the paper's printed numbers alone (what claims judge with source=paper)."""
    out = []
    metrics = pd.get("metrics") or {}
    for pc in pd.get("cells") or []:
        for m, spec in metrics.items():
            printed = pc.get(m)
            if isinstance(printed, dict) and printed.get("mean") is not None:
                out.append({"cell": pc["cell"], "metric": m, "unit": spec.get("unit"), "better": spec.get("better"),
                            "paper_mean": printed["mean"], "paper_std": printed.get("std")})
    return out


def paper_numbers(log=print) -> int:
    """Every claim whose cells the paper prints, judged on the printed numbers by the same rule."""
    log("claims judged on the papers' own printed numbers (mean ± std; Welch; Holm within each claim):")
    for name in list_rows():
        p = PAPER_DIR / f"{name}.yaml"
        if not p.exists():
            continue
        row, pd = load_row(name), load_paper_data(p)
        records = paper_records(pd)
        if not records:
            continue
        axes, cells = C.cell_axes(row, pd)
        n = pd.get("seeds") if isinstance(pd.get("seeds"), int) else None
        for claim in pd.get("claims") or []:
            j = C.judge_claim(claim, records, {}, cells, axes, metrics=pd.get("metrics") or {}, source="paper",
                              paper_n=n or C.PAPER_N_ASSUMED)
            if j["verdict"] == "not run":
                continue
            log(f"  {name} / {claim['id']} ({claim['direction']}, {j['quantifier']}; n = "
                f"{n or C.PAPER_N_ASSUMED}{'' if n else ' assumed'}): {j['verdict']} -- {C.tally_text(j)}")
    return 0


__all__ = ["Shape", "calibrate", "paper_numbers", "paper_records", "shapes", "simulate"]
