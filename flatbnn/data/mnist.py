"""MNIST and Fashion-MNIST (60k train / 10k test, 28x28 grey, 10 classes) from the idx files.

Layout (torchvision's): ``<root>/MNIST/raw/`` resp. ``<root>/FashionMNIST/raw/`` holding
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, each optionally gzipped (``.gz``). ``root`` may also point at the
``MNIST``/``FashionMNIST`` folder or at the ``raw`` folder itself. ``download=True`` fetches the
files with ``torchvision.datasets.MNIST`` / ``FashionMNIST``.

Items are ``[1, 28, 28]``; canonical order by class then file position; subsets class-balanced
with a fixed RNG, as for CIFAR. ``normalize`` (default true): pixels / 255 standardised with the training set's
mean / std (``SETS``); false feeds them in [0, 1], as the bSAM code does (its data.py: ``ToTensor()`` only). The
OOD sets of a run follow its choice (they take the in-distribution statistics).
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from flatbnn.data.registry import DataBundle, DataOptions, make_bundle, register_dataset
from flatbnn.data.arrays import canonical_subset, check_arrays
from flatbnn.data.ood import register_test_loader

NUM_CLASSES = 10
INPUT_SHAPE = (1, 28, 28)
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SETS = {
    # name: (torchvision folder, torchvision class, mean, std, classes, where to get it)
    "mnist": ("MNIST", "MNIST", (0.1307,), (0.3081,), tuple(str(i) for i in range(10)),
              "http://yann.lecun.com/exdb/mnist/ (or dataset.download=true)"),
    "fashion_mnist": ("FashionMNIST", "FashionMNIST", (0.2860,), (0.3530,),
                      ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                       "Bag", "Ankle boot"),
                      "https://github.com/zalandoresearch/fashion-mnist (or dataset.download=true)"),
}


def read_idx(path: Path) -> np.ndarray:
    """An idx file (``.gz`` or not) -> uint8 array of its shape (magic 0x0000 08 <ndim>)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file (magic {data[:4].hex()})")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    count = int(np.prod(dims)) if dims else 0
    if len(data) - offset != count:
        raise ValueError(f"{path}: idx header says {dims} ({count} bytes) but the file holds {len(data) - offset}")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims)


def idx_bytes(arr: np.ndarray) -> bytes:
    """The inverse of :func:`read_idx`: a uint8 array -> idx file bytes (magic 0x0000 08 <ndim>, big-endian dims)."""
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def locate(root: Any, name: str) -> Path | None:
    """The folder holding the four idx files (plain or .gz) for ``name``, or None."""
    tv_folder = SETS[name][0]
    root = Path(os.path.expanduser(str(root)))
    for cand in (root / tv_folder / "raw", root / tv_folder, root / "raw", root):
        if all(_find(cand, f) is not None for pair in FILES.values() for f in pair):
            return cand
    return None


def not_found_message(root: Any, name: str, key: str = "dataset.root") -> str:
    tv_folder, _, _, _, _, where = SETS[name]
    files = ", ".join(f for pair in FILES.values() for f in pair)
    return (f"{tv_folder} not found under '{root}': expected {root}/{tv_folder}/raw/ with {files} "
            f"(each optionally .gz; torchvision layout); get it from {where}; set {key} to the folder "
            f"holding {tv_folder}/")


def load_arrays(name: str, root: Any, train_subset: int | None = None, test_subset: int | None = None,
                download: bool = False, key: str = "dataset.root",
                splits: Iterable[str] = ("train", "test")) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    folder = locate(root, name)
    if folder is None and download:
        import torchvision

        cls = getattr(torchvision.datasets, SETS[name][1])
        for train in (True, False):  # downloads + md5-checks into <root>/<Folder>/raw
            cls(os.path.expanduser(str(root)), train=train, download=True)
        folder = locate(root, name)
    if folder is None:
        raise FileNotFoundError(not_found_message(root, name, key))
    out = {}
    subsets = {"train": train_subset, "test": test_subset}
    for split in splits:
        img_f, lbl_f = (_find(folder, f) for f in FILES[split])
        x, y = read_idx(img_f), read_idx(lbl_f).astype(np.int64)
        if x.ndim != 3 or len(x) != len(y):
            raise ValueError(f"{name} {split}: images {x.shape} and labels {y.shape} do not match")
        out[split] = canonical_subset(x[..., None], y, subsets[split], NUM_CLASSES)
    return out


def _builder(name: str):
    tv_folder, _, mean, std, classes, _ = SETS[name]

    def build(opts: DataOptions, normalize: bool = True) -> DataBundle:
        if not isinstance(normalize, bool):
            raise ValueError(f"{name}: normalize must be true or false, got {normalize!r}")
        data = load_arrays(name, opts.root, opts.train_subset, opts.test_subset, opts.download)
        check_arrays(name, data, (28, 28, 1), NUM_CLASSES)
        mean_std = (mean, std) if normalize else ((0.0,), (1.0,))
        return make_bundle(opts, data["train"], data["test"], num_classes=NUM_CLASSES, mean=mean_std[0],
                           std=mean_std[1], scale=255.0,
                           meta={"classes": classes, "layout": "idx", "root": str(opts.root)})

    def test_arrays(root: Any, *, subset: int | None = None, download: bool = False, cache_dir: Any = None,
                    key: str = "dataset.root") -> tuple[np.ndarray, np.ndarray]:
        return load_arrays(name, root, None, subset, download, key=key, splits=("test",))["test"]

    build.__name__ = f"build_{name}"
    build.__doc__ = f"{tv_folder} from the idx files (see module docstring)."
    register_dataset(name, num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE)(build)
    register_test_loader(name)(test_arrays)
    return build


build_mnist = _builder("mnist")
build_fashion_mnist = _builder("fashion_mnist")
