"""Checks before a row is launched: every cell composes, and the data it needs is there (one line if not)."""

from __future__ import annotations

from flatbnn.reproduce.launch import compose_cell
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
                    compose_cell(cell.overrides)
                except Exception as e:  # hydra composition errors: report, go on
                    problems.append(f"{name} / {cell.id} / {scale}: {' '.join(str(e).split())[:300]}")
    return problems


def check_data(row: Row, scale: str, extra: list[str]) -> None:
    """Build each distinct data set the row's cells use (once): a missing data set raises the data module's own
    one-line FileNotFoundError (which data, which key) before any job starts."""
    from hydra.utils import instantiate

    seen = set()
    for cell in row.cells_for(scale):
        if cell.blocked:
            continue
        cfg = compose_cell(cell.overrides + list(extra))
        key = (cfg.dataset.name, str(cfg.dataset.get("root")), str(cfg.dataset.get("shift_root")))
        if key in seen:
            continue
        seen.add(key)
        try:
            instantiate(cfg.dataset)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{row.row} ({scale}) needs data set {cfg.dataset.name}: "
                                    f"{' '.join(str(e).split())} -- pass it after '--', e.g. "
                                    f"scripts/reproduce.py run {row.row} --scale {scale} -- dataset.root=PATH") from None


__all__ = ["compose_all", "check_data", "SpecError"]
