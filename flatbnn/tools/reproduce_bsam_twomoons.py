#!/usr/bin/env python
"""bSAM paper, App. F.2 / Fig. 6: SAM vs bSAM predictive uncertainty on two moons. CPU, < 2 minutes.

    python scripts/reproduce_bsam_twomoons.py --out outputs/toys/bsam_twomoons
    (`make reproduce-bsam-twomoons` runs it through the runner: page, figures and summary.json in results/reproduce/)

Set-up in flatbnn/toys/twomoons.py (the authors' demo2d.py values for bSAM: 100 points, MLP
2-32-32-32-32-1 ELU, batch 30, M = 5, alpha 0.5, rho 0.05, damping 0.1, delta 1e-4, 250 + 1 epochs,
per-epoch cosine). bSAM's predictive averages sigmoid over 32 samples w + n sqrt(1/(N s)); SAM's is
the plug-in sigmoid at its weights. Reported per seed and averaged: train accuracy, and the mean
predictive entropy (nats, max log 2 = 0.693) on grid points far from the data (distance to the nearest
training point > ``--far``) and near it (< 0.2). The paper's claim: bSAM is uncertain away from the
data where SAM stays confident.
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

from flatbnn.metrics.reliability import save_png  # noqa: E402
from flatbnn.engine.provenance import git_commit, hardware  # noqa: E402
from flatbnn.toys.report import write_checks  # noqa: E402
from flatbnn.toys.twomoons import (  # noqa: E402
    BATCH, BSAM_HP, DELTA, N_DATA, SAM_HP, binary_entropy, make_data, predictive, train_bsam, train_sam,
)

REGION = (-2.5, 3.5, -2.0, 2.5)
NUM_SAMPLES = 32


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="outputs/toys/bsam_twomoons")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--far", type=float, default=1.0, help="'away from the data': distance to the nearest point")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    X, y = make_data()
    x1 = np.linspace(REGION[0], REGION[1], 121)
    x2 = np.linspace(REGION[2], REGION[3], 91)
    A, B = np.meshgrid(x1, x2)
    grid = np.stack([A.ravel(), B.ravel()], 1)
    dist = np.sqrt(((grid[:, None, :] - X.numpy()[None, :, :]) ** 2).sum(-1)).min(1)
    far, near = dist > args.far, dist < 0.2
    Xq = torch.as_tensor(grid, dtype=torch.float32)
    seeds = [int(s) for s in args.seeds.split(",")]
    per_seed, maps = [], {}
    for seed in seeds:
        ts = time.perf_counter()
        bsam = train_bsam(X, y, epochs=args.epochs, seed=seed)
        sam = train_sam(X, y, epochs=args.epochs, seed=seed)
        p = {"sam": predictive(sam, Xq), "bsam": predictive(bsam, Xq, NUM_SAMPLES),
             "bsam_mean": predictive(bsam, Xq)}
        p_train = {"sam": predictive(sam, X), "bsam": predictive(bsam, X, NUM_SAMPLES),
                   "bsam_mean": predictive(bsam, X)}
        row = {"seed": seed, "seconds": None}
        for k in p:
            ent = binary_entropy(p[k])
            row[k] = {"train_accuracy": float(((p_train[k] > 0.5) == (y.numpy() > 0.5)).mean()),
                      "entropy_far": float(ent[far].mean()), "entropy_near": float(ent[near].mean()),
                      "fraction_far_confident_(p<0.05_or_>0.95)":
                          float(((p[k][far] < 0.05) | (p[k][far] > 0.95)).mean())}
        row["bsam"]["mean_posterior_std"] = bsam.optimizer.summary()["mean_posterior_std"]
        row["seconds"] = time.perf_counter() - ts
        per_seed.append(row)
        if seed == seeds[0]:
            maps = p
        print(f"seed {seed}: " + "  ".join(
            f"{k}: train acc {row[k]['train_accuracy']:.3f}, H far {row[k]['entropy_far']:.3f}, "
            f"H near {row[k]['entropy_near']:.3f}" for k in ("sam", "bsam", "bsam_mean"))
            + f"  ({row['seconds']:.0f}s)")
    mean = {k: {m: float(np.mean([r[k][m] for r in per_seed])) for m in per_seed[0][k]}
            for k in ("sam", "bsam", "bsam_mean")}
    claim = {
        "bsam_more_uncertain_far_from_data_every_seed": all(r["bsam"]["entropy_far"] > r["sam"]["entropy_far"]
                                                           for r in per_seed),
        "bsam_fits_training_data_(acc>=0.95)": all(r["bsam"]["train_accuracy"] >= 0.95 for r in per_seed),
        "sam_fits_training_data_(acc>=0.95)": all(r["sam"]["train_accuracy"] >= 0.95 for r in per_seed),
    }
    # figure (first seed)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), constrained_layout=True)
    for j, (key, title) in enumerate((("sam", "SAM (plug-in)"), ("bsam", f"bSAM ({NUM_SAMPLES} samples)"))):
        P = maps[key].reshape(len(x2), len(x1))
        im0 = axes[0, j].contourf(x1, x2, P, levels=np.linspace(0, 1, 21), cmap="RdBu", vmin=0, vmax=1)
        axes[0, j].contour(x1, x2, P, levels=[0.5], colors="k", linewidths=1.5)
        im1 = axes[1, j].contourf(x1, x2, binary_entropy(P), levels=np.linspace(0, np.log(2), 15), cmap="viridis")
        for ax in axes[:, j]:
            ax.scatter(*X[y == 0].numpy().T, c="tab:red", edgecolors="k", s=18)
            ax.scatter(*X[y == 1].numpy().T, c="tab:blue", edgecolors="k", s=18)
        r = per_seed[0][key]
        axes[0, j].set_title(f"{title}: p(y=1|x); train acc {r['train_accuracy']:.2f}", fontsize=10)
        axes[1, j].set_title(f"{title}: predictive entropy; mean far from data {r['entropy_far']:.3f}", fontsize=10)
    fig.colorbar(im0, ax=axes[0, :].tolist(), shrink=0.8, label="p(y = 1 | x)")
    fig.colorbar(im1, ax=axes[1, :].tolist(), shrink=0.8, label="entropy (nats)")
    fig.suptitle(f"bSAM App. F.2 reproduction: two moons, seed {seeds[0]}", fontsize=12)
    save_png(fig, out / "fig6_twomoons.png", dpi=110)
    plt.close(fig)
    summary = {
        "header": {
            "what": "bSAM (Moellenhoff & Khan, ICLR 2023) App. F.2 / Fig. 6: SAM vs bSAM on two moons",
            "budget": f"CPU; {len(seeds)} seeds x 2 methods x {args.epochs + 1} epochs of {N_DATA // BATCH} steps "
                      f"(batch {BATCH}, M = 5 parts per step)",
            "git": git_commit(untracked=True), "seconds": time.perf_counter() - t0,
            "hardware": hardware(torch.device("cpu"), 1),
            "paper_reproduction": "qualitative (figure); the paper gives no numbers for this toy",
        },
        "choices": {
            "data": "sklearn make_moons(100, noise=0.1, random_state=1) (= the authors' demo2d.py)",
            "model": "flatbnn MLP 2-32-32-32-32-1, ELU, BCE on one logit",
            "bsam": {**BSAM_HP, "prior_precision": DELTA * N_DATA, "n_data": N_DATA,
                     "schedule": "per-epoch cosine 0.5(1+cos(pi e/E)), E = epochs, e = 0..E",
                     "predictive": f"average of sigmoid over {NUM_SAMPLES} samples (eval seed 1); bsam_mean = mean w"},
            "sam": {**SAM_HP, "weight_decay": DELTA, "optimizer": "SGD heavy-ball (flatbnn MAP) x flatbnn SAM flatness",
                    "predictive": "plug-in"},
            "entropy_regions": f"121 x 91 grid on {REGION}; far: distance to nearest training point > {args.far}; "
                               f"near: < 0.2 ({int(far.sum())} far / {int(near.sum())} near points)",
        },
        "per_seed": per_seed,
        "mean_over_seeds": mean,
        "claims": claim,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    git = summary["header"]["git"]
    cols = ["train_accuracy", "entropy_far", "entropy_near", "fraction_far_confident_(p<0.05_or_>0.95)"]
    write_checks(out / "checks.md", "Our checks (bSAM App. F.2, two moons)",
                 f"{summary['header']['budget']}; commit {git['commit'][:8]}{' (dirty tree)' if git.get('dirty') else ''}",
                 claim, tables=[(f"Mean over the {len(seeds)} seeds (predictive entropy in nats; far: more than "
                                 f"{args.far} from every training point; bsam_mean: bSAM's mean weights alone).",
                                 ["method", *cols], [[k, *(v.get(c) for c in cols)] for k, v in mean.items()])])
    print("mean over seeds:", json.dumps(mean))
    print("claims:", json.dumps(claim))
    print(f"wrote {out / 'summary.json'} and {out / 'fig6_twomoons.png'} in {summary['header']['seconds']:.0f}s")


if __name__ == "__main__":
    main()
