"""What a run says about itself, on the console and in ``<run dir>/train.log``, whatever ``trainer.progress`` is:

* the start-up line: data set, model and its parameter count, method x flatness, epochs x steps, device, run dir;
* the resolved config tree, once, when ``print_config=true`` (as lightning-hydra-template's ``print_config``);
* warnings: a posterior built from fewer than 2 weight snapshots, a run that ends at chance accuracy, and any
  other ``warn(...)`` of the engine (non-finite predictions);
* the final line: the final predictive's accuracy / NLL / ECE and the path of ``results.json``.

Info lines go to stdout, warnings to stderr; both are appended to ``train.log`` (the file Hydra names after the
script, which nothing else writes). Only rank 0 reports.
"""

from __future__ import annotations

import math

# the run's log and its warning line live in flatbnn/runlog.py (lowest layer: metrics warn through it too)
from flatbnn.runlog import LOG_NAME, RunReport, warn  # noqa: F401

# a run within this many binomial standard errors of 1/K test accuracy learned nothing (also the reproduction
# rows' "at chance": flatbnn/reproduce/compare.py imports it)
CHANCE_SE = 3.0
# on this few test examples the engine says nothing about chance: 3 standard errors at n = 10 reach 0.38 of 10 classes
# and 0.97 of 2, a band that holds most real runs (the smoke scale tests on 2 images)
CHANCE_MIN_TEST = 11

# ---------------------------------------------------------------------------------------------- the lines
def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


# the hyperparameters that set a flatness variant's ascent, shown on the start line where the variant has them
# (fsam(rho=0.1, eta=1): Fisher-SAM's eta scales the Fisher term, as decisive as rho; asam's too; random's sigma)
_FLATNESS_SHOWN = ("rho", "eta", "sigma")


def _flatness(desc: dict) -> str:
    name = desc.get("name", "?")
    shown = ", ".join(f"{k}={desc[k]:g}" for k in _FLATNESS_SHOWN if isinstance(desc.get(k), (int, float)))
    return name if name == "none" or not shown else f"{name}({shown})"


def start_line(*, dataset: str, n_train: int, n_test: int, model: str, n_params: int, method: str,
               flatness: dict, epochs: int, steps_per_epoch: int, batch_size: int, device, run_dir) -> str:
    return (f"flatbnn: {dataset} ({n_train:,} train / {n_test:,} test) | {model} ({_count(n_params)} parameters) | "
            f"{method} x {_flatness(flatness)} | {epochs} epochs x {steps_per_epoch} steps (batch {batch_size}) | "
            f"{device} | run dir {run_dir}")


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) and math.isfinite(v) else "null"


def final_line(metrics: dict, results_path, seconds: float | None = None, closed_form: str | None = None) -> str:
    """``closed_form``: the name of a predictive computed in closed form (Laplace's probit), said instead of a
    sample count (it is one predictive, not one sample)."""
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    k = metrics.get("num_samples")
    samples = f", {closed_form}" if closed_form else f", {k} sample{'s' if k != 1 else ''}" if k else ""
    return (f"flatbnn: done{took}: accuracy {_fmt(metrics.get('accuracy'))}, NLL {_fmt(metrics.get('nll'))}, "
            f"ECE {_fmt(metrics.get('ece'))} (final predictive{samples}) -> {results_path}")


def at_chance(accuracy, num_classes: int, n: int, se: float = CHANCE_SE) -> bool:
    """Test accuracy within ``se`` binomial standard errors of a constant guess (1/K) on ``n`` examples (never on
    fewer than ``CHANCE_MIN_TEST``)."""
    if not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy) or (n or 0) < CHANCE_MIN_TEST \
            or num_classes < 2:
        return False
    p = 1.0 / num_classes
    return accuracy <= p + se * math.sqrt(p * (1.0 - p) / n)


def degenerate_run_warnings(metrics: dict, method: dict, num_classes: int, n_test: int) -> list[str]:
    """One line per way the finished run is degenerate (empty: none). ``method`` is ``Method.describe()``:
    the engine reads the snapshot counts the posterior methods report there, nothing method-specific."""
    out = []
    for key in ("n_collected", "kept_samples"):  # SWA / SWAG / SWAG-Diag; SGLD
        n = method.get(key)
        if isinstance(n, int) and n < 2:
            out.append(f"method={method.get('name')} built its posterior from {n} weight snapshot(s) ({key}={n}): "
                       f"its predictive is one weight vector, not a posterior; collect more ("
                       f"{'a lower method.burn_in' if key == 'kept_samples' else 'a lower method.swa_start'}, "
                       f"or more trainer.epochs)")
    acc = metrics.get("accuracy")
    if at_chance(acc, num_classes, n_test):
        out.append(f"final test accuracy {_fmt(acc)} is at chance (1/{num_classes} = {1 / num_classes:.4f}, within "
                   f"{CHANCE_SE:g} standard errors on {n_test:,} test examples): the run learned nothing; check "
                   f"optimizer.lr, trainer.epochs and the data")
    return out


# ---------------------------------------------------------------------------------------------- engine hooks
def report_start(report: RunReport, b, model_name: str) -> None:
    """Called by ``engine.run`` once the run is built and its run dir claimed, before training."""
    from omegaconf import OmegaConf

    cfg = b.cfg
    if cfg.get("print_config"):
        report.info("flatbnn: resolved config\n" + OmegaConf.to_yaml(cfg, resolve=True).rstrip())
    n_params = sum(p.numel() for p in b.module.parameters())
    report.info(start_line(dataset=cfg.dataset.name, n_train=len(b.bundle.train), n_test=len(b.bundle.test),
                           model=model_name, n_params=n_params, method=b.method.describe().get("name", "?"),
                           flatness=b.flatness.describe(), epochs=b.total_epochs, steps_per_epoch=b.steps_per_epoch,
                           batch_size=cfg.trainer.batch_size, device=b.device, run_dir=b.run_dir))


def report_final(report: RunReport, b, results: dict, results_path) -> None:
    """Called by ``engine.run`` after results.json is written: the warnings, then the final line."""
    metrics = results["metrics"]
    for line in degenerate_run_warnings(metrics, b.method.describe(), int(b.cfg.model.num_classes),
                                        len(b.bundle.test)):
        report.warn(line)
    report.info(final_line(metrics, results_path, results.get("meta", {}).get("wall_seconds"),
                           closed_form=b.method.closed_form))


__all__ = ["CHANCE_MIN_TEST", "CHANCE_SE", "LOG_NAME", "RunReport", "at_chance", "degenerate_run_warnings", "final_line",
           "report_final", "report_start", "start_line", "warn"]
