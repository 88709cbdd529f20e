"""The keys every data set accepts, parsed and validated once for all builders.

``build_dataset(name, **keys)`` splits a config's keys in three: the common ones
(:data:`COMMON_KEYS`, parsed into a frozen :class:`DataOptions`), the builder's own keyword
parameters (passed to it unchanged), and anything else (a warning, then ignored). What differs
between data sets -- the default ``root`` and ``augment``, the allowed ``augment`` / ``loader``
values and the fixed ``num_classes`` / ``input_shape`` -- is declared with
``@register_dataset(name, ...)`` and kept in a :class:`DatasetSpec`.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from flatbnn.data.transforms import ARRAY_AUGMENTATIONS, check_augment

__all__ = ["COMMON_KEYS", "LOADERS", "DataOptions", "DatasetSpec", "check_expected", "check_loader", "warn_unused"]

LOADERS = ("cpu", "device")

#: the config keys every data set accepts (``name`` aside); :class:`DataOptions` holds them parsed
COMMON_KEYS = (
    "root", "train_subset", "test_subset", "val_split", "augment", "seed", "download",
    "num_classes", "input_shape", "label_noise", "label_noise_seed", "ood", "ood_roots", "ood_subset",
    "loader", "cache_dir", "image_size",
)


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


def check_loader(dataset: str, loader: Any, augment: str, allowed: Iterable[str] = LOADERS) -> str:
    """Validate ``dataset.loader`` (``cpu`` | ``device``; the engine picks the loader class)."""
    loader = "cpu" if loader in (None, False) else str(loader)
    allowed = tuple(allowed)
    if loader not in allowed:
        raise ValueError(f"{dataset}: loader must be one of {list(allowed)}, got {loader!r}")
    if loader == "device" and augment not in ("none", "crop_flip"):
        raise ValueError(f"{dataset}: loader=device supports augment none|crop_flip, got {augment!r}")
    return loader


def warn_unused(dataset: str, unused: Mapping[str, Any]) -> None:
    if unused:
        warnings.warn(
            f"{dataset}: ignoring unknown dataset arguments {sorted(unused)}",
            stacklevel=3,  # the caller of DatasetSpec.parse, i.e. build_dataset
        )


@dataclass(frozen=True)
class DataOptions:
    """The common keys of a data set config, validated: what every builder gets as ``opts``.

    ``augment`` and ``loader`` are checked against the data set's allowed values; ``val_split``,
    ``seed``, ``label_noise`` (a fraction of the training labels), ``label_noise_seed`` and
    ``download`` are converted to their types; the other values are the config's, as given.
    ``expected_num_classes`` / ``expected_input_shape`` are the config's ``num_classes`` /
    ``input_shape`` (None: not checked); :meth:`check_expected` compares them with the data.
    """

    name: str
    root: Any = "data"
    train_subset: int | None = None
    test_subset: int | None = None
    val_split: int = 0
    augment: str = "none"
    seed: int = 0
    download: bool = False
    label_noise: float = 0.0
    label_noise_seed: int = 0
    ood: Any = None
    ood_roots: Any = None
    ood_subset: int | None = None
    loader: str = "cpu"
    cache_dir: Any = None
    expected_num_classes: Any = None
    expected_input_shape: Any = None
    image_size: int | None = None  # serve items at S x S (flatbnn.data.resize); None = the data set's own size

    def check_expected(self, num_classes: int, input_shape: Iterable[int]) -> None:
        """``ValueError`` unless the data's ``num_classes``/``input_shape`` (as served: ``image_size``) match the
        config's."""
        if self.image_size is not None:
            input_shape = (tuple(input_shape)[0], self.image_size, self.image_size)
        check_expected(self.name, num_classes, input_shape, self.expected_num_classes, self.expected_input_shape)


@dataclass(frozen=True)
class DatasetSpec:
    """A registered builder ``builder(opts, **own_keys) -> DataBundle`` and what is particular to its
    data set: the defaults of ``root`` and ``augment``, the allowed ``augments`` and ``loaders``, and
    ``num_classes`` / ``input_shape`` when they are known without reading the data (both or neither)."""

    name: str
    builder: Callable[..., Any]
    root: Any = "data"
    augment: str = "none"
    augments: tuple[str, ...] = ARRAY_AUGMENTATIONS
    loaders: tuple[str, ...] = LOADERS
    num_classes: int | None = None
    input_shape: tuple[int, ...] | None = None
    #: the builder's own keyword parameters (everything after ``opts``)
    own_keys: frozenset[str] = field(init=False)
    #: the builder takes ``**kwargs``: every non-common key is its own (nothing is warned about)
    takes_any: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "augments", tuple(self.augments))
        object.__setattr__(self, "loaders", tuple(self.loaders))
        if (self.num_classes is None) != (self.input_shape is None):
            raise ValueError(f"data set {self.name!r}: declare both num_classes and input_shape, or neither")
        if self.input_shape is not None:
            object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        params = list(inspect.signature(self.builder).parameters.values())[1:]  # [0] is opts
        own = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        clash = sorted(own & set(COMMON_KEYS))
        if clash:  # a builder reads those from opts; a parameter of the same name would never be set
            raise ValueError(f"data set {self.name!r}: builder parameters {clash} are common keys (use opts)")
        object.__setattr__(self, "own_keys", frozenset(own))
        object.__setattr__(self, "takes_any", any(p.kind is p.VAR_KEYWORD for p in params))

    def parse(self, keys: Mapping[str, Any]) -> tuple[DataOptions, dict[str, Any]]:
        """``(opts, own)`` from a config's keys: the validated common options and the builder's own
        keys; unknown keys are warned about and dropped. Checks ``augment`` first, then ``loader``."""
        own = {k: v for k, v in keys.items()
               if k in self.own_keys or (self.takes_any and k not in COMMON_KEYS)}
        warn_unused(self.name, {k: v for k, v in keys.items() if k not in COMMON_KEYS and k not in own})
        get = keys.get
        augment = check_augment(self.name, get("augment", self.augment), self.augments)
        opts = DataOptions(
            name=self.name,
            root=get("root", self.root),
            train_subset=get("train_subset"),
            test_subset=get("test_subset"),
            augment=augment,
            loader=check_loader(self.name, get("loader", "cpu"), augment, self.loaders),
            label_noise=float(get("label_noise") or 0.0),
            label_noise_seed=int(get("label_noise_seed") or 0),
            ood=get("ood"),
            ood_roots=get("ood_roots"),
            ood_subset=get("ood_subset"),
            download=bool(get("download", False)),
            cache_dir=get("cache_dir"),
            val_split=int(get("val_split") or 0),
            seed=int(get("seed", 0)),
            expected_num_classes=get("num_classes"),
            expected_input_shape=get("input_shape"),
            image_size=int(get("image_size")) if get("image_size") not in (None, 0) else None,
        )
        if opts.image_size is not None and opts.loader == "device":
            raise ValueError(f"{self.name}: image_size needs loader=cpu (the device loader serves the stored arrays)")
        return opts, own
