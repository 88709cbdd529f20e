"""Helpers shared by the array data sets (CIFAR-10/100, CIFAR-10-C, MNIST, SVHN): the fixed class-balanced
subset in canonical order, and the shape / label check of decoded arrays."""

from __future__ import annotations

import numpy as np

from flatbnn.data.transforms import balanced_subset

SUBSET_SEED = 0  # fixed: every run seed sees the same subset
Arrays = tuple[np.ndarray, np.ndarray]  # images uint8 [N, H, W, C], labels int64 [N]


def canonical_subset(x: np.ndarray, y: np.ndarray, n: int | None, num_classes: int) -> Arrays:
    """Canonical order (by class, then by position within the class) and the fixed class-balanced
    subset of ``n`` (all if None), as every layout of every array data set uses."""
    y = np.asarray(y, dtype=np.int64)
    order = np.argsort(y, kind="stable")
    sel = order[balanced_subset(y[order], n, seed=SUBSET_SEED, num_classes=num_classes)]
    return x[sel], y[sel]


def check_arrays(dataset: str, data: dict[str, Arrays], shape: tuple[int, ...], num_classes: int) -> None:
    for split, (x, y) in data.items():
        if tuple(x.shape[1:]) != tuple(shape) or len(x) != len(y):
            raise ValueError(f"{dataset} {split}: unexpected array shapes {x.shape}, {y.shape}")
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"{dataset} {split}: labels outside [0, {num_classes})")
