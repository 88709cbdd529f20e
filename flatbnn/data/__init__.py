"""Data sets -> :class:`DataBundle`.

``build_dataset(name, **kwargs)`` dispatches to a builder registered with
``@register_dataset(name)``. Every builder accepts at least ``root``, ``train_subset``,
``test_subset``, ``val_split``, ``augment``, ``seed`` and ``download``, and checks the
``num_classes`` / ``input_shape`` keys the config passes along against the data.

Items of every data set are ``(x: FloatTensor, y: int)``. The train set always has
``set_epoch(epoch)``; its random augmentation is a deterministic function of
``(seed, epoch, index)`` (see :mod:`flatbnn.data.transforms`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from torch.utils.data import Dataset

__all__ = [
    "DataBundle",
    "build_dataset",
    "register_dataset",
    "list_datasets",
]


@dataclass
class DataBundle:
    """What a data set builder returns.

    ``train`` has ``set_epoch(epoch)``; ``val`` (if any) is held out from the training
    data and never augmented; ``ood`` maps names to out-of-distribution test sets.
    ``meta`` carries free-form extras (class names, normalisation constants, ...).
    """

    train: Dataset
    test: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    val: Dataset | None = None
    ood: dict[str, Dataset] = field(default_factory=dict)
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_classes = int(self.num_classes)
        self.input_shape = tuple(int(s) for s in self.input_shape)


_REGISTRY: dict[str, Callable[..., DataBundle]] = {}


def register_dataset(name: str) -> Callable[[Callable[..., DataBundle]], Callable[..., DataBundle]]:
    """Decorator registering a builder ``fn(**kwargs) -> DataBundle`` under ``name``."""

    def deco(fn: Callable[..., DataBundle]) -> Callable[..., DataBundle]:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"data set {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def list_datasets() -> list[str]:
    return sorted(_REGISTRY)


def build_dataset(name: str, **kwargs: Any) -> DataBundle:
    """Build the data set ``name``; unknown names raise a one-line ``KeyError``."""
    try:
        builder = _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown data set {name!r}; available: {', '.join(list_datasets())}"
        ) from None
    bundle = builder(**kwargs)
    if not bundle.name:
        bundle.name = name
    return bundle


# --------------------------------------------------------------------------- helpers
# Shared by the builders (kept here so every builder validates arguments the same way).

def check_expected(
    dataset: str,
    num_classes: int,
    input_shape: Iterable[int],
    expected_num_classes: Any = None,
    expected_input_shape: Any = None,
) -> None:
    """Raise ``ValueError`` if the config's ``num_classes``/``input_shape`` disagree with the data."""
    if expected_num_classes is not None and int(expected_num_classes) != int(num_classes):
        raise ValueError(
            f"{dataset}: config says num_classes={expected_num_classes} but the data has {num_classes}"
        )
    if expected_input_shape is not None:
        want = tuple(int(s) for s in expected_input_shape)
        have = tuple(int(s) for s in input_shape)
        if want != have:
            raise ValueError(
                f"{dataset}: config says input_shape={list(want)} but the data has {list(have)}"
            )


def make_bundle(
    name: str,
    train: tuple[Any, Any],
    test: tuple[Any, Any],
    *,
    num_classes: int,
    mean: Any,
    std: Any,
    scale: float | None = None,
    val_split: int = 0,
    augment: str = "none",
    seed: int = 0,
    val_seed: int = 0,
    meta: dict[str, Any] | None = None,
) -> DataBundle:
    """Arrays -> DataBundle: hold out ``val_split`` training examples (fixed permutation,
    ``val_seed``), wrap the rest for augmentation; val/test are never augmented."""
    from flatbnn.data.transforms import ArrayDataset, holdout_split, make_train_set

    train_x, train_y = train
    val = None
    if val_split:
        keep, held = holdout_split(len(train_y), val_split, seed=val_seed)
        val = ArrayDataset(train_x[held], train_y[held], mean=mean, std=std, scale=scale)
        train_x, train_y = train_x[keep], train_y[keep]
    base = ArrayDataset(train_x, train_y, mean=mean, std=std, scale=scale)
    test_ds = ArrayDataset(test[0], test[1], mean=mean, std=std, scale=scale)
    return DataBundle(
        train=make_train_set(base, augment, seed),
        test=test_ds,
        num_classes=num_classes,
        input_shape=base.item_shape,
        val=val,
        name=name,
        meta=dict(meta or {}, mean=tuple(float(m) for m in base.mean.reshape(-1)),
                  std=tuple(float(s) for s in base.std.reshape(-1))),
    )


def warn_unused(dataset: str, unused: dict[str, Any]) -> None:
    if unused:
        warnings.warn(
            f"{dataset}: ignoring unknown dataset arguments {sorted(unused)}",
            stacklevel=3,
        )


# Register the built-in data sets (imported last: they import the names above).
from flatbnn.data import cifar as _cifar  # noqa: E402,F401
from flatbnn.data import digits as _digits  # noqa: E402,F401
