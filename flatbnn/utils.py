"""Small pure-Python helpers that several layers share (no torch, nothing of flatbnn imported): the engine, the
evaluation and the reproduction tools use them without importing one another."""

from __future__ import annotations

from typing import Any


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty dicts are leaves."""
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out
