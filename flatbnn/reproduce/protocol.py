"""The paper's training / evaluation protocol as data, checked against every composed paper-scale cell.

``results/paper/<row>.yaml`` holds, next to the paper's numbers, a ``protocol:`` section (schema: docs/reproduce.md)::

    protocol:
      entries:                      # hold for every paper-scale cell
        epochs: {key: trainer.epochs, value: 120, source: "App. G.1: 'we train for 120 epochs'"}
        lr:     {key: optimizer.lr, value: 0.03, status: lost, from: "author README: '--lr 0.03'"}
      cells:                        # per-cell entries by glob, applied in order (null removes an entry)
        "*/adam": {lr: {key: optimizer.lr, value: 1.0e-3, status: lost, from: "author README"}, momentum: null}

``inherit: <row>`` starts from another row's protocol (its entries, then its cell patterns, then this row's; a
pattern of this row adds to, and overrides by name, the inherited one of the same glob). An entry names the config
key(s) it maps to (``row.n_seeds``: the paper scale's number of seeds) and either the paper's ``value`` with its
``source`` (section / table and a short quote), or ``status: silent`` (the paper does not say) / ``lost`` (our copy
lost it, bSAM's tables) with ``from`` saying where the value we check comes from (official code, author README, our
choice). An entry without a value only documents (nothing to compare). Every entry with a value is compared with the
composed config of every cell it applies to; a difference must be declared in the row's ``departures:``
(rows/<row>.yaml)::

    departures:
      - {key: trainer.epochs, cells: "mnist/*", ours: 120, paper: 100, category: paper silent, reason: "..."}

Anything else -- an undeclared difference, a key the composed config lacks, a departure that matches no
difference -- is a problem (one line each): tests/test_protocol_fidelity.py and ``scripts/reproduce.py check``.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from dataclasses import dataclass, field

from flatbnn.reproduce.spec import PAPER_DIR, Row, SpecError, list_rows, load_row

STATUSES = ("silent", "lost")
CATEGORIES = ("paper silent", "official code differs", "data or weights unavailable", "our extension")
_ABSENT = object()


@dataclass
class Fidelity:
    """One row's protocol check: ``checked`` entries (with a value) compared over ``cells`` composed cells."""
    row: str
    has_protocol: bool
    entries: int = 0
    checked: int = 0
    cells: int = 0
    departures: int = 0
    problems: list[str] = field(default_factory=list)


def duplicate_keys(text: str) -> list[str]:
    """Keys written twice in one YAML mapping: YAML keeps the last silently, so a second cell pattern of the same
    glob would drop the first one's entries unseen."""
    import yaml
    dups, stack = [], [yaml.compose(text)]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.value != "<<"]
            dups += sorted({k for k in keys if keys.count(k) > 1})
            stack += [v for _, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return sorted(set(dups))


def protocol_of(row: Row) -> dict | None:
    """The ``protocol:`` section of the row's paper file (None: no protocol transcribed yet), with the protocol
    it inherits (``inherit: <row>``: that row's entries and cell patterns first, this one's after) resolved."""
    pd = row.paper_data() or {}
    return _resolve(pd.get("protocol"), row.row)


def _resolve(protocol: dict | None, name: str, depth: int = 0) -> dict | None:
    if not protocol or not protocol.get("inherit"):
        return protocol
    parent_name = protocol["inherit"]
    if depth > 4:
        raise SpecError(f"{name}: protocol inherit chain too deep")
    from flatbnn.reproduce.spec import load_paper_data
    path = PAPER_DIR / f"{parent_name}.yaml"
    if not path.exists():
        raise SpecError(f"{name}: protocol inherits {parent_name!r}: no {path}")
    parent = _resolve(load_paper_data(path).get("protocol"), parent_name, depth + 1) or {}
    own_cells = protocol.get("cells") or {}
    cells = dict(parent.get("cells") or {})
    for glob, block in own_cells.items():  # the same glob: this row's entries over the inherited ones
        cells[glob] = {**(cells.get(glob) or {}), **(block or {})}
    return {"entries": {**(parent.get("entries") or {}), **(protocol.get("entries") or {})},
            "cells": cells, "own_cells": list(own_cells), "notes": protocol.get("notes")}


def _validate(row: str, protocol: dict) -> list[str]:
    problems = []
    unknown = set(protocol) - {"entries", "cells", "notes", "inherit", "own_cells"}
    if unknown:
        problems.append(f"{row}: protocol has unknown keys {sorted(unknown)} (use inherit, entries, cells, notes)")
    blocks = [("entries", protocol.get("entries") or {})] + [
        (f"cells[{g!r}]", v or {}) for g, v in (protocol.get("cells") or {}).items()]
    for where, block in blocks:
        for name, e in block.items():
            if e is None:
                continue  # removes an inherited or shared entry
            if not isinstance(e, dict) or not e.get("key"):
                problems.append(f"{row}: protocol {where}.{name} needs a `key:` (the config key(s) it maps to)")
                continue
            st = e.get("status")
            if st is not None and st not in STATUSES:
                problems.append(f"{row}: protocol {where}.{name}: status must be one of {STATUSES}, got {st!r}")
            if st is None and ("value" not in e or not e.get("source")):
                problems.append(f"{row}: protocol {where}.{name}: a stated entry needs `value:` and `source:` "
                                f"(or `status: silent|lost`)")
            if st is not None and "value" in e and not e.get("from"):
                problems.append(f"{row}: protocol {where}.{name}: a {st} entry with a value needs `from:` "
                                f"(official code, author README or our choice)")
    return problems


def entries_for(protocol: dict, cell_id: str) -> dict[str, dict]:
    """The protocol entries that apply to one cell: the shared ones, then every matching cell pattern in order."""
    out = {k: v for k, v in (protocol.get("entries") or {}).items() if v is not None}
    for pattern, block in (protocol.get("cells") or {}).items():
        if fnmatch.fnmatchcase(cell_id, pattern):
            for name, e in (block or {}).items():
                if e is None:
                    out.pop(name, None)
                else:
                    out[name] = e
    return out


def same(paper, ours, rel_tol: float = 1e-6) -> bool:
    """Equal as protocol values: numbers to ``rel_tol`` (a transcribed 4.1667e-4 is the config's 25/60000 only
    with ``tol:``), lists element-wise, everything else exactly (a bool is not the number 1)."""
    if isinstance(paper, bool) or isinstance(ours, bool):
        return type(paper) is type(ours) and paper == ours
    if isinstance(paper, (int, float)) and isinstance(ours, (int, float)):
        return math.isclose(float(paper), float(ours), rel_tol=rel_tol, abs_tol=1e-12)
    if isinstance(paper, (list, tuple)) and isinstance(ours, (list, tuple)):
        return len(paper) == len(ours) and all(same(a, b, rel_tol) for a, b in zip(paper, ours))
    return paper == ours


def _plain(value):
    from omegaconf import DictConfig, ListConfig, OmegaConf
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def composed_value(cfg, key: str):
    """The composed config's value at ``key`` (resolved), or ``_ABSENT`` when the config has no such key.
    An interpolation that cannot resolve here (an unset environment variable) is compared as written."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError
    try:
        return _plain(OmegaConf.select(cfg, key, default=_ABSENT))
    except InterpolationResolutionError:
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        return str(parent._get_node(leaf)._value())


# One composition per distinct override list. Sharing Hydra's cache of parsed config files between composes would
# save ~40 % but is wrong: tried, a cell composed after a flat_bnn experiment cell inherited its metrics.ece_bins.
@functools.cache
def _compose(overrides: tuple[str, ...]):
    from flatbnn.reproduce.launch import compose_cell
    return compose_cell(list(overrides))


def paper_cells(row: Row) -> list[tuple[str, tuple[str, ...], dict]]:
    """(cell id, the overrides train.py / evaluate.py composes, the row-level facts ``row.*`` keys read) of every
    runnable paper-scale cell: an eval row's cells on top of the trained cell they re-evaluate (as
    ``scripts/reproduce.py check`` composes them)."""
    from flatbnn.reproduce.preflight import _eval_base
    return [(c.id, tuple(_eval_base(row, "paper", c.id) + c.overrides), {"n_seeds": len(c.seeds)})
            for c in row.cells_for("paper") if not c.blocked]


def _fmt(v) -> str:
    return "absent" if v is _ABSENT else repr(v)


def check_row(row: Row, protocol: dict | None = _ABSENT, compose=None) -> Fidelity:
    """Compare every protocol entry with every paper-scale cell's composed config (see the module doc)."""
    protocol = protocol_of(row) if protocol is _ABSENT else protocol
    compose = compose or _compose
    fid = Fidelity(row.row, has_protocol=bool(protocol), departures=len(row.departures or []))
    deps = list(row.departures or [])
    for i, d in enumerate(deps):
        if not isinstance(d, dict) or not {"key", "ours", "paper", "category", "reason"} <= set(d):
            fid.problems.append(f"{row.row}: departures[{i}] needs key, ours, paper, category and reason")
        elif d["category"] not in CATEGORIES:
            fid.problems.append(f"{row.row}: departures[{i}] ({d['key']}): category must be one of {CATEGORIES}")
    deps = [d for d in deps if isinstance(d, dict) and "key" in d]
    if not protocol:
        if deps:
            fid.problems.append(f"{row.row}: declares departures but results/paper/{row.row}.yaml has no protocol")
        return fid
    fid.problems += _validate(row.row, protocol)
    paper_file = row.paper_data() is not None and (PAPER_DIR / f"{row.row}.yaml")
    for key in duplicate_keys(paper_file.read_text()) if paper_file else []:
        fid.problems.append(f"{row.row}: results/paper/{row.row}.yaml writes the key {key!r} twice in one mapping "
                            f"(YAML keeps only the last)")
    if fid.problems:
        return fid
    names = {n for n, e in (protocol.get("entries") or {}).items() if e is not None} | {
        n for b in (protocol.get("cells") or {}).values() for n, e in (b or {}).items() if e is not None}
    fid.entries = len(names)
    checked, used = set(), set()
    undeclared: dict[tuple, list[str]] = {}  # (key, entry, paper, ours) -> cells: one line per difference
    cells = paper_cells(row)
    fid.cells = len(cells)
    for pattern in protocol.get("own_cells", protocol.get("cells") or {}):  # an inherited pattern may not apply
        if not any(fnmatch.fnmatchcase(cid, pattern) for cid, _, _ in cells):
            fid.problems.append(f"{row.row}: protocol cell pattern {pattern!r} matches no paper-scale cell")
    for cid, overrides, facts in cells:
        try:
            cfg = compose(overrides)
        except Exception as e:  # composition errors are `check`'s too; here: say which cell
            fid.problems.append(f"{row.row} / {cid}: does not compose: {' '.join(str(e).split())[:200]}")
            continue
        for name, e in entries_for(protocol, cid).items():
            keys = e["key"] if isinstance(e["key"], list) else [e["key"]]
            values = e.get("value") if isinstance(e["key"], list) else [e.get("value")]
            if "value" in e and (not isinstance(values, list) or len(values) != len(keys)):
                fid.problems.append(f"{row.row}: protocol entry {name!r} maps to {len(keys)} keys: its value must "
                                    f"be a list of {len(keys)}, one per key")
                continue
            for key, paper in zip(keys, values):
                ours = facts.get(key[4:], _ABSENT) if key.startswith("row.") else composed_value(cfg, key)
                if ours is _ABSENT:
                    fid.problems.append(f"{row.row} / {cid}: protocol entry {name!r} maps to {key}, which the "
                                        f"composed config does not have")
                    continue
                if "value" not in e:
                    continue  # silent / lost without a value: documented, nothing to compare
                checked.add(name)
                if same(paper, ours, float(e.get("tol", 1e-6))):
                    continue
                hit = next((j for j, d in enumerate(deps) if d["key"] == key
                            and fnmatch.fnmatchcase(cid, str(d.get("cells", "*")))
                            and same(d.get("paper"), paper) and same(d.get("ours"), ours)), None)
                if hit is None:
                    undeclared.setdefault((key, name, repr(paper), _fmt(ours)), []).append(cid)
                else:
                    used.add(hit)
    for (key, name, paper, ours), cids in undeclared.items():
        where = ", ".join(cids[:3]) + (f" (+{len(cids) - 3} more cells)" if len(cids) > 3 else "")
        fid.problems.append(f"{row.row} / {where}: {key}: paper {paper} ({name}), ours {ours} -- an undeclared "
                            f"departure: fix the spec or declare it under `departures:` in rows/{row.row}.yaml")
    for j, d in enumerate(deps):
        if j not in used:
            fid.problems.append(f"{row.row}: departure {d['key']} (cells {d.get('cells', '*')!r}, ours "
                                f"{d.get('ours')!r}, paper {d.get('paper')!r}) matches no difference: remove it")
    fid.checked = len(checked)
    return fid


def rows_with_paper_scale() -> list[str]:
    """The rows whose paper scale trains or evaluates cells (the ones a protocol applies to)."""
    out = []
    for name in list_rows():
        row = load_row(name)
        if row.kind in ("train", "eval") and row.scale("paper") is not None:
            out.append(name)
    return out


def check_all(rows: list[str] | None = None) -> list[str]:
    """Every paper-scale row's protocol problems, one line each (a row without a protocol is not a problem
    here: STATUS.md shows it as "no protocol yet")."""
    problems = []
    for name in rows or rows_with_paper_scale():
        try:
            problems += check_row(load_row(name)).problems
        except SpecError as e:
            problems.append(str(e))
    return problems


def fidelity_summary(row: Row) -> str:
    """STATUS.md's fidelity column, from the files alone (no composition: CI's test does the comparing)."""
    if row.kind not in ("train", "eval") or row.scale("paper") is None:
        return "–"
    protocol = protocol_of(row)
    if not protocol:
        return "**no protocol yet**"
    checked = {n for c in row.cells_for("paper") if not c.blocked
               for n, e in entries_for(protocol, c.id).items() if "value" in e}
    n = len(row.departures or [])
    return f"{len(checked)} checked / {n} departure{'s' if n != 1 else ''}"
