"""Data sets -> :class:`DataBundle`.

``build_dataset(name, **kwargs)`` dispatches to a builder registered with
``@register_dataset(name)``. Every builder accepts at least ``root``, ``train_subset``,
``test_subset``, ``val_split``, ``augment``, ``seed`` and ``download``, plus the common options
``label_noise``, ``ood``/``ood_roots``/``ood_subset`` and (array-backed sets) ``loader``, and
checks the ``num_classes`` / ``input_shape`` keys the config passes along against the data.

Items of every data set are ``(x: FloatTensor, y: int)``. The train set always has
``set_epoch(epoch)``; its random augmentation is a deterministic function of
``(seed, epoch, index)`` (see :mod:`flatbnn.data.transforms`). See docs/data.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils.data import Dataset

__all__ = [
    "DataBundle",
    "finish_bundle",
    "make_bundle",
    "build_dataset",
    "register_dataset",
    "list_datasets",
]


@dataclass
class DataBundle:
    """What a data set builder returns.

    ``train`` has ``set_epoch(epoch)``; ``val`` (if any) is held out from the training
    data and never augmented; ``ood`` maps names to out-of-distribution test sets (normalised
    with the in-distribution statistics); ``shift`` maps ``"<corruption>/<severity>"`` to
    distribution-shifted test sets with the in-distribution labels (CIFAR-10-C), index i of
    each being the corrupted version of index i of ``test`` when both come from the same
    CIFAR-10 test set. ``meta`` carries free-form extras (class names, normalisation constants,
    the noisy-label mask, the corruption groups, ...).
    """

    train: Dataset
    test: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    val: Dataset | None = None
    ood: dict[str, Dataset] = field(default_factory=dict)
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    shift: dict[str, Dataset] = field(default_factory=dict)

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


LOADERS = ("cpu", "device")


def as_list(value: Any) -> list[Any]:
    """``None`` -> ``[]``, a string -> ``[value]``, any sequence (also OmegaConf's) -> ``list``."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def as_dict(value: Any) -> dict[str, Any]:
    """``None`` -> ``{}``; any mapping (also OmegaConf's) -> ``dict``."""
    if value is None:
        return {}
    return {str(k): v for k, v in value.items()}


def check_loader(dataset: str, loader: Any, augment: str, allowed: Iterable[str] = LOADERS) -> str:
    """Validate ``dataset.loader`` (``cpu`` | ``device``; the engine picks the loader class)."""
    loader = "cpu" if loader in (None, False) else str(loader)
    allowed = tuple(allowed)
    if loader not in allowed:
        raise ValueError(f"{dataset}: loader must be one of {list(allowed)}, got {loader!r}")
    if loader == "device" and augment not in ("none", "crop_flip"):
        raise ValueError(f"{dataset}: loader=device supports augment none|crop_flip, got {augment!r}")
    return loader


def finish_bundle(
    name: str,
    train_base: Any,
    test: Dataset,
    *,
    num_classes: int,
    val_split: int = 0,
    augment: str = "none",
    seed: int = 0,
    val_seed: int = 0,
    label_noise: float = 0.0,
    label_noise_seed: int = 0,
    ood: Any = None,
    ood_roots: Any = None,
    ood_subset: int | None = None,
    root: Any = None,
    download: bool = False,
    cache_dir: Any = None,
    loader: str = "cpu",
    shift: dict[str, Dataset] | None = None,
    meta: dict[str, Any] | None = None,
) -> DataBundle:
    """The steps every builder shares, in this order:

    1. hold out ``val_split`` training examples (fixed permutation, ``val_seed``; never augmented,
       labels clean);
    2. symmetric label noise on the remaining training labels (exact fraction, fixed RNG
       independent of the run seed); ``meta["noisy_mask"]`` (bool, train order; all False without
       noise), ``meta["clean_targets"]`` and ``meta["label_noise"]`` are always set;
    3. wrap the training set for ``augment``;
    4. build the OOD test sets named in ``ood`` (each from ``ood_roots[name]``, default
       ``root``), normalised with this data set's statistics.

    ``train_base`` is an :class:`~flatbnn.data.transforms.ArrayDataset` or an
    :class:`~flatbnn.data.imagefolder.ImageFileDataset` (anything with ``subset``, ``targets``,
    ``mean``/``std`` and ``item_shape``).
    """
    from flatbnn.data.transforms import holdout_split, make_train_set, symmetric_label_noise

    meta = dict(meta or {})
    val = None
    if val_split:
        keep, held = holdout_split(len(train_base), val_split, seed=val_seed)
        val = train_base.subset(held)
        train_base = train_base.subset(keep)
    rate = float(label_noise or 0.0)
    clean = train_base.targets.numpy().copy()
    noisy, mask = symmetric_label_noise(clean, rate, num_classes, seed=label_noise_seed)
    if rate:
        train_base.targets = torch.from_numpy(noisy)
    meta.update(noisy_mask=mask, clean_targets=clean,
                label_noise={"rate": rate, "num_noisy": int(mask.sum()), "seed": int(label_noise_seed),
                             "kind": "symmetric (uniform over the other classes)"})
    mean = tuple(float(m) for m in train_base.mean.reshape(-1))
    std = tuple(float(s) for s in train_base.std.reshape(-1))
    ood_sets: dict[str, Dataset] = {}
    names = [str(n) for n in as_list(ood)]
    ood_roots = {k: v for k, v in as_dict(ood_roots).items() if v not in (None, "")}
    unknown = sorted(set(ood_roots) - set(names))
    if unknown:
        raise ValueError(f"{name}: ood_roots names {unknown} that are not in ood={names}")
    if names:
        from flatbnn.data.ood import build_ood_sets

        ood_sets = build_ood_sets(names, ood_roots, root, in_name=name,
                                  item_shape=tuple(train_base.item_shape), mean=mean, std=std,
                                  subset=ood_subset, download=download, cache_dir=cache_dir)
    return DataBundle(
        train=make_train_set(train_base, augment, seed),
        test=test,
        num_classes=num_classes,
        input_shape=tuple(train_base.item_shape),
        val=val,
        ood=ood_sets,
        name=name,
        meta=dict(meta, mean=mean, std=std, augment=augment, loader=loader),
        shift=dict(shift or {}),
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
    meta: dict[str, Any] | None = None,
    **options: Any,
) -> DataBundle:
    """Arrays -> DataBundle via :func:`finish_bundle` (``options``: its keyword arguments)."""
    from flatbnn.data.transforms import ArrayDataset

    base = ArrayDataset(train[0], train[1], mean=mean, std=std, scale=scale)
    test_ds = ArrayDataset(test[0], test[1], mean=mean, std=std, scale=scale)
    return finish_bundle(name, base, test_ds, num_classes=num_classes, meta=meta, **options)


def warn_unused(dataset: str, unused: dict[str, Any]) -> None:
    if unused:
        warnings.warn(
            f"{dataset}: ignoring unknown dataset arguments {sorted(unused)}",
            stacklevel=3,
        )


# Register the built-in data sets (imported last: they import the names above).
from flatbnn.data import cifar as _cifar  # noqa: E402,F401
from flatbnn.data import cifar10_c as _cifar10_c  # noqa: E402,F401
from flatbnn.data import digits as _digits  # noqa: E402,F401
from flatbnn.data import imagefolder as _imagefolder  # noqa: E402,F401
from flatbnn.data import mnist as _mnist  # noqa: E402,F401
from flatbnn.data import svhn as _svhn  # noqa: E402,F401
