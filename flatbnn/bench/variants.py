"""What scripts/benchmark.py times, read from ``configs/``: a row is a ``method+flatness`` pair, each side an option of
``configs/method`` / ``configs/flatness`` built as a run builds it (the option's keys, its same-group defaults
merged first), so a new method or flatness variant -- one file plus one YAML -- is benchmarked without being named
here.

* The labels: every option of the two groups (``swag_diag``, ``sgvb_lrt``, ... too; the ``# @package _global_``
  presets such as ``f_swag`` are pairs already: ``swag+sam``), plus the measurement variants below.
* The default rows (:func:`default_pairs`): every method option with a class of its own with flatness ``none``,
  every flatness option with a class of its own with ``map`` (or the method that gives it the scaling it needs),
  then the cross pairs :data:`EXTRA_PAIRS` the ratios and the papers' comparisons ask for.

What the benchmark changes of a config is said here once: :data:`STEP_KEYS` (every step does the method's
bookkeeping: SWAG collects each step, the worst case; SGLD never starts keeping samples, so its row is its step) and
the measurement variants' settings (:class:`Variant`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from flatbnn import resources

# keys of a method / flatness option the benchmark sets where the option has them (worst case of per-step work)
STEP_KEYS = {"swa_start": 0, "collect_unit": "step", "collect_every": 1, "burn_in": 10**9}


@dataclass(frozen=True)
class Variant:
    """One side of a row: a config option, the keys the benchmark changes, and the run settings it measures with."""
    option: str                                      # configs/<group>/<option>.yaml
    keys: dict = field(default_factory=dict)         # its keys changed (after STEP_KEYS)
    model: dict = field(default_factory=dict)        # keyword arguments of the backbone (mc_dropout: a dropout rate)
    optimizer: str = "sgd"                           # "sgd" (lr 0.01, momentum) or "adam" (lr 1e-3)
    momentum: float = 0.9


# measurement variants and settings, by row label (every other label: its option as configured)
METHOD_VARIANTS = {
    "map_adam": Variant("map", optimizer="adam"),  # SAM-Adam's base (bSAM paper baseline): map+sam_m8 with Adam
    # worst case of Alg. 2 with Eq. 5: an average + restart every step, low-rank part in every training sample
    "hwa_lowrank": Variant("hwa", keys={"covariance": "lowrank", "start": 0.0, "cycle_length": 1}),
    "sgld": Variant("sgld", momentum=0.0),  # textbook SGLD has no momentum
    "sgld_official": Variant("sgld_official", momentum=0.0),
    "mc_dropout": Variant("mc_dropout", model={"dropout": 0.05}),
    "vogn_m8": Variant("vogn", keys={"m": 8}),  # the papers' VOGN: 8 independent noise samples per step (bsam rows)
    # the m parts batched (one vmap over the parts) or looped, whatever the device's rule (batched_parts=auto) says
    "vogn_m8_batched": Variant("vogn", keys={"m": 8, "batched_parts": True}),
    "vogn_m8_loop": Variant("vogn", keys={"m": 8, "batched_parts": False}),
    "bsam_batched": Variant("bsam", keys={"batched_parts": True}),
    "bsam_loop": Variant("bsam", keys={"batched_parts": False}),
}
FLATNESS_VARIANTS = {"sam_m8": Variant("sam", keys={"m": 8}),
                     "sam_m8_batched": Variant("sam", keys={"m": 8, "batched_chunks": True})}
# cross pairs beyond the default rows: the RATIOS of scripts/benchmark.py and the papers' F-methods
EXTRA_PAIRS = ("map+sam_m8", "swag+sam", "swag+fsam", "swag_diag+none", "sgld+sam", "sgvb_lrt+none", "sgvb+sam",
               "hwa_lowrank+none", "map_adam+none", "map_adam+sam_m8")


def _is_preset(path: Path) -> bool:
    return re.search(r"^# @package _global_", path.read_text(), re.M) is not None


def option_node(group: str, option: str, configs_dir: Path | None = None) -> dict:
    """``configs/<group>/<option>.yaml`` as a run composes it: its same-group defaults (``hwa`` -> ``sgvb``) merged
    first, then its own keys (Hydra's ``_self_`` last, as every option here places it)."""
    from omegaconf import OmegaConf

    node = resources.group_options(group, configs_dir).get(option)
    if node is None:
        raise KeyError(f"no configs/{group}/{option}.yaml")
    merged = OmegaConf.create({})
    for parent in node.get("defaults") or []:
        if isinstance(parent, str) and parent != "_self_":
            merged = OmegaConf.merge(merged, option_node(group, parent, configs_dir))
    own = OmegaConf.create({k: v for k, v in node.items() if k != "defaults"})
    return OmegaConf.to_container(OmegaConf.merge(merged, own), resolve=True)


def options(group: str, configs_dir: Path | None = None) -> list[str]:
    """The options of ``group`` a row can name: every one but the ``# @package _global_`` presets."""
    folder = Path(configs_dir or resources.CONFIGS_DIR) / group
    return [f.stem for f in sorted(folder.glob("*.yaml")) if not _is_preset(f)]


def methods(configs_dir: Path | None = None) -> dict[str, Variant]:
    return {**{o: Variant(o) for o in options("method", configs_dir)}, **METHOD_VARIANTS}


def flatness(configs_dir: Path | None = None) -> dict[str, Variant]:
    return {**{o: Variant(o) for o in options("flatness", configs_dir)}, **FLATNESS_VARIANTS}


def keys_of(group: str, variant: Variant, configs_dir: Path | None = None) -> dict:
    """The constructor keys of a row's side: the option's, with :data:`STEP_KEYS` and the variant's keys."""
    node = option_node(group, variant.option, configs_dir)
    return {**node, **{k: v for k, v in STEP_KEYS.items() if k in node}, **variant.keys}


def build(group: str, variant: Variant, configs_dir: Path | None = None):
    """The method / flatness object of a row's side (``hydra.utils.instantiate``, as train.py builds it)."""
    from hydra.utils import instantiate

    return instantiate(keys_of(group, variant, configs_dir))


def _class(target: str) -> type:
    from hydra.utils import get_class

    return get_class(target)


def flatness_partner(flat_cls: type, method_classes: dict[str, type]) -> str:
    """The method a flatness variant is paired with: ``map``, or -- for a variant that needs a per-weight scaling
    from its method (``Flatness.needs_scaling``: geometry) -- the most basic method class offering one
    (``flatness_scaling``; SGVB before its subclass HWA), ``sgvb`` where it is one (the geometry of flat_seeking_bnn,
    whose benchmark rows are kept; IVON offers one too)."""
    if not getattr(flat_cls, "needs_scaling", False):
        return "map"
    able = {n: c for n, c in method_classes.items() if callable(getattr(c, "flatness_scaling", None))}
    roots = [n for n, c in able.items() if not any(o is not c and issubclass(c, o) for o in able.values())]
    return "sgvb" if "sgvb" in roots else roots[0]


def default_pairs(configs_dir: Path | None = None) -> list[str]:
    """The default rows: every method class with flatness none, every flatness class with its partner, then
    :data:`EXTRA_PAIRS` (each once, in that order)."""
    method_classes = {o: _class(t) for o, t in resources.own_targets("method", configs_dir).items()}
    flat_targets = resources.own_targets("flatness", configs_dir)
    rows = [f"{m}+none" for m in method_classes]
    rows += [f"{flatness_partner(_class(t), method_classes)}+{f}" for f, t in flat_targets.items() if f != "none"]
    return list(dict.fromkeys(rows + list(EXTRA_PAIRS)))


@functools.cache
def pair_keys() -> dict[str, dict]:
    """Every row label -> ``{"method": keys, "flatness": keys}``: the constructor keys each side is built with (a run
    config's shape, for the cost estimates' matching: which path the row's m parts take, say)."""
    ms = {n: keys_of("method", v) for n, v in methods().items()}
    fs = {n: keys_of("flatness", v) for n, v in flatness().items()}
    return {f"{mn}+{fn}": {"method": mk, "flatness": fk} for mn, mk in ms.items() for fn, fk in fs.items()}


#: keys that change what one training step costs within one class, so the cost estimates key on them too: SGVB's
#: estimator (bbb_flipout, sgvb_lrt and sgvb are one class; flipout runs a second product per layer)
WORK_KEYS = ("estimator",)


def target_class(group) -> str:
    """The class name a config group's ``_target_`` names (``flatbnn.methods.sgvb.SGVB`` -> ``SGVB``; "" for none)."""
    return str((group or {}).get("_target_", "")).rsplit(".", 1)[-1]


def work_class(group: dict | None) -> str:
    """A config group's class as the cost estimates match runs to measured rows: :func:`target_class`, with the
    :data:`WORK_KEYS` it sets (``SGVB[estimator=flipout]``)."""
    group = group or {}
    extra = ",".join(f"{k}={group[k]}" for k in WORK_KEYS if group.get(k) is not None)
    return f"{target_class(group)}[{extra}]" if extra else target_class(group)


@functools.cache
def pair_classes() -> dict[str, tuple[str, str, int]]:
    """Every row label -> (method class, flatness class, m-sharpness split) of what the row builds (classes as
    :func:`work_class` names them): how the cost estimates (flatbnn/reproduce/cost.py) match a measured row to a run
    config. m as a run config gives it: the flatness option's, else the method's own (bsam's 8), else 1."""
    return {label: (work_class(k["method"]), work_class(k["flatness"]),
                    int(k["flatness"].get("m") or k["method"].get("m") or 1)) for label, k in pair_keys().items()}
