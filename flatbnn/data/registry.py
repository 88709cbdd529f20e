"""The data set registry (``register_dataset`` / ``build_dataset``) and the :class:`DataBundle` every builder
returns, with the helpers builders share (``make_bundle``, ``finish_bundle``, ``as_list``). Its own module, not
the package ``__init__`` (which imports every data set): no data set module imports its package. The package
docstring (flatbnn/data/__init__.py) describes the keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils.data import Dataset

from flatbnn.data.options import LOADERS, DataOptions, DatasetSpec
from flatbnn.data.transforms import ARRAY_AUGMENTATIONS



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


_REGISTRY: dict[str, DatasetSpec] = {}


def register_dataset(
    name: str,
    *,
    root: Any = "data",
    augment: str = "none",
    augments: Iterable[str] = ARRAY_AUGMENTATIONS,
    loaders: Iterable[str] = LOADERS,
    num_classes: int | None = None,
    input_shape: Iterable[int] | None = None,
) -> Callable[[Callable[..., DataBundle]], Callable[..., DataBundle]]:
    """Decorator registering a builder ``fn(opts: DataOptions, **own_keys) -> DataBundle`` under ``name``.

    ``fn``'s parameters after ``opts`` are the data set's own config keys (with their defaults);
    the keyword arguments here are what is particular to the data set: the defaults of ``root`` and
    ``augment``, the allowed ``augments`` / ``loaders``, and ``num_classes`` / ``input_shape`` when
    they are fixed (checked before the builder runs; otherwise on the bundle it returns).
    """

    def deco(fn: Callable[..., DataBundle]) -> Callable[..., DataBundle]:
        if name in _REGISTRY and _REGISTRY[name].builder is not fn:
            raise ValueError(f"data set {name!r} is already registered")
        _REGISTRY[name] = DatasetSpec(name, fn, root=root, augment=augment, augments=augments, loaders=loaders,
                                      num_classes=num_classes, input_shape=input_shape)
        return fn

    return deco


def list_datasets() -> list[str]:
    return sorted(_REGISTRY)


def build_dataset(name: str, **kwargs: Any) -> DataBundle:
    """Build the data set ``name``; unknown names raise a one-line ``KeyError``."""
    try:
        spec = _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown data set {name!r}; available: {', '.join(list_datasets())}"
        ) from None
    opts, own = spec.parse(kwargs)
    if spec.num_classes is not None:  # fixed: fail before reading any data
        opts.check_expected(spec.num_classes, spec.input_shape)
    bundle = spec.builder(opts, **own)
    if opts.image_size is not None:  # e.g. CIFAR at 224 px for a pretrained ViT (flatbnn.data.resize)
        from flatbnn.data.resize import resize_bundle
        bundle = resize_bundle(bundle, opts.image_size)
    if spec.num_classes is None:  # known only from the data
        opts.check_expected(bundle.num_classes, bundle.input_shape)
    if not bundle.name:
        bundle.name = name
    return bundle


# --------------------------------------------------------------------------- helpers
# Shared by the builders (kept here so every builder finishes its bundle the same way).

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


def finish_bundle(
    opts: DataOptions,
    train_base: Any,
    test: Dataset,
    *,
    num_classes: int,
    shift: dict[str, Dataset] | None = None,
    meta: dict[str, Any] | None = None,
    val_seed: int = 0,
) -> DataBundle:
    """The steps every builder shares, driven by ``opts``, in this order:

    1. hold out ``opts.val_split`` training examples (fixed permutation, ``val_seed``; never
       augmented, labels clean);
    2. symmetric label noise (``opts.label_noise``) on the remaining training labels (exact
       fraction, fixed RNG independent of the run seed); ``meta["noisy_mask"]`` (bool, train
       order; all False without noise), ``meta["clean_targets"]`` and ``meta["label_noise"]`` are
       always set;
    3. wrap the training set for ``opts.augment`` (seeded with ``opts.seed``);
    4. build the OOD test sets named in ``opts.ood`` (each from ``opts.ood_roots[name]``, default
       ``opts.root``), normalised with this data set's statistics.

    ``train_base`` is an :class:`~flatbnn.data.transforms.ArrayDataset` or an
    :class:`~flatbnn.data.imagefolder.ImageFileDataset` (anything with ``subset``, ``targets``,
    ``mean``/``std`` and ``item_shape``).
    """
    from flatbnn.data.transforms import holdout_split, make_train_set, symmetric_label_noise

    name = opts.name
    meta = dict(meta or {})
    val = None
    if opts.val_split:
        keep, held = holdout_split(len(train_base), opts.val_split, seed=val_seed)
        val = train_base.subset(held)
        train_base = train_base.subset(keep)
    rate = opts.label_noise
    clean = train_base.targets.numpy().copy()
    noisy, mask = symmetric_label_noise(clean, rate, num_classes, seed=opts.label_noise_seed)
    if rate:
        train_base.targets = torch.from_numpy(noisy)
    meta.update(noisy_mask=mask, clean_targets=clean,
                label_noise={"rate": rate, "num_noisy": int(mask.sum()), "seed": opts.label_noise_seed,
                             "kind": "symmetric (uniform over the other classes)"})
    mean = tuple(float(m) for m in train_base.mean.reshape(-1))
    std = tuple(float(s) for s in train_base.std.reshape(-1))
    ood_sets: dict[str, Dataset] = {}
    names = [str(n) for n in as_list(opts.ood)]
    ood_roots = {k: v for k, v in as_dict(opts.ood_roots).items() if v not in (None, "")}
    unknown = sorted(set(ood_roots) - set(names))
    if unknown:
        raise ValueError(f"{name}: ood_roots names {unknown} that are not in ood={names}")
    if names:
        from flatbnn.data.ood import build_ood_sets

        ood_sets = build_ood_sets(names, ood_roots, opts.root, in_name=name,
                                  item_shape=tuple(train_base.item_shape), mean=mean, std=std,
                                  subset=opts.ood_subset, download=opts.download, cache_dir=opts.cache_dir)
    return DataBundle(
        train=make_train_set(train_base, opts.augment, opts.seed),
        test=test,
        num_classes=num_classes,
        input_shape=tuple(train_base.item_shape),
        val=val,
        ood=ood_sets,
        name=name,
        meta=dict(meta, mean=mean, std=std, augment=opts.augment, loader=opts.loader),
        shift=dict(shift or {}),
    )


def make_bundle(
    opts: DataOptions,
    train: tuple[Any, Any],
    test: tuple[Any, Any],
    *,
    num_classes: int,
    mean: Any,
    std: Any,
    scale: float | None = None,
    meta: dict[str, Any] | None = None,
    shift: dict[str, Dataset] | None = None,
) -> DataBundle:
    """Arrays ``(x, y)`` -> DataBundle via :func:`finish_bundle`."""
    from flatbnn.data.transforms import ArrayDataset

    base = ArrayDataset(train[0], train[1], mean=mean, std=std, scale=scale)
    test_ds = ArrayDataset(test[0], test[1], mean=mean, std=std, scale=scale)
    return finish_bundle(opts, base, test_ds, num_classes=num_classes, meta=meta, shift=shift)
