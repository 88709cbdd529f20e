"""Data sets -> :class:`DataBundle`.

``build_dataset(name, **kwargs)`` dispatches to a builder registered with
``@register_dataset(name, ...)``. Every data set accepts the common keys ``root``,
``train_subset``, ``test_subset``, ``val_split``, ``augment``, ``seed``, ``download``,
``label_noise``/``label_noise_seed``, ``ood``/``ood_roots``/``ood_subset``, ``loader``,
``cache_dir``, ``image_size`` (serve items at S x S, :mod:`flatbnn.data.resize`) and
``num_classes``/``input_shape``: :func:`build_dataset` parses and validates
them once into a :class:`~flatbnn.data.options.DataOptions` (warning about keys nobody takes),
checks the config's ``num_classes`` / ``input_shape`` against the data, and calls
``builder(opts, **own_keys)`` with the keys only that builder declares (e.g. cifar10's
``shift_root``). Per data set, ``register_dataset`` declares the defaults of ``root`` and
``augment``, the allowed ``augment`` and ``loader`` values, and the fixed ``num_classes`` /
``input_shape`` (see :mod:`flatbnn.data.options`).

Items of every data set are ``(x: FloatTensor, y: int)``. The train set always has
``set_epoch(epoch)``; its random augmentation is a deterministic function of
``(seed, epoch, index)`` (see :mod:`flatbnn.data.transforms`). See docs/data.md.
"""

from __future__ import annotations

from flatbnn.data.registry import (  # noqa: F401
    DataBundle,
    DataOptions,
    as_dict,
    as_list,
    build_dataset,
    finish_bundle,
    list_datasets,
    make_bundle,
    register_dataset,
)

__all__ = [
    "DataBundle",
    "DataOptions",
    "finish_bundle",
    "make_bundle",
    "build_dataset",
    "register_dataset",
    "list_datasets",
]

# Every built-in data set, so that each registers itself (they import data/registry.py, not this package).
from flatbnn.data import cifar as _cifar  # noqa: F401
from flatbnn.data import cifar10_c as _cifar10_c  # noqa: F401
from flatbnn.data import digits as _digits  # noqa: F401
from flatbnn.data import finegrained as _finegrained  # noqa: F401
from flatbnn.data import imagefolder as _imagefolder  # noqa: F401
from flatbnn.data import mnist as _mnist  # noqa: F401
from flatbnn.data import svhn as _svhn  # noqa: F401
