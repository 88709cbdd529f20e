"""The types and ranges of the config nodes the engine reads by name: ``trainer`` and ``metrics``.

Each node is a dataclass whose ``__post_init__`` checks every field against its annotation (strictly: ``1.5`` is not
an ``int``, ``"no"`` is not a ``bool``) and its range (``check(...)`` in the field's metadata), and
:func:`check_node` refuses a key the dataclass does not have, naming the nearest one. A wrong value is a
:class:`ConfigError`: one line naming the key, the value and what is allowed (exit 2).

Where the values are declared (once each):

- ``metrics``: HERE, :class:`EvalConfig`'s defaults. configs/config.yaml composes them from Hydra's ConfigStore
  (``- metrics: default`` in its defaults list), and ``evaluate(..., cfg=EvalConfig())`` in one's own loop gets the
  same conventions as ``train.py``. Importing this module registers the node; :mod:`flatbnn.resources`, through
  which every reader finds configs/, imports it.
- ``trainer``: in configs/trainer/default.yaml (with why each value), so :class:`TrainerConfig` declares no values
  (``MISSING``): it is the schema only, checked at run time by :func:`flatbnn.engine.validate.validate_config`. It is
  not composed into the config: a ``float`` field would turn the YAML's ``dist_timeout_s: 600`` into ``600.0`` in
  every ``config_resolved.yaml`` (OmegaConf 2.3 has no ``int | float``), which resume and the aggregated rows
  compare; and OmegaConf's coercions (``"no"`` -> ``False``) are laxer than this check.

Torch-free, and below everything else in the package (the layers: scripts/import_graph.py).
"""

import difflib
import math
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A config value that cannot work: one line, exit 2."""


def check(*, ge=None, gt=None, le=None, lt=None, choices: tuple = ()) -> dict:
    """A field's range: bounds (``ge`` >=, ``gt`` >, ``le`` <=, ``lt`` <) or the allowed strings."""
    return {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": tuple(choices)}


def _number(x) -> str:
    return str(x) if isinstance(x, int) else format(x, "g")


def problem(value, annotation, limits: dict | None = None) -> str | None:
    """What is wrong with ``value`` for a field typed ``annotation`` with range ``limits`` (None: fine)."""
    if annotation is Any:
        return None
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:  # X | None
        if value is None:
            return None
        annotation = next(a for a in args if a is not type(None))
    elif value is None:
        return "must be set (not null)"
    limits = limits or {}
    if annotation is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if annotation is str:
        if limits.get("choices"):
            return None if value in limits["choices"] else f"must be one of {', '.join(limits['choices'])}"
        return None if isinstance(value, str) else "must be a string"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int and not (isinstance(value, int) and not isinstance(value, bool)):
        return "must be a whole number" if number else "must be a number (a whole one)"
    if annotation is float and not number:
        return "must be a number"
    if annotation is float and not math.isfinite(value):
        return "must be finite"
    for name, op, ok in (("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
                         ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b)):
        bound = limits.get(name)
        if bound is not None and not ok(value, bound):
            return f"must be {op} {_number(bound)}"
    return None


class Checked:
    """``__post_init__`` checks every field that holds a value (``MISSING``: not given, not checked)."""

    node: ClassVar[str]  # where the dataclass sits in the config, for the error line

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if value == MISSING:
                continue
            why = problem(value, hints[f.name], f.metadata.get("check"))
            if why:
                raise ConfigError(f"{self.node}.{f.name}={value!r}: {why}")


def _closest(word: str, options) -> str:
    near = difflib.get_close_matches(word, sorted(options), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(near)}?" if near else f"; known: {', '.join(sorted(options))}"


def check_node(schema: type, cfg: DictConfig) -> Any:
    """``cfg.<schema.node>`` as a ``schema`` instance, interpolations resolved: unknown keys and wrong values refused
    (:class:`ConfigError`); keys the node lacks stay ``MISSING`` (the engine reads those with a default). ``None``
    when the config has no such node."""
    name = schema.node
    node = cfg.get(name)
    if not isinstance(node, DictConfig):
        return None
    known = {f.name for f in fields(schema)}
    for k in node:
        if k not in known:
            raise ConfigError(f"{name}.{k}: no such key in {name}{_closest(str(k), known)}")
    values = {}
    for k in node:
        try:
            value = OmegaConf.select(node, str(k), throw_on_missing=True)
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
        except Exception as e:  # a ??? or an interpolation that does not resolve
            raise ConfigError(f"{name}.{k}: {' '.join(str(e).split())[:160]}") from None
        values[k] = value
    return schema(**values)


@dataclass
class TrainerConfig(Checked):
    """The ``trainer`` node: configs/trainer/default.yaml holds the values and says what each is for."""

    node: ClassVar[str] = "trainer"

    epochs: int = field(default=MISSING, metadata={"check": check(ge=0)})  # 0: evaluate the loaded weights
    batch_size: int = field(default=MISSING, metadata={"check": check(ge=1)})
    eval_batch_size: int = field(default=MISSING, metadata={"check": check(ge=1)})
    eval_sample_chunk: int = field(default=MISSING, metadata={"check": check(ge=1)})
    num_workers: int = field(default=MISSING, metadata={"check": check(ge=0)})
    device: Any = MISSING  # checked against the visible devices by engine/validate.check_device
    precision: str = field(default=MISSING, metadata={"check": check(choices=("fp32", "bf16", "fp16"))})
    channels_last: bool = MISSING
    compile: bool = MISSING
    compile_cache: Any = MISSING  # a folder or null; checked where it is read (engine/compiling.py)
    cuda_graph: bool = MISSING
    sync_bn: bool = MISSING
    dist_timeout_s: float | None = field(default=MISSING, metadata={"check": check(gt=0.0)})
    deterministic: bool = MISSING
    grad_clip: float | None = field(default=MISSING, metadata={"check": check(gt=0.0)})
    label_smoothing: float = field(default=MISSING, metadata={"check": check(ge=0.0, lt=1.0)})
    # true / false / a checkpoint path; a list of keys; a path; an entry name: checked where they are read
    resume: Any = MISSING
    resume_overrides: Any = MISSING
    resume_data_changed: str | None = field(default=MISSING, metadata={"check": check(choices=("ok",))})
    init_from: Any = MISSING
    init_key: Any = MISSING
    weights_required: str | None = MISSING  # a config key; checked by engine/validate.check_weights
    checkpoint_every: int = field(default=MISSING, metadata={"check": check(ge=0)})
    eval_every: int = field(default=MISSING, metadata={"check": check(ge=0)})
    limit_train_batches: int | None = field(default=MISSING, metadata={"check": check(ge=1)})
    progress: bool = MISSING
    reliability_diagram: bool = MISSING


_SCORES = ("max_prob", "entropy")


@dataclass
class EvalConfig(Checked):
    """The ``metrics`` node, and the one declaration of its defaults: the conventions of the one evaluation
    routine (flatbnn/metrics/evaluate.py), written into every results.json. Field order = the order in the
    composed config (and so in config_resolved.yaml)."""

    node: ClassVar[str] = "metrics"

    ece_bins: int = field(default=15, metadata={"check": check(ge=1)})  # the papers' 20-bin variant: ece_bins=20
    # width | mass (SWAG paper: equal-mass)
    ece_binning: str = field(default="width", metadata={"check": check(choices=("width", "mass"))})
    # right: (lo, hi] (flat_seeking_bnn code) | left: [lo, hi) | both: [lo, hi] (bSAM) | strict: (lo, hi)
    ece_edges: str = field(default="right", metadata={"check": check(choices=("right", "left", "both", "strict"))})
    # score for misclassification AUROC (positives = correct)
    misclass_score: str = field(default="max_prob", metadata={"check": check(choices=_SCORES)})
    # score for OOD AUROC (positives = in-distribution)
    ood_score: str = field(default="max_prob", metadata={"check": check(choices=_SCORES)})
    # misclassification AUROC: exact (every distinct score) | thresholds (bSAM / VOGN code: a fixed grid, trapezoid)
    auroc: str = field(default="exact", metadata={"check": check(choices=("exact", "thresholds"))})
    auroc_thresholds: int = field(default=2500, metadata={"check": check(ge=1)})  # the bSAM code's 2,500
    single_sample_metrics: bool = True  # multi-sample methods: also the mean single-sample metrics
    # null: NLL = the exact mean | B: the bSAM code's (test set in batches of B, sum of batch means / (batches - 1))
    nll_batches: int | None = field(default=None, metadata={"check": check(ge=1)})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.auroc == "thresholds" and self.misclass_score != "max_prob":
            raise ConfigError("metrics.auroc=thresholds: the threshold grid is on [0, 1] and needs "
                              "metrics.misclass_score=max_prob")


def register() -> None:
    """``metrics: default`` of configs/config.yaml's defaults list (idempotent)."""
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(group="metrics", name="default", node=EvalConfig)


register()
