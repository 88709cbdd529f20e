"""A toy reproduction's own checks as Markdown (``checks.md`` beside its summary.json): what the row's page includes
(``compare: {include: [checks.md]}`` in rows/<toy>.yaml), so the reading of a figure without printed numbers is on the
page and not only in JSON."""

from __future__ import annotations

import json
from pathlib import Path

from flatbnn.atomic_io import write_text


def fmt(value) -> str:
    """One table cell: yes / no, 4 significant digits, lists comma-joined, anything else compact JSON."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str, bool)) for v in value):
        return ", ".join(fmt(v) for v in value)
    return json.dumps(value, default=str)[:300]


def table(header: list[str], rows: list[list]) -> list[str]:
    cell = lambda v: fmt(v).replace("|", "\\|")  # noqa: E731 -- a bar inside a cell ('|z|') would split it
    return (["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def write_checks(path: Path, title: str, budget: str, checks: dict, reading: str = "",
                 tables: list[tuple[str, list[str], list[list]]] = ()) -> str:
    """``path`` <- ``# title``, the budget line, ``reading`` (a sentence on what the checks say), the checks as a
    two-column table, then each ``(caption, header, rows)`` table. Written atomically; returns the text."""
    lines = [f"# {title}", "", budget, ""]
    if reading:
        lines += [reading, ""]
    lines += table(["check", "ours"], [[k, v] for k, v in checks.items()])
    for caption, header, rows in tables:
        lines += ["", caption, ""] + table(header, rows)
    text = "\n".join(lines) + "\n"
    write_text(Path(path), text)
    return text
