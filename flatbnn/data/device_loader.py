"""GPU-resident training loader for small in-memory image sets (CIFAR-10/100, SVHN, MNIST, ...).

``dataset.loader: device`` asks the engine to use :class:`DeviceLoader` instead of a
``DataLoader`` for the TRAIN set: the whole uint8 train set is copied to the device once, and each
batch is gathered, randomly cropped (zero padding) + flipped and normalised there -- no worker
processes, no host-to-device copies per step.

Equal IN DISTRIBUTION to the CPU path, not bitwise:

* order: the permutation of epoch ``e`` is ``torch.randperm(N, generator=Generator().manual_seed(seed + e))``,
  padded and strided over ``num_replicas`` exactly like ``DistributedSampler(drop_last=False)``
  (what the engine's ``ResumableSampler`` uses), so the batches hold the SAME indices in the SAME
  order as the CPU path;
* augmentation: the crop offsets ``(dy, dx)`` (uniform in ``[0, 2 * padding]``) and flips
  (probability 1/2) of all N items of epoch ``e`` are drawn at once from a CPU generator seeded
  with ``aug_seed(seed, e, 2**64 - 1)`` and indexed by dataset index -- a function of
  ``(seed, epoch, index)`` again (independent of the sharding and of ``skip``), but not the
  per-item draws of :class:`~flatbnn.data.transforms.AugmentedDataset`;
* with ``augment: none`` the batches are exactly (bitwise on the CPU) the normalised images the
  CPU path yields, in the same order.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from flatbnn.data.transforms import ArrayDataset, AugmentedDataset, aug_seed

__all__ = ["DeviceLoader"]

_EPOCH_STREAM = (1 << 64) - 1  # the "index" used to seed the per-epoch augmentation draw


class _SamplerView:
    """What the engine's ``Trainer.fit`` expects of its sampler: ``set_epoch(epoch)`` and a
    ``skip`` in SAMPLES (``step_in_epoch * loader.batch_size``), forwarded to the loader in batches."""

    def __init__(self, loader: "DeviceLoader") -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    @property
    def skip(self) -> int:
        return self._loader.skip * self._loader.batch_size

    @skip.setter
    def skip(self, samples: int) -> None:
        samples = int(samples)
        if samples % self._loader.batch_size:
            raise ValueError(f"skip of {samples} samples is not a whole number of batches of {self._loader.batch_size}")
        self._loader.skip = samples // self._loader.batch_size

    def __len__(self) -> int:
        return self._loader.num_samples


class DeviceLoader:
    """Iterate ``(x, y)`` training batches built on ``device``.

    Args:
        dataset: the bundle's train set: an :class:`ArrayDataset` of uint8 images (``augment: none``)
            or an :class:`AugmentedDataset` with ``crop_flip`` around one. Other wrappers
            (``autoaugment_cutout``, image-file sets) raise ``ValueError``.
        batch_size: batch size PER REPLICA (the engine's ``trainer.batch_size // world_size``).
        device: where images, batches and the augmentation live (``"cuda"``, ``"cpu"``, ...).
        seed: the run seed (permutation ``seed + epoch`` as DistributedSampler; augmentation
            ``aug_seed(seed, epoch, .)``). Default: the train set's own ``seed`` if it has one, else 0.
        shuffle: permute each epoch (else dataset order).
        drop_last: drop this replica's last incomplete batch.
        num_replicas, rank: shard like ``DistributedSampler`` (default: 1 replica, rank 0).
        augment: ``"none"`` | ``"crop_flip"``; default: that of ``dataset``.
        padding: zero padding of the random crop; default: the dataset's (4).

    Attributes: ``batch_size``, ``skip`` (batches to skip at the start of the next iteration, then
    reset to 0 -- for a mid-epoch resume), ``epoch``, ``num_samples`` (this replica's samples per
    epoch), ``sampler`` (a view with ``set_epoch``/``skip`` in samples, so ``Trainer.fit(loader,
    sampler=loader.sampler, ...)`` works unchanged), ``dataset``.

    ``len(loader)`` is the number of batches of a FULL epoch on this replica (like the
    ``DataLoader`` the engine builds before any skip).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        device: Any = "cpu",
        seed: int | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        augment: str | None = None,
        padding: int | None = None,
    ) -> None:
        if isinstance(dataset, AugmentedDataset) and type(dataset) is AugmentedDataset:
            base, ds_augment, ds_padding = dataset.base, dataset.augment, dataset.padding
        elif isinstance(dataset, ArrayDataset):
            base, ds_augment, ds_padding = dataset, "none", 4
        else:
            raise ValueError(
                f"DeviceLoader needs an in-memory image train set (ArrayDataset, or crop_flip around one); "
                f"got {type(dataset).__name__} -- use dataset.loader=cpu for this data set / augmentation")
        if not isinstance(base, ArrayDataset) or not base.is_image:
            raise ValueError("DeviceLoader needs in-memory image data ([N, H, W, C])")
        self.augment = ds_augment if augment is None else str(augment)
        if self.augment not in ("none", "crop_flip"):
            raise ValueError(f"DeviceLoader supports augment none|crop_flip, got {self.augment!r}")
        self.dataset = dataset
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        if self.batch_size <= 0:
            raise ValueError("batch_size must be positive")
        self.seed = int(getattr(dataset, "seed", 0) if seed is None else seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.num_replicas = 1 if num_replicas is None else int(num_replicas)
        self.rank = 0 if rank is None else int(rank)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} not in [0, {self.num_replicas})")
        self.padding = int(ds_padding if padding is None else padding)
        self.epoch = 0
        self.skip = 0
        # the data, once, on the device (zero-padded once for crop_flip: no per-batch padding)
        p = self.padding if self.augment == "crop_flip" else 0
        h, w = base.images.shape[1:3]
        self._padded = torch.nn.functional.pad(base.images.to(self.device), (0, 0, p, p, p, p))
        self.images = self._padded[:, p:p + h, p:p + w]  # uint8 [N, H, W, C] (a view)
        self.targets = base.targets.to(self.device)
        self._mul = base._mul.to(self.device)  # [C, 1, 1]
        self._add = base._add.to(self.device)
        self.n = int(self.images.shape[0])
        self.num_samples = math.ceil(self.n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.sampler = _SamplerView(self)

    # ---------------------------------------------------------------- sampler part
    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This replica's dataset indices for ``epoch`` (CPU int64), as ``DistributedSampler`` orders them."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm = torch.randperm(self.n, generator=g)
        else:
            perm = torch.arange(self.n)
        pad = self.total_size - self.n
        if pad > 0:
            reps = math.ceil(pad / self.n)
            perm = torch.cat([perm, perm.repeat(reps)[:pad]])
        return perm[self.rank:self.total_size:self.num_replicas]

    def augment_params(self, epoch: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dy, dx, flip)`` for every dataset index in ``epoch`` (CPU tensors of length N)."""
        epoch = self.epoch if epoch is None else int(epoch)
        g = torch.Generator()
        g.manual_seed(aug_seed(self.seed, epoch, _EPOCH_STREAM))
        offs = torch.randint(0, 2 * self.padding + 1, (self.n, 2), generator=g)
        flip = torch.randint(0, 2, (self.n,), generator=g).bool()
        return offs[:, 0], offs[:, 1], flip

    # ---------------------------------------------------------------- batches
    def _crop_flip(self, bi: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """Items ``bi`` cropped at ``(dy, dx)`` from the zero-padded images and flipped: uint8 ``[B, H, W, C]``."""
        h, w = self.images.shape[1:3]
        ar_h = torch.arange(h, device=self.device)
        ar_w = torch.arange(w, device=self.device)
        rows = dy[:, None] + ar_h[None, :]  # [B, H]
        cols = dx[:, None] + torch.where(flip[:, None], ar_w.flip(0)[None, :], ar_w[None, :])  # [B, W]
        return self._padded[bi[:, None, None], rows[:, :, None], cols[:, None, :]]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        skip, self.skip = int(self.skip), 0
        idx = self.indices().to(self.device)
        if self.augment == "crop_flip":
            dy, dx, flip = (t.to(self.device) for t in self.augment_params())
        for k in range(skip, len(self)):
            bi = idx[k * self.batch_size:(k + 1) * self.batch_size]
            if self.augment == "crop_flip":
                raw = self._crop_flip(bi, dy[bi], dx[bi], flip[bi])
            else:
                raw = self._padded[bi]  # [B, H, W, C] (no padding without crop_flip)
            x = torch.addcmul(self._add, raw.permute(0, 3, 1, 2).to(torch.float32), self._mul)
            yield x, self.targets[bi]

    def __repr__(self) -> str:
        return (f"DeviceLoader(n={self.n}, batch_size={self.batch_size}, device={self.device}, augment={self.augment!r}, "
                f"replica={self.rank}/{self.num_replicas}, epoch={self.epoch})")
