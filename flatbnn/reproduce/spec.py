"""Row specs (``rows/<row>.yaml``) and the papers' numbers (``results/paper/<row>.yaml``): loading and checks.

A row is one table or figure of a paper; its spec names the cells (axis values -> Hydra overrides), the seeds and
the overrides of each scale. Schema and conventions: docs/reproduce.md.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from flatbnn import resources
from flatbnn.reproduce import claims as claims_mod
from flatbnn.reproduce import curves

REPO = resources.project_root()  # where outputs/ and results/ are written
ROWS_DIR = resources.ROWS_DIR
PAPER_DIR = resources.PAPER_DIR
SCALES = ("smoke", "cpu", "paper")


class SpecError(ValueError):
    """A row spec or paper-data file that does not follow docs/reproduce.md (one-line message)."""


class UnreadableFile(SpecError):
    """A record, results.json, comparison or YAML file that does not parse (truncated, corrupt, a YAML syntax error):
    ``file:line:column: message``, one line, exit 2 -- not a parser's traceback naming ``<unicode string>``."""


_UNREADABLE_HINT = "truncated or corrupt: restore it (git checkout) or rerun the job that wrote it"


def load_json(path: Path):
    """``path``'s JSON; an unreadable file is :class:`UnreadableFile` naming the file, line and column."""
    import json

    path = Path(path)
    text = path.read_text()
    try:
        return json.loads(text)
    except ValueError as e:
        line, col = (e.lineno, e.colno) if isinstance(e, json.JSONDecodeError) else (1, 1)
        raise UnreadableFile(f"{path}:{line}:{col}: {getattr(e, 'msg', e)} ({_UNREADABLE_HINT})") from None


def load_yaml(path: Path):
    """``path``'s YAML (``None`` for an empty file); a syntax error is :class:`UnreadableFile` naming the file,
    line and column (PyYAML names ``<unicode string>``)."""
    path = Path(path)
    text = path.read_text()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else f"{path}:1:1"
        what = " ".join(f"{getattr(e, 'context', None) or ''} {getattr(e, 'problem', None) or ''}".split())
        raise UnreadableFile(f"{where}: YAML syntax error: {what or type(e).__name__}") from None


@dataclass
class Cell:
    id: str
    overrides: list[str]
    seeds: list[int]
    blocked: str | None = None
    init_from: str | None = None  # the cell of the same row and scale whose run (same seed) it starts from


@dataclass
class Row:
    row: str
    paper: str
    title: str
    kind: str = "train"
    axes: list[str] = field(default_factory=list)
    base: list[str] = field(default_factory=list)
    values: dict = field(default_factory=dict)
    cells: list[str] | None = None
    cell_overrides: dict = field(default_factory=dict)
    cell_blocked: dict = field(default_factory=dict)
    choices: dict = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    compare: dict = field(default_factory=dict)
    scales: dict = field(default_factory=dict)
    requires: list = field(default_factory=list)
    blocked: str | None = None
    script: dict = field(default_factory=dict)
    eval_from: dict = field(default_factory=dict)  # eval rows: {row: <train row>, cell: "<format over our axes>"}
    notes: list | str | None = None
    departures: list = field(default_factory=list)  # where the paper scale knowingly differs from the paper's protocol
    path: Path | None = None

    # ---------------------------------------------------------------- cells
    def cell_ids(self) -> list[str]:
        if self.kind not in ("train", "eval"):
            return []
        if self.cells:
            return list(self.cells)
        return ["/".join(combo) for combo in itertools.product(*(list(self.values[a]) for a in self.axes))]

    def seed_test(self) -> tuple[str, str]:
        """(``paired`` | ``welch``, why): how two of this row's cells are compared over seeds. Paired only where
        the cells share one trained run per seed (an eval row's sample counts or corruption sets; a script row over
        the same models declares ``compare.seed_test: paired``); cells trained separately are independent samples
        (Welch). Claims and the direction table both read it."""
        declared = (self.compare or {}).get("seed_test")
        if declared is not None:
            return str(declared), "declared in the row (compare.seed_test)"
        if self.kind == "eval":
            return "paired", "an eval row: its cells share one trained run per seed"
        return "welch", "cells trained separately"

    def scale(self, scale: str) -> dict | None:
        if scale not in SCALES:
            raise SpecError(f"unknown scale {scale!r}: use one of {', '.join(SCALES)}")
        sc = self.scales.get(scale)
        return sc if isinstance(sc, dict) else None  # a string = why this scale does not exist (e.g. no data here)

    def scale_missing_reason(self, scale: str) -> str | None:
        sc = self.scales.get(scale)
        return sc if isinstance(sc, str) else (None if isinstance(sc, dict) else "not defined")

    def cells_for(self, scale: str) -> list[Cell]:
        """Every cell of the row with its overrides at ``scale`` (base, axis values, per-cell, scale)."""
        sc = self.scale(scale)
        if sc is None:
            return []
        out = []
        only = sc.get("cells")  # a scale may run a subset of the cells (globs), e.g. one column at cpu scale
        for cid in self.cell_ids():
            if only and not any(fnmatch.fnmatchcase(cid, g) for g in only):
                continue
            parts = cid.split("/")
            ov = list(self.base)
            for axis, value in zip(self.axes, parts):
                ov += list(self.values[axis][value] or [])
            blocked = self.blocked
            for pattern, extra in self.cell_overrides.items():
                if fnmatch.fnmatchcase(cid, pattern):
                    ov += list(extra or [])
            for pattern, reason in self.cell_blocked.items():
                if fnmatch.fnmatchcase(cid, pattern):
                    blocked = blocked or reason
            ov += list(sc.get("overrides") or [])
            for pattern, extra in (sc.get("cell_overrides") or {}).items():
                if fnmatch.fnmatchcase(cid, pattern):
                    ov += list(extra or [])
            out.append(Cell(cid, ov, list(sc.get("seeds", self.seeds)), blocked, self.init_source(scale, cid)))
        return out

    def init_source(self, scale: str, cell_id: str) -> str | None:
        """The cell whose finished run (same seed) ``cell_id`` fine-tunes at ``scale``: the scale's
        ``init_from: {<cell glob>: <source cell, formatted over the axes>}``, e.g. FlatBNN's official SGLD starts
        from the row's own SWAG run ({"*/sgld": "{model}/swag"}). The launcher runs sources first and passes the
        run dir as trainer.init_from; None = from scratch."""
        sc = self.scale(scale) or {}
        for pattern, template in (sc.get("init_from") or {}).items():
            if fnmatch.fnmatchcase(cell_id, pattern):
                return template.format(**dict(zip(self.axes, cell_id.split("/"))))
        return None

    def paper_data(self) -> dict | None:
        p = PAPER_DIR / f"{self.row}.yaml"
        return load_paper_data(p) if p.exists() else None


KNOWN_KEYS = {f for f in Row.__dataclass_fields__ if f != "path"}


def _check(cond: bool, path: Path, msg: str) -> None:
    if not cond:
        raise SpecError(f"{path}: {msg}")


def load_row(name_or_path: str | Path) -> Row:
    path = Path(name_or_path)
    if not path.suffix:
        path = ROWS_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(list_rows()) or "none"
        raise SpecError(f"no row spec {path} (rows: {known})")
    data = _read_spec(path)
    unknown = set(data) - KNOWN_KEYS
    _check(not unknown, path, f"unknown keys {sorted(unknown)} (schema: docs/reproduce.md)")
    for key in ("row", "paper", "title"):
        _check(key in data, path, f"missing key {key!r}")
    _check(data["row"] == path.stem, path, f"row {data['row']!r} must equal the file name {path.stem!r}")
    row = Row(**data, path=path)
    _check(row.kind in ("train", "script", "eval"), path, f"kind must be train, eval or script, got {row.kind!r}")
    if row.kind == "eval":
        _check(bool(row.eval_from.get("row")), path, "an eval row needs eval_from: {row: <the trained row>}")
    for s in row.scales:
        _check(s in SCALES, path, f"unknown scale {s!r} (use {', '.join(SCALES)})")
    keep = (row.compare or {}).get("keep", [])
    _check(isinstance(keep, list) and all(isinstance(k, str) and "/" not in k for k in keep), path,
           f"compare.keep must be a list of file names in the script's output, got {keep!r}")
    _check(isinstance((row.compare or {}).get("exact", False), bool), path,
           f"compare.exact must be true or false, got {(row.compare or {}).get('exact')!r}")
    _check((row.compare or {}).get("seed_test") in (None, "paired", "welch"), path,
           f"compare.seed_test must be paired or welch, got {(row.compare or {}).get('seed_test')!r}")
    if row.kind in ("train", "eval"):
        _check(bool(row.axes), path, "a train row needs axes")
        for a in row.axes:
            _check(a in row.values and row.values[a], path, f"axis {a!r} has no values")
        ids = row.cell_ids()
        _check(len(ids) == len(set(ids)), path, "duplicate cell ids")
        for cid in ids:
            parts = cid.split("/")
            _check(len(parts) == len(row.axes), path, f"cell {cid!r} needs {len(row.axes)} parts ({row.axes})")
            for a, v in zip(row.axes, parts):
                _check(v in row.values[a], path, f"cell {cid!r}: {v!r} is not a value of axis {a!r}")
        for pattern in list(row.cell_overrides) + list(row.cell_blocked):
            _check(any(fnmatch.fnmatchcase(c, pattern) for c in ids), path, f"pattern {pattern!r} matches no cell")
        _check(isinstance(row.scales.get("smoke"), dict) or row.blocked, path,
               "every runnable row needs a smoke scale (CI runs it)")
        for scale, sc in row.scales.items():
            for pattern in (sc.get("init_from") or {}) if isinstance(sc, dict) else ():
                _check(row.kind == "train", path, "init_from: only a train row fine-tunes its own runs")
                scale_ids = {c.id for c in row.cells_for(scale)}
                dependents = [c for c in scale_ids if fnmatch.fnmatchcase(c, pattern)]
                _check(bool(dependents), path, f"scales.{scale}.init_from: {pattern!r} matches no cell")
                for cid in dependents:
                    src = row.init_source(scale, cid)
                    _check(src in scale_ids and row.init_source(scale, src) is None, path,
                           f"scales.{scale}.init_from: {cid!r} starts from {src!r}, which is not a from-scratch "
                           f"cell of that scale")
    else:
        _check(bool(row.script) or bool(row.blocked), path, "a script row needs `script:` per scale")
    return row


def _read_spec(path: Path, depth: int = 0) -> dict:
    """A spec's YAML; ``extends: <row>`` starts from that row's spec (top-level keys of this file replace it)."""
    data = load_yaml(path) or {}
    parent = data.pop("extends", None)
    if parent is None:
        return data
    _check(depth < 5, path, "extends chain too deep")
    ppath = ROWS_DIR / f"{parent}.yaml"
    _check(ppath.exists(), path, f"extends {parent!r}: no {ppath}")
    base = _read_spec(ppath, depth + 1)
    base.pop("row", None)
    return {**base, **data}


def list_rows() -> list[str]:
    return sorted(p.stem for p in ROWS_DIR.glob("*.yaml"))


def rows_reading(name: str, scale: str) -> list[str]:
    """The rows that read ``name``'s runs at ``scale``: eval rows (``eval_from.row``) and analysis scripts
    (``{runs}/<name>/`` in their command)."""
    readers = []
    for other in list_rows():
        row = load_row(other)
        if (row.eval_from or {}).get("row") == name or f"{{runs}}/{name}/" in str((row.script or {}).get(scale, "")):
            readers.append(other)
    return readers


def load_paper_data(path: str | Path) -> dict:
    path = Path(path)
    data = load_yaml(path) or {}
    _check(isinstance(data, dict), path, f"a YAML {type(data).__name__}, not a mapping of keys")
    for key in ("row", "paper", "cells"):
        _check(key in data, path, f"missing key {key!r}")
    metrics = data.get("metrics") or {}
    axes = data.get("axes") or []
    for c in data["cells"] or []:
        _check("cell" in c, path, "a cell without `cell:` id")
        if axes:
            _check(len(str(c["cell"]).split("/")) == len(axes), path, f"cell {c['cell']!r} does not match axes {axes}")
        for m in metrics:
            v = c.get(m)
            _check(v is None or isinstance(v, dict), path, f"cell {c['cell']!r}: {m} must be {{mean:, std:}}")
    bad = curves.problems(metrics) + claims_mod.problems(data.get("claims"), axes, metrics)
    _check(not bad, path, "; ".join(bad[:3]) + " (claims: docs/reproduce.md)")
    return data


def check_all() -> list[str]:
    """Load every spec and paper-data file; the problems found, one line each (empty = all good)."""
    problems = []
    for name in list_rows():
        try:
            row = load_row(name)
            pd = row.paper_data()
            if pd is not None and row.kind == "train" and pd.get("cells") and not (row.compare or {}).get("join"):
                ids = set(row.cell_ids())
                missing = [c["cell"] for c in pd["cells"] if c["cell"] not in ids]
                if missing:
                    problems.append(f"{name}: paper cells without a spec cell: {missing[:5]}")
            if pd is not None:  # a claim that names no pair of existing cells would be 'not run' forever
                axes, cells = claims_mod.cell_axes(row, pd)
                idle = [c["id"] for c in pd.get("claims") or [] if not claims_mod.expand(c, cells, axes)]
                if idle:
                    problems.append(f"{name}: claims comparing no pair of the row's cells: {idle}")
        except SpecError as e:
            problems.append(str(e))
    for p in sorted(PAPER_DIR.glob("*.yaml")):
        try:
            load_paper_data(p)
        except SpecError as e:
            problems.append(str(e))
    return list(dict.fromkeys(problems))  # a bad paper file is found by its row and by itself: said once
