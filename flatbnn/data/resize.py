"""``dataset.image_size``: serve every item of a data set at ``S x S`` pixels (e.g. CIFAR at 224 for an
ImageNet-pretrained ViT, Fisher SAM Table 3).

Items are resized on access (bilinear, no antialiasing: upsampling) AFTER the data set's own augmentation
(CIFAR's crop/flip or AutoAugment+Cutout act at 32 px, as in the usual CIFAR fine-tuning pipelines) and after
normalisation (bilinear resizing commutes with the per-channel affine normalisation). Nothing is stored at the
large size: 50k CIFAR images at 224 px would take 7.5 GB as uint8.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class ResizedDataset(Dataset):
    """``base[i]`` resized to ``(C, size, size)``; ``targets``/``set_epoch`` are the base's."""

    def __init__(self, base: Any, size: int) -> None:
        self.base = base
        self.size = int(size)
        if self.size < 1:
            raise ValueError(f"image_size must be >= 1, got {size}")

    @property
    def targets(self) -> torch.Tensor:
        return self.base.targets

    @property
    def item_shape(self) -> tuple[int, ...]:
        return (int(self.base.item_shape[0]), self.size, self.size)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.base, "set_epoch"):
            self.base.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x, y = self.base[index]
        x = torch.as_tensor(x)
        if tuple(x.shape[-2:]) != (self.size, self.size):
            x = F.interpolate(x[None].float(), size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        return x, y

    def __repr__(self) -> str:
        return f"ResizedDataset({self.base!r}, size={self.size})"


def resize_bundle(bundle: Any, size: int | None) -> Any:
    """Wrap every image set of ``bundle`` (train, test, val, OOD, shift) in :class:`ResizedDataset`."""
    if size in (None, 0):
        return bundle
    wrap = lambda ds: None if ds is None else ResizedDataset(ds, size)  # noqa: E731
    bundle.train, bundle.test, bundle.val = wrap(bundle.train), wrap(bundle.test), wrap(bundle.val)
    bundle.ood = {k: wrap(v) for k, v in bundle.ood.items()}
    bundle.shift = {k: wrap(v) for k, v in bundle.shift.items()}
    bundle.input_shape = (int(bundle.input_shape[0]), int(size), int(size))
    bundle.meta = dict(bundle.meta, image_size=int(size))
    return bundle
