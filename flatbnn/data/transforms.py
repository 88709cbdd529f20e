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
* :func:`balanced_subset` / :func:`holdout_split` pick subsets and validation hold-outs with
  fixed RNGs that do not depend on the run seed, so runs compare on the same data.
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
    "make_train_set",
    "check_augment",
    "aug_seed",
    "balanced_subset",
    "holdout_split",
]

AUGMENTATIONS = ("none", "crop_flip")

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


class AugmentedDataset(Dataset):
    """Train-time wrapper: random crop of the zero-padded image + horizontal flip (standard CIFAR).

    Padding is applied to the raw pixels (0 = black), before normalisation, exactly like
    ``RandomCrop(size, padding=4)`` on a PIL image followed by ``Normalize``. The crop offset
    and flip of item ``i`` come from ``torch.Generator().manual_seed(aug_seed(seed, epoch, i))``.
    """

    def __init__(self, base: ArrayDataset, seed: int, augment: str = "crop_flip", padding: int = 4) -> None:
        if augment != "crop_flip":
            raise ValueError(f"AugmentedDataset supports augment='crop_flip', got {augment!r}")
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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        if index < 0:
            index += len(self)
        x = self._aug_raw(index, self.epoch)
        return self.base.normalize(x), int(self.base.targets[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        epoch = self.epoch
        idx = [int(i) + len(self) if int(i) < 0 else int(i) for i in indices]
        raw = torch.stack([self._aug_raw(i, epoch) for i in idx])
        x = self.base.normalize(raw)
        ys = self.base.targets[torch.as_tensor(idx, dtype=torch.int64)].tolist()
        return list(zip(x.unbind(0), ys))

    def __repr__(self) -> str:
        return f"AugmentedDataset({self.base!r}, augment={self.augment!r}, seed={self.seed}, epoch={self.epoch})"


def check_augment(dataset: str, augment: Any, allowed: Sequence[str] = AUGMENTATIONS) -> str:
    augment = "none" if augment in (None, False) else str(augment)
    if augment not in allowed:
        raise ValueError(f"{dataset}: augment must be one of {list(allowed)}, got {augment!r}")
    return augment


def make_train_set(base: ArrayDataset, augment: str, seed: int) -> Dataset:
    """``base`` itself for ``"none"`` (it has a no-op ``set_epoch``), else an :class:`AugmentedDataset`."""
    if augment == "none":
        return base
    return AugmentedDataset(base, seed=seed, augment=augment)


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
