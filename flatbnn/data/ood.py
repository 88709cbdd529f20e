"""Out-of-distribution test sets for ``DataBundle.ood``.

A data set config names its OOD partners (``ood: [svhn, cifar100]``); each partner's TEST split
is loaded from ``ood_roots[<name>]`` (default: the data set's own ``root``, or its folder when
``root`` is an archive file), optionally reduced to a class-balanced ``ood_subset``, brought to
the in-distribution image shape (grey <-> RGB, bilinear resize if the sizes differ) and
normalised with the IN-DISTRIBUTION mean/std, exactly as the in-distribution test images are.

Partners register a test-split loader with :func:`register_test_loader`; loaders return
uint8 ``[N, H, W, C]`` images and int64 labels (the labels are kept but meaningless for OOD).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from flatbnn.data.transforms import ArrayDataset

__all__ = ["register_test_loader", "list_ood_sources", "load_test_arrays", "build_ood_sets", "adapt_images",
           "default_ood_root"]

TestLoader = Callable[..., tuple[np.ndarray, np.ndarray]]
_TEST_LOADERS: dict[str, TestLoader] = {}


def register_test_loader(name: str) -> Callable[[TestLoader], TestLoader]:
    """Decorator: ``fn(root, *, subset, download, cache_dir, key) -> (uint8 [N,H,W,C], int64 [N])``."""

    def deco(fn: TestLoader) -> TestLoader:
        _TEST_LOADERS[name] = fn
        return fn

    return deco


def list_ood_sources() -> list[str]:
    return sorted(_TEST_LOADERS)


def default_ood_root(root: Any) -> str:
    """The data set's ``root``, or its parent folder when ``root`` is a file (an archive)."""
    if root is None:
        return "data"
    path = Path(os.path.expanduser(str(root)))
    return str(path.parent) if path.is_file() else str(root)


def load_test_arrays(name: str, root: Any, *, subset: int | None = None, download: bool = False,
                     cache_dir: Any = None, key: str = "dataset.root") -> tuple[np.ndarray, np.ndarray]:
    try:
        fn = _TEST_LOADERS[name]
    except KeyError:
        raise KeyError(f"unknown OOD data set {name!r}; available: {', '.join(list_ood_sources())}") from None
    x, y = fn(root, subset=subset, download=download, cache_dir=cache_dir, key=key)
    if x.ndim == 3:
        x = x[..., None]
    return x, y


def adapt_images(x: np.ndarray, item_shape: Iterable[int]) -> np.ndarray:
    """uint8 ``[N, H, W, C]`` -> uint8 ``[N, H', W', C']`` for ``item_shape = (C', H', W')``:
    RGB -> grey with PIL's ITU-R 601-2 luma, grey -> RGB by replication, bilinear (antialiased)
    resize when the spatial size differs."""
    c, h, w = (int(s) for s in item_shape)
    if x.ndim == 3:
        x = x[..., None]
    if x.shape[-1] != c:
        if x.shape[-1] == 1 and c == 3:
            x = np.repeat(x, 3, axis=-1)
        elif x.shape[-1] == 3 and c == 1:
            luma = x[..., 0] * 299.0 / 1000 + x[..., 1] * 587.0 / 1000 + x[..., 2] * 114.0 / 1000
            x = np.clip(np.round(luma), 0, 255).astype(np.uint8)[..., None]
        else:
            raise ValueError(f"cannot map {x.shape[-1]}-channel OOD images to {c} channels")
    if x.shape[1:3] != (h, w):
        from PIL import Image

        out = np.empty((len(x), h, w, c), dtype=np.uint8)
        for i, img in enumerate(x):
            im = Image.fromarray(img[..., 0] if c == 1 else img)
            out[i] = np.asarray(im.resize((w, h), Image.BILINEAR), dtype=np.uint8).reshape(h, w, c)
        x = out
    return np.ascontiguousarray(x)


def build_ood_sets(
    names: Iterable[str],
    roots: dict[str, Any],
    root: Any,
    *,
    in_name: str,
    item_shape: tuple[int, ...],
    mean: Any,
    std: Any,
    subset: int | None = None,
    download: bool = False,
    cache_dir: Any = None,
) -> dict[str, ArrayDataset]:
    """``{name: test set}`` for every OOD partner, normalised with the in-distribution ``mean``/``std``."""
    names = list(names)
    if len(item_shape) != 3:
        raise ValueError(f"{in_name}: OOD sets need image data, got item shape {item_shape}")
    unknown = set(roots) - set(names)
    if unknown:
        raise ValueError(f"{in_name}: ood_roots names {sorted(unknown)} that are not in ood={names}")
    out: dict[str, ArrayDataset] = {}
    for name in names:
        if name == in_name:
            raise ValueError(f"{in_name}: a data set cannot be its own OOD set")
        if name in out:
            raise ValueError(f"{in_name}: OOD set {name!r} listed twice")
        explicit = roots.get(name)
        key = f"dataset.ood_roots.{name}"
        src = explicit if explicit not in (None, "") else default_ood_root(root)
        x, y = load_test_arrays(name, src, subset=subset, download=download, cache_dir=cache_dir, key=key)
        out[name] = ArrayDataset(adapt_images(x, item_shape), y, mean=mean, std=std, scale=255.0)
    return out
