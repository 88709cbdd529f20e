"""Label noise, the autoaugment_cutout preset, the GPU-resident DeviceLoader (checked on CPU tensors) and the
common data set keys (DataOptions, parsed once by build_dataset)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from flatbnn.data import build_dataset
from flatbnn.data.cifar import MEAN, STD
from flatbnn.data.device_loader import DeviceLoader
from flatbnn.data.transforms import (ArrayDataset, AugmentedDataset, AutoAugmentCutoutDataset, CropFlipCutoutDataset,
                                     aug_seed, symmetric_label_noise)
from flatbnn.engine.distributed import ResumableSampler


def _images(n=64, seed=0, hw=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, hw, hw, 3), dtype=torch.uint8, generator=g)


def _base(n=64, seed=0):
    return ArrayDataset(_images(n, seed), torch.arange(n) % 10, mean=MEAN, std=STD)


# --------------------------------------------------------------------------- label noise

def test_symmetric_label_noise_exact_and_fixed():
    labels = np.repeat(np.arange(10), 100)
    for rate in (0.0, 0.2, 0.4, 0.8):
        noisy, mask = symmetric_label_noise(labels, rate, 10)
        assert mask.sum() == round(rate * 1000)  # exact fraction
        assert np.all(noisy[mask] != labels[mask]) and np.array_equal(noisy[~mask], labels[~mask])
        n2, m2 = symmetric_label_noise(labels, rate, 10)
        assert np.array_equal(noisy, n2) and np.array_equal(mask, m2)  # deterministic
    # new labels uniform over the 9 other classes
    noisy, mask = symmetric_label_noise(labels, 0.9, 10)
    shift = (noisy[mask] - labels[mask]) % 10
    counts = np.bincount(shift, minlength=10)
    assert counts[0] == 0 and counts[1:].min() > 60 and counts[1:].max() < 140
    assert not np.array_equal(symmetric_label_noise(labels, 0.2, 10, seed=1)[1], symmetric_label_noise(labels, 0.2, 10)[1])
    with pytest.raises(ValueError):
        symmetric_label_noise(labels, 1.0, 10)


def test_label_noise_in_bundle_train_only_independent_of_run_seed():
    b = build_dataset("digits", label_noise=0.25, val_split=100, seed=0)
    meta = b.meta
    n = len(b.train)
    assert meta["noisy_mask"].shape == (n,) and meta["noisy_mask"].sum() == round(0.25 * n)
    assert meta["label_noise"]["num_noisy"] == round(0.25 * n)
    noisy = b.train.targets.numpy()
    clean = meta["clean_targets"]
    assert np.array_equal(noisy != clean, meta["noisy_mask"])
    ref = build_dataset("digits", val_split=100, seed=0)
    assert np.array_equal(clean, ref.train.targets.numpy())  # the clean labels are the usual ones
    assert torch.equal(b.val.targets, ref.val.targets) and torch.equal(b.test.targets, ref.test.targets)
    other = build_dataset("digits", label_noise=0.25, val_split=100, seed=123)  # another run seed
    assert torch.equal(other.train.targets, b.train.targets)
    assert not build_dataset("digits").meta["noisy_mask"].any()  # always recorded


# --------------------------------------------------------------------------- autoaugment + cutout

def test_autoaugment_cutout_deterministic_per_seed_epoch_index():
    a = AutoAugmentCutoutDataset(_base(), seed=3)
    b = AutoAugmentCutoutDataset(_base(), seed=3)
    for epoch in (0, 2):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        xs = [a[i][0] for i in range(16)]
        assert all(torch.equal(xs[i], b[i][0]) for i in reversed(range(16)))  # any access order
    batch = a.__getitems__([5, 2, 9])
    assert all(torch.equal(x, a[i][0]) for (x, _), i in zip(batch, [5, 2, 9]))
    # changes with epoch and seed
    a.set_epoch(0)
    e0 = [a[i][0] for i in range(16)]
    a.set_epoch(1)
    assert sum(not torch.equal(x, a[i][0]) for i, x in enumerate(e0)) >= 12
    c = AutoAugmentCutoutDataset(_base(), seed=4)
    assert sum(not torch.equal(x, c[i][0]) for i, x in enumerate(e0)) >= 12
    # the caller's RNG streams are untouched
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a[7]
    assert torch.equal(state, torch.get_rng_state())


def test_cutout_square_and_crop_flip_of_the_preset():
    ds = AutoAugmentCutoutDataset(_base(), seed=1)
    for i in range(20):
        x, _ = ds[i]
        cy, cx = ds.cutout_center(i)
        y0, y1, x0, x1 = max(cy - 8, 0), min(cy + 8, 32), max(cx - 8, 0), min(cx + 8, 32)
        assert torch.all(x[:, y0:y1, x0:x1] == 0)  # zero in normalised space = the mean pixel
        assert 0 < (y1 - y0) * (x1 - x0) <= 256
    # crop/flip draws are those of crop_flip (same (seed, epoch, index) stream)
    cf = AugmentedDataset(_base(), seed=1)
    assert [ds.augment_params(i, 2) for i in range(10)] == [cf.augment_params(i, 2) for i in range(10)]
    b = build_dataset("digits")  # digits: no augmentation at all
    with pytest.raises(ValueError, match="augment"):
        build_dataset("digits", augment="autoaugment_cutout")
    assert b.meta["augment"] == "none"


def test_crop_flip_cutout_is_davda54_sams_pipeline_crop_flip_then_cutout_on_half_the_items(tmp_path):
    """VariationalSAM's notebooks (davda54/sam Cifar): crop + flip, Normalize, Cutout(16, p=0.5): an item either
    equals its crop_flip image exactly, or that image with one clipped 16x16 square set to 0 (the mean pixel)."""
    ds, cf = CropFlipCutoutDataset(_base(400), seed=1), AugmentedDataset(_base(400), seed=1)
    ds.set_epoch(3)
    cf.set_epoch(3)
    cut = 0
    for i in range(400):
        x, plain, center = ds[i][0], cf[i][0], ds.cutout_center(i)
        if center is None:
            assert torch.equal(x, plain)
            continue
        cut += 1
        cy, cx = center
        mask = torch.zeros(32, 32, dtype=torch.bool)
        mask[max(cy - 8, 0):min(cy + 8, 32), max(cx - 8, 0):min(cx + 8, 32)] = True
        assert torch.all(x[:, mask] == 0) and torch.equal(x[:, ~mask], plain[:, ~mask])
    assert 160 <= cut <= 240  # p = 0.5 of 400 (binomial sd 10)
    batch = ds.__getitems__([5, 2, 9])
    assert all(torch.equal(x, ds[i][0]) for (x, _), i in zip(batch, [5, 2, 9]))
    from test_data_fixtures import write_cifar10_torchvision
    b = build_dataset("cifar10", root=str(write_cifar10_torchvision(tmp_path / "c10")), augment="crop_flip_cutout")
    assert isinstance(b.train, CropFlipCutoutDataset) and b.meta["augment"] == "crop_flip_cutout"
    with pytest.raises(ValueError, match="DeviceLoader"):  # the GPU loader's crop+flip is not this
        DeviceLoader(ds, batch_size=8, device="cpu")


# --------------------------------------------------------------------------- DeviceLoader

def _cpu_batches(ds, batch, seed, epoch, world=1, rank=0):
    s = ResumableSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    s.set_epoch(epoch)
    return list(DataLoader(ds, batch_size=batch, sampler=s))


@pytest.mark.parametrize("world", [1, 3])
def test_device_loader_without_augmentation_equals_cpu_path(world):
    ds = _base(n=70)  # not divisible by the batch or the world size
    for rank in range(world):
        dl = DeviceLoader(ds, 16, device="cpu", seed=5, num_replicas=world, rank=rank)
        for epoch in (0, 3):
            dl.set_epoch(epoch)
            got, want = list(dl), _cpu_batches(ds, 16, 5, epoch, world, rank)
            assert len(dl) == len(got) == len(want)
            for (x, y), (xc, yc) in zip(got, want):
                assert torch.equal(x, xc) and torch.equal(y, yc) and y.dtype == torch.int64  # bitwise
    assert DeviceLoader(ds, 16, drop_last=True).__len__() == 4


def test_device_loader_crop_flip_distribution_and_content():
    base = _base(n=400)
    aug = AugmentedDataset(base, seed=2)
    dl = DeviceLoader(aug, 50, device="cpu")
    assert dl.augment == "crop_flip" and dl.seed == 2 and dl.padding == 4 and dl.batch_size == 50
    dys, dxs, flips = [], [], []
    for epoch in range(10):
        dy, dx, fl = dl.augment_params(epoch)
        dys.append(dy)
        dxs.append(dx)
        flips.append(fl)
    dy, dx, fl = torch.cat(dys), torch.cat(dxs), torch.cat(flips)
    for off in (dy, dx):  # uniform over 0..8: 4000 draws, ~444 each
        counts = torch.bincount(off, minlength=9)
        assert len(counts) == 9 and counts.min() > 340 and counts.max() < 550
    assert abs(fl.float().mean().item() - 0.5) < 0.04
    assert abs(torch.corrcoef(torch.stack([dy.float(), dx.float()]))[0, 1].item()) < 0.06
    # same law as the CPU path's per-item draws
    cpu = torch.tensor([aug.augment_params(i, e) for e in range(10) for i in range(400)])
    assert abs(cpu[:, 0].float().mean() - dy.float().mean()) < 0.25 and abs(cpu[:, 2].float().mean() - fl.float().mean()) < 0.05
    # each batch item is the crop/flip of the zero-padded image at its offsets, normalised as on the CPU
    dl.set_epoch(4)
    dy, dx, fl = dl.augment_params(4)
    idx = dl.indices(4)
    x, y = next(iter(dl))
    for k in range(0, 50, 7):
        i = int(idx[k])
        want = base.normalize(aug.augment_raw(base.raw(i), int(dy[i]), int(dx[i]), bool(fl[i])))
        assert torch.equal(x[k], want) and int(y[k]) == int(base.targets[i])


def test_device_loader_epochs_skip_and_sampler_view():
    dl = DeviceLoader(AugmentedDataset(_base(n=100), seed=0), 16, device="cpu")
    dl.set_epoch(1)
    full = list(dl)
    dl.set_epoch(1)
    again = list(dl)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, again))
    dl.set_epoch(2)
    assert not torch.equal(next(iter(dl))[0], full[0][0])
    # mid-epoch resume: skip batches once
    dl.set_epoch(1)
    dl.skip = 3
    rest = list(dl)
    assert len(rest) == len(full) - 3 and all(torch.equal(a[0], b[0]) for a, b in zip(rest, full[3:]))
    assert dl.skip == 0 and len(list(dl)) == len(full)
    # the engine's Trainer sets sampler.skip in samples and calls sampler.set_epoch
    view = dl.sampler
    view.set_epoch(1)
    view.skip = 2 * 16
    assert dl.epoch == 1 and dl.skip == 2 and view.skip == 32
    with pytest.raises(ValueError):
        view.skip = 5
    # what it refuses
    with pytest.raises(ValueError, match="DeviceLoader"):
        DeviceLoader(AutoAugmentCutoutDataset(_base(), seed=0), 8)
    with pytest.raises(ValueError, match="loader must be one of"):
        build_dataset("digits", loader="gpu")
    with pytest.raises(ValueError):
        DeviceLoader(_base(), 8, num_replicas=2, rank=2)


def test_loader_key_validated_by_builders(tmp_path):
    from test_data_fixtures import write_cifar10_torchvision

    root = write_cifar10_torchvision(tmp_path / "c10")
    b = build_dataset("cifar10", root=str(root), loader="device", augment="crop_flip", seed=7)
    assert b.meta["loader"] == "device"
    dl = DeviceLoader(b.train, 8)
    assert dl.seed == 7 and next(iter(dl))[0].shape == (8, 3, 32, 32)
    with pytest.raises(ValueError, match="loader=device"):
        build_dataset("cifar10", root=str(root), loader="device", augment="autoaugment_cutout")
    assert aug_seed(1, 2, (1 << 64) - 1) != aug_seed(1, 2, 0)


# --------------------------------------------------------------------------- common keys (DataOptions)

@pytest.fixture
def registry(monkeypatch):
    """A throw-away copy of the data set registry (test data sets do not leak into other tests)."""
    import flatbnn.data as data
    from flatbnn.data import registry as data_registry

    monkeypatch.setattr(data_registry, "_REGISTRY", dict(data_registry._REGISTRY))
    return data


def _tiny_bundle(opts, num_classes=4):
    from flatbnn.data import make_bundle

    x = np.arange(40 * 4 * 4, dtype=np.uint8).reshape(40, 4, 4, 1)
    y = np.arange(40) % num_classes
    return make_bundle(opts, (x, y), (x[:8], y[:8]), num_classes=num_classes, mean=[0.5], std=[0.25], scale=255.0)


def test_common_keys_parsed_once_and_own_keys_passed(registry):
    from flatbnn.data import DataOptions

    seen = {}

    @registry.register_dataset("tiny_opts", augment="crop_flip", loaders=("cpu",), num_classes=4,
                               input_shape=(1, 4, 4))
    def build_tiny(opts: DataOptions, extra: int = 3):
        seen.update(opts=opts, extra=extra)
        return _tiny_bundle(opts)

    with pytest.warns(UserWarning, match=r"tiny_opts: ignoring unknown dataset arguments \['zzz'\]"):
        b = registry.build_dataset("tiny_opts", seed="5", val_split=None, label_noise=None, download=1, zzz=1,
                                   num_classes=4, input_shape=[1, 4, 4])
    opts = seen["opts"]
    assert isinstance(opts, DataOptions) and seen["extra"] == 3  # own key: its default
    assert (opts.name, opts.root, opts.augment, opts.loader) == ("tiny_opts", "data", "crop_flip", "cpu")
    assert (opts.seed, opts.val_split, opts.label_noise, opts.label_noise_seed, opts.download) == (5, 0, 0.0, 0, True)
    assert b.name == "tiny_opts" and b.meta["augment"] == "crop_flip" and isinstance(b.train, AugmentedDataset)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 1
    registry.build_dataset("tiny_opts", extra=7, augment=None)
    assert seen["extra"] == 7 and seen["opts"].augment == "none"

    seen.clear()
    with pytest.raises(ValueError, match=r"loader must be one of \['cpu'\]"):
        registry.build_dataset("tiny_opts", loader="device")
    with pytest.raises(ValueError, match="tiny_opts: config says num_classes=5 but the data has 4"):
        registry.build_dataset("tiny_opts", num_classes=5)
    with pytest.raises(ValueError, match=r"config says input_shape=\[3, 4, 4\]"):
        registry.build_dataset("tiny_opts", input_shape=[3, 4, 4])
    assert not seen  # declared shapes: checked before the builder reads any data


def test_undeclared_shapes_are_checked_on_the_bundle(registry):
    calls = []

    @registry.register_dataset("tiny_data_classes")
    def build_tiny(opts):
        calls.append(opts)
        return _tiny_bundle(opts, num_classes=2)

    assert registry.build_dataset("tiny_data_classes", num_classes=2, input_shape=[1, 4, 4]).num_classes == 2
    with pytest.raises(ValueError, match="config says num_classes=3 but the data has 2"):
        registry.build_dataset("tiny_data_classes", num_classes=3)
    with pytest.raises(ValueError, match="augment must be one of"):
        registry.build_dataset("tiny_data_classes", augment="imagenet")
    assert len(calls) == 2


def test_register_dataset_refuses_bad_declarations(registry):
    with pytest.raises(ValueError, match="common keys"):
        registry.register_dataset("tiny_bad")(lambda opts, root=None: None)
    with pytest.raises(ValueError, match="both num_classes and input_shape"):
        registry.register_dataset("tiny_bad", num_classes=3)(lambda opts: None)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_dataset("digits")(lambda opts: None)
