#!/usr/bin/env python
"""Analyse finished runs: sharpness, loss landscapes and reliability diagrams (flat_seeking_bnn
section 4.2, Figs. 1-2).

    python scripts/analyze.py sharpness   RUN... [--rho 0.05] [--samples 5] [--steps 1] [--out s.json|s.png]
    python scripts/analyze.py landscape   RUN... [--samples 2] [--span 1 --points 21] [--two-d] --out fig.png
    python scripts/analyze.py reliability RUN... [--bins 20] [--binning width] [--edges right] --out fig.png
    python scripts/analyze.py perturb     RUN... [--labels SGD SGD SAM ...] [--alphas 0,0.1,...,5] --out fig.png
    python scripts/analyze.py overhead    BENCHMARK.json --out overhead.png   # FSAM Sec. 5.7 ratios vs the paper

Each RUN is a run directory with ``.hydra/config.yaml`` and ``checkpoints/last.pt``. The run's
dataset, model and method are rebuilt from its config and the method's state is loaded from the
checkpoint. "Sampled models" are the method's own posterior samples, in its own order: the first
K samples that ``method.predict`` evaluates (SWAG: its sampler with the run's evaluation seed and
a BatchNorm refresh per sample; SGLD: the last K kept samples; deep ensembles: the first K
members; bSAM/VOGN/VSAM/RSAM: their Gaussian samples; MAP / SWA: the one model). Methods whose
samples are stochastic forward passes rather than weights (SGVB family incl. HWA, MC dropout) are
refused by ``sharpness`` and ``landscape``.

The loss is the mean cross-entropy over a fixed random subset (``--examples``, ``--subset-seed``)
of the training set without its crop/flip or AutoAugment (``--data train``, the paper's L_S;
ImageNet's train set keeps its augmentation at the last epoch) or of the test set,
evaluated in eval mode (BatchNorm running statistics, no dropout). ``sharpness`` reports per
sampled model ``max_{||eps|| <= rho} L(theta + eps) - L(theta)`` (``--steps 1`` = SAM's one-step
estimate, more = projected gradient ascent) and their mean (the paper averages 5 samples), and
optionally the Hessian's top eigenvalue and Hutchinson trace. ``reliability`` uses
``RUN/predictive.pt`` (``{"test": [N, C] predictive log-probs}``) when present, else re-predicts
the test set with the method's ``predict`` and the run's metric settings. ``perturb`` (Fisher SAM Fig. 4)
evaluates the test set at theta + alpha g/||g||, g the gradient of the clean training loss
(:mod:`flatbnn.metrics.perturbation`); runs given the same label are seeds of one curve (mean, std band).

Every PNG gets a JSON of the same name beside it with all numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


from flatbnn import resources  # noqa: E402
from flatbnn.engine.checkpoint import write_json, write_text  # noqa: E402


# --------------------------------------------------------------------------------------------
# reloading a finished run
# --------------------------------------------------------------------------------------------
@dataclass
class Run:
    path: Path
    cfg: object
    built: object           # flatbnn.engine.build.Built
    bundle: object
    method: object
    device: torch.device
    label: str
    results: dict | None


def _label(cfg, results) -> str:
    meta = (results or {}).get("meta", {})
    method = meta.get("method", {}).get("name") or cfg.method.get("mode") or cfg.method.get("name") \
        or str(cfg.method._target_).rsplit(".", 1)[-1].lower()
    flat = meta.get("flatness", {}).get("name") or cfg.get("flatness", {}).get("name", "none")
    return method if flat in (None, "none") else f"{method}+{flat}"


def load_run(path, device: str | None = None) -> Run:
    """Rebuild a finished run with train.py's builder (``flatbnn.engine.build.build``, as evaluate.py
    does) and restore the method (weights + posterior state) from ``checkpoints/last.pt``. The
    training data are put at the last epoch (order and augmentation), as the run's final evaluation
    saw them, so BatchNorm refreshes of sampled weights (SWAG) see the same batches."""
    from omegaconf import OmegaConf

    from flatbnn.engine.checkpoint import load_checkpoint
    from flatbnn.engine.build import build

    path = Path(path)
    cfg_file, ckpt_file = path / ".hydra" / "config.yaml", path / "checkpoints" / "last.pt"
    for f in (cfg_file, ckpt_file):
        if not f.exists():
            raise SystemExit(f"analyze: {path}: no {f.relative_to(path)} (not a finished run directory)")
    cfg = OmegaConf.load(cfg_file)
    if device is not None:
        cfg.trainer.device = device
    state = load_checkpoint(ckpt_file)
    b = build(cfg, run_dir=path, training=False)
    if state["epoch"] != b.total_epochs or state.get("step_in_epoch", 0):
        print(f"analyze: warning: {path}: checkpoint at epoch {state['epoch']} of {b.total_epochs} "
              f"(an unfinished run)", file=sys.stderr)
    b.method.load_state_dict(state["method"])
    last = b.total_epochs - 1
    if last >= 0:
        if hasattr(b.bundle.train, "set_epoch"):
            b.bundle.train.set_epoch(last)
        b.sampler.set_epoch(last)
    b.module.eval()
    res_file = path / "results.json"
    results = json.loads(res_file.read_text()) if res_file.exists() else None
    return Run(path, cfg, b, b.bundle, b.method, b.device, _label(cfg, results), results)


def load_runs(paths, device, labels=None) -> list[Run]:
    runs = [load_run(p, device) for p in paths]
    if labels:
        if len(labels) != len(runs):
            raise SystemExit(f"analyze: {len(labels)} --labels for {len(runs)} runs")
        for r, lab in zip(runs, labels):
            r.label = lab
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:  # disambiguate equal labels by the run directory's name
        if seen[r.label] > 1:
            r.label = f"{r.label} ({r.path.name})"
    return runs


def _weight_sampling(method) -> bool:
    return bool(getattr(method, "samples_weights", True))  # declared by the method class (flatbnn/methods/base.py)


def _weight_sampling_options() -> str:
    """The shipped method configs whose class samples weights."""
    from hydra.utils import get_class

    from flatbnn.resources import own_targets
    return ", ".join(n for n, t in own_targets("method").items() if get_class(t).samples_weights)


def sampled_models(run: Run, k: int):
    """Yield ``(i, module)`` holding the method's i-th posterior sample (its own sampler, BN refresh);
    the method restores its weights when the generator is closed."""
    m = run.method
    if not _weight_sampling(m):
        raise SystemExit(f"analyze: {run.path}: method={m.name} samples stochastic forward passes, not weights; "
                         f"sharpness/landscape need weight samples (methods that sample them: "
                         f"{_weight_sampling_options()})")
    gen = m.predict({}, k)  # no loaders: each step only sets (and BN-refreshes) the sampled weights
    try:
        for i, _ in enumerate(gen):
            yield i, m.module
            if i + 1 >= k:
                break
    finally:
        gen.close()


def loss_batches(run: Run, data: str, examples: int, batch_size: int, seed: int) -> list:
    from flatbnn.data.transforms import AugmentedDataset

    ds = run.bundle.test if data == "test" else run.bundle.train
    if isinstance(ds, AugmentedDataset):  # crop/flip, AutoAugment+Cutout: the un-augmented images
        ds = ds.base
    n = len(ds)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: examples] if 0 < examples < n \
        else torch.arange(n)
    idx = idx.sort().values
    out = []
    for s in range(0, len(idx), batch_size):
        items = [ds[int(i)] for i in idx[s:s + batch_size]]
        x = torch.stack([torch.as_tensor(a) for a, _ in items]).to(run.device)
        y = torch.as_tensor([int(b) for _, b in items], dtype=torch.long).to(run.device)
        out.append((x, y))
    return out


def cross_entropy(logits, y):
    return F.cross_entropy(logits.float(), y)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def _json_path(out: Path) -> Path:
    return out.with_suffix(".json")


def _options(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("func", "runs")}


# --------------------------------------------------------------------------------------------
# sub-commands
# --------------------------------------------------------------------------------------------
def cmd_sharpness(args) -> dict:
    from flatbnn.metrics.sharpness import hessian_top_eigenvalue, hessian_trace, max_loss_in_ball

    runs = load_runs(args.runs, args.device, args.labels)
    out = {"command": "sharpness", "options": _options(args), "loss": "cross-entropy, eval mode", "runs": {}}
    for run in runs:
        batches = loss_batches(run, args.data, args.examples, args.batch_size, args.subset_seed)
        rows = []
        for i, module in sampled_models(run, args.samples):
            r = max_loss_in_ball(module, cross_entropy, batches, args.rho, steps=args.steps, seed=args.seed + i)
            row = {k: r[k] for k in ("sharpness", "loss", "max_loss", "grad_norm", "eps_norm")}
            if args.eigen_iters:
                row["hessian_top_eigenvalue"] = hessian_top_eigenvalue(
                    module, cross_entropy, batches, iters=args.eigen_iters, seed=args.seed + i, tol=1e-4)["eigenvalue"]
            if args.trace_samples:
                row["hessian_trace"] = hessian_trace(module, cross_entropy, batches, samples=args.trace_samples,
                                                     seed=args.seed + i)["trace"]
            rows.append(row)
        summary = {}
        for key in rows[0]:
            m, s = _mean_std([r[key] for r in rows])
            summary[key] = {"mean": m, "std": s}
        out["runs"][run.label] = {"run": str(run.path), "method": run.method.name, "num_samples": len(rows),
                                  "examples": sum(int(y.numel()) for _, y in batches),
                                  "samples": rows, "summary": summary}
        print(f"{run.label}: sharpness {summary['sharpness']['mean']:.5g} +- {summary['sharpness']['std']:.2g} "
              f"over {len(rows)} sampled model(s) (rho={args.rho}, steps={args.steps})")
    if args.out:
        o = Path(args.out)
        if o.suffix == ".png":
            _bar_plot(out, o, args)
            write_json(_json_path(o), out)
        else:
            write_json(o, out)
    return out


def _bar_plot(out: dict, path: Path, args) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from flatbnn.metrics.reliability import save_png

    fig = Figure(figsize=(1.2 + 1.3 * len(out["runs"]), 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, r in enumerate(out["runs"].values()):
        s = r["summary"]["sharpness"]
        ax.bar(i, s["mean"], yerr=s["std"], color=f"C{i}", alpha=0.7, capsize=4)
        ax.plot([i] * len(r["samples"]), [x["sharpness"] for x in r["samples"]], "k.", markersize=4)
    ax.set_xticks(range(len(out["runs"])))
    ax.set_xticklabels(list(out["runs"]), rotation=20, fontsize=8)
    ax.set_ylabel(f"sharpness (rho={args.rho}, {args.steps} step{'s' if args.steps > 1 else ''})")
    ax.set_title(f"mean over {args.samples} sampled models", fontsize=9)
    save_png(fig, path)


def cmd_landscape(args) -> dict:
    from flatbnn.metrics.landscape import loss_surface_1d, loss_surface_2d, plot_curves_1d, plot_surfaces_2d

    runs = load_runs(args.runs, args.device, args.labels)
    n = args.points
    alphas = [args.span * (2 * i - (n - 1)) / (n - 1) for i in range(n)] if n > 1 else [0.0]  # 0 exactly
    curves, styles = {}, {}
    linestyles = ["-", "--", ":", "-."]
    for ri, run in enumerate(runs):
        batches = loss_batches(run, args.data, args.examples, args.batch_size, args.subset_seed)
        for i, module in sampled_models(run, args.samples):
            label = f"{run.label} #{i + 1}"
            if args.two_d:
                r = loss_surface_2d(module, cross_entropy, batches, alphas, seed=args.seed)
            else:
                r = loss_surface_1d(module, cross_entropy, batches, alphas, seed=args.seed)
            curves[label] = {**r, "run": str(run.path)}
            styles[label] = {"color": f"C{ri}", "linestyle": linestyles[i % len(linestyles)]}
    o = Path(args.out)
    title = f"loss along filter-normalised random direction(s), seed {args.seed} ({args.data})"
    if args.two_d:
        plot_surfaces_2d(curves, o, title=title)  # log10 levels
    else:
        plot_curves_1d(curves, o, title=title, styles=styles, log_loss=args.log)
    out = {"command": "landscape", "options": _options(args), "loss": "cross-entropy, eval mode",
           "curves": curves}
    write_json(_json_path(o), out)
    if not args.two_d:
        for label, c in curves.items():
            print(f"{label}: loss from {min(c['loss']):.5g} to {max(c['loss']):.5g} on alpha in "
                  f"[{alphas[0]:g}, {alphas[-1]:g}]")
    return out


def _predictive(run: Run, args):
    """Predictive test log-probs [N, C]: RUN/predictive.pt if present, else the method's predict
    with the run's evaluation settings (as its final evaluation: same loader, samples, seed)."""
    from flatbnn.metrics.evaluate import evaluate

    b = run.built
    saved = run.path / "predictive.pt"
    if saved.exists() and not args.repredict:
        lp = torch.load(saved, map_location="cpu", weights_only=False)
        return (lp["test"] if isinstance(lp, dict) else lp), b.test_targets, "saved"
    m = evaluate(run.method, {"test": b.eval_loaders["test"]}, b.test_targets, b.eval_cfg, gather=b.gather,
                 num_samples=args.num_samples, keep_predictive=True)
    return m["_predictive"]["test"], b.test_targets, "re-predicted"


def cmd_reliability(args) -> dict:
    from flatbnn.metrics.reliability import reliability_overlay

    runs = load_runs(args.runs, args.device, args.labels)
    cfg_metrics = runs[0].cfg.metrics
    binning = args.binning or cfg_metrics.get("ece_binning", "width")
    edges = args.edges or cfg_metrics.get("ece_edges", "right")
    data, sources = {}, {}
    for run in runs:
        lp, targets, source = _predictive(run, args)
        data[run.label] = (lp.exp(), targets)  # exp in the predictive's dtype, as evaluate()'s ECE
        sources[run.label] = source
    o = Path(args.out)
    stats = reliability_overlay(data, o, n_bins=args.bins, binning=binning, edges=edges, style=args.style,
                                title=args.title)
    out = {"command": "reliability", "options": {**_options(args), "binning": binning, "edges": edges},
           "runs": {}}
    for run in runs:
        s = stats[run.label]
        res = (run.results or {}).get("metrics", {})
        conv = (run.results or {}).get("meta", {}).get("metric_conventions", {})
        out["runs"][run.label] = {"run": str(run.path), "predictive": sources[run.label], **s,
                                  "results_json_ece": res.get("ece"), "results_json_conventions": conv}
        print(f"{run.label}: ECE = {s['ece']:.4f} ({args.bins} {binning} bins, edges={edges}; "
              f"{sources[run.label]})")
    write_json(_json_path(o), out)
    return out


def _alphas(text: str) -> list[float]:
    try:
        vals = [float(a) for a in text.split(",") if a.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--alphas must be comma-separated numbers, got {text!r}") from None
    if not vals or any(a < 0 or not math.isfinite(a) for a in vals):
        raise argparse.ArgumentTypeError(f"--alphas must be finite and >= 0, got {text!r}")
    return vals


def cmd_perturb(args) -> dict:
    """FSAM Fig. 4: test accuracy / loss at theta + alpha g/||g|| (flatbnn.metrics.perturbation); runs that
    share a label are seeds of one curve (mean, and std as a band)."""
    from flatbnn.metrics.perturbation import adversarial_perturbation_curve, plot_perturbation_curves

    if args.labels and len(args.labels) != len(args.runs):
        raise SystemExit(f"analyze: {len(args.labels)} --labels for {len(args.runs)} runs")
    out = {"command": "perturb", "options": _options(args),
           "perturbation": "theta + alpha * g/||g||, g = grad of the mean cross-entropy (no label smoothing) over "
                           f"the un-augmented {args.grad_data} set ({args.grad_examples or 'all'} examples), one "
                           "global L2 norm over every trainable parameter; eval mode (BatchNorm running statistics)",
           "curves": {}}
    per_label: dict[str, list[dict]] = {}
    for i, path in enumerate(args.runs):
        run = load_run(path, args.device)
        label = args.labels[i] if args.labels else run.label
        grad_batches = loss_batches(run, args.grad_data, args.grad_examples, args.batch_size, args.subset_seed)
        eval_batches = loss_batches(run, "test", args.eval_examples, args.batch_size, args.subset_seed)
        for _, module in sampled_models(run, 1):  # MAP: the model itself; posteriors: their first sample
            c = adversarial_perturbation_curve(module, cross_entropy, grad_batches, eval_batches, args.alphas)
        rec = {"run": str(run.path), "seed": ((run.results or {}).get("meta") or {}).get("seed"),  # per-seed claims
               **c, "results_json_accuracy": (run.results or {}).get("metrics", {}).get("accuracy"),
               "test_examples": sum(int(y.numel()) for _, y in eval_batches)}
        per_label.setdefault(label, []).append(rec)
        print(f"{label} ({run.path}): accuracy " + " ".join(f"{a:g}:{100 * v:.2f}" for a, v in zip(args.alphas, c["accuracy"]))
              + f" (results.json {rec['results_json_accuracy']})")
    bands = {}
    for label, recs in per_label.items():
        curve = {"alphas": list(args.alphas), "runs": recs, "n": len(recs)}
        for key in ("accuracy", "loss"):
            cols = list(zip(*[r[key] for r in recs]))
            stats = [_mean_std(list(col)) for col in cols]
            curve[key] = [m for m, _ in stats]
            curve[f"{key}_std"] = [sd for _, sd in stats]
        out["curves"][label] = curve
        bands[label] = curve[f"{args.metric}_std"] if len(recs) > 1 else None
    o = Path(args.out)
    title = (f"θ + α∇L/‖∇L‖ (∇ on {args.grad_data}); test {args.metric}; "
             + ", ".join(f"{k}: n={v['n']}" for k, v in out["curves"].items()))
    if o.suffix == ".png":
        plot_perturbation_curves(out["curves"], o, metric=args.metric, title=title, bands=bands)
        write_json(_json_path(o), out)
    else:
        write_json(o, out)
    return out


def cmd_overhead(args) -> dict:
    """FSAM Sec. 5.7: step-time ratios FSAM/SAM and ASAM/SAM of a scripts/benchmark.py JSON beside the paper's
    per-batch times (results/paper/fsam_overhead.yaml). Ratios are per interleaved round, reported as the
    median-time ratio with the min-max over rounds; absolute times are hardware-bound and labelled with it."""
    import yaml

    bench = json.loads(Path(args.benchmark).read_text())
    paper = yaml.safe_load(Path(args.paper).read_text())
    paper_s = {c["cell"]: c["seconds_per_batch"]["mean"] for c in paper["cells"]}
    rows, device = bench["rows"], bench["device"]
    hw = f"{device['name']}, torch {bench.get('torch')}"
    batch = bench["settings"]["batch_size"]
    seconds = {pair: rows[pair]["step_ms_median"] / 1e3 for pair in ("map+none", "map+sam", "map+asam", "map+fsam")
               if pair in rows}
    ratios = {}
    for name, num, den in (("FSAM/SAM", "map+fsam", "map+sam"), ("ASAM/SAM", "map+asam", "map+sam"),
                           ("SAM/SGD", "map+sam", "map+none")):
        if num in rows and den in rows:
            per_round = [a / b for a, b in zip(rows[num]["step_ms"], rows[den]["step_ms"])]
            ratios[name] = {"ours": rows[num]["step_ms_median"] / rows[den]["step_ms_median"],
                            "ours_min": min(per_round), "ours_max": max(per_round), "rounds": len(per_round)}
    if "fsam" in paper_s and "sam" in paper_s and "FSAM/SAM" in ratios:
        ratios["FSAM/SAM"]["paper"] = paper_s["fsam"] / paper_s["sam"]  # derived: the paper prints the two times
    out = {"command": "overhead", "benchmark": str(args.benchmark), "hardware": hw, "label": bench.get("label"),
           "model": bench["settings"]["model"], "batch_size": batch, "precision": bench["settings"]["precision"],
           "git": bench.get("git"), "seconds_per_batch": seconds, "paper_seconds_per_batch": paper_s,
           "paper_hardware": "one RTX 2080 Ti, CIFAR-10 WRN-28-10, batch 128", "ratios": ratios,
           "note": "only the ratios transfer across hardware; ours are compute-only steps on synthetic inputs"}
    lines = [f"# Fisher SAM Sec. 5.7: step-time overhead, ours ({hw}) vs the paper (RTX 2080 Ti)", "",
             f"Ours: `{out['model']}`, batch {batch}, {out['precision']}, median of {next(iter(ratios.values()))['rounds'] if ratios else 0} "
             f"interleaved rounds (scripts/benchmark.py); **{device['type'].upper()} numbers**. "
             "Paper: CIFAR-10 WRN-28-10, batch 128. Only the ratios are comparable.", "",
             "| ratio | ours (min-max over rounds) | paper |", "|---|---|---|"]
    for name, r in ratios.items():
        paper_r = f"{r['paper']:.4f} (0.2334 / 0.2322 s)" if "paper" in r else "not printed"
        lines.append(f"| {name} | {r['ours']:.3f} ({r['ours_min']:.3f}-{r['ours_max']:.3f}) | {paper_r} |")
    lines += ["", "| method | ours s/batch | paper s/batch |", "|---|---|---|"]
    for pair, cell in (("map+none", "sgd"), ("map+sam", "sam"), ("map+asam", "asam"), ("map+fsam", "fsam")):
        if pair in seconds:
            lines.append(f"| {cell} | {seconds[pair]:.4f} | {paper_s.get(cell, '–')} |")
    o = Path(args.out)
    o.parent.mkdir(parents=True, exist_ok=True)
    write_json(_json_path(o), out)
    md = o.with_suffix(".md")
    write_text(md, "\n".join(lines) + "\n")
    if o.suffix == ".png":
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from flatbnn.metrics.reliability import save_png

        fig = Figure(figsize=(5.0, 3.4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        names = list(ratios)
        ours = [ratios[n]["ours"] for n in names]
        err = [[ratios[n]["ours"] - ratios[n]["ours_min"] for n in names],
               [ratios[n]["ours_max"] - ratios[n]["ours"] for n in names]]
        ax.bar([i - 0.2 for i in range(len(names))], ours, 0.4, yerr=err, capsize=3, label=f"ours ({device['type']})")
        ax.bar([i + 0.2 for i in range(len(names)) if "paper" in ratios[names[i]]],
               [ratios[n]["paper"] for n in names if "paper" in ratios[n]], 0.4, label="paper (RTX 2080 Ti)")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.set_ylabel("step-time ratio")
        ax.set_title(f"{out['model']}, batch {batch}: {hw}", fontsize=7)
        ax.legend(fontsize=8)
        save_png(fig, o)
    for name, r in ratios.items():
        print(f"{name}: ours {r['ours']:.3f} ({r['ours_min']:.3f}-{r['ours_max']:.3f}, {device['type']})"
              + (f", paper {r['paper']:.4f}" if "paper" in r else ""))
    return out


# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p, data=True):
        p.add_argument("runs", nargs="+", help="finished run directories")
        p.add_argument("--labels", nargs="+", help="legend labels, one per run (default: method[+flatness])")
        p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the run's trainer.device, auto = GPU if any)")
        p.add_argument("--batch-size", type=int, default=500, help="batch size of the loss batches")
        if data:
            p.add_argument("--samples", type=int, default=5, help="sampled models per run (the method's first K)")
            p.add_argument("--data", choices=("train", "test"), default="train",
                           help="loss on the un-augmented train set (L_S) or the test set")
            p.add_argument("--examples", type=int, default=5000, help="random subset size (0 = all)")
            p.add_argument("--subset-seed", type=int, default=0)
            p.add_argument("--seed", type=int, default=0, help="random directions / ascent start")

    p = sub.add_parser("sharpness", help="max-in-ball sharpness averaged over sampled models")
    common(p)
    p.add_argument("--rho", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=1, help="ascent steps (1 = SAM's estimate)")
    p.add_argument("--eigen-iters", type=int, default=0, help="> 0: also the Hessian's top eigenvalue")
    p.add_argument("--trace-samples", type=int, default=0, help="> 0: also the Hutchinson trace")
    p.add_argument("--out", help="*.json, or *.png (bar chart, JSON beside)")
    p.set_defaults(func=cmd_sharpness)

    p = sub.add_parser("landscape", help="loss along filter-normalised random directions (Fig. 1)")
    common(p)
    p.set_defaults(samples=2)
    p.add_argument("--span", type=float, default=1.0, help="alphas from -span to span (2-D: both axes)")
    p.add_argument("--points", type=int, default=21, help="grid points per axis")
    p.add_argument("--two-d", action="store_true", help="2-D contours instead of 1-D curves")
    p.add_argument("--log", action="store_true", help="1-D: log-scale loss axis (2-D contours are always log10)")
    p.add_argument("--out", required=True, help="PNG (JSON beside)")
    p.set_defaults(func=cmd_landscape)

    p = sub.add_parser("reliability", help="reliability diagrams of several runs overlaid (Fig. 2)")
    common(p, data=False)
    p.add_argument("--bins", type=int, default=20)
    p.add_argument("--binning", choices=("width", "mass"), help="default: the first run's metrics.ece_binning")
    p.add_argument("--edges", choices=("right", "left", "both", "strict"),
                   help="default: the first run's metrics.ece_edges")
    p.add_argument("--style", choices=("gap", "accuracy"), default="gap")
    p.add_argument("--num-samples", type=int, help="posterior samples when re-predicting (default: the run's)")
    p.add_argument("--repredict", action="store_true", help="ignore RUN/predictive.pt")
    p.add_argument("--title")
    p.add_argument("--out", required=True, help="PNG (JSON beside)")
    p.set_defaults(func=cmd_reliability)

    p = sub.add_parser("perturb", help="accuracy under theta + alpha grad/||grad|| (FSAM Fig. 4)")
    common(p, data=False)
    p.add_argument("--alphas", type=_alphas, default=_alphas("0,0.1,0.25,0.5,0.75,1,1.5,2,2.5,3,3.5,4,4.5,5"),
                   help="comma-separated perturbation strengths (0 = the trained model)")
    p.add_argument("--grad-data", choices=("train", "test"), default="train",
                   help="the gradient's data: the un-augmented train set (default) or the test set")
    p.add_argument("--grad-examples", type=int, default=0, help="random subset for the gradient (0 = all)")
    p.add_argument("--eval-examples", type=int, default=0, help="random test subset for the curve (0 = all)")
    p.add_argument("--subset-seed", type=int, default=0)
    p.add_argument("--metric", choices=("accuracy", "loss"), default="accuracy", help="the plotted metric")
    p.add_argument("--out", required=True, help="*.png (JSON beside) or *.json")
    p.set_defaults(func=cmd_perturb)

    p = sub.add_parser("overhead", help="FSAM/SAM, ASAM/SAM step-time ratios of a benchmark JSON vs the paper (Sec. 5.7)")
    p.add_argument("benchmark", help="scripts/benchmark.py --json output")
    p.add_argument("--paper", default=str(resources.PAPER_DIR / "fsam_overhead.yaml"))
    p.add_argument("--out", required=True, help="*.png (JSON and Markdown beside) or *.json")
    p.set_defaults(func=cmd_overhead)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
