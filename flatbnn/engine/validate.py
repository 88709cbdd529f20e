"""Check a composed config before anything is built: types and ranges of the keys the engine reads
itself, keys a config group does not know, the device, and whether the run dir can be written.

Hydra's struct mode refuses ``trainer.epochz=1`` but lets ``+trainer.foo=1`` in, and OmegaConf takes
``trainer.epochs=1.5`` or ``=abc`` as they are; a wrong value then fails deep in training (a traceback)
or, worse, runs (``trainer.epochs=-1`` trained nothing and exited 0). Keys passed to a constructor
(``optimizer.*``, ``method.*``, ``model.*``, ...) are checked by the constructor's signature already
(an unknown one is a one-line TypeError); the ranges of the common ones are checked here.

:func:`validate_config` raises :class:`ConfigError` (a ``ValueError``: one line, exit 2) naming the key,
the value and what is allowed.
"""

from __future__ import annotations

import difflib
import math
import os
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from flatbnn import resources


class ConfigError(ValueError):
    """A config value that cannot work: one line, exit 2."""


# the per-process noise generator is seeded with seed * 1_000_003 + rank, a signed 64-bit integer (room for 1024 ranks)
SEED_MAX = (2**63 - 1) // 1_000_003 - 1024
# kind, constraint: "int" / "float" with (lo, hi, lo_inclusive) bounds, "bool", or a tuple of choices;
# ``None`` in the rule's third slot: the key may be null
_POS_INT = ("int", (1, None))
_NONNEG_INT = ("int", (0, None))
RULES: dict[str, tuple] = {
    "seed": ("int", (0, SEED_MAX)),
    "trainer.epochs": ("int", (0, None)),               # 0 = evaluate the loaded weights (rows/fsam_t2.yaml)
    "trainer.batch_size": _POS_INT,
    "trainer.eval_batch_size": _POS_INT,
    "trainer.eval_sample_chunk": _POS_INT,
    "trainer.num_workers": _NONNEG_INT,
    "trainer.checkpoint_every": _NONNEG_INT,
    "trainer.eval_every": _NONNEG_INT,
    "trainer.limit_train_batches": ("int", (1, None), None),
    "trainer.precision": ("choice", ("fp32", "bf16", "fp16")),
    "trainer.channels_last": ("bool",),
    "trainer.compile": ("bool",),
    "trainer.sync_bn": ("bool",),
    "trainer.deterministic": ("bool",),
    "trainer.progress": ("bool",),
    "trainer.reliability_diagram": ("bool",),
    "trainer.grad_clip": ("float", (0.0, None, False), None),
    "trainer.label_smoothing": ("float", (0.0, 1.0, True, False)),
    "trainer.dist_timeout_s": ("float", (0.0, None, False), None),
    "optimizer.lr": ("float", (0.0, None, False)),
    "optimizer.weight_decay": ("float", (0.0, None)),
    "optimizer.momentum": ("float", (0.0, 1.0, True, False)),
    "flatness.rho": ("float", (0.0, None)),
    "flatness.m": _POS_INT,
    "method.num_samples": ("int", (1, None), None),     # 0 only where the method predicts with its mean
    "method.num_members": _POS_INT,
    "metrics.ece_bins": _POS_INT,
    "metrics.ece_binning": ("choice", ("width", "mass")),
    "metrics.ece_edges": ("choice", ("right", "left", "both", "strict")),
    "metrics.misclass_score": ("choice", ("max_prob", "entropy")),
    "metrics.ood_score": ("choice", ("max_prob", "entropy")),
    "metrics.single_sample_metrics": ("bool",),
    "metrics.auroc": ("choice", ("exact", "thresholds")),
    "metrics.auroc_thresholds": _POS_INT,
}

CONFIGS = resources.CONFIGS_DIR
# groups whose keys the engine reads by name (nothing passes them to a constructor that would refuse an
# unknown one): every key must be in one of the group's option files
CLOSED_GROUPS = ("trainer",)


def _known_keys(group: str) -> set[str]:
    keys: set[str] = set()
    for f in sorted((CONFIGS / group).glob("*.yaml")):
        node = OmegaConf.load(f)
        keys.update(k for k in node if k != "defaults")
    return keys


def _known_metrics_keys() -> set[str]:
    from dataclasses import fields

    from flatbnn.metrics.evaluate import EvalConfig
    return {f.name for f in fields(EvalConfig)}


def _closest(word: str, options) -> str:
    near = difflib.get_close_matches(word, sorted(options), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(near)}?" if near else f"; known: {', '.join(sorted(options))}"


def _check(key: str, value, rule: tuple) -> str | None:
    """What is wrong with ``value`` under ``rule`` (None: fine)."""
    kind, nullable = rule[0], len(rule) > 2
    if value is None:
        return None if nullable else "must be set (not null)"
    if kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if kind == "choice":
        return None if value in rule[1] else f"must be one of {', '.join(rule[1])}"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
        return "must be a whole number" if number else "must be a number (a whole one)"
    if kind == "float" and not number:
        return "must be a number"
    if kind == "float" and not math.isfinite(value):
        return "must be finite"
    bounds = rule[1]
    lo, hi = bounds[0], bounds[1]
    lo_incl = bounds[2] if len(bounds) > 2 else True
    hi_incl = bounds[3] if len(bounds) > 3 else True
    if lo is not None and (value < lo or (value == lo and not lo_incl)):
        return f"must be {'>=' if lo_incl else '>'} {lo:g}"
    if hi is not None and (value > hi or (value == hi and not hi_incl)):
        return f"must be {'<=' if hi_incl else '<'} {hi if isinstance(hi, int) else format(hi, 'g')}"
    return None


def _select(cfg: DictConfig, key: str):
    """``(present, value)`` of a dotted key, interpolations resolved."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        return False, None
    try:
        return True, OmegaConf.select(cfg, key, throw_on_missing=True)
    except Exception as e:  # a ??? or an interpolation that does not resolve
        raise ConfigError(f"{key}: {' '.join(str(e).split())[:160]}") from None


def _method_allows_zero_samples(cfg: DictConfig) -> bool:
    """Diagonal-Gaussian methods (bsam, vogn) predict with the mean for ``num_samples=0``."""
    try:
        from hydra.utils import get_class

        from flatbnn.methods.diag_gaussian import DiagonalGaussianMethod
        return issubclass(get_class(cfg.method._target_), DiagonalGaussianMethod)
    except Exception:
        return False


def check_values(cfg: DictConfig) -> None:
    for key, rule in RULES.items():
        present, value = _select(cfg, key)
        if not present:
            continue
        if key == "method.num_samples" and value == 0 and _method_allows_zero_samples(cfg):
            continue
        problem = _check(key, value, rule)
        if problem:
            raise ConfigError(f"{key}={value!r}: {problem}")
    if (OmegaConf.select(cfg, "metrics.auroc", default="exact") == "thresholds"
            and OmegaConf.select(cfg, "metrics.misclass_score", default="max_prob") != "max_prob"):
        raise ConfigError("metrics.auroc=thresholds: the threshold grid is on [0, 1] and needs "
                          "metrics.misclass_score=max_prob")


def check_unknown_keys(cfg: DictConfig) -> None:
    """``+trainer.foo=1`` / ``+metrics.foo=1``: a key nothing reads is a typo, not a setting."""
    groups = {g: _known_keys(g) for g in CLOSED_GROUPS}
    groups["metrics"] = _known_metrics_keys()
    for group, known in groups.items():
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        for k in node:
            if k not in known:
                raise ConfigError(f"{group}.{k}: no such key in {group}{_closest(str(k), known)}")


def _image_side(shape) -> int | None:
    return min(int(s) for s in shape[1:]) if shape is not None and len(shape) == 3 else None


def check_model_data(cfg: DictConfig) -> None:
    """A network meant for larger images than the data set has (``model.min_input_size``, e.g. WRN-28-10 on the
    8x8 digits, the default data set) is refused with the fix: the data it is meant for, and where they come from."""
    need = OmegaConf.select(cfg, "model.min_input_size", default=None)
    try:
        shape = OmegaConf.select(cfg, "model.input_shape", default=None)
    except Exception:  # an interpolation that does not resolve is reported where it is used
        return
    side = _image_side(shape)
    if need is None or side is None or side >= int(need):
        return
    from hydra.core.hydra_config import HydraConfig  # the group choice (wrn28x10), not the family (wrn)
    model = (HydraConfig.get().runtime.choices.get("model") if HydraConfig.initialized() else None) \
        or OmegaConf.select(cfg, "model.name")
    fits = []
    for f in sorted((CONFIGS / "dataset").glob("*.yaml")):
        s = _image_side(OmegaConf.load(f).get("input_shape"))
        if s is not None and s >= int(need):
            fits.append(f.stem)
    data = "cifar10" if "cifar10" in fits else (fits[0] if fits else "<a data set>")
    raise ConfigError(
        f"model={model} is meant for images of at least {need}x{need} px (model.min_input_size) and "
        f"dataset={cfg.dataset.name} has {side}x{side}: train it on its data, e.g. dataset={data} "
        f"dataset.root=<folder or .tar.gz holding it> (docs/data.md says where to get each; data sets it fits: "
        f"{', '.join(fits)}), or use model=mlp on {cfg.dataset.name}; model.min_input_size=null trains it anyway")


def check_device(cfg: DictConfig) -> None:
    spec = str(OmegaConf.select(cfg, "trainer.device", default="auto"))
    if spec == "auto":
        return
    import torch
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError(f"trainer.device={spec}: not a device (auto, cpu, cuda, cuda:<i>, mps)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"trainer.device={spec}: no CUDA GPU is visible to this process; use "
                              f"trainer.device=auto (GPU if any, else CPU) or trainer.device=cpu")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"trainer.device={spec}: only {n} GPU(s) visible (cuda:0..cuda:{n - 1})")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError(f"trainer.device={spec}: MPS is not available here; use trainer.device=auto or cpu")


def check_writable(run_dir: Path) -> None:
    """The run dir and its ``checkpoints/`` (where it exists already; otherwise it is created in the run
    dir) take a file -- before training, not when the first checkpoint is due. Creates nothing that stays
    (a probe file, removed at once; the run dir itself, which Hydra has usually made)."""
    run_dir = Path(run_dir)
    for d in (run_dir, run_dir / "checkpoints"):
        if d != run_dir and not d.is_dir():
            continue
        probe = d / f".flatbnn-write-test.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
        except OSError as e:
            raise ConfigError(f"cannot write to {d} ({e.strerror or type(e).__name__}); make it writable or put the "
                              f"run elsewhere with hydra.run.dir=<dir>") from None
        finally:
            try:
                probe.unlink()
            except OSError:
                pass


def validate_config(cfg: DictConfig, run_dir: Path | None = None, *, rank: int | None = None) -> None:
    """Every check above; ``run_dir`` is probed for writing by rank 0 (``rank`` default: ``$RANK``), the
    only rank that writes files."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    check_unknown_keys(cfg)
    check_values(cfg)
    check_model_data(cfg)
    check_device(cfg)
    if run_dir is not None and rank == 0:
        check_writable(run_dir)


__all__ = ["ConfigError", "RULES", "check_device", "check_model_data", "check_unknown_keys", "check_values",
           "check_writable", "validate_config"]


def check_group_files(choices: dict, sources) -> None:
    """Every config-group option the run composed is a mapping: Hydra merges a file holding a YAML list (or a
    scalar) as nothing at all, so ``experiment=my_list`` would silently train the default config. ``sources``:
    Hydra's config sources (``HydraConfig.get().runtime.config_sources``); only folders are checked."""
    import yaml

    folders = [Path(str(src.path)) for src in sources if str(getattr(src, "schema", "")) == "file"]
    for group, option in choices.items():
        if option in (None, "") or str(group).startswith("hydra"):
            continue
        for folder in folders:
            f = folder / str(group) / f"{option}.yaml"
            if f.is_file():
                node = yaml.safe_load(f.read_text())
                if node is not None and not isinstance(node, dict):
                    raise ConfigError(f"{f}: {group}={option} is a YAML {type(node).__name__}, not a mapping of "
                                      f"keys (Hydra would ignore it and train the default config)")
                break
