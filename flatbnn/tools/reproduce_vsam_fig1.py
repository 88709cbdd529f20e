#!/usr/bin/env python
"""VariationalSAM (Ujvary et al.) Fig. 1: the Fisher-SAM toy loss and its SAM / Gaussian smoothings.

    python scripts/reproduce_vsam_fig1.py --out outputs/toys/vsam_fig1
    (`make reproduce-vsam-fig1` runs it through the runner: page, figures and summary.json in results/reproduce/)

The VSAM paper's Fig. 1 uses "the original loss L [12]", [12] = Fisher SAM, i.e. the same 2-D
loss over theta = (mu, sigma) as scripts/reproduce_fsam_toy.py, with rho = 8 in all panels:

  A  L(theta)
  B  E_{z ~ N(0, rho^2/p I)} L(theta + z), p = 2 (RandomSAM / MFVI with Sigma = rho^2/p I):
     std = rho / sqrt(2) per coordinate; quadrature: 32-node Gauss-Hermite in mu x Gauss-Legendre
     in sigma over +-8 std, split at sigma = 0 with t^3-clustered nodes (L has an integrable log
     singularity there); sigma + z < 0 is evaluated as |sigma + z| (N(mu, sigma^2) depends on
     sigma^2 only). Checked against Monte Carlo at a few points (summary.json).
  C  max_{||eps|| <= rho} L(theta + eps) (SAM with Sigma = rho^2/p I: eps^T Sigma^-1 eps <= p is
     the Euclidean ball of radius rho): dense polar search (8 rings x 256 angles + centre) then
     projected gradient ascent. Where the ball reaches sigma <= 0 the supremum is +inf (L -> +inf
     as sigma -> 0+); those points are shown hatched.
  D  L(theta + rho g/||g||), g = grad L(theta): the first-order inner max the SAM update uses.

Writes fig1.png and summary.json (minima of every landscape, basin areas, checks).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from flatbnn.metrics.reliability import save_png  # noqa: E402
from flatbnn.engine.provenance import git_commit  # noqa: E402
from flatbnn.toys.report import write_checks  # noqa: E402
from flatbnn.toys.fsam_gaussian import DTYPE, KL_OFFSET_PAPER, GaussianMixtureLoss, find_minima  # noqa: E402
from flatbnn.toys.smoothing import (  # noqa: E402
    gaussian_smoothed, gaussian_smoothed_mc, sam_first_order, sam_smoothed,
)

BLOWUP = {1: 0.0}      # L -> +inf as sigma -> 0+
SINGULAR = {1: 0.0}    # integrable log singularity of L at sigma = 0
NEAR = 8.0             # a smoothed landscape's minimum within this distance "is" the original minimum moved


def grid_local_minima(Z: np.ndarray, merge: int = 5) -> list[tuple[int, int]]:
    """Finite interior grid points below all 8 (finite) neighbours; of several within ``merge``
    cells of each other (a flat-bottomed valley, e.g. the SAM max) only the lowest is kept."""
    out = []
    ny, nx = Z.shape
    for i in range(1, ny - 1):
        for j in range(1, nx - 1):
            z = Z[i, j]
            if not np.isfinite(z):
                continue
            nb = Z[i - 1:i + 2, j - 1:j + 2].copy()
            nb[1, 1] = np.inf
            if np.all(z <= nb[np.isfinite(nb)]) and np.isfinite(nb).sum() == 8:
                out.append((i, j))
    out.sort(key=lambda ij: Z[ij])
    kept: list[tuple[int, int]] = []
    for ij in out:
        if all(max(abs(ij[0] - k[0]), abs(ij[1] - k[1])) > merge for k in kept):
            kept.append(ij)
    return kept


def grid_basins(Z: np.ndarray) -> np.ndarray:
    """Discrete steepest descent on the grid: each finite cell -> flat index of the local min it flows to."""
    ny, nx = Z.shape
    Zf = np.where(np.isfinite(Z), Z, np.inf)
    nxt = np.arange(ny * nx)
    for i in range(ny):
        for j in range(nx):
            if not np.isfinite(Zf[i, j]):
                nxt[i * nx + j] = -1
                continue
            i0, i1, j0, j1 = max(0, i - 1), min(ny, i + 2), max(0, j - 1), min(nx, j + 2)
            win = Zf[i0:i1, j0:j1]
            k = np.unravel_index(np.argmin(win), win.shape)
            if win[k] < Zf[i, j]:
                nxt[i * nx + j] = (i0 + k[0]) * nx + (j0 + k[1])
    root = nxt.copy()
    for _ in range(ny + nx + 10):
        valid = root >= 0
        new = root.copy()
        new[valid] = nxt[root[valid]]
        if np.array_equal(new, root):
            break
        root = new
    return root.reshape(ny, nx)


def pattern_descent(fn, x0: np.ndarray, v0: float, radii=(2.0, 0.5, 0.1, 0.02), n_dir: int = 64,
                    max_steps: int = 100):
    """Local minimum by pattern search: evaluate fn at ``n_dir`` points on a circle of radius r around
    the current point, move to the best if it is lower, else shrink r. The fine direction set
    follows the creases of a non-smooth landscape (the SAM max has them where its maximiser jumps),
    where a grid or box search stalls. Batched evaluations; position error ~ radii[-1]."""
    ang = np.linspace(0, 2 * np.pi, n_dir, endpoint=False)
    ring = np.stack([np.cos(ang), np.sin(ang)], 1)
    x, v = np.asarray(x0, float), float(v0)
    for r in radii:
        for _ in range(max_steps):
            P = x + r * ring
            vals = torch.as_tensor(fn(P)).detach().numpy().astype(float).reshape(-1)
            vals = np.where(np.isfinite(vals), vals, np.inf)
            k = int(np.argmin(vals))
            if not vals[k] < v:
                break
            x, v = P[k], float(vals[k])
    return x, v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/toys/vsam_fig1")
    ap.add_argument("--rho", type=float, default=8.0)
    ap.add_argument("--p", type=int, default=2, help="number of parameters: Sigma = rho^2/p I")
    ap.add_argument("--nodes", type=int, default=32, help="quadrature nodes per axis (32 and 64 agree to 1e-7)")
    ap.add_argument("--kl-offset", type=float, default=KL_OFFSET_PAPER)
    ap.add_argument("--mu", type=float, nargs=2, default=(-45.0, 45.0))
    ap.add_argument("--sigma", type=float, nargs=2, default=(1.0, 60.0))
    ap.add_argument("--n", type=int, nargs=2, default=(91, 60), help="grid points in mu, sigma")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    loss = GaussianMixtureLoss(kl_offset=args.kl_offset)
    rho, std = args.rho, args.rho / math.sqrt(args.p)

    mu = np.linspace(*args.mu, args.n[0])
    sg = np.linspace(*args.sigma, args.n[1])
    M, S = np.meshgrid(mu, sg)
    pts = np.stack([M.ravel(), S.ravel()], 1)

    fns = {
        "original": lambda x: loss(torch.as_tensor(np.asarray(x, float), dtype=DTYPE).reshape(-1, 2)),
        "gaussian": lambda x: gaussian_smoothed(loss, x, std, n_nodes=args.nodes, singular=SINGULAR),
        "sam_max": lambda x: sam_smoothed(loss, x, rho, blowup_below=BLOWUP),
        "sam_first_order": lambda x: sam_first_order(loss, x, rho, blowup_below=BLOWUP),
    }
    # cheaper versions for the many evaluations of the local searches (the SAM max with a coarser
    # disk search, still followed by projected gradient ascent); reported values use ``fns``
    fast = {**fns, "sam_max": lambda x: sam_smoothed(loss, x, rho, blowup_below=BLOWUP, n_radii=4, n_angles=64,
                                                      refine_steps=15)}
    Z = {}
    with torch.no_grad():
        Z["original"] = fns["original"](pts).numpy().reshape(M.shape)
    Z["gaussian"] = fns["gaussian"](pts).numpy().reshape(M.shape)
    inside = pts[:, 1] - rho > 0                       # ball stays in sigma > 0
    zs = np.full(len(pts), np.inf)
    zs[inside] = sam_smoothed(loss, pts[inside], rho, blowup_below=BLOWUP).numpy()
    Z["sam_max"] = zs.reshape(M.shape)
    Z["sam_first_order"] = fns["sam_first_order"](pts).detach().numpy().reshape(M.shape)

    # ---------------------------------------------------------------- minima and basins
    orig_min = find_minima(loss)
    landscapes = {}
    for key, z in Z.items():
        mins = []
        for i, j in grid_local_minima(z):
            x0 = np.array([M[i, j], S[i, j]])
            x, _ = pattern_descent(fast[key], x0, float(fast[key](x0[None])[0]), radii=(2.0, 0.5, 0.1, 0.02, 0.005),
                                   n_dir=128)
            v = float(torch.as_tensor(fns[key](x[None])).detach()[0])   # value at full resolution
            mins.append({"theta": [float(t) for t in x], "value": v,
                         "grid_theta": [float(M[i, j]), float(S[i, j])], "grid_value": float(z[i, j])})
        merged: list[dict] = []                        # a flat-bottomed valley can give two grid minima
        for m in sorted(mins, key=lambda m: m["value"]):
            if all(np.linalg.norm(np.subtract(m["theta"], k["theta"])) > 0.5 for k in merged):
                merged.append(m)
        mins = sorted(merged, key=lambda m: m["theta"][0])
        # area of each local minimum's basin (discrete steepest descent on the grid), over sigma > rho
        # (where all four landscapes are finite), attributed to the nearest original minimum
        root = grid_basins(np.where(S > rho, z, np.inf))
        cells = np.isfinite(np.where(S > rho, z, np.inf))
        area = {"flat": 0, "sharp": 0, "other": 0}
        for r in np.unique(root[cells]):
            # a grid sink can be an artefact of a narrow diagonal valley: follow it down first
            x0 = np.array([M.ravel()[r], S.ravel()[r]])
            rm, _ = pattern_descent(fast[key], x0, float(fast[key](x0[None])[0]), radii=(2.0, 0.5))
            side = min(("flat", "sharp"), key=lambda k: np.linalg.norm(rm - orig_min[k]["theta"]))
            if np.linalg.norm(rm - orig_min[side]["theta"]) > NEAR:
                side = "other"                           # e.g. the first-order landscape's sink at the saddle
            area[side] += int((root[cells] == r).sum())
        n = int(cells.sum())
        sharp_survives = any(np.linalg.norm(np.array(m["theta"]) - orig_min["sharp"]["theta"]) < NEAR for m in mins)
        landscapes[key] = {"local_minima": mins,
                           "basin_fraction_sigma_gt_rho": {k: v / n for k, v in area.items()},
                           f"sharp_minimum_survives_(a_local_min_within_{NEAR:g})": bool(sharp_survives)}

    # ---------------------------------------------------------------- checks
    checks = []
    for p in [(0.0, 30.0), (-16.0, 13.5), (20.0, 30.0), (0.0, 10.0), (-10.0, 4.0)]:
        q = float(gaussian_smoothed(loss, [p], std, n_nodes=args.nodes, singular=SINGULAR)[0])
        mc, se = gaussian_smoothed_mc(loss, p, std, n=400_000, seed=0)
        checks.append({"theta": p, "quadrature": q, "monte_carlo": mc, "mc_stderr": se, "z": (q - mc) / se})
    finite = np.isfinite(Z["sam_max"])
    sam_ge = bool(np.all(Z["sam_max"][finite] >= Z["original"][finite] - 1e-12))

    summary = {
        "header": {
            "what": "VariationalSAM Fig. 1 (Ujvary et al.): Fisher-SAM toy loss, SAM- and Gaussian-smoothed",
            "budget": f"CPU, exact 2-D problem, {M.size}-point grid",
            "git_commit": git_commit()["commit"],
            "loss": "Fisher-SAM Eq. 15 (VSAM Fig. 1 caption: 'the original loss L [12]', [12] = Fisher SAM), "
                    f"E_i = KL_i + c, c = {args.kl_offset}",
        },
        "rho": rho, "p": args.p, "gaussian_std_per_coordinate": std,
        "methods": {
            "gaussian": f"E_(z~N(0,(rho^2/p) I)) L(theta+z): {args.nodes}-node Gauss-Hermite in mu x Gauss-Legendre in sigma "
                        f"over +-8 std ({args.nodes} nodes, or 2x{args.nodes} t^3-clustered nodes split at sigma=0 "
                        "when the window reaches it); L(mu, s) for s < 0 evaluated as L(mu, |s|)",
            "sam_max": "max over the Euclidean disk ||eps|| <= rho (= eps^T Sigma^-1 eps <= p): centre + 8 rings x 256 "
                       "angles, then 30 steps of monotone projected gradient ascent; +inf where the disk reaches sigma <= 0",
            "sam_first_order": "L(theta + rho g/||g||); undefined (nan) where that point has sigma <= 0",
            "minima": "local minima of the grid (<= all 8 finite neighbours; the lowest of any within 5 cells), refined by pattern search (128 directions, radii 2, 0.5, 0.1, 0.02, 0.005) on the landscape, merged within 0.5",
            "basins": "discrete steepest descent on the grid restricted to sigma > rho; each grid sink followed down "
                      "by pattern search (64 directions, radii 2, 0.5) and attributed to the nearer original minimum if within 8, "
                      "else to 'other'",
        },
        "grid": {"mu": list(args.mu), "sigma": list(args.sigma), "n": list(args.n)},
        "original_minima": {k: {"theta": v["theta"], "loss": v["loss"]} for k, v in orig_min.items()},
        "landscapes": landscapes,
        "checks": {"gaussian_quadrature_vs_monte_carlo": checks, "sam_max_ge_original_everywhere_on_grid": sam_ge},
        "seconds": None,
    }

    # ---------------------------------------------------------------- figure
    titles = {
        "original": "A: original loss L",
        "gaussian": f"B: Gaussian smoothing E L(θ+z), z~N(0,{std:.2f}² I)",
        "sam_max": f"C: SAM max over ‖ε‖≤{rho:g}",
        "sam_first_order": f"D: first-order SAM L(θ+{rho:g} g/‖g‖)",
    }
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.3), sharey=True)
    allv = np.concatenate([z[np.isfinite(z)] for z in Z.values()])
    levels = np.unique(np.quantile(allv, np.linspace(0, 0.95, 28)))   # one colour scale for all panels
    for ax, key in zip(axes, Z):
        z = Z[key]
        cs = ax.contourf(M, S, np.where(np.isfinite(z), z, np.nan), levels=levels, cmap="viridis_r", extend="max")
        ax.contour(M, S, np.where(np.isfinite(z), z, np.nan), levels=levels, colors="k", linewidths=0.3, alpha=0.5)
        if not np.all(np.isfinite(z)):
            ax.contourf(M, S, (~np.isfinite(z)).astype(float), levels=[0.5, 1.5], colors="none", hatches=["///"])
        ax.plot(*orig_min["flat"]["theta"], "*", color="blue", ms=14, mec="w", label="flat min of L")
        ax.plot(*orig_min["sharp"]["theta"], "o", color="magenta", ms=8, mec="w", label="sharp min of L")
        for m in landscapes[key]["local_minima"]:
            ax.plot(*m["theta"], "P", color="red", ms=9, mec="k")
        ax.set_title(titles[key], fontsize=10)
        ax.set_xlabel("μ")
    axes[0].set_ylabel("σ")
    fig.colorbar(cs, ax=axes, shrink=0.8, pad=0.01, format="%.2f")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"VSAM Fig. 1 on the Fisher-SAM toy, ρ = {rho:g} (red +: local minima of each landscape; "
                 "hatched: +inf / undefined, the ρ-ball or probe reaches σ ≤ 0)", fontsize=10)
    save_png(fig, out / "fig1.png", dpi=70)
    plt.close(fig)

    summary["seconds"] = round(time.time() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_checks(out / "checks.md", "Our checks (VariationalSAM Fig. 1)",
                 f"{summary['header']['budget']}; commit {summary['header']['git_commit'][:8]}; rho {rho:g}, Gaussian "
                 f"std {std:.3f} per coordinate",
                 {"SAM max >= the original loss everywhere on the grid": sam_ge,
                  "Gaussian smoothing by quadrature vs Monte Carlo, largest |z| at the check points":
                      max(abs(c["z"]) for c in checks)},
                 tables=[("Each landscape's local minima (mu, sigma) and the share of the grid (sigma > rho) that "
                          "descends to each minimum.",
                          ["landscape", "local minima", "flat basin", "sharp basin", "other"],
                          [[k, "; ".join(f"({m['theta'][0]:.2f}, {m['theta'][1]:.2f}) L={m['value']:.4f}"
                                         for m in v["local_minima"]),
                            *(v["basin_fraction_sigma_gt_rho"][b] for b in ("flat", "sharp", "other"))]
                           for k, v in landscapes.items()])])
    print(summary["header"]["budget"], "| commit", summary["header"]["git_commit"][:10], f"| rho={rho:g}, std={std:.3f}")
    for key, v in landscapes.items():
        ms = "; ".join(f"({m['theta'][0]:.2f}, {m['theta'][1]:.2f}) v={m['value']:.4f}" for m in v["local_minima"])
        bf = v["basin_fraction_sigma_gt_rho"]
        print(f"{key:16s} minima: {ms}   basin(sigma>{rho:g}): flat {bf['flat']:.2f} sharp {bf['sharp']:.2f}"
              f" other {bf['other']:.2f}")
    print("quadrature vs MC (z-scores):", [round(c["z"], 2) for c in checks], "| SAM max >= L on grid:", sam_ge)
    print(f"wrote {out}/fig1.png and summary.json in {summary['seconds']} s")


if __name__ == "__main__":
    main()
