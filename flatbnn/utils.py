"""Small pure-Python helpers that several layers share (no torch, nothing of flatbnn imported at import time): the
engine, the evaluation and the reproduction tools use them without importing one another."""

from __future__ import annotations

import functools
import importlib
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


@functools.cache
def _defined_at(path: str) -> str:
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest importable prefix is the module, the rest attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        except Exception:  # noqa: BLE001 -- a module that fails to import: nothing to resolve, compare as written
            return path
        for name in parts[i:]:
            obj = getattr(obj, name, None)
        module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        return f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else path
    return path


def canonical_target(key: str, value: Any) -> Any:
    """A config value as runs are compared by: a Hydra ``_target_`` (``key`` ends in ``_target_``) naming one of
    flatbnn's objects becomes where it is defined, so two spellings of one class are one config --
    ``flatbnn.methods.SWAG`` (the package re-export that configs used before they named modules) and
    ``flatbnn.methods.swag.SWAG``, the spelling configs use now. Any other value, another library's target (kept in
    the public spelling its docs and the tables use: ``torch.optim.SGD``) and a target that does not import (a
    class since removed) are returned as they are."""
    if isinstance(value, str) and value.startswith("flatbnn.") and key.rpartition(".")[2] == "_target_":
        return _defined_at(value)
    return value
