"""Tensor-backed data sets, deterministic augmentation and fixed subset selection.

* :class:`ArrayDataset` holds uint8 images ``[N, H, W, C]`` (or float features ``[N, D]``)
  and int64 targets; it scales and normalises per channel in ``__getitem__`` and returns
  ``(FloatTensor [C, H, W], int)``.
* :class:`AugmentedDataset` wraps a train set with random crop (zero padding) + horizontal
  flip whose randomness is a deterministic function of ``(seed, epoch, index)``: each item
  draws from its own ``torch.Generator`` seeded with a 63-bit hash of the three numbers. So a
  DDP rank and a single process see the same augmented image for the same index, and a run
  resumed mid-epoch reproduces the remaining batches exactly. The epoch lives in a
  shared-memory tensor, so ``set_epoch`` also reaches persistent DataLoader workers.
* :class:`AutoAugmentCutoutDataset` (``augment: autoaugment_cutout``, FSAM section 5.1): the same
  crop + flip, then torchvision's AutoAugment (CIFAR-10 policy) and Cutout (one 16x16 square,
  zeroed after normalisation = the mean pixel). torchvision's AutoAugment draws from torch's
  global RNG and takes no generator, so each item runs it inside ``torch.random.fork_rng`` with
  the CPU default generator seeded from ``(seed, epoch, index)``: deterministic, and the caller's
  RNG stream is untouched. Cost: ~0.5 ms per 32x32 item on one CPU core (AutoAugment on the PIL
  image; the fork/seed/restore is ~0.02 ms of it) against ~0.1 ms for crop_flip, i.e. ~25 s of
  CPU per CIFAR epoch: use DataLoader workers (trainer.num_workers).
* :class:`CropFlipCutoutDataset` (``augment: crop_flip_cutout``, davda54/sam's CIFAR pipeline, VariationalSAM):
  crop + flip, then Cutout (16x16, zeroed after normalisation) on half of the items.
* :func:`balanced_subset` / :func:`holdout_split` pick subsets and validation hold-outs with
  fixed RNGs that do not depend on the run seed, so runs compare on the same data;
  :func:`symmetric_label_noise` corrupts a fixed, exact fraction of training labels.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "AUGMENTATIONS",
    "ArrayDataset",
    "AugmentedDataset",
    "AutoAugmentCutoutDataset",
    "CropFlipCutoutDataset",
    "make_train_set",
    "symmetric_label_noise",
    "sub_seed",
    "check_augment",
    "aug_seed",
    "balanced_subset",
    "holdout_split",
]

AUGMENTATIONS = ("none", "crop_flip", "crop_flip_cutout", "autoaugment_cutout", "imagenet")
#: presets for in-memory / decoded images of fixed size (CIFAR-like); "imagenet" needs image files
ARRAY_AUGMENTATIONS = ("none", "crop_flip", "crop_flip_cutout", "autoaugment_cutout")

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _to_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().contiguous()
    return torch.from_numpy(np.ascontiguousarray(x))


class ArrayDataset(Dataset):
    """In-memory data set of images ``[N, H, W, C]`` (``[N, H, W]`` = one channel) or features ``[N, D]``.

    ``x = (raw / scale - mean) / std`` per channel (per feature for ``[N, D]``); ``scale``
    defaults to 255 for uint8 and 1 otherwise; ``mean``/``std`` default to 0/1.
    """

    def __init__(
        self,
        images: Any,
        targets: Any,
        mean: Sequence[float] | float | None = None,
        std: Sequence[float] | float | None = None,
        scale: float | None = None,
    ) -> None:
        images = _to_tensor(images)
        if images.ndim == 3:
            images = images.unsqueeze(-1)
        if images.ndim not in (2, 4):
            raise ValueError(f"images must be [N,H,W,C], [N,H,W] or [N,D]; got shape {tuple(images.shape)}")
        targets = _to_tensor(targets).to(torch.int64).reshape(-1)
        if len(targets) != len(images):
            raise ValueError(f"{len(images)} images but {len(targets)} targets")
        self.images = images
        self.targets = targets
        self.scale = float(scale if scale is not None else (255.0 if images.dtype == torch.uint8 else 1.0))
        width = images.shape[-1]
        self.mean = self._stat(mean, 0.0, width)
        self.std = self._stat(std, 1.0, width)
        if bool((self.std <= 0).any()):
            raise ValueError("std must be positive")
        # x = raw * _mul + _add  ==  (raw / scale - mean) / std
        self._mul = 1.0 / (self.scale * self.std)
        self._add = -self.mean / self.std

    def _stat(self, value: Any, default: float, width: int) -> torch.Tensor:
        t = torch.as_tensor(default if value is None else value, dtype=torch.float32).reshape(-1)
        if t.numel() == 1:
            t = t.expand(width).clone()
        if t.numel() != width:
            raise ValueError(f"mean/std has {t.numel()} entries but the data has {width} channels")
        return t.reshape(-1, 1, 1) if self.images.ndim == 4 else t

    # ---------------------------------------------------------------- properties
    @property
    def is_image(self) -> bool:
        return self.images.ndim == 4

    @property
    def item_shape(self) -> tuple[int, ...]:
        """Shape of one returned ``x``: ``(C, H, W)`` for images, ``(D,)`` for features."""
        if self.is_image:
            _, h, w, c = self.images.shape
            return (int(c), int(h), int(w))
        return (int(self.images.shape[1]),)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def set_epoch(self, epoch: int) -> None:  # no randomness: nothing to do
        pass

    # ---------------------------------------------------------------- access
    def raw(self, index: int) -> torch.Tensor:
        """The stored item in model layout but not normalised: ``[C, H, W]`` (uint8 for images) or ``[D]``."""
        x = self.images[int(index)]
        return x.permute(2, 0, 1) if self.is_image else x

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        """``[..., C, H, W]`` (or ``[..., D]``) raw values -> normalised float32."""
        return torch.addcmul(self._add, raw.to(torch.float32), self._mul)

    def subset(self, indices: Any) -> "ArrayDataset":
        """A new data set of the rows ``indices`` (same normalisation)."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        out = ArrayDataset.__new__(ArrayDataset)
        out.__dict__.update(self.__dict__)
        out.images, out.targets = self.images[idx], self.targets[idx].clone()
        return out

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        return self.normalize(self.raw(index)), int(self.targets[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        # Batched fetch used by DataLoader: one vectorised normalisation per batch.
        idx = np.asarray([int(i) for i in indices], dtype=np.int64)
        raw = torch.from_numpy(self.images.numpy()[idx])  # numpy gather: much cheaper than torch's
        if self.is_image:
            raw = raw.permute(0, 3, 1, 2)
        x = self.normalize(raw)
        ys = self.targets.numpy()[idx].tolist()
        return list(zip(x.unbind(0), ys))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={len(self)}, item_shape={self.item_shape}, dtype={self.images.dtype})"


def aug_seed(seed: int, epoch: int, index: int) -> int:
    """63-bit seed for the item ``index`` in ``epoch`` of a run with ``seed`` (platform independent)."""
    packed = struct.pack("<QQQ", int(seed) & _MASK64, int(epoch) & _MASK64, int(index) & _MASK64)
    digest = hashlib.blake2b(packed, digest_size=8, person=b"flatbnn.aug").digest()
    return int.from_bytes(digest, "little") & _MASK63


def sub_seed(seed: int, stream: str) -> int:
    """An independent 63-bit seed derived from ``seed`` for the named random ``stream``."""
    packed = struct.pack("<Q", int(seed) & _MASK64) + stream.encode()
    digest = hashlib.blake2b(packed, digest_size=8, person=b"flatbnn.sub").digest()
    return int.from_bytes(digest, "little") & _MASK63


def call_with_torch_seed(seed: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` with torch's global CPU generator seeded with ``seed``; the caller's RNG state
    (CPU only: CUDA generators are neither touched nor forked) is restored afterwards.

    Only the CPU default generator is seeded (not ``torch.manual_seed``, which would also reseed
    every CUDA generator and so change dropout/noise streams of a GPU run).
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(seed))
        return fn(*args, **kwargs)


class AugmentedDataset(Dataset):
    """Train-time wrapper: random crop of the zero-padded image + horizontal flip (standard CIFAR).

    Padding is applied to the raw pixels (0 = black), before normalisation, exactly like
    ``RandomCrop(size, padding=4)`` on a PIL image followed by ``Normalize``. The crop offset
    and flip of item ``i`` come from ``torch.Generator().manual_seed(aug_seed(seed, epoch, i))``.
    """

    _AUGMENT = "crop_flip"

    def __init__(self, base: ArrayDataset, seed: int, augment: str = "crop_flip", padding: int = 4) -> None:
        if augment != self._AUGMENT:
            raise ValueError(f"{type(self).__name__} supports augment={self._AUGMENT!r}, got {augment!r}")
        if not base.is_image:
            raise ValueError("crop_flip needs image data")
        self.base = base
        self.seed = int(seed)
        self.augment = augment
        self.padding = int(padding)
        # Shared memory: DataLoader workers (also persistent ones) read the current epoch.
        self._epoch = torch.zeros(1, dtype=torch.int64)
        try:
            self._epoch.share_memory_()
        except RuntimeError:  # no shared memory: still correct for non-persistent workers
            pass

    # expose the base data for convenience (metrics, subset checks)
    @property
    def images(self) -> torch.Tensor:
        return self.base.images

    @property
    def targets(self) -> torch.Tensor:
        return self.base.targets

    @property
    def item_shape(self) -> tuple[int, ...]:
        return self.base.item_shape

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(int(epoch))

    def __len__(self) -> int:
        return len(self.base)

    def augment_params(self, index: int, epoch: int | None = None) -> tuple[int, int, bool]:
        """``(dy, dx, flip)`` used for ``index`` in ``epoch`` (default: the current epoch).

        ``dy, dx`` in ``[0, 2 * padding]`` index the crop window in the padded image;
        ``(padding, padding, False)`` is the identity.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        g = torch.Generator()
        g.manual_seed(aug_seed(self.seed, epoch, int(index)))
        offs = torch.randint(0, 2 * self.padding + 1, (2,), generator=g)
        flip = torch.randint(0, 2, (1,), generator=g)
        return int(offs[0]), int(offs[1]), bool(flip[0])

    def augment_raw(self, raw: torch.Tensor, dy: int, dx: int, flip: bool) -> torch.Tensor:
        """Crop ``[C, H, W]`` raw pixels at offset ``(dy, dx)`` of the zero-padded image, then flip."""
        c, h, w = raw.shape
        p = self.padding
        padded = raw.new_zeros((c, h + 2 * p, w + 2 * p))
        padded[:, p : p + h, p : p + w] = raw
        out = padded[:, dy : dy + h, dx : dx + w]
        if flip:
            out = out.flip(-1)
        return out

    def _aug_raw(self, index: int, epoch: int) -> torch.Tensor:
        if index < 0:
            index += len(self)
        return self.augment_raw(self.base.raw(index), *self.augment_params(index, epoch))

    def _item(self, index: int, epoch: int) -> torch.Tensor:
        """Normalised augmented ``x`` of ``index`` (subclasses add steps here)."""
        return self.base.normalize(self._aug_raw(index, epoch))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        if index < 0:
            index += len(self)
        return self._item(index, self.epoch), int(self.base.targets[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        epoch = self.epoch
        idx = [int(i) + len(self) if int(i) < 0 else int(i) for i in indices]
        if type(self)._item is AugmentedDataset._item:  # plain crop+flip: one batched normalisation
            x = self.base.normalize(torch.stack([self._aug_raw(i, epoch) for i in idx])).unbind(0)
        else:
            x = [self._item(i, epoch) for i in idx]
        ys = self.base.targets[torch.as_tensor(idx, dtype=torch.int64)].tolist()
        return list(zip(x, ys))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base!r}, augment={self.augment!r}, seed={self.seed}, epoch={self.epoch})"


def _cutout_center(self: AugmentedDataset, index: int, epoch: int | None = None,
                   p: float = 1.0) -> tuple[int, int] | None:
    """``(cy, cx)`` of the Cutout square of ``index`` in ``epoch`` (default: current epoch); None with probability
    1 - ``p`` (drawn first, from the same generator)."""
    epoch = self.epoch if epoch is None else int(epoch)
    _, h, w = self.item_shape
    g = torch.Generator().manual_seed(sub_seed(aug_seed(self.seed, epoch, int(index)), "cutout"))
    if p < 1.0 and float(torch.rand(1, generator=g)) >= p:
        return None
    return int(torch.randint(0, h, (1,), generator=g)), int(torch.randint(0, w, (1,), generator=g))


def _zero_square(x: torch.Tensor, center: tuple[int, int], size: int) -> None:
    """Sets the ``size`` x ``size`` square around ``center`` (clipped at the borders) of ``x`` to 0, in place."""
    cy, cx = center
    h, w = x.shape[-2:]
    half = size // 2
    x[..., max(cy - half, 0):min(cy + half, h), max(cx - half, 0):min(cx + half, w)] = 0.0


class AutoAugmentCutoutDataset(AugmentedDataset):
    """``augment: autoaugment_cutout`` (Fisher SAM section 5.1, as in the ASAM/FSAM CIFAR code):
    random crop (zero padding 4) + horizontal flip, AutoAugment with the CIFAR-10 policy
    (torchvision's, applied to the PIL image as the reference code does; fill 0), normalisation,
    then Cutout: one
    ``cutout`` x ``cutout`` square (centre uniform over the image, clipped at the borders) set
    to 0 in normalised space (= the per-channel mean pixel), as DeVries & Taylor's code does
    after ``Normalize``.

    All randomness is a function of ``(seed, epoch, index)``: the crop/flip are exactly those of
    the ``crop_flip`` preset; AutoAugment runs under :func:`call_with_torch_seed` with
    ``sub_seed(aug_seed(...), "autoaugment")``; the Cutout centre comes from a generator seeded
    with ``sub_seed(aug_seed(...), "cutout")``.
    """

    _AUGMENT = "autoaugment_cutout"

    def __init__(self, base: Any, seed: int, augment: str = "autoaugment_cutout", padding: int = 4,
                 cutout: int = 16) -> None:
        super().__init__(base, seed=seed, augment=augment, padding=padding)
        from torchvision.transforms import AutoAugment, AutoAugmentPolicy

        self.cutout = int(cutout)
        self.autoaugment = AutoAugment(AutoAugmentPolicy.CIFAR10)

    def _autoaugment_pil(self, raw: torch.Tensor) -> torch.Tensor:
        """AutoAugment on the PIL image (as the reference code's CIFAR10Policy; ~10x faster than
        torchvision's tensor path on 32x32 images) -> uint8 ``[C, H, W]``."""
        from PIL import Image

        arr = raw.permute(1, 2, 0).numpy()
        im = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
        out = torch.from_numpy(np.asarray(self.autoaugment(im), dtype=np.uint8).copy())
        return out.unsqueeze(0) if out.ndim == 2 else out.permute(2, 0, 1)

    cutout_center = _cutout_center

    def _item(self, index: int, epoch: int) -> torch.Tensor:
        if index < 0:
            index += len(self)
        raw = self._aug_raw(index, epoch)
        s = sub_seed(aug_seed(self.seed, epoch, index), "autoaugment")
        raw = call_with_torch_seed(s, self._autoaugment_pil, raw)
        x = self.base.normalize(raw)
        if self.cutout > 0:
            _zero_square(x, self.cutout_center(index, epoch), self.cutout)
        return x


class CropFlipCutoutDataset(AugmentedDataset):
    """``augment: crop_flip_cutout``: the CIFAR pipeline of davda54/sam (``example/data/cifar.py``), which the
    VariationalSAM authors' notebooks train with -- random crop (zero padding 4) + horizontal flip, normalisation,
    then Cutout with probability ``p`` (0.5): one ``cutout`` x ``cutout`` (16) square, centre uniform over the
    image, clipped at the borders, set to 0 in normalised space. The crop/flip are exactly the ``crop_flip``
    preset's; whether and where the square goes come from a generator seeded with
    ``sub_seed(aug_seed(...), "cutout")`` (a function of seed, epoch and index)."""

    _AUGMENT = "crop_flip_cutout"

    def __init__(self, base: Any, seed: int, augment: str = "crop_flip_cutout", padding: int = 4,
                 cutout: int = 16, p: float = 0.5) -> None:
        super().__init__(base, seed=seed, augment=augment, padding=padding)
        self.cutout, self.p = int(cutout), float(p)

    def cutout_center(self, index: int, epoch: int | None = None) -> tuple[int, int] | None:
        """``(cy, cx)`` of the square of ``index`` in ``epoch``, or None when this item keeps its pixels."""
        return _cutout_center(self, index, epoch, p=self.p)

    def _item(self, index: int, epoch: int) -> torch.Tensor:
        x = self.base.normalize(self._aug_raw(index, epoch))
        center = self.cutout_center(index, epoch)
        if center is not None and self.cutout > 0:
            _zero_square(x, center, self.cutout)
        return x


def check_augment(dataset: str, augment: Any, allowed: Sequence[str] = ARRAY_AUGMENTATIONS) -> str:
    augment = "none" if augment in (None, False) else str(augment)
    if augment not in allowed:
        raise ValueError(f"{dataset}: augment must be one of {list(allowed)}, got {augment!r}")
    return augment


def make_train_set(base: Any, augment: str, seed: int) -> Dataset:
    """``base`` itself for ``"none"`` (it has a no-op ``set_epoch``), else the preset's wrapper:
    ``crop_flip`` -> :class:`AugmentedDataset`, ``autoaugment_cutout`` ->
    :class:`AutoAugmentCutoutDataset`, ``imagenet`` -> :class:`flatbnn.data.imagefolder.ImageNetTrainDataset`
    (made by ``ImageFileDataset.imagenet_train_set``)."""
    if augment == "none":
        return base
    if augment == "crop_flip":
        return AugmentedDataset(base, seed=seed, augment=augment)
    if augment == "crop_flip_cutout":
        return CropFlipCutoutDataset(base, seed=seed)
    if augment == "autoaugment_cutout":
        return AutoAugmentCutoutDataset(base, seed=seed)
    if augment == "imagenet":
        # the image-file data set makes its own wrapper: this generic helper imports no data set (no import cycle)
        imagenet_train_set = getattr(base, "imagenet_train_set", None)
        if imagenet_train_set is None:
            raise ValueError("augment='imagenet' needs an image-file data set (imagenet)")
        return imagenet_train_set(seed)
    raise ValueError(f"unknown augment {augment!r}; one of {list(AUGMENTATIONS)}")


# --------------------------------------------------------------------------- label noise

LABEL_NOISE_SEED = 20220717  # fixed stream; the run seed never enters


def symmetric_label_noise(labels: Any, rate: float, num_classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(noisy_labels, mask)``: exactly ``round(rate * n)`` labels, chosen uniformly without
    replacement, are replaced by a uniformly drawn *different* class (symmetric noise, FSAM
    Table 4). The RNG is ``default_rng([LABEL_NOISE_SEED, seed])``, independent of the run seed."""
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"label_noise must be a fraction in [0, 1), got {rate}")
    if rate > 0 and num_classes < 2:
        raise ValueError("label noise needs at least 2 classes")
    n = len(labels)
    k = int(round(rate * n))
    rng = np.random.default_rng([LABEL_NOISE_SEED, int(seed)])
    idx = rng.choice(n, size=k, replace=False) if k else np.zeros(0, dtype=np.int64)
    shift = rng.integers(1, num_classes, size=k) if k else np.zeros(0, dtype=np.int64)
    noisy = labels.copy()
    noisy[idx] = (labels[idx] + shift) % int(num_classes)
    mask = np.zeros(n, dtype=bool)
    mask[idx] = True
    return noisy, mask


# --------------------------------------------------------------------------- subsets

def balanced_subset(labels: Any, n: int | None, seed: int = 0, num_classes: int | None = None) -> np.ndarray:
    """Sorted indices of ``n`` examples, as class-balanced as the data allows.

    Each class gets ``n // C`` examples, ``n % C`` randomly chosen classes one more; a class
    with too few examples gives its shortfall to the others. Which examples are taken
    depends only on ``seed`` and the per-class counts (not on ``n``), and growing ``n``
    gives supersets. ``n=None`` returns all indices.
    """
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    total = len(labels)
    if n is None:
        return np.arange(total, dtype=np.int64)
    n = int(n)
    if not 0 < n <= total:
        raise ValueError(f"subset size must be in [1, {total}], got {n}")
    c = int(num_classes if num_classes is not None else (labels.max() + 1 if total else 0))
    members = [np.flatnonzero(labels == k) for k in range(c)]
    counts = np.array([len(m) for m in members])
    rng = np.random.default_rng(seed)
    order = rng.permutation(c)  # which classes get the remainder
    perms = [rng.permutation(len(m)) for m in members]
    quota = np.full(c, n // c, dtype=np.int64)
    quota[order[: n % c]] += 1
    # redistribute shortfalls round-robin (in the fixed random class order)
    short = int(np.maximum(quota - counts, 0).sum())
    quota = np.minimum(quota, counts)
    while short > 0:
        for k in order:
            if short and quota[k] < counts[k]:
                quota[k] += 1
                short -= 1
    picked = [m[np.sort(p[:q])] for m, p, q in zip(members, perms, quota)]
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)


def holdout_split(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(keep, held_out)``: the last ``k`` of a fixed permutation of ``range(n)`` are held out (both sorted)."""
    n, k = int(n), int(k or 0)
    if not 0 <= k < n:
        raise ValueError(f"val_split must be in [0, {n - 1}] (number of held-out training examples), got {k}")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[: n - k]), np.sort(perm[n - k :])
