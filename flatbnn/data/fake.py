"""Tiny fake data sets in each data set's official on-disk layout (CIFAR pickles, MNIST idx, SVHN .mat,
TinyImageNet / ImageNet folders, CIFAR-10-C .npy, torchvision's Stanford Cars / Flowers-102 layouts). Used by the tests (every image's label and position are
coded in its pixels, so label order can be checked through the real loaders) and by the reproduction runner's
``smoke`` scale, which runs every paper cell through the real loaders on these files instead of the real data.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np

C10_TRAIN, C10_TEST = 3, 2  # per class in the fake CIFAR-10
C100_TRAIN, C100_TEST = 2, 1
MNIST_TRAIN, MNIST_TEST = 3, 2
SVHN_TRAIN, SVHN_TEST = 3, 2
TIN_TRAIN, TIN_VAL = 1, 1
IN_CLASSES, IN_TRAIN, IN_VAL = 3, 3, 2
C10C_CORRUPTIONS = ("gaussian_noise", "fog", "contrast")


def coded_image(shape, seed, label: int, index: int) -> np.ndarray:
    """Random uint8 image with ``label`` at [0, 0, 0] and ``index`` at [0, 0, 1] (flat [0]/[1] if grey)."""
    img = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    flat = img.reshape(-1, shape[-1]) if len(shape) == 3 else img.reshape(-1, 1)
    if flat.shape[1] >= 2:
        flat[0, 0], flat[0, 1] = label, index
    else:
        flat[0, 0], flat[1, 0] = label, index
    return img


def interleaved(num_classes: int, per_class: int) -> list[tuple[int, int]]:
    """(class, index) pairs in an interleaved file order, as in the real files (0,0), (1,0), ..."""
    return [(c, j) for j in range(per_class) for c in range(num_classes)]


# --------------------------------------------------------------------------- CIFAR-10 / 100 pickles

def write_cifar10_torchvision(root: Path) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for split, n in (("train", C10_TRAIN), ("test", C10_TEST)):
        pairs = interleaved(10, n)
        data = np.stack([coded_image((32, 32, 3), [10, split == "train", c, j], c, j).transpose(2, 0, 1).reshape(-1)
                         for c, j in pairs])
        labels = [c for c, _ in pairs]
        names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        for name, idx in zip(names, np.array_split(np.arange(len(pairs)), len(names))):
            with open(folder / name, "wb") as f:
                pickle.dump({"data": data[idx], "labels": [labels[i] for i in idx]}, f)
    return root


def cifar10_clean_test_in_file_order() -> tuple[np.ndarray, np.ndarray]:
    pairs = interleaved(10, C10_TEST)
    return (np.stack([coded_image((32, 32, 3), [10, False, c, j], c, j) for c, j in pairs]),
            np.array([c for c, _ in pairs]))


def write_cifar100(root: Path) -> Path:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    for split, n in (("train", C100_TRAIN), ("test", C100_TEST)):
        pairs = interleaved(100, n)
        data = np.stack([coded_image((32, 32, 3), [100, split == "train", c, j], c, j).transpose(2, 0, 1).reshape(-1)
                         for c, j in pairs])
        with open(folder / split, "wb") as f:
            pickle.dump({"data": data, "fine_labels": [c for c, _ in pairs],
                         "coarse_labels": [c // 5 for c, _ in pairs]}, f)
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"class{c:03d}" for c in range(100)],
                     "coarse_label_names": [f"super{c:02d}" for c in range(20)]}, f)
    return root


# --------------------------------------------------------------------------- MNIST idx

def write_mnist(root: Path, folder: str = "MNIST", gz: bool = True) -> Path:
    from flatbnn.data.mnist import idx_bytes

    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    for split, prefix, n in (("train", "train", MNIST_TRAIN), ("test", "t10k", MNIST_TEST)):
        pairs = interleaved(10, n)
        x = np.stack([coded_image((28, 28), [28, folder == "MNIST", split == "train", c, j], c, j) for c, j in pairs])
        y = np.array([c for c, _ in pairs], dtype=np.uint8)
        for stem, arr in ((f"{prefix}-images-idx3-ubyte", x), (f"{prefix}-labels-idx1-ubyte", y)):
            data = idx_bytes(arr)
            if gz:
                with gzip.open(raw / (stem + ".gz"), "wb") as f:
                    f.write(data)
            else:
                (raw / stem).write_bytes(data)
    return root


# --------------------------------------------------------------------------- SVHN .mat

def write_svhn(root: Path) -> Path:
    from scipy.io import savemat

    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", SVHN_TRAIN), ("test", SVHN_TEST)):
        pairs = interleaved(10, n)
        x = np.stack([coded_image((32, 32, 3), [73, split == "train", c, j], c, j) for c, j in pairs])
        y = np.array([[10 if c == 0 else c] for c, _ in pairs], dtype=np.uint8)  # digit 0 is stored as 10
        savemat(str(root / f"{split}_32x32.mat"), {"X": x.transpose(1, 2, 3, 0), "y": y})
    return root


# --------------------------------------------------------------------------- image trees

def class_colour(c: int) -> tuple[int, int, int]:
    return (c % 256, (255 - c) % 256, (37 * c + 11) % 256)


def _save_jpeg(path: Path, size: tuple[int, int], colour) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, quality=95)


def tin_wnids() -> list[str]:
    return [f"n{c:08d}" for c in range(200)]


def write_tinyimagenet(root: Path) -> Path:
    base = root / "tiny-imagenet-200"
    wnids = tin_wnids()
    shuffled = list(np.random.default_rng(0).permutation(wnids))
    base.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(shuffled) + "\n")
    for c, w in enumerate(wnids):
        for j in range(TIN_TRAIN):
            _save_jpeg(base / "train" / w / "images" / f"{w}_{j}.JPEG", (64, 64), class_colour(c))
        (base / "train" / w / f"{w}_boxes.txt").write_text("")
    lines = []
    order = np.random.default_rng(1).permutation(200 * TIN_VAL)
    for k, o in enumerate(order):
        c = int(o) % 200
        name = f"val_{k}.JPEG"
        _save_jpeg(base / "val" / "images" / name, (64, 64), class_colour(c))
        lines.append(f"{name}\t{wnids[c]}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root


def write_imagenet(root: Path) -> Path:
    sizes = [(300, 200), (180, 260), (256, 256)]
    for split, n in (("train", IN_TRAIN), ("val", IN_VAL)):
        for c in range(IN_CLASSES):
            for j in range(n):
                _save_jpeg(root / split / f"n{c:08d}" / f"img_{j}.JPEG", sizes[(c + j) % 3], class_colour(40 * c + 20))
    return root


# --------------------------------------------------------------------------- Stanford Cars / Flowers-102

CARS_CLASSES, CARS_TRAIN, CARS_TEST = 196, 1, 1   # per class
FLOWERS_CLASSES, FLOWERS_PER_SPLIT = 102, 1        # per class in each of trnid / valid / tstid


def write_stanford_cars(root: Path) -> Path:
    """torchvision StanfordCars layout: devkit/*.mat, cars_{train,test}/ and the labelled test annotations;
    image colour = class_colour(class), file names shuffled against the class order (as in the real set)."""
    from scipy.io import savemat

    base = root / "stanford_cars"
    (base / "devkit").mkdir(parents=True)
    savemat(base / "devkit" / "cars_meta.mat",
            {"class_names": np.array([f"Car {c:03d}" for c in range(CARS_CLASSES)], dtype=object)})
    fields = [("bbox_x1", "O"), ("bbox_y1", "O"), ("bbox_x2", "O"), ("bbox_y2", "O"), ("class", "O"), ("fname", "O")]
    for split, n, annos in (("train", CARS_TRAIN, base / "devkit" / "cars_train_annos.mat"),
                            ("test", CARS_TEST, base / "cars_test_annos_withlabels.mat")):
        pairs = interleaved(CARS_CLASSES, n)
        order = np.random.default_rng(2 + (split == "test")).permutation(len(pairs))
        rows = []
        for k, o in enumerate(order):
            c, _ = pairs[o]
            name = f"{k + 1:05d}.jpg"
            _save_jpeg(base / f"cars_{split}" / name, (40 + c % 7, 30 + c % 5), class_colour(c))
            rows.append((1, 1, 20, 20, c + 1, name))  # class 1-based, as in the official .mat files
        savemat(annos, {"annotations": np.array(rows, dtype=fields)})
    return root


def write_flowers102(root: Path) -> Path:
    """torchvision Flowers102 layout: jpg/image_%05d.jpg, imagelabels.mat (1-based labels), setid.mat."""
    from scipy.io import savemat

    base = root / "flowers-102"
    n = FLOWERS_CLASSES * 3 * FLOWERS_PER_SPLIT
    labels = np.random.default_rng(4).permutation(np.repeat(np.arange(FLOWERS_CLASSES), 3 * FLOWERS_PER_SPLIT))
    for i, c in enumerate(labels, start=1):
        _save_jpeg(base / "jpg" / f"image_{i:05d}.jpg", (36, 28 + int(c) % 9), class_colour(int(c)))
    ids = {}
    for c in range(FLOWERS_CLASSES):  # the k-th image of class c goes to split k
        mine = [i for i in range(1, n + 1) if labels[i - 1] == c]
        for name, i in zip(("trnid", "valid", "tstid"), mine):
            ids.setdefault(name, []).append(i)
    savemat(base / "imagelabels.mat", {"labels": (labels + 1).astype(np.uint8)})
    savemat(base / "setid.mat", {k: np.array(sorted(v), dtype=np.uint16) for k, v in ids.items()})
    return root


# --------------------------------------------------------------------------- CIFAR-10-C

def write_cifar10_c(root: Path, corruptions=C10C_CORRUPTIONS) -> Path:
    """Official layout from the fake CIFAR-10 test set in its FILE order (test_batch order):
    rows of severity s carry the clean image with pixel [0, 0, 2] = 10 * s + corruption number."""
    x, y = cifar10_clean_test_in_file_order()
    root.mkdir(parents=True)
    for k, name in enumerate(corruptions):
        blocks = []
        for s in range(1, 6):
            b = x.copy()
            b[:, 0, 0, 2] = 10 * s + k
            blocks.append(b)
        np.save(root / f"{name}.npy", np.concatenate(blocks))
    np.save(root / "labels.npy", np.tile(y.astype(np.uint8), 5))
    return root


def write_all(base: Path) -> dict[str, Path]:
    """Every fake data set under ``base``; returns ``{dataset config name: the root to pass as dataset.root}``."""
    base = Path(base)
    return {
        "cifar10": write_cifar10_torchvision(base / "cifar10"),
        "cifar100": write_cifar100(base / "cifar100"),
        "mnist": write_mnist(base / "mnist", "MNIST", gz=True),
        "fashion_mnist": write_mnist(base / "fashion", "FashionMNIST", gz=False),
        "svhn": write_svhn(base / "svhn"),
        "tinyimagenet": write_tinyimagenet(base / "tin"),
        "imagenet": write_imagenet(base / "imagenet"),
        "cifar10_c": write_cifar10_c(base / "CIFAR-10-C"),
        "stanford_cars": write_stanford_cars(base / "cars"),
        "flowers102": write_flowers102(base / "flowers"),
    }
