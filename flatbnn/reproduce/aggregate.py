"""Run directories -> one row per experiment: mean ± std over seeds, never across different experiments.

A run directory holds ``results.json`` (``{"metrics": ..., "meta": ...}``, written by flatbnn/engine/run.py; the
meta: engine/results.py) and, when Hydra made it, ``.hydra/config.yaml`` beside it. Runs are grouped by their
**whole configuration**:

* the config as Hydra saved it (``.hydra/config.yaml``; interpolations such as ``${dataset.num_classes}`` are
  compared as written: they are functions of keys that are compared too), without the keys that legitimately vary
  between the seeds of one experiment or only say where / how visibly / how fast a run ran (:data:`IGNORED_KEYS`,
  the roles declared in flatbnn/keyroles.py: the seed and everything derived from it, ``hydra.*``, progress bars,
  resume, workers, device choice, eval batch size, data paths, loggers, the reproduction runner's row / cell labels);
* plus from ``meta``: the budget (epochs, steps, train / test size, global batch, world size, precision), the
  metric conventions, the hardware kind (cpu / which GPU), the dataset / model / method / flatness descriptions.
  A run without ``.hydra/config.yaml`` (e.g. ``run(cfg, run_dir)`` called directly) is keyed by ``meta`` and its
  Hydra ``overrides`` instead, so it never shares a row with a run that has a config.

So runs with different epochs, optimiser or learning rate, label noise, number of predictive samples, ECE bins or
budget are never averaged together. Within a row a seed may appear once (:class:`DuplicateSeedError` otherwise).

Sweep members that have a ``.hydra/`` directory but no ``results.json`` (failed or still running), and jobs that a
sweep's ``multirun.yaml`` lists but that never started, are returned as :class:`Failed` entries; they are never
counted in n. Statistics (flatbnn/reproduce/stats.py, shared with the paper comparisons): mean and
``statistics.stdev`` (ddof = 1) over the seeds; n = 1 has no std; a seed whose value is NaN / inf / missing is left
out of the cell's mean and std and counted beside it (``[1/3 non-finite]``; ``nan [3/3 non-finite]`` when none is
finite).

Library use (scripts/aggregate.py is the command line)::

    from flatbnn.reproduce.aggregate import load_runs, group_runs, summarize
    runs, failed = load_runs(["multirun/2026-11-22/12-00-00"])
    for g in group_runs(runs, failed):
        row = summarize(g)          # {"accuracy": [mean, std], "n": 3, "stats": {...}, ...}
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from flatbnn import keyroles
from flatbnn.reproduce.stats import NAN_POLICY, is_finite, nonfinite_note, seed_stats
from flatbnn.utils import canonical_target, flatten  # noqa: F401 (also aggregate.flatten for its callers)

METRICS = ["accuracy", "nll", "ece", "brier", "auroc_misclassification", "auroc_ood"]

STATS_NOTE = ("mean ± std over seeds (std: sample standard deviation, ddof = 1); n = number of seeds; "
              f"a row with n=1 shows its single value without ±; {NAN_POLICY}")

# config keys (dotted; a key also removes everything below it) that never split a group: the seed, paths, display,
# bookkeeping, labels -- the roles that do not split rows, declared in flatbnn/keyroles.py
IGNORED_KEYS = keyroles.declared("splits_rows", False)
# meta keys in the group key (besides the config): what was actually run and how it was measured
# (shift_data: a generated CIFAR-10-C stand-in is never averaged with the official release)
META_KEYS = ("dataset", "model", "method", "flatness", "epochs", "budget", "metric_conventions", "shift_data")
HARDWARE_KEYS = ("device", "gpu", "world_size")  # cpu model, core count, torch version do not split a group

ERROR_FILES = ("failed.txt", "error.txt", "error.log", "*.err", "stderr*", "*.log")


class DuplicateSeedError(ValueError):
    """Two run directories of one group report the same seed (one-line message naming them)."""


@dataclass
class Run:
    """One finished run: its directory, results.json and (if Hydra made it) its saved config."""
    path: Path
    results: dict
    config: dict | None = None
    key: dict[str, str] = field(default_factory=dict)

    @property
    def meta(self) -> dict:
        return self.results.get("meta") or {}

    @property
    def metrics(self) -> dict:
        return self.results.get("metrics") or {}

    @property
    def seed(self):
        s = self.meta.get("seed")
        if s is None and self.config is not None:
            s = self.config.get("seed")
        return s


@dataclass
class Failed:
    """A sweep member without results: failed, killed, still running, or never started."""
    path: Path
    reason: str
    message: str | None = None          # last line of the run's error file, if any
    overrides: list[str] | None = None
    config: dict | None = None

    def describe(self) -> str:
        s = f"`{self.path}`: {self.reason}"
        if self.message:
            s += f" -- {self.message}"
        if self.overrides:
            s += f" (overrides: {' '.join(self.overrides)})"
        return s


@dataclass
class Group:
    """The runs of one experiment (identical key), and the failed members with the same config."""
    key: dict[str, str]
    runs: list[Run]
    failed: list[Failed] = field(default_factory=list)

    @property
    def seeds(self) -> list:
        return sorted((r.seed for r in self.runs), key=_sort_key)

    @property
    def meta(self) -> dict:
        return self.runs[0].meta


# ---------------------------------------------------------------------------------------------------- discovery


def load_runs(paths: Iterable[str | Path], warn=None) -> tuple[list[Run], list[Failed]]:
    """Find the runs under ``paths`` (run dirs, sweep dirs, any parent, or results.json files).

    Returns ``(runs, failed)``: every directory with a readable results.json is a :class:`Run`; every directory
    with a ``.hydra/`` but no (readable) results.json, and every job a sweep's ``multirun.yaml`` lists that has no
    directory, is a :class:`Failed`. A directory reached through two of the paths counts once."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    result_files: dict[Path, Path] = {}
    hydra_dirs: set[Path] = set()
    sweep_dirs: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            warn(f"no such path: {p}")
            continue
        if p.is_file():
            if p.name == "results.json":
                result_files[p.parent.resolve()] = p
            elif p.name == "multirun.yaml":
                sweep_dirs.add(p.parent.resolve())
            else:
                warn(f"skipping {p}: not a run directory or results.json")
            continue
        for f in p.rglob("results.json"):
            result_files.setdefault(f.parent.resolve(), f)
        for h in p.rglob(".hydra"):
            if h.is_dir():
                hydra_dirs.add(h.parent.resolve())
        for m in p.rglob("multirun.yaml"):
            sweep_dirs.add(m.parent.resolve())

    runs, failed = [], []
    for d, f in sorted(result_files.items()):
        try:
            results = json.loads(f.read_text())
            if not isinstance(results, dict) or not isinstance(results.get("metrics"), dict):
                raise ValueError("no 'metrics' dict")
        except (OSError, ValueError) as e:
            warn(f"skipping {f}: {e}")
            failed.append(_failed_dir(d, f"unreadable results.json ({e})"))
            continue
        # an evaluation's config is the evaluated run's plus the overrides (an eval-row job's own .hydra/ holds
        # only which run it evaluated: flatbnn/reproduce/eval_job.py)
        evaluated_from = (results.get("meta") or {}).get("evaluated_from")
        config = _evaluation_config(d, evaluated_from) if isinstance(evaluated_from, dict) else None
        config = config if config is not None else _read_yaml(d / ".hydra" / "config.yaml")
        runs.append(Run(path=d, results=results, config=config if isinstance(config, dict) else None))
    done = set(result_files)
    for d in sorted(hydra_dirs - done):
        failed.append(_failed_dir(d, "no results.json (failed, killed or still running)"))
    for s in sorted(sweep_dirs):
        members = [d for d in hydra_dirs if _nearest_sweep(d, sweep_dirs) == s]
        failed += _never_started(s, members, warn)
    for r in runs:
        r.key = run_key(r)
    return runs, failed


def find_results(paths: list[str]) -> list[dict]:
    """The results.json contents under ``paths`` (the finished runs only; scripts/sweep_heatmap.py uses this)."""
    return [r.results for r in load_runs(paths)[0]]


def _read_yaml(path: Path) -> dict | None:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, (dict, list)) else None


def _evaluation_config(d: Path, ev: dict) -> dict | None:
    """evaluate.py's ``RUN/eval/<name>/results.json``: the trained run's config with the evaluation overrides."""
    src = Path(str(ev.get("run_dir") or d.parent.parent))
    config = _read_yaml(src / ".hydra" / "config.yaml") or _read_yaml(d.parent.parent / ".hydra" / "config.yaml")
    if not isinstance(config, dict):
        return None
    for o in ev.get("overrides") or []:
        k, sep, v = str(o).lstrip("+").partition("=")
        if not sep:
            continue
        parts = k.split(".")
        node = config
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        try:
            node[parts[-1]] = yaml.safe_load(v)
        except yaml.YAMLError:
            node[parts[-1]] = v
    return config


def _failed_dir(d: Path, reason: str) -> Failed:
    overrides = _read_yaml(d / ".hydra" / "overrides.yaml")
    return Failed(path=d, reason=reason, message=last_error_line(d),
                  overrides=[str(o) for o in overrides] if isinstance(overrides, list) else None,
                  config=_read_yaml(d / ".hydra" / "config.yaml"))


def last_error_line(d: Path) -> str | None:
    """The last non-empty line of the run's error file (failed.txt, error.txt, *.err, *.log), if any."""
    for pattern in ERROR_FILES:
        for f in sorted(d.glob(pattern)):
            try:
                lines = [ln.strip() for ln in f.read_text(errors="replace").splitlines() if ln.strip()]
            except OSError:
                continue
            if lines:
                line = lines[-1]
                return f"{f.name}: {line[:300]}"
    return None


def _nearest_sweep(d: Path, sweep_dirs: set[Path]) -> Path | None:
    for parent in d.parents:
        if parent in sweep_dirs:
            return parent
    return None


def sweep_jobs(multirun_yaml: dict) -> list[list[str]] | None:
    """The override list of every job of a basic-sweeper multirun (Hydra's own expansion), or None if unknown."""
    try:
        hydra_cfg = multirun_yaml["hydra"]
        sweeper = hydra_cfg.get("sweeper") or {}
        if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return None
        params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
        task = list(hydra_cfg["overrides"]["task"])
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        overrides = OverridesParser.create().parse_overrides(params + task)
        return BasicSweeper.split_arguments(overrides, None)[0]
    except Exception:  # another sweeper, a glob sweep, an old file: no job list, no missing-job check
        return None


def _never_started(sweep: Path, members: list[Path], warn) -> list[Failed]:
    multirun = _read_yaml(sweep / "multirun.yaml")
    jobs = sweep_jobs(multirun) if isinstance(multirun, dict) else None
    if jobs is None:
        return []
    present = []
    for d in members:
        ov = _read_yaml(d / ".hydra" / "overrides.yaml")
        present.append(tuple(sorted(map(str, ov))) if isinstance(ov, list) else None)
    if any(p is None for p in present):  # cannot match jobs to directories: compare the counts
        missing = len(jobs) - len(members)
        return [Failed(path=sweep, reason=f"{missing} of {len(jobs)} sweep jobs have no run directory")] \
            if missing > 0 else []
    have = set(present)
    subdir = str(((multirun.get("hydra") or {}).get("sweep") or {}).get("subdir", ""))
    out = []
    for k, job in enumerate(jobs):
        if tuple(sorted(job)) not in have:
            where = sweep / str(k) if subdir == "${hydra.job.num}" else sweep
            out.append(Failed(path=where, reason=f"sweep job #{k} of {len(jobs)} never started", overrides=job))
    return out


# ---------------------------------------------------------------------------------------------------- group key


def _norm(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return int(v) if v.is_integer() else v
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _norm(x) for k, x in v.items()}
    return str(v)


def _canon(v: Any) -> str:
    return json.dumps(_norm(v), sort_keys=True, default=str)


def _ignored(key: str, value: Any, seed: Any) -> bool:
    if not keyroles.splits_rows(key):
        return True
    if isinstance(value, str) and "${seed}" in value.replace(" ", ""):
        return True  # derived from the seed (dataset.seed: ${seed})
    return key.rsplit(".", 1)[-1] == "seed" and seed is not None and _norm(value) == _norm(seed)


def config_key(config: dict | None, seed: Any = None) -> dict[str, str]:
    """The part of the group key that comes from a saved Hydra config (``{dotted key: canonical JSON}``)."""
    if not isinstance(config, dict):
        return {}
    seed = config.get("seed") if seed is None else seed
    return {k: _canon(canonical_target(k, v)) for k, v in flatten(config).items() if not _ignored(k, v, seed)}


def run_key(run: Run) -> dict[str, str]:
    """Everything that must be equal for two runs to be seeds of one experiment (``{name: canonical JSON}``).

    Config keys keep their dotted names (``optimizer.lr``); keys from results.json meta are prefixed ``meta.``;
    for a run without a saved config its Hydra overrides are keyed as ``override.<key>``."""
    meta = run.meta
    key = config_key(run.config, run.seed)
    for k in META_KEYS:
        if k in meta:
            v = meta[k]
            if isinstance(v, dict) and v:
                key.update({f"meta.{k}.{kk}": _canon(vv) for kk, vv in flatten(v).items()})
            else:
                key[f"meta.{k}"] = _canon(v)
    hw = meta.get("hardware") or {}
    for k in HARDWARE_KEYS:
        if k in hw:
            key[f"meta.hardware.{k}"] = _canon(hw[k])
    ev = meta.get("evaluated_from")
    key["meta.evaluation"] = _canon(ev.get("name", "?") if isinstance(ev, dict) else "train.py")
    if run.config is None:
        key["meta.config"] = _canon("absent")  # never mixed with runs whose full config is known
        for o in meta.get("overrides") or []:
            k, sep, v = str(o).lstrip("+~").partition("=")
            if sep and not _ignored(k, v, run.seed):
                key[f"override.{k}"] = _canon(v)
    return key


# ---------------------------------------------------------------------------------------------------- grouping


def _sort_key(v):
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))


def group_runs(runs: list[Run], failed: Iterable[Failed] = (), allow_duplicate_seeds: bool = False) -> list[Group]:
    """Group runs whose keys are identical (see :func:`run_key`); attach the failed members whose saved config
    matches a group's config. Raises :class:`DuplicateSeedError` if a group holds one seed twice."""
    groups: dict[tuple, Group] = {}
    for r in runs:
        if not r.key:
            r.key = run_key(r)
        k = tuple(sorted(r.key.items()))
        groups.setdefault(k, Group(key=r.key, runs=[])).runs.append(r)
    out = list(groups.values())
    dupes = []
    for g in out:
        by_seed: dict[str, list[Run]] = {}
        for r in g.runs:
            by_seed.setdefault(_canon(r.seed), []).append(r)
        for s, rs in by_seed.items():
            if len(rs) > 1:
                dupes.append(f"seed {s} in {', '.join(str(r.path) for r in rs)}")
    if dupes and not allow_duplicate_seeds:
        raise DuplicateSeedError("duplicate seed within one experiment: " + "; ".join(dupes)
                                 + " (remove one, or pass --allow-duplicate-seeds to count both)")
    for f in failed:
        if f.config is None:
            continue
        ck = config_key(f.config)
        for g in out:
            cfg_part = {k: v for k, v in g.key.items() if not k.startswith(("meta.", "override."))}
            if cfg_part and cfg_part == ck:
                g.failed.append(f)
                break
    out.sort(key=lambda g: (_row_label(g), _canon(sorted(g.key.items()))))
    return out


# ---------------------------------------------------------------------------------------------------- statistics


_ABSENT = object()


def _walk(metrics: dict, name: str):
    """``metrics[name]``, where a dotted name walks nested dicts; ``_ABSENT`` where there is no such key (a null
    value is there: None)."""
    if name in metrics:
        return metrics[name]
    node = metrics
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def metric_value(metrics: dict, name: str):
    """``metrics[name]``, where a dotted name walks nested dicts (``ood.svhn.auroc``)."""
    value = _walk(metrics, name)
    return None if value is _ABSENT else value


def _has_metric(metrics: dict, name: str) -> bool:
    """Does ``metrics`` hold ``name`` (dotted: nested) at all -- null included?"""
    return _walk(metrics, name) is not _ABSENT


def metric_stats(values: list) -> dict:
    """``{"n", "n_nonfinite", "mean", "std", "values"}`` under the NaN policy of flatbnn/reproduce/stats.py: mean /
    std (ddof = 1) of the finite values, n = how many; NaN / inf / missing values are left out and counted in
    ``n_nonfinite`` (kept in ``values`` as null / "nan" / "inf"). mean is None for n = 0, std for n < 2."""
    st = seed_stats(values)
    return {"n": st.n, "n_nonfinite": st.n_nonfinite, **({"n_nonnumeric": st.n_nonnumeric} if st.n_nonnumeric else {}),
            "mean": st.mean, "std": st.std, "values": [v if is_finite(v) else (None if v is None else str(v)) for v in values]}


def _flatness_label(fl: dict) -> str:
    hp = [f"{k}={fl[k]}" for k in ("rho", "eta", "sigma", "m") if fl.get(k) is not None
          and not (k == "m" and fl[k] == 1)]
    return str(fl.get("name", "?")) + (f"({', '.join(hp)})" if hp else "")


def config_labels(run: Run) -> dict:
    """What a results.json's meta names (dataset, model, method, flatness, epochs, global batch) taken from the run's
    ``.hydra/`` files instead, for a results.json without meta (an old or hand-made one): the group options Hydra
    chose (``hydra.yaml``: the names train.py's meta uses), else the config's own names. {} without a config."""
    cfg = run.config or {}
    if not cfg:
        return {}
    hydra = _read_yaml(Path(run.path) / ".hydra" / "hydra.yaml") or {}
    choices = ((hydra.get("hydra") or {}).get("runtime") or {}).get("choices") or {} if isinstance(hydra, dict) else {}

    def name(group: str):  # the chosen option, the node's name, else its class's module (one file per method)
        node = cfg.get(group) if isinstance(cfg.get(group), dict) else {}
        target = str(node.get("_target_") or "")
        return choices.get(group) or node.get("name") or (target.rsplit(".", 2)[-2] if target.count(".") >= 2 else None)

    trainer = cfg.get("trainer") if isinstance(cfg.get("trainer"), dict) else {}
    flatness = cfg.get("flatness") if isinstance(cfg.get("flatness"), dict) else {}
    out = {"dataset": name("dataset"), "model": name("model"), "method": {"name": name("method")},
           "flatness": {"name": name("flatness"), **{k: flatness[k] for k in ("rho", "eta", "sigma", "m")
                                                    if isinstance(flatness.get(k), (int, float))}},
           "budget": {"epochs": trainer.get("epochs"), "global_batch": trainer.get("batch_size")}}
    return {k: v for k, v in out.items() if v not in (None, {"name": None})}


def _with_config_labels(meta: dict, run: Run) -> dict:
    """``meta``, where it names no dataset / model / method / flatness / budget, completed from the run's config."""
    missing = [k for k in ("dataset", "model", "method", "flatness", "budget") if not meta.get(k)]
    if not missing:
        return meta
    labels = config_labels(run)
    return {**meta, **{k: labels[k] for k in missing if k in labels}}


def _row_label(g: Group) -> tuple:
    m = _with_config_labels(g.meta, g.runs[0])
    return (str(m.get("dataset", "?")), str(m.get("model", "?")), str((m.get("method") or {}).get("name", "?")),
            _flatness_label(m.get("flatness") or {}))


def budget_label(meta: dict) -> str:
    b, hw = meta.get("budget") or {}, meta.get("hardware") or {}
    s = (f"{b.get('epochs', meta.get('epochs', '?'))} ep, n={b.get('train_size', '?')}, "
         f"batch {b.get('global_batch', '?')}, {b.get('world_size', hw.get('world_size', 1))}x"
         f"{hw.get('gpu') or hw.get('device', '?')}")
    if b.get("precision") not in (None, "fp32"):
        s += f", {b['precision']}"
    if (meta.get("shift_data") or {}).get("source") == "generated":
        s += ", generated shift sets"
    return s


def summarize(g: Group, metrics: list[str] = METRICS, config: dict[str, Any] | None = None) -> dict:
    """One row: identity, n, seeds, per-metric ``[mean, std]`` (None where undefined) and full ``stats``."""
    dataset, model, method, flat = _row_label(g)
    row = {"dataset": dataset, "model": model, "method": method, "flatness": flat,
           "config": config or {}, "n": len(g.runs), "seeds": g.seeds, "stats": {}}
    for m in metrics:
        vals = [metric_value(r.metrics, m) for r in g.runs]
        if not any(_has_metric(r.metrics, m) for r in g.runs):  # not computed by these runs (e.g. no OOD set)
            continue
        st = metric_stats(vals)  # a null the run wrote counts as non-finite: its column stays, "nan [1/1 ...]"
        row["stats"][m] = st
        row[m] = [st["mean"], st["std"]]
    row["budget"] = budget_label(_with_config_labels(g.meta, g.runs[0]))
    row["commits"] = sorted({_commit(r.meta) for r in g.runs})
    row["runs"] = [str(r.path) for r in sorted(g.runs, key=lambda r: _sort_key(r.seed))]
    row["failed"] = [str(f.path) for f in g.failed]
    row["key"] = {k: json.loads(v) for k, v in sorted(g.key.items())}
    return row


def _commit(meta: dict) -> str:
    git = meta.get("git") or {}
    c = str(git.get("commit", "unknown"))[:8]
    return c + ("+dirty" if git.get("dirty") else "")


# ---------------------------------------------------------------------------------------------------- config diff

# keys already shown by the fixed columns (dataset, model, method, flatness, budget); hidden from "config"
_SHOWN_ELSEWHERE = ("dataset._target_", "dataset.name", "model._target_", "model.name", "method._target_",
                    "method.name", "flatness._target_", "flatness.name", "meta.dataset", "meta.model",
                    "meta.method.name", "meta.flatness.name", "meta.flatness.rho", "meta.flatness.eta",
                    "meta.flatness.sigma", "meta.flatness.m", "meta.epochs", "meta.budget.epochs",
                    "meta.budget.train_size", "meta.budget.global_batch", "meta.budget.world_size",
                    "meta.budget.precision", "meta.hardware.device", "meta.hardware.gpu",
                    "meta.hardware.world_size", "meta.config")
# meta keys that mirror config keys: shown only for runs without a saved config
_MIRRORS = ("meta.method.", "meta.flatness.", "meta.metric_conventions.")


def _display_name(k: str) -> str:
    return k.split(".", 1)[1] if k.startswith(("meta.", "override.")) else k


def _fmt_value(canon: str | None) -> str:
    if canon is None:
        return "(unset)"
    v = json.loads(canon)
    if isinstance(v, str):
        return v
    return json.dumps(v, separators=(",", ":"))


def config_diff(groups: list[Group]) -> list[dict[str, str]]:
    """For each group, ``{key: value}`` of the keys whose value differs from another group's (the readable part
    of the group key: keys shown by the fixed columns, and meta mirrors of config keys, are left out unless two
    rows would otherwise look the same)."""
    def candidates(g: Group) -> dict[str, str]:
        has_cfg = "meta.config" not in g.key
        return {k: v for k, v in g.key.items() if k not in _SHOWN_ELSEWHERE
                and not (has_cfg and k.startswith(_MIRRORS))}

    cands = [candidates(g) for g in groups]
    diffs = []
    for i, c in enumerate(cands):
        d = {}
        for k, v in c.items():
            if any(k in o and o[k] != v for j, o in enumerate(cands) if j != i):
                d[k] = v
        diffs.append(d)
    # two rows that would print identically: show every key on which they differ (absent -> "(unset)")
    labels = [(_row_label(g), budget_label(g.meta), tuple(sorted(d.items()))) for g, d in zip(groups, diffs)]
    for i in range(len(groups)):
        for j in range(len(groups)):
            if i != j and labels[i] == labels[j]:
                a, b = groups[i].key, groups[j].key
                for k in sorted(set(a) | set(b)):
                    if a.get(k) != b.get(k):
                        diffs[i][k] = a.get(k)
    return [{_display_name(k): _fmt_value(v) for k, v in sorted(d.items())} for d in diffs]


# ---------------------------------------------------------------------------------------------------- output


def fmt_cell(st: dict | None, metric: str) -> str:
    if st is None:
        return "–"
    scale, digits = (100, 2) if metric == "accuracy" else (1, 4)
    left_out = nonfinite_note(st["n"], st["n_nonfinite"], st.get("n_nonnumeric", 0))
    if st["mean"] is None:
        return "nan" + left_out
    mean = f"{scale * st['mean']:.{digits}f}"
    if st["n"] == 1:
        return f"{mean} (n=1){left_out}"
    return f"{mean} ± {scale * st['std']:.{digits}f}{left_out}"


def _seeds_cell(row: dict) -> str:
    s = ",".join(map(str, row["seeds"]))
    if row["failed"]:
        s += f" (+{len(row['failed'])} failed)"
    return s


def to_markdown(rows: list[dict], metrics: list[str] = METRICS) -> str:
    metrics = [m for m in metrics if any(m in r["stats"] for r in rows)]
    with_config = any(r["config"] for r in rows)
    head = ["dataset", "model", "method", "flatness", *(["config"] if with_config else []), "n", "seeds",
            *[("acc %" if m == "accuracy" else m) for m in metrics], "budget", "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["dataset"], r["model"], r["method"], r["flatness"]]
        if with_config:
            cells.append(", ".join(f"{k}={v}" for k, v in r["config"].items()))
        cells += [str(r["n"]), _seeds_cell(r)]
        cells += [fmt_cell(r["stats"].get(m), m) for m in metrics]
        cells += [r["budget"], ",".join(r["commits"])]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def failed_markdown(failed: list[Failed]) -> str:
    if not failed:
        return ""
    return "\n".join([f"Failed / missing runs ({len(failed)}; not counted in n):", ""]
                     + [f"- {f.describe()}" for f in failed])


def aggregate_paths(paths: Iterable[str | Path], metrics: list[str] = METRICS, allow_duplicate_seeds=False,
                    warn=None) -> tuple[list[dict], list[Failed], list[Run]]:
    """load_runs + group_runs + summarize: ``(rows, failed, runs)``."""
    runs, failed = load_runs(paths, warn=warn)
    groups = group_runs(runs, failed, allow_duplicate_seeds=allow_duplicate_seeds)
    rows = [summarize(g, metrics, d) for g, d in zip(groups, config_diff(groups))]
    return rows, failed, runs


def aggregate(results: list[dict], metrics: list[str] = METRICS) -> list[dict]:
    """Rows from results.json contents alone (no run directories: keyed by meta; kept for old callers)."""
    runs = [Run(path=Path(str((r.get("meta") or {}).get("run_dir", f"<results {i}>"))), results=r)
            for i, r in enumerate(results)]
    groups = group_runs(runs)
    return [summarize(g, metrics, d) for g, d in zip(groups, config_diff(groups))]


__all__ = ["METRICS", "STATS_NOTE", "IGNORED_KEYS", "DuplicateSeedError", "Run", "Failed", "Group", "load_runs",
           "find_results", "run_key", "config_key", "group_runs", "metric_stats", "summarize", "config_diff",
           "to_markdown", "failed_markdown", "aggregate_paths", "aggregate", "sweep_jobs", "last_error_line"]
