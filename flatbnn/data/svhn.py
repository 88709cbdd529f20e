"""SVHN cropped digits (73,257 train / 26,032 test, 32x32 RGB, 10 classes); mainly an OOD set for CIFAR.

Layout (torchvision's): ``<root>/train_32x32.mat`` and ``<root>/test_32x32.mat`` (MATLAB v5
files with ``X`` uint8 ``[32, 32, 3, N]`` and ``y`` ``[N, 1]``, digit 0 stored as label 10 and
mapped to 0 here, as torchvision does); ``<root>/svhn/`` is searched too. ``download=True``
fetches them with ``torchvision.datasets.SVHN``. The ``extra`` split is not used. Reading needs
scipy (``scipy.io.loadmat``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from flatbnn.data.registry import DataBundle, DataOptions, make_bundle, register_dataset
from flatbnn.data.arrays import canonical_subset, check_arrays
from flatbnn.data.ood import register_test_loader

NUM_CLASSES = 10
INPUT_SHAPE = (3, 32, 32)
MEAN = (0.4377, 0.4438, 0.4728)
STD = (0.1980, 0.2010, 0.1970)
FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}


def locate(root: Any, splits: Iterable[str]) -> Path | None:
    root = Path(os.path.expanduser(str(root)))
    for cand in (root, root / "svhn", root / "SVHN"):
        if all((cand / FILES[s]).is_file() for s in splits):
            return cand
    return None


def not_found_message(root: Any, splits: Iterable[str], key: str = "dataset.root") -> str:
    files = " and ".join(f"{root}/{FILES[s]}" for s in splits)
    return (f"SVHN not found: expected {files} (torchvision layout, cropped digits); get them from "
            f"http://ufldl.stanford.edu/housenumbers/ (or dataset.download=true); set {key} to the folder holding them")


def read_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        from scipy.io import loadmat
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading SVHN's .mat files needs scipy: pip install scipy") from e
    d = loadmat(str(path))
    x = np.asarray(d["X"], dtype=np.uint8)
    if x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise ValueError(f"{path}: expected X of shape (32, 32, 3, N), got {x.shape}")
    y = np.asarray(d["y"], dtype=np.int64).reshape(-1)
    y[y == 10] = 0
    return np.ascontiguousarray(x.transpose(3, 0, 1, 2)), y


def load_arrays(root: Any, train_subset: int | None = None, test_subset: int | None = None, download: bool = False,
                key: str = "dataset.root", splits: Iterable[str] = ("train", "test")) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    splits = tuple(splits)
    folder = locate(root, splits)
    if folder is None and download:
        import torchvision

        for split in splits:
            torchvision.datasets.SVHN(os.path.expanduser(str(root)), split=split, download=True)
        folder = locate(root, splits)
    if folder is None:
        raise FileNotFoundError(not_found_message(root, splits, key))
    subsets = {"train": train_subset, "test": test_subset}
    return {s: canonical_subset(*read_mat(folder / FILES[s]), subsets[s], NUM_CLASSES) for s in splits}


@register_test_loader("svhn")
def svhn_test_arrays(root: Any, *, subset: int | None = None, download: bool = False, cache_dir: Any = None,
                     key: str = "dataset.root") -> tuple[np.ndarray, np.ndarray]:
    return load_arrays(root, None, subset, download, key=key, splits=("test",))["test"]


@register_dataset("svhn", num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE)
def build_svhn(opts: DataOptions) -> DataBundle:
    data = load_arrays(opts.root, opts.train_subset, opts.test_subset, opts.download)
    check_arrays("svhn", data, (32, 32, 3), NUM_CLASSES)
    return make_bundle(opts, data["train"], data["test"], num_classes=NUM_CLASSES, mean=MEAN, std=STD, scale=255.0,
                       meta={"classes": tuple(str(i) for i in range(10)), "layout": "mat", "root": str(opts.root)})
