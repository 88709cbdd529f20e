"""Checks before a row is launched: every cell composes, and the data it needs is there (one line if not)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from flatbnn.reproduce.launch import compose_cell, select_cells, source_cell
from flatbnn.reproduce.spec import SCALES, Row, SpecError, list_rows, load_row


def compose_all(rows: list[str] | None = None) -> list[str]:
    """Compose every cell of every row at every scale with command-line semantics (an unknown key, group
    option or type is an error). Returns the problems, one line each."""
    problems = []
    for name in rows or list_rows():
        row = load_row(name)
        for scale in SCALES:
            for cell in row.cells_for(scale):
                if cell.blocked:
                    continue
                try:
                    compose_cell(_eval_base(row, scale, cell.id) + cell.overrides)
                except Exception as e:  # hydra composition errors: report, go on
                    problems.append(f"{name} / {cell.id} / {scale}: {' '.join(str(e).split())[:300]}")
    return problems


def _eval_base(row: Row, scale: str, cell_id: str) -> list[str]:
    """An eval row's overrides apply on top of the trained row's cell it re-evaluates (evaluate.py loads that
    run's config), so that cell's overrides are composed first; a train row has none."""
    if row.kind != "eval":
        return []
    src = load_row(row.eval_from["row"])
    wanted = source_cell(row, cell_id)
    return next((c.overrides for c in src.cells_for(scale) if c.id == wanted), [])


def check_data(row: Row, scale: str, extra: list[str], cells_glob: str | None = None) -> None:
    """Build each distinct data set the row's cells use (once): a missing data set raises the data module's own
    one-line FileNotFoundError (which data, which key) before any job starts. Only the cells ``--cells`` selects
    are checked: a row mixing data sets (HWA Fig 1: MNIST and CIFAR-10) is run one data root at a time."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    check_files(row, scale, extra)
    if row.kind == "eval":  # its data is the trained row's (checked when that row ran); only its own files here
        return
    seen = set()
    for cell in select_cells(row.cells_for(scale), cells_glob, None):  # the cells the launcher runs (--cells)
        if cell.blocked:
            continue
        cfg = compose_cell(cell.overrides + list(extra))
        key = (cfg.dataset.name, str(cfg.dataset.get("root")), str(cfg.dataset.get("shift_root")))
        if key in seen:
            continue
        seen.add(key)
        try:
            try:
                instantiate(cfg.dataset)
            except InstantiationException as e:  # hydra wraps the data module's error: unwrap the one line
                raise (e.__cause__ if isinstance(e.__cause__, FileNotFoundError) else e) from None
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{row.row} ({scale}) needs data set {cfg.dataset.name}: "
                                    f"{' '.join(str(e).split())} -- pass it after '--', e.g. "
                                    f"scripts/reproduce.py run {row.row} --scale {scale} -- dataset.root=PATH") from None


def check_files(row: Row, scale: str, extra: list[str]) -> None:
    """The spec's ``requires`` entries with ``file: true`` (weights, checkpoints) or ``dir: true`` (a data folder
    read by path, e.g. CIFAR-10-C): the config key must name an existing file / folder,
    else ONE line saying which key, which file and what it holds. An entry is one value, checked on its first
    runnable cell: where the value differs per cell (one weights file per network), ``cells:`` globs give each
    value its own entry. An eval row's cells are composed on their trained row's cell."""
    from omegaconf import OmegaConf

    for req in row.requires or []:
        if not (isinstance(req, dict) and (req.get("file") or req.get("dir"))):
            continue
        exists = Path.is_dir if req.get("dir") else Path.is_file
        for cell in row.cells_for(scale):
            if cell.blocked or any(fnmatch.fnmatchcase(cell.id, g) for g in req.get("unless_cells") or []):
                continue
            if req.get("cells") and not any(fnmatch.fnmatchcase(cell.id, g) for g in req["cells"]):
                continue
            value = OmegaConf.select(compose_cell(_eval_base(row, scale, cell.id) + cell.overrides + list(extra)),
                                     req["key"])
            if value in (None, "") or not exists(Path(str(value)).expanduser()):
                got = "not set" if value in (None, "") else f"{value} does not exist"
                only = f" --cells '{req['cells'][0]}'" if req.get("cells") else ""
                raise FileNotFoundError(f"{row.row} ({scale}) needs {req['key']} = {req['what']} ({got}); pass it "
                                        f"after '--': scripts/reproduce.py run {row.row} --scale {scale}{only} -- "
                                        f"{req['key']}=/path/to/{req.get('example', 'file')}")
            break  # one cell per entry (see above)


__all__ = ["compose_all", "check_data", "check_files", "SpecError"]
