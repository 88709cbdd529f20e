"""Image-file data sets decoded lazily with PIL: Tiny ImageNet and ImageNet.

* ``tinyimagenet`` (200 classes, 64x64): the official layout
  ``<root>/tiny-imagenet-200/{wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG,
  val/val_annotations.txt}`` (``root`` may also be the ``tiny-imagenet-200`` folder). The labelled
  ``val`` split is the test set (the official ``test`` split has no labels). Class index = rank of
  the wnid in sorted order (= ``ImageFolder`` on ``train/``).
* ``imagenet`` (ILSVRC-2012, 1000 classes): ImageFolder layout ``<root>/train/<wnid>/*`` and
  ``<root>/val/<wnid>/*`` (the validation images sorted into class folders, e.g. with the
  widely used ``valprep.sh``), the val split being the test set. Train items: RandomResizedCrop(224)
  (scale 0.08-1, ratio 3/4-4/3, bilinear) + horizontal flip (``augment: imagenet``); test/val
  items: Resize(256) (shorter side) + CenterCrop(224).

Images are decoded in ``__getitem__`` (never held in memory as arrays); the file list is a
numpy bytes array (no per-file Python objects, so forked DataLoader workers share it).
Random augmentation is a deterministic function of ``(seed, epoch, index)`` as everywhere in
flatbnn: torchvision's ``RandomResizedCrop.get_params`` draws from torch's global RNG, so it runs
under :func:`~flatbnn.data.transforms.call_with_torch_seed`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from flatbnn.data.registry import DataBundle, DataOptions, finish_bundle, register_dataset
from flatbnn.data.ood import register_test_loader
from flatbnn.data.transforms import aug_seed, balanced_subset, call_with_torch_seed, sub_seed

IMAGE_EXTS = {".jpeg", ".jpg", ".png", ".bmp"}
SUBSET_SEED = 0


class ImageFileDataset(Dataset):
    """Images decoded from files on access; the same ``raw``/``normalize``/``targets``/``subset``
    interface as :class:`~flatbnn.data.transforms.ArrayDataset`, so the crop/flip and AutoAugment
    wrappers work on it unchanged.

    ``raw(i)`` is uint8 ``[C, H, W]``: the decoded RGB image, resized to ``size`` (``(H, W)``,
    bilinear) if it differs, or -- with ``resize``/``crop`` -- Resize(resize) of the shorter side
    followed by CenterCrop(crop).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        files: Sequence[str] | np.ndarray,
        targets: Any,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        size: tuple[int, int] | None = None,
        resize: int | None = None,
        crop: int | None = None,
    ) -> None:
        if (size is None) == (crop is None):
            raise ValueError("give either size=(H, W) or resize/crop")
        self.root = str(root)
        files = np.asarray(files)
        self.files = files if files.dtype.kind == "S" else np.char.encode(files.astype(str), "utf-8")
        self.targets = torch.as_tensor(np.asarray(targets, dtype=np.int64))
        if len(self.files) != len(self.targets):
            raise ValueError(f"{len(self.files)} files but {len(self.targets)} targets")
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self.resize = None if resize is None else int(resize)
        self.crop = None if crop is None else int(crop)
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        self.scale = 255.0
        self._mul = 1.0 / (self.scale * self.std)
        self._add = -self.mean / self.std

    # ---------------------------------------------------------------- ArrayDataset interface
    is_image = True

    @property
    def item_shape(self) -> tuple[int, ...]:
        h, w = self.size if self.size is not None else (self.crop, self.crop)
        return (3, int(h), int(w))

    def __len__(self) -> int:
        return len(self.files)

    def set_epoch(self, epoch: int) -> None:
        pass

    def path(self, index: int) -> str:
        return os.path.join(self.root, self.files[int(index)].decode("utf-8"))

    def decode(self, index: int):
        """The image ``index`` as an RGB PIL image (no resizing)."""
        from PIL import Image

        with Image.open(self.path(index)) as im:
            return im.convert("RGB")

    def raw(self, index: int) -> torch.Tensor:
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as TF

        img = self.decode(index)
        if self.size is not None:
            if (img.height, img.width) != self.size:
                img = img.resize((self.size[1], self.size[0]), resample=2)  # PIL.Image.BILINEAR
        else:
            img = TF.center_crop(TF.resize(img, self.resize, interpolation=InterpolationMode.BILINEAR), self.crop)
        return TF.pil_to_tensor(img)

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self._add, raw.to(torch.float32), self._mul)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        return self.normalize(self.raw(index)), int(self.targets[index])

    def imagenet_train_set(self, seed: int) -> "ImageNetTrainDataset":
        """``augment: imagenet`` of this set (transforms.make_train_set calls it)."""
        return ImageNetTrainDataset(self, seed=seed)

    def subset(self, indices: Any) -> "ImageFileDataset":
        idx = np.asarray(indices, dtype=np.int64)
        out = ImageFileDataset.__new__(ImageFileDataset)
        out.__dict__.update(self.__dict__)
        out.files = self.files[idx]
        out.targets = self.targets[torch.as_tensor(idx)].clone()
        return out

    def decode_all(self) -> np.ndarray:
        """All ``raw`` images as uint8 ``[N, H, W, C]`` (for small sets, e.g. as an OOD set)."""
        return np.stack([self.raw(i).permute(1, 2, 0).numpy() for i in range(len(self))]) if len(self) else \
            np.zeros((0, *self.item_shape[1:], 3), dtype=np.uint8)

    def __repr__(self) -> str:
        return f"ImageFileDataset(n={len(self)}, root={self.root!r}, item_shape={self.item_shape})"


class ImageNetTrainDataset(Dataset):
    """``augment: imagenet``: RandomResizedCrop(size) + horizontal flip of the decoded image,
    deterministic in ``(seed, epoch, index)`` (see the module docstring)."""

    def __init__(self, base: ImageFileDataset, seed: int, size: int = 224,
                 scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.base = base
        self.seed = int(seed)
        self.augment = "imagenet"
        self.size = int(size)
        self.scale, self.ratio = tuple(scale), tuple(ratio)
        self._epoch = torch.zeros(1, dtype=torch.int64)
        try:
            self._epoch.share_memory_()
        except RuntimeError:
            pass

    @property
    def targets(self) -> torch.Tensor:
        return self.base.targets

    @property
    def item_shape(self) -> tuple[int, ...]:
        return (3, self.size, self.size)

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(int(epoch))

    def __len__(self) -> int:
        return len(self.base)

    def augment_params(self, index: int, img: Any, epoch: int | None = None) -> tuple[int, int, int, int, bool]:
        """``(top, left, height, width, flip)`` of the crop of ``img`` (PIL) for ``index``."""
        from torchvision.transforms import RandomResizedCrop

        epoch = self.epoch if epoch is None else int(epoch)
        s = aug_seed(self.seed, epoch, int(index))
        i, j, h, w = call_with_torch_seed(sub_seed(s, "rrc"), RandomResizedCrop.get_params, img,
                                          list(self.scale), list(self.ratio))
        g = torch.Generator().manual_seed(s)
        flip = bool(torch.randint(0, 2, (1,), generator=g)[0])
        return int(i), int(j), int(h), int(w), flip

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as TF

        index = int(index)
        if index < 0:
            index += len(self)
        img = self.base.decode(index)
        i, j, h, w, flip = self.augment_params(index, img)
        img = TF.resized_crop(img, i, j, h, w, [self.size, self.size], interpolation=InterpolationMode.BILINEAR)
        raw = TF.pil_to_tensor(img)
        if flip:
            raw = raw.flip(-1)
        return self.base.normalize(raw), int(self.base.targets[index])

    def __repr__(self) -> str:
        return f"ImageNetTrainDataset({self.base!r}, seed={self.seed}, epoch={self.epoch})"


# --------------------------------------------------------------------------- listing helpers

def _images_in(folder: Path) -> list[str]:
    with os.scandir(folder) as it:
        return sorted(e.name for e in it if e.is_file() and not e.name.startswith(".")
                      and os.path.splitext(e.name)[1].lower() in IMAGE_EXTS)


def _class_dirs(folder: Path) -> list[str]:
    with os.scandir(folder) as it:
        return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))


def _select(files: list[str], labels: np.ndarray, n: int | None, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    sel = balanced_subset(labels, n, seed=SUBSET_SEED, num_classes=num_classes)
    return np.asarray(files, dtype=object)[sel].astype(str), labels[sel]


# --------------------------------------------------------------------------- Tiny ImageNet

TIN_FOLDER = "tiny-imagenet-200"
TIN_NUM_CLASSES = 200
TIN_SHAPE = (3, 64, 64)
TIN_MEAN = (0.4802, 0.4481, 0.3975)
TIN_STD = (0.2302, 0.2265, 0.2262)


def locate_tinyimagenet(root: Any) -> Path | None:
    root = Path(os.path.expanduser(str(root)))
    for cand in (root / TIN_FOLDER, root):
        if (cand / "wnids.txt").is_file() and (cand / "train").is_dir() and (cand / "val").is_dir():
            return cand
    return None


def tin_not_found_message(root: Any, key: str = "dataset.root") -> str:
    return (f"Tiny ImageNet not found under '{root}': expected {root}/{TIN_FOLDER}/{{wnids.txt, "
            "train/<wnid>/images/*.JPEG, val/images/*.JPEG, val/val_annotations.txt}; get "
            "tiny-imagenet-200.zip from http://cs231n.stanford.edu/tiny-imagenet-200.zip and unzip it; "
            f"set {key} to the folder holding {TIN_FOLDER}")


def load_tinyimagenet(root: Any, train_subset: int | None = None, test_subset: int | None = None,
                      key: str = "dataset.root", splits: Sequence[str] = ("train", "test")
                      ) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]], list[str]]:
    """``(folder, {split: (relative files, labels)}, wnids)``; test = the labelled val split."""
    folder = locate_tinyimagenet(root)
    if folder is None:
        raise FileNotFoundError(tin_not_found_message(root, key))
    wnids = sorted({w.strip() for w in (folder / "wnids.txt").read_text().split() if w.strip()})
    if len(wnids) != TIN_NUM_CLASSES:
        raise ValueError(f"Tiny ImageNet at {folder}: wnids.txt lists {len(wnids)} classes, expected {TIN_NUM_CLASSES}")
    index = {w: i for i, w in enumerate(wnids)}
    out = {}
    if "train" in splits:
        files, labels = [], []
        for w in wnids:
            d = folder / "train" / w / "images"
            if not d.is_dir():
                raise FileNotFoundError(f"Tiny ImageNet at {folder}: missing {d} (class {w} of wnids.txt); "
                                        f"re-extract tiny-imagenet-200.zip and point {key} at it")
            names = _images_in(d)
            files += [f"train/{w}/images/{n}" for n in names]
            labels += [index[w]] * len(names)
        out["train"] = _select(files, np.asarray(labels, dtype=np.int64), train_subset, TIN_NUM_CLASSES)
    if "test" in splits:
        ann = folder / "val" / "val_annotations.txt"
        if not ann.is_file():
            raise FileNotFoundError(f"Tiny ImageNet at {folder}: missing {ann}; re-extract tiny-imagenet-200.zip "
                                    f"and point {key} at it")
        pairs = []
        for line in ann.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 2 and parts[0].strip():
                name, w = parts[0].strip(), parts[1].strip()
                if w not in index:
                    raise ValueError(f"{ann}: {name} has class {w!r}, not in wnids.txt")
                pairs.append((index[w], name))
        pairs.sort()  # canonical order: by class, then file name
        out["test"] = _select([f"val/images/{n}" for _, n in pairs], np.asarray([c for c, _ in pairs], dtype=np.int64),
                              test_subset, TIN_NUM_CLASSES)
    return folder, out, wnids


@register_test_loader("tinyimagenet")
def tinyimagenet_test_arrays(root: Any, *, subset: int | None = None, download: bool = False, cache_dir: Any = None,
                             key: str = "dataset.root") -> tuple[np.ndarray, np.ndarray]:
    folder, data, _ = load_tinyimagenet(root, None, subset, key=key, splits=("test",))
    ds = ImageFileDataset(folder, data["test"][0], data["test"][1], TIN_MEAN, TIN_STD, size=TIN_SHAPE[1:])
    return ds.decode_all(), data["test"][1]


# loader "cpu" only: images are decoded from files, so there is no array for the device loader
@register_dataset("tinyimagenet", augment="crop_flip", loaders=("cpu",), num_classes=TIN_NUM_CLASSES,
                  input_shape=TIN_SHAPE)
def build_tinyimagenet(opts: DataOptions) -> DataBundle:
    """Tiny ImageNet; ``download`` is not offered (see the FileNotFoundError for the source)."""
    folder, data, wnids = load_tinyimagenet(opts.root, opts.train_subset, opts.test_subset)
    mk = lambda split: ImageFileDataset(folder, data[split][0], data[split][1], TIN_MEAN, TIN_STD,  # noqa: E731
                                        size=TIN_SHAPE[1:])
    return finish_bundle(opts, mk("train"), mk("test"), num_classes=TIN_NUM_CLASSES,
                         meta={"classes": tuple(wnids), "layout": "tiny-imagenet-200", "root": str(opts.root)})


# --------------------------------------------------------------------------- ImageNet

IN_NUM_CLASSES = 1000
IN_SHAPE = (3, 224, 224)
IN_MEAN = (0.485, 0.456, 0.406)
IN_STD = (0.229, 0.224, 0.225)


def locate_imagenet(root: Any) -> Path | None:
    root = Path(os.path.expanduser(str(root)))
    for cand in (root, root / "imagenet", root / "ILSVRC2012"):
        if (cand / "train").is_dir() and (cand / "val").is_dir():
            return cand
    return None


def in_not_found_message(root: Any, key: str = "dataset.root") -> str:
    return (f"ImageNet not found under '{root}': expected {root}/train/<wnid>/*.JPEG and {root}/val/<wnid>/*.JPEG "
            "(ImageFolder layout, validation images sorted into class folders); get ILSVRC2012_img_train.tar and "
            "ILSVRC2012_img_val.tar from https://image-net.org/download.php (registration required); "
            f"set {key} to the folder holding train/ and val/")


def load_imagenet_listing(root: Any, train_subset: int | None = None, test_subset: int | None = None,
                          key: str = "dataset.root", num_classes: int | None = None
                          ) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]], list[str]]:
    folder = locate_imagenet(root)
    if folder is None:
        raise FileNotFoundError(in_not_found_message(root, key))
    classes = _class_dirs(folder / "train")
    if not classes:
        raise FileNotFoundError(f"ImageNet at {folder}: train/ has no class folders; {in_not_found_message(root, key)}")
    index = {c: i for i, c in enumerate(classes)}
    val_classes = _class_dirs(folder / "val")
    extra = sorted(set(val_classes) - set(classes))
    if extra:
        raise ValueError(f"ImageNet at {folder}: val/ has class folders not in train/: {extra[:5]}")
    if not val_classes:
        raise FileNotFoundError(f"ImageNet at {folder}: val/ has no class folders (sort the validation images into "
                                f"val/<wnid>/ first); set {key} accordingly")
    out = {}
    c = len(classes)
    for split, src, n in (("train", classes, train_subset), ("test", val_classes, test_subset)):
        files, labels = [], []
        sub = "train" if split == "train" else "val"
        for w in src:
            names = _images_in(folder / sub / w)
            files += [f"{sub}/{w}/{f}" for f in names]
            labels += [index[w]] * len(names)
        out[split] = _select(files, np.asarray(labels, dtype=np.int64), n, c)
    return folder, out, classes


# num_classes/input_shape not declared: the class count is that of the data (build_dataset checks the bundle)
@register_dataset("imagenet", augment="imagenet", augments=("none", "imagenet"), loaders=("cpu",))
def build_imagenet(opts: DataOptions) -> DataBundle:
    """ImageNet (ILSVRC-2012) in ImageFolder layout; the number of classes is that of ``train/``
    (1000 for the real data set) and must match ``num_classes`` when the config gives it."""
    folder, data, classes = load_imagenet_listing(opts.root, opts.train_subset, opts.test_subset)
    opts.check_expected(len(classes), IN_SHAPE)  # already here: fail before the hold-out and OOD sets
    mk = lambda split: ImageFileDataset(folder, data[split][0], data[split][1], IN_MEAN, IN_STD,  # noqa: E731
                                        resize=256, crop=224)
    return finish_bundle(opts, mk("train"), mk("test"), num_classes=len(classes),
                         meta={"classes": tuple(classes), "layout": "imagefolder", "root": str(opts.root)})
