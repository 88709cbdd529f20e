#!/usr/bin/env python
"""bSAM paper, Fig. 3 / App. F.1: 2-D Bayesian logistic regression (no bias), exact posterior vs
SAM, bSAM and Laplace at the SAM solution. CPU, exact problem, < 2 minutes.

    python scripts/reproduce_bsam_logreg.py --out outputs/toys/bsam_logreg
    (`make reproduce-bsam-logreg` runs it through the runner: page, figures and summary.json in results/reproduce/)

Data: Murphy (2012) §8.4-style two clouds (flatbnn/toys/logreg2d.py: make_data, 30 per class,
seed 0), separable by a line through the origin. Exact posterior: grid integration (601 x 601 cells
on [-lim, lim]^2), giving its moments and the exact predictive. SAM: flatbnn's MAP method (heavy-ball
SGD) x flatbnn's SAM flatness, full batch. bSAM: flatbnn's BSAM method, the whole data set every step
split into one example per part. Laplace at the SAM solution: diagonal of the Hessian of the negative
log joint (the paper: "for the rest, we use diagonal Gaussians"; the full-Hessian variant is
reported too). Gaussian predictives: exact 1-D integral over the logit by Gauss-Hermite quadrature.

Numbers: KL(q || exact moment-matched Gaussian), KL(exact mm || q), and the 2-Wasserstein distance
of every Gaussian (and of the SAM/MAP point masses) to the exact posterior's moment-matched Gaussian;
predictive mean absolute difference to the exact predictive and a confidence gap (mean |p - 1/2|
minus the exact one over the plotted region: > 0 overconfident, < 0 underconfident).

The paper states neither the prior, nor SAM's rho, nor bSAM's settings for this figure; our choices
are in summary.json. The main figure uses the prior N(0, I); ``--prior-vars`` adds others (Murphy's
demo uses variance 100, where the exact posterior is strongly skewed) as extra rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Ellipse  # noqa: E402

from flatbnn.metrics.reliability import save_png  # noqa: E402
from flatbnn.engine.provenance import git_commit, hardware  # noqa: E402
from flatbnn.toys.report import write_checks  # noqa: E402
from flatbnn.toys.logreg2d import (  # noqa: E402
    exact_posterior, fit_bsam, fit_sam, gaussian_kl, gaussian_w2, laplace, make_data, predictive_gaussian,
    predictive_grid, separation_margin,
)

REGION = (-10.0, 6.0, -5.0, 10.0)  # x1_min, x1_max, x2_min, x2_max of the predictive maps
SAM_RHOS = (0.05, 0.2, 0.5)
BSAM = dict(lr=0.5, beta1=0.9, beta2=0.99, rho=0.05, damping=0.1, s_init=1.0, steps=600)  # m = N
SAM = dict(lr=2.0, momentum=0.9, steps=2500)


def region_grid(n=121):
    x1 = np.linspace(REGION[0], REGION[1], n)
    x2 = np.linspace(REGION[2], REGION[3], n)
    A, B = np.meshgrid(x1, x2)
    return x1, x2, np.stack([A.ravel(), B.ravel()], 1)


def compare(name, mean, cov, ex, Xq, p_exact, kind):
    """Distances of one approximation to the exact posterior and its predictive."""
    p = predictive_gaussian(Xq, mean, cov)
    row = {"kind": kind, "mean": mean.tolist(),
           "cov": None if cov is None else np.asarray(cov).tolist(),
           "std": None if cov is None else np.sqrt(np.diag(cov)).tolist(),
           "w2_to_exact_mm": gaussian_w2(mean, np.zeros((2, 2)) if cov is None else cov, ex.mean, ex.cov),
           "kl_q_to_exact_mm": None if cov is None else gaussian_kl(mean, cov, ex.mean, ex.cov),
           "kl_exact_mm_to_q": None if cov is None else gaussian_kl(ex.mean, ex.cov, mean, cov),
           "predictive_mae": float(np.abs(p - p_exact).mean()),
           "confidence_gap": float(np.abs(p - 0.5).mean() - np.abs(p_exact - 0.5).mean())}
    return row, p


def run_prior(X, y, prior_var, Xq, verbose=True):
    t0 = time.perf_counter()
    ex = exact_posterior(X, y, prior_var)
    p_exact = predictive_grid(Xq, ex)
    out = {"prior_var": prior_var,
           "exact": {"mean": ex.mean.tolist(), "cov": ex.cov.tolist(), "std": np.sqrt(np.diag(ex.cov)).tolist(),
                     "mode_on_grid": ex.mode.tolist(), "grid_lim": float(ex.axis[-1]), "grid_n": len(ex.axis),
                     "edge_mass": ex.edge_mass,
                     "predictive_mean_abs_confidence": float(np.abs(p_exact - 0.5).mean())},
           "methods": {}}
    preds = {"exact": p_exact}
    w_map = fit_sam(X, y, prior_var, rho=0.0, **SAM)
    for name, cov, kind in (("map", None, "point (plug-in)"),
                            ("laplace_map_diag", laplace(w_map, X, prior_var), "Gaussian"),
                            ("laplace_map_full", laplace(w_map, X, prior_var, diagonal=False), "Gaussian")):
        out["methods"][name], preds[name] = compare(name, w_map, cov, ex, Xq, p_exact, kind)
    for rho in SAM_RHOS:
        w = fit_sam(X, y, prior_var, rho=rho, **SAM)
        for name, cov, kind in ((f"sam_rho{rho}", None, "point (plug-in)"),
                                (f"laplace_sam_rho{rho}_diag", laplace(w, X, prior_var), "Gaussian"),
                                (f"laplace_sam_rho{rho}_full", laplace(w, X, prior_var, diagonal=False), "Gaussian")):
            out["methods"][name], preds[name] = compare(name, w, cov, ex, Xq, p_exact, kind)
    hp = dict(BSAM)
    steps = hp.pop("steps")
    w, cov, info = fit_bsam(X, y, prior_var, steps=steps, **hp)
    out["methods"]["bsam"], preds["bsam"] = compare("bsam", w, cov, ex, Xq, p_exact, "Gaussian (diagonal)")
    out["methods"]["bsam"]["precision_s"] = info["s"]
    out["seconds"] = time.perf_counter() - t0
    if verbose:
        print(f"\nprior N(0, {prior_var:g} I): exact mean {np.round(ex.mean, 3)}, "
              f"std {np.round(np.sqrt(np.diag(ex.cov)), 3)}"
              f"  ({out['seconds']:.0f}s)")
        print(f"  {'method':24s} {'mean':>18s} {'std':>16s} {'KL(q||p)':>9s} {'KL(p||q)':>9s} {'W2':>7s}"
              f" {'pred MAE':>8s} {'conf gap':>8s}")
        for name, r in out["methods"].items():
            kl = "" if r["kl_q_to_exact_mm"] is None else f"{r['kl_q_to_exact_mm']:9.3f}"
            klr = "" if r["kl_exact_mm_to_q"] is None else f"{r['kl_exact_mm_to_q']:9.3f}"
            std = "point" if r["std"] is None else str(np.round(r["std"], 3))
            print(f"  {name:24s} {str(np.round(r['mean'], 3)):>18s} {std:>16s} {kl:>9s} {klr:>9s}"
                  f" {r['w2_to_exact_mm']:7.3f} {r['predictive_mae']:8.4f} {r['confidence_gap']:+8.4f}")
    return out, ex, preds


def claims(res, sam_rho):
    m = res["methods"]
    lap, sam, bsam = m[f"laplace_sam_rho{sam_rho}_diag"], m[f"sam_rho{sam_rho}"], m["bsam"]
    gaussians = {k: v for k, v in m.items() if v["kl_q_to_exact_mm"] is not None}
    diagonal = {k: v for k, v in gaussians.items() if not k.endswith("_full")}
    best_kl = min(gaussians, key=lambda k: gaussians[k]["kl_q_to_exact_mm"])
    best_w2 = min(gaussians, key=lambda k: gaussians[k]["w2_to_exact_mm"])
    best_kl_diag = min(diagonal, key=lambda k: diagonal[k]["kl_q_to_exact_mm"])
    best_w2_diag = min(diagonal, key=lambda k: diagonal[k]["w2_to_exact_mm"])
    best_pred = min(m, key=lambda k: m[k]["predictive_mae"])
    return {
        "sam_rho_used": sam_rho,
        "sam_overconfident": sam["confidence_gap"] > 0,
        "laplace_at_sam_underconfident": lap["confidence_gap"] < 0,
        "laplace_at_sam_broader_than_exact": all(a > b for a, b in zip(lap["std"], res["exact"]["std"])),
        "bsam_closest_diagonal_gaussian_by_kl": best_kl_diag == "bsam", "closest_diagonal_gaussian_by_kl": best_kl_diag,
        "bsam_closest_diagonal_gaussian_by_w2": best_w2_diag == "bsam", "closest_diagonal_gaussian_by_w2": best_w2_diag,
        "bsam_closest_gaussian_by_kl": best_kl == "bsam", "closest_gaussian_by_kl": best_kl,
        "bsam_closest_gaussian_by_w2": best_w2 == "bsam", "closest_gaussian_by_w2": best_w2,
        "bsam_closest_predictive": best_pred == "bsam", "closest_predictive": best_pred,
        "bsam_predictive_mae_vs_sam": [bsam["predictive_mae"], sam["predictive_mae"]],
    }


def ellipse(ax, mean, cov, label=None, **kw):
    vals, vecs = np.linalg.eigh(np.asarray(cov))
    angle = np.degrees(np.arctan2(vecs[1, 1], vecs[0, 1]))
    for k, ls in ((1, "-"), (2, "--")):
        ax.add_patch(Ellipse(mean, 2 * k * np.sqrt(vals[1]), 2 * k * np.sqrt(vals[0]), angle=angle, fill=False,
                             linestyle=ls, label=label if k == 1 else None, **kw))


def figure(path, X, y, res, ex, preds, sam_rho, x1, x2):
    m = res["methods"]
    panels = [("exact", "exact Bayes (grid integration)"), (f"sam_rho{sam_rho}", f"SAM (rho={sam_rho}), plug-in"),
              ("bsam", "bSAM (diagonal Gaussian)"), (f"laplace_sam_rho{sam_rho}_diag", "Laplace at SAM (diag)")]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.ravel()[:4], panels):
        P = preds[key].reshape(len(x2), len(x1))
        im = ax.contourf(x1, x2, P, levels=np.linspace(0, 1, 21), cmap="RdBu", vmin=0, vmax=1)
        ax.contour(x1, x2, P, levels=[0.1, 0.5, 0.9], colors="k", linewidths=(0.6, 1.2, 0.6))
        ax.scatter(*X[y == 1].T, c="tab:blue", edgecolors="k", s=22)
        ax.scatter(*X[y == 0].T, c="tab:red", edgecolors="k", s=22)
        extra = "" if key == "exact" else (f"\npred. MAE {m[key]['predictive_mae']:.3f}, "
                                           f"conf. gap {m[key]['confidence_gap']:+.3f}")
        ax.set_title(title + extra, fontsize=10)
        ax.set_xlim(REGION[:2])
        ax.set_ylim(REGION[2:])
    fig.colorbar(im, ax=axes[0, :].tolist(), shrink=0.8, label="p(y = 1 | x)")
    # posteriors over w
    ax = axes[1, 1]
    n = len(ex.axis)
    dens = ex.weights.reshape(n, n).T
    lim_lo = ex.mean - 4 * np.sqrt(np.diag(ex.cov))
    lim_hi = ex.mean + 4 * np.sqrt(np.diag(ex.cov))
    ax.contourf(ex.axis, ex.axis, dens, levels=12, cmap="Greys")
    ellipse(ax, ex.mean, ex.cov, color="k", lw=1.4, label="exact, moment-matched")
    ellipse(ax, m["bsam"]["mean"], m["bsam"]["cov"], color="tab:orange", lw=1.6, label="bSAM")
    key = f"laplace_sam_rho{sam_rho}_diag"
    ellipse(ax, m[key]["mean"], m[key]["cov"], color="tab:green", lw=1.4, label="Laplace at SAM (diag)")
    ax.plot(*m["map"]["mean"], "kx", ms=9, label="MAP")
    ax.plot(*m[f"sam_rho{sam_rho}"]["mean"], "m^", ms=8, label=f"SAM (rho={sam_rho})")
    ax.plot(*ex.mean, "k+", ms=10)
    ax.set_xlim(lim_lo[0], lim_hi[0])
    ax.set_ylim(lim_lo[1], lim_hi[1])
    ax.set_xlabel("w1")
    ax.set_ylabel("w2")
    ax.set_title("posterior over w (1 and 2 std ellipses)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    # a 1-D slice through the data: the line through both class centres (-5, 1) and (1, 5)
    ax = axes[1, 2]
    t = np.linspace(-10, 10, 401)
    d = np.array([6.0, 4.0]) / np.hypot(6.0, 4.0)
    Xs = t[:, None] * d[None, :] + np.array([-2.0, 3.0])
    ax.plot(t, predictive_grid(Xs, ex), "k", lw=2, label="exact")
    for key, lab, col in ((f"sam_rho{sam_rho}", "SAM", "m"), ("bsam", "bSAM", "tab:orange"),
                          (f"laplace_sam_rho{sam_rho}_diag", "Laplace at SAM", "tab:green")):
        mm = m[key]
        ax.plot(t, predictive_gaussian(Xs, np.array(mm["mean"]), None if mm["cov"] is None else np.array(mm["cov"])),
                color=col, label=lab)
    ax.set_xlabel("position t along x = (-2, 3) + t (6, 4)/|(6, 4)|")
    ax.set_ylabel("p(y = 1 | x)")
    ax.set_title("predictive on the line through both class centres", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"bSAM Fig. 3 / F.1 reproduction: 2-D logistic regression, prior N(0, {res['prior_var']:g} I), "
                 f"N = {len(y)}", fontsize=12)
    save_png(fig, path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="outputs/toys/bsam_logreg")
    ap.add_argument("--prior-vars", default="1,100", help="comma list; the first one makes the figure")
    ap.add_argument("--sam-rho", type=float, default=0.5, help="SAM radius of the figure (one of %s)" % (SAM_RHOS,))
    ap.add_argument("--steps-divisor", type=int, default=1,
                    help="divide every optimiser's step count (smoke: the pipeline in seconds; the numbers mean nothing)")
    args = ap.parse_args(argv)
    for hp in (SAM, BSAM):  # the summary's budget and choices then state the counts that ran
        hp["steps"] = max(1, hp["steps"] // args.steps_divisor)
    if args.sam_rho not in SAM_RHOS:
        ap.error(f"--sam-rho must be one of {SAM_RHOS}")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    X, y = make_data()
    x1, x2, Xq = region_grid()
    prior_vars = [float(v) for v in args.prior_vars.split(",")]
    rows, main_claims = [], None
    for i, pv in enumerate(prior_vars):
        res, ex, preds = run_prior(X, y, pv, Xq)
        res["claims"] = claims(res, args.sam_rho)
        rows.append(res)
        if i == 0:
            main_claims = res["claims"]
            figure(out / "fig3_logreg.png", X, y, res, ex, preds, args.sam_rho, x1, x2)
    summary = {
        "header": {
            "what": "bSAM (Moellenhoff & Khan, ICLR 2023) Fig. 3 / App. F.1: 2-D Bayesian logistic regression",
            "budget": (f"CPU, exact 2-D problem; {len(prior_vars)} priors x (MAP + {len(SAM_RHOS)} SAM runs of "
                       f"{SAM['steps']} "
                       f"full-batch steps + 1 bSAM run of {BSAM['steps']} steps with {len(y)} parts each)"),
            "git": git_commit(untracked=True), "seconds": None, "hardware": hardware(torch.device("cpu"), 1),
            "paper_reproduction": "qualitative (figure); the paper gives no numbers for this toy",
        },
        "data": {"generator": "flatbnn.toys.logreg2d.make_data(n_per_class=30, seed=0): class 1 ~ N((1,5), 1^2 I), "
                              "class 0 ~ N((-5,1), 1.1^2 I), numpy default_rng(0), class 1 drawn first",
                 "n": len(y), "separation_margin_through_origin": separation_margin(X, y),
                 "model": "p(y=1|x,w) = sigmoid(w^T x), w in R^2, no bias; prior N(0, prior_var I)"},
        "choices": {
            "exact": "grid integration, 601 x 601 midpoint cells on [-lim, lim]^2, lim = 8 sqrt(prior_var) + 4",
            "gaussian_predictive": "exact 1-D integral over a = w^T x ~ N(mu^T x, x^T S x), 64-point Gauss-Hermite",
            "sam": ("flatbnn MAP (SGD lr %g, momentum %g, weight decay 1/(prior_var N), cosine to 0, %d full-batch "
                    "steps, start 0) x flatbnn flatness SAM (m = 1); rho in %s, the figure uses %s"
                    % (SAM["lr"], SAM["momentum"], SAM["steps"], SAM_RHOS, args.sam_rho)),
            "laplace": "at the SAM (or MAP) solution: H = sum_i p_i(1-p_i) x_i x_i^T + I/prior_var; diag: 1/diag(H) "
                       "(the paper's 'diagonal Gaussians'); full: H^-1",
            "bsam": {**BSAM, "m": f"N = {len(y)} (one example per part, fresh random order each step)",
                     "n_data": len(y), "prior_precision": "1/prior_var", "start": "w = 0",
                     "note": "beta2 0.99 (not 0.999) so the precision's EMA converges within the run; "
                             "damping 0.1, rho 0.05, lr 0.5 are the official two-moons demo's values"},
            "metrics": "KL and W2 to the exact posterior's moment-matched Gaussian N(m_exact, C_exact); W2 of a point "
                       "estimate = sqrt(|w - m|^2 + tr C); predictive MAE and confidence gap over a 121 x 121 grid "
                       f"on x in {REGION}",
        },
        "results": rows,
        "claims_main_prior": main_claims,
    }
    summary["header"]["seconds"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    main = rows[0]
    write_checks(out / "checks.md", "Our checks (bSAM Fig. 3 / App. F.1)",
                 f"{summary['header']['budget']}; commit {summary['header']['git']['commit'][:8]}"
                 f"{' (dirty tree)' if summary['header']['git'].get('dirty') else ''}; prior N(0, {prior_vars[0]:g} I)",
                 main_claims, tables=[(
                     "Each method against the exact posterior (grid integration): KL and W2 to its moment-matched "
                     "Gaussian (a point estimate has no KL), the predictive's mean absolute error and confidence gap "
                     "(> 0: over-confident) on a 121 x 121 input grid.",
                     ["method", "KL(q, exact)", "W2", "predictive MAE", "confidence gap"],
                     [[k, "–" if v["kl_q_to_exact_mm"] is None else v["kl_q_to_exact_mm"], v["w2_to_exact_mm"],
                       v["predictive_mae"], v["confidence_gap"]] for k, v in main["methods"].items()])])
    print(f"\nclaims (prior N(0, {prior_vars[0]:g} I)): {json.dumps(main_claims)}")
    print(f"wrote {out / 'summary.json'} and {out / 'fig3_logreg.png'} in {summary['header']['seconds']:.0f}s")


if __name__ == "__main__":
    main()
