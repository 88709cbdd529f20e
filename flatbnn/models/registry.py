"""The model registry (one name -> one builder) and what builders share; the family modules register into it.
Its own module, not the package ``__init__`` (which imports every family): no family imports its package."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

Builder = Callable[..., nn.Module]
_MODELS: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator registering ``fn(num_classes, input_shape, **kw)`` under ``name``."""

    def decorator(fn: Builder) -> Builder:
        if name in _MODELS and _MODELS[name] is not fn:
            raise ValueError(f"model {name!r} is already registered")
        _MODELS[name] = fn
        return fn

    return decorator


def list_models() -> list[str]:
    """Sorted names of the registered builders."""
    return sorted(_MODELS)


def _plain(value: Any) -> Any:
    # Hydra passes lists/dicts from YAML as ListConfig/DictConfig; builders expect plain Python.
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def create_model(
    name: str,
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    min_input_size: int | None = None,
    **kw: Any,
) -> nn.Module:
    """Build the registered model ``name``; ``input_shape`` is per example, e.g. (3, 32, 32).
    ``min_input_size`` (the config's declaration of the data a network is meant for) is checked before
    anything is built, by ``flatbnn.engine.validate.check_model_data``; the builder does not take it."""
    if name not in _MODELS:
        raise KeyError(f"unknown model {name!r}; registered: {', '.join(list_models())}")
    if input_shape is not None:
        input_shape = tuple(int(s) for s in _plain(input_shape))
    kw = {k: _plain(v) for k, v in kw.items()}
    return _MODELS[name](num_classes=int(num_classes), input_shape=input_shape, **kw)


def in_channels_of(input_shape: Sequence[int] | None, default: int = 3) -> int:
    """Channel count of a (C, H, W) input shape; conv nets accept any spatial size."""
    if input_shape is None:
        return default
    if len(input_shape) != 3:
        raise ValueError(f"conv nets need a (C, H, W) input_shape, got {tuple(input_shape)}")
    return int(input_shape[0])
