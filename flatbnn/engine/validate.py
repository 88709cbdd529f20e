"""Check a composed config before anything is built: types and ranges of the keys the engine reads
itself, keys a config group does not know, the device, and whether the run dir can be written.

Hydra's struct mode refuses ``trainer.epochz=1`` but lets ``+trainer.foo=1`` in, and OmegaConf takes
``trainer.epochs=1.5`` or ``=abc`` as they are; a wrong value then fails deep in training (a traceback)
or, worse, runs (``trainer.epochs=-1`` trained nothing and exited 0).

- ``trainer`` and ``metrics``, the nodes the engine reads by name: their dataclasses in :mod:`flatbnn.schema`
  (types, ranges, no unknown key).
- The groups whose keys are passed to a constructor (``optimizer.*``, ``method.*``, ``flatness.*``, ...) are open:
  each option's constructor signature is its schema (an unknown key is a one-line TypeError); only the ranges of
  their common keys, and the root ``seed``, are checked here (:data:`RANGES`).
- The data set's keys: :class:`flatbnn.data.options.DataOptions`, when the data set is built.

:func:`validate_config` raises :class:`ConfigError` (a ``ValueError``: one line, exit 2) naming the key,
the value and what is allowed.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from flatbnn import resources
from flatbnn.schema import ConfigError, EvalConfig, TrainerConfig, check, check_node, problem

# the per-process noise generator is seeded with seed * 1_000_003 + rank, a signed 64-bit integer (room for 1024 ranks)
SEED_MAX = (2**63 - 1) // 1_000_003 - 1024
# key of an open group (or the root) -> (type, range), as a schema field would declare them
RANGES: dict[str, tuple] = {
    "seed": (int, check(ge=0, le=SEED_MAX)),
    "optimizer.lr": (float, check(gt=0.0)),
    "optimizer.weight_decay": (float, check(ge=0.0)),
    "optimizer.momentum": (float, check(ge=0.0, lt=1.0)),
    "flatness.rho": (float, check(ge=0.0)),
    "flatness.m": (int, check(ge=1)),
    "method.num_samples": (int | None, check(ge=1)),     # lower bound: the method class's min_num_samples
    "method.num_members": (int, check(ge=1)),
}

CONFIGS = resources.CONFIGS_DIR


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


def _min_num_samples(cfg: DictConfig) -> int:
    """The fewest predictive samples the run's method class declares (``Method.min_num_samples``: 0 where it
    predicts with its mean, as bsam and vogn); 1 when the class cannot be found (its own error comes at build)."""
    try:
        from hydra.utils import get_class

        return int(getattr(get_class(cfg.method._target_), "min_num_samples", 1))
    except Exception:
        return 1


def check_values(cfg: DictConfig) -> None:
    """``trainer`` and ``metrics`` against their schemas (unknown keys included), then :data:`RANGES`."""
    for schema in (TrainerConfig, EvalConfig):
        check_node(schema, cfg)
    for key, (kind, limits) in RANGES.items():
        present, value = _select(cfg, key)
        if not present:
            continue
        if key == "method.num_samples":  # the method class says how few it takes
            limits = {**limits, "ge": _min_num_samples(cfg)}
        why = problem(value, kind, limits)
        if why:
            raise ConfigError(f"{key}={value!r}: {why}")


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


def check_weights(cfg: DictConfig) -> None:
    """``trainer.weights_required``: the config key it names (a fine-tuning protocol's pretrained weights) must
    name an existing local file or run dir -- refused in one line otherwise, never trained from random init (the
    reproduce runner's preflight says the same from the row's ``requires``; this covers train.py run directly)."""
    key = OmegaConf.select(cfg, "trainer.weights_required", default=None)
    if key in (None, ""):
        return
    try:
        value = OmegaConf.select(cfg, str(key), default=_NO_KEY)
    except Exception:  # e.g. ${oc.env:...} of an unset variable without a default: nothing given
        value = None
    if value is _NO_KEY:
        raise ConfigError(f"trainer.weights_required={key}: the config has no key {key}")
    if value not in (None, "") and Path(str(value)).expanduser().exists():
        return
    got = "not set" if value in (None, "") else f"{value} does not exist"
    raise ConfigError(f"{key} must name this config's pretrained weights, a local file ({got}): it fine-tunes them "
                      f"and is never trained from random init; pass {key}=/path/to/weights "
                      f"(trainer.weights_required=null trains it from scratch anyway)")


_NO_KEY = object()


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


def refusal_of_config(cfg, processes: int = 1) -> str | None:
    """flatness/batched.py's ``config_refusal`` of a composed run config (here before a run; the CPU campaign's step
    rule, bench/selfcheck.py). Here, not in flatness/: it reads the method's class, a layer up. Raises where a
    ``_target_`` class does not import."""
    from hydra.utils import get_class

    from flatbnn.flatness.batched import config_refusal
    from flatbnn.flatness.sam import SAM
    from flatbnn.methods.base import Method
    flatness, method = get_class(cfg.flatness._target_), get_class(cfg.method._target_)
    return config_refusal(
        flatness_name=getattr(flatness, "name", flatness.__name__),
        plain_sam=issubclass(flatness, SAM) and flatness.direction is SAM.direction,
        method_name=getattr(method, "name", method.__name__),
        plain_loss=issubclass(method, Method) and method.loss_fn is Method.loss_fn,  # as Method.has_plain_loss
        m=int(cfg.flatness.m), batch_size=int(cfg.trainer.batch_size) // processes,
        precision=str(cfg.trainer.precision), compiled=bool(cfg.trainer.compile), processes=processes)


def check_batched_chunks(cfg: DictConfig) -> None:
    """``flatness.batched_chunks=true``: what the config alone rules out (``refusal_of_config``),
    before any data is loaded -- not after an epoch (issue 41). A class that does not import is reported where
    it is built."""
    if not OmegaConf.select(cfg, "flatness.batched_chunks", default=False):
        return
    m = int(OmegaConf.select(cfg, "flatness.m", default=1) or 1)
    if m <= 1:
        return
    processes = max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    try:
        why = refusal_of_config(cfg, processes)
    except Exception:  # a class that does not import is reported where it is built
        return
    if why is not None:
        raise ConfigError(why)


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
    check_values(cfg)
    check_model_data(cfg)
    check_weights(cfg)
    check_device(cfg)
    check_batched_chunks(cfg)
    if run_dir is not None and rank == 0:
        check_writable(run_dir)


__all__ = ["ConfigError", "RANGES", "check_batched_chunks", "check_device", "check_model_data", "check_values",
           "check_weights", "check_writable", "validate_config"]


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
