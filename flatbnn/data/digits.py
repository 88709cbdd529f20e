"""scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes; ships with scikit-learn).

Pixels are 0..16, scaled to [0, 1] and normalised with the mean/std of the fixed training
split. The 360-image test split is fixed (36 per class, RNG seed 0) and never depends on
the run seed. No augmentation (``augment`` must be ``"none"``).
"""

from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np

from flatbnn.data.registry import DataBundle, DataOptions, make_bundle, register_dataset
from flatbnn.data.transforms import balanced_subset

NUM_CLASSES = 10
INPUT_SHAPE = (1, 8, 8)
NUM_TEST = 360
SPLIT_SEED = 0  # fixed: the train/test split never changes
SUBSET_SEED = 0  # fixed: train_subset/test_subset/val_split are the same for every run seed


def _shipped_csv() -> Path | None:
    """scikit-learn's own copy of the data (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and the label a row),
    found without importing scikit-learn, or None where a release moved it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


@lru_cache(maxsize=1)
def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 images as uint8 ``[N, 8, 8]`` (values 0..16) and int64 labels: scikit-learn's CSV read as its
    ``load_digits`` reads it, without importing scikit-learn (~1 s of modules in every digits process, the tests'
    subprocesses included; tests/test_data.py checks the arrays equal ``load_digits``'), or through ``load_digits``
    where the file is not where it was."""
    path = _shipped_csv()
    if path is not None:
        with gzip.open(path, "rt") as f:
            data = np.loadtxt(f, delimiter=",")
        images, labels = data[:, :-1].reshape(-1, 8, 8), data[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the 'digits' data set needs scikit-learn: pip install scikit-learn"
            ) from e
        d = load_digits()
        images, labels = d.images, d.target
    images = np.asarray(images).round().astype(np.uint8)
    labels = np.asarray(labels).astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def fixed_split() -> tuple[np.ndarray, np.ndarray]:
    """``(train_idx, test_idx)`` into the 1,797 images: 360 test (36 per class), the rest train."""
    _, labels = load_digits_arrays()
    test_idx = balanced_subset(labels, NUM_TEST, seed=SPLIT_SEED, num_classes=NUM_CLASSES)
    train_idx = np.setdiff1d(np.arange(len(labels)), test_idx)
    return train_idx, test_idx


@register_dataset("digits", root=None, augment="none", augments=("none",), num_classes=NUM_CLASSES,
                  input_shape=INPUT_SHAPE)
def build_digits(opts: DataOptions) -> DataBundle:
    """``root`` and ``download`` are accepted and ignored (the data ships with scikit-learn);
    ``root`` is the default folder of OOD sets named in ``ood`` (resized to 8x8 grey)."""
    images, labels = load_digits_arrays()
    train_idx, test_idx = fixed_split()
    train_x, train_y = images[train_idx], labels[train_idx]
    test_x, test_y = images[test_idx], labels[test_idx]

    # normalisation from the full fixed training split (independent of subsets)
    pix = train_x.astype(np.float64) / 16.0
    mean, std = float(pix.mean()), float(pix.std())

    sel = balanced_subset(train_y, opts.train_subset, seed=SUBSET_SEED, num_classes=NUM_CLASSES)
    train_x, train_y = train_x[sel], train_y[sel]
    sel = balanced_subset(test_y, opts.test_subset, seed=SUBSET_SEED, num_classes=NUM_CLASSES)
    test_x, test_y = test_x[sel], test_y[sel]

    return make_bundle(
        opts,
        (train_x[..., None], train_y),
        (test_x[..., None], test_y),
        num_classes=NUM_CLASSES,
        mean=[mean],
        std=[std],
        scale=16.0,
        meta={"classes": tuple(str(i) for i in range(NUM_CLASSES))},
    )
