"""Fine-grained transfer sets of Fisher SAM Table 3, read from torchvision's on-disk layouts (never downloaded).

* ``stanford_cars`` (Krause et al. 2013; 196 classes, 8,144 train / 8,041 test): torchvision ``StanfordCars``'s
  layout under ``<root>/stanford_cars/`` (``root`` may also be that folder)::

      devkit/cars_meta.mat            class_names (196)
      devkit/cars_train_annos.mat     annotations: fname, class (1-based), bbox
      cars_train/*.jpg
      cars_test_annos_withlabels.mat  annotations of the test split, with class
      cars_test/*.jpg

  Whole images are used (no bounding-box crop), as in the ViT transfer benchmarks.
* ``flowers102`` (Nilsback & Zisserman 2008; 102 classes): torchvision ``Flowers102``'s layout under
  ``<root>/flowers-102/`` (or that folder): ``jpg/image_%05d.jpg``, ``imagelabels.mat`` (``labels``, 1-based, per
  image id) and ``setid.mat`` (``trnid``, ``valid``, ``tstid``). ``train_split: trainval`` (default) trains on the
  official train + val ids (2,040 images), the split of the ViT / BiT transfer benchmarks; ``train`` on the
  1,020 train ids only. The test set is ``tstid`` (6,149).

Class index = label - 1 (torchvision's). Items are 224 x 224 (ImageNet statistics): test Resize(256) of the shorter
side + CenterCrop(224); train the same with ``augment: none``, or ``augment: imagenet`` = RandomResizedCrop(224) +
flip, deterministic in (seed, epoch, index) (:class:`~flatbnn.data.imagefolder.ImageNetTrainDataset`). The paper
states no augmentation or resolution for Table 3: these are our choices (rows/fsam_t3.yaml).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from flatbnn.data.registry import DataBundle, DataOptions, finish_bundle, register_dataset
from flatbnn.data.imagefolder import IN_MEAN, IN_STD, ImageFileDataset, _select

SHAPE = (3, 224, 224)
CARS_FOLDER, CARS_CLASSES = "stanford_cars", 196
FLOWERS_FOLDER, FLOWERS_CLASSES = "flowers-102", 102
FLOWERS_SPLITS = {"train": ("trnid",), "trainval": ("trnid", "valid")}


def _loadmat(path: Path) -> dict:
    from scipy.io import loadmat

    return loadmat(str(path), squeeze_me=True)


def _find(root: Any, folder: str, required: tuple[str, ...]) -> Path | None:
    root = Path(os.path.expanduser(str(root)))
    for cand in (root / folder, root):
        if all((cand / r).exists() for r in required):
            return cand
    return None


def _image_sets(opts: DataOptions, folder: Path, train: tuple[list[str], np.ndarray], test: tuple[list[str], np.ndarray],
                num_classes: int) -> tuple[ImageFileDataset, ImageFileDataset]:
    mk = lambda files, labels: ImageFileDataset(folder, files, labels, IN_MEAN, IN_STD, resize=256, crop=224)  # noqa: E731
    return (mk(*_select(train[0], train[1], opts.train_subset, num_classes)),
            mk(*_select(test[0], test[1], opts.test_subset, num_classes)))


# --------------------------------------------------------------------------- Stanford Cars

CARS_REQUIRED = ("devkit/cars_meta.mat", "devkit/cars_train_annos.mat", "cars_test_annos_withlabels.mat",
                 "cars_train", "cars_test")


def cars_not_found_message(root: Any, key: str = "dataset.root") -> str:
    return (f"Stanford Cars not found under '{root}': expected {root}/{CARS_FOLDER}/{{devkit/cars_meta.mat, "
            "devkit/cars_train_annos.mat, cars_train/, cars_test_annos_withlabels.mat, cars_test/}} (torchvision "
            f"StanfordCars layout; not downloaded by flatbnn); set {key} to the folder holding {CARS_FOLDER}")


def _cars_split(folder: Path, annos: Path, images: str) -> tuple[list[str], np.ndarray]:
    entries = np.atleast_1d(_loadmat(annos)["annotations"])
    pairs = sorted((int(a["class"]) - 1, str(a["fname"])) for a in entries)  # canonical: by class, then file
    return [f"{images}/{f}" for _, f in pairs], np.asarray([c for c, _ in pairs], dtype=np.int64)


def load_stanford_cars(root: Any, key: str = "dataset.root"):
    folder = _find(root, CARS_FOLDER, CARS_REQUIRED)
    if folder is None:
        raise FileNotFoundError(cars_not_found_message(root, key))
    classes = [str(c) for c in np.atleast_1d(_loadmat(folder / "devkit" / "cars_meta.mat")["class_names"])]
    train = _cars_split(folder, folder / "devkit" / "cars_train_annos.mat", "cars_train")
    test = _cars_split(folder, folder / "cars_test_annos_withlabels.mat", "cars_test")
    for name, (_, labels) in (("train", train), ("test", test)):
        if len(labels) and (labels.min() < 0 or labels.max() >= len(classes)):
            raise ValueError(f"Stanford Cars at {folder}: {name} classes outside 1..{len(classes)}")
    return folder, train, test, classes


@register_dataset("stanford_cars", augment="imagenet", augments=("none", "imagenet"), loaders=("cpu",),
                  num_classes=CARS_CLASSES, input_shape=SHAPE)
def build_stanford_cars(opts: DataOptions) -> DataBundle:
    folder, train, test, classes = load_stanford_cars(opts.root)
    if len(classes) != CARS_CLASSES:
        raise ValueError(f"Stanford Cars at {folder}: cars_meta.mat lists {len(classes)} classes, expected {CARS_CLASSES}")
    tr, te = _image_sets(opts, folder, train, test, CARS_CLASSES)
    return finish_bundle(opts, tr, te, num_classes=CARS_CLASSES,
                         meta={"classes": tuple(classes), "layout": "torchvision StanfordCars", "root": str(opts.root)})


# --------------------------------------------------------------------------- Oxford Flowers-102

FLOWERS_REQUIRED = ("jpg", "imagelabels.mat", "setid.mat")


def flowers_not_found_message(root: Any, key: str = "dataset.root") -> str:
    return (f"Flowers-102 not found under '{root}': expected {root}/{FLOWERS_FOLDER}/{{jpg/image_00001.jpg ..., "
            "imagelabels.mat, setid.mat}} (torchvision Flowers102 layout; 102flowers.tgz, imagelabels.mat and "
            "setid.mat from https://www.robots.ox.ac.uk/~vgg/data/flowers/102/); set "
            f"{key} to the folder holding {FLOWERS_FOLDER}")


def load_flowers102(root: Any, train_split: str = "trainval", key: str = "dataset.root"):
    if train_split not in FLOWERS_SPLITS:
        raise ValueError(f"flowers102: train_split must be one of {list(FLOWERS_SPLITS)}, got {train_split!r}")
    folder = _find(root, FLOWERS_FOLDER, FLOWERS_REQUIRED)
    if folder is None:
        raise FileNotFoundError(flowers_not_found_message(root, key))
    labels = np.atleast_1d(_loadmat(folder / "imagelabels.mat")["labels"]).astype(np.int64) - 1  # index = id - 1
    setid = _loadmat(folder / "setid.mat")

    def split(names) -> tuple[list[str], np.ndarray]:
        ids = sorted(int(i) for n in names for i in np.atleast_1d(setid[n]))
        pairs = sorted((int(labels[i - 1]), i) for i in ids)  # canonical: by class, then image id
        files = [f"jpg/image_{i:05d}.jpg" for _, i in pairs]
        missing = [f for f in files[:1] + files[-1:] if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"Flowers-102 at {folder}: missing {folder / missing[0]}; extract 102flowers.tgz "
                                    f"there (jpg/) and point {key} at it")
        return files, np.asarray([c for c, _ in pairs], dtype=np.int64)

    return folder, split(FLOWERS_SPLITS[train_split]), split(("tstid",))


@register_dataset("flowers102", augment="imagenet", augments=("none", "imagenet"), loaders=("cpu",),
                  num_classes=FLOWERS_CLASSES, input_shape=SHAPE)
def build_flowers102(opts: DataOptions, train_split: str = "trainval") -> DataBundle:
    folder, train, test = load_flowers102(opts.root, train_split)
    tr, te = _image_sets(opts, folder, train, test, FLOWERS_CLASSES)
    return finish_bundle(opts, tr, te, num_classes=FLOWERS_CLASSES,
                         meta={"layout": "torchvision Flowers102", "train_split": train_split, "root": str(opts.root)})
