"""flatbnn.data: digits, CIFAR-10 layouts, subsets, caching and deterministic augmentation."""

from __future__ import annotations

import hashlib
import os
import pickle
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flatbnn.data import DataBundle, build_dataset, list_datasets
from flatbnn.data import cifar as cifar_mod
from flatbnn.data.transforms import (
    ArrayDataset,
    AugmentedDataset,
    aug_seed,
    balanced_subset,
    holdout_split,
)

REPO = Path(__file__).resolve().parents[1]
CLASSES = cifar_mod.CLASSES
N_TRAIN, N_TEST = 6, 3  # per class in the fake CIFAR trees


# --------------------------------------------------------------------------- registry

def test_registry_and_unknown_name():
    assert {"digits", "cifar10"} <= set(list_datasets())
    with pytest.raises(KeyError) as e:
        build_dataset("no_such_data")
    msg = str(e.value)
    assert "\n" not in msg and "digits" in msg and "cifar10" in msg


# --------------------------------------------------------------------------- digits

def test_digits_shapes_and_fixed_split():
    b = build_dataset("digits", seed=1, num_classes=10, input_shape=[1, 8, 8])
    assert isinstance(b, DataBundle) and b.name == "digits"
    assert (b.num_classes, b.input_shape) == (10, (1, 8, 8))
    assert len(b.train) == 1797 - 360 and len(b.test) == 360 and b.val is None and b.ood == {}
    x, y = b.train[0]
    assert x.dtype == torch.float32 and x.shape == (1, 8, 8) and isinstance(y, int)
    assert np.bincount(b.test.targets.numpy(), minlength=10).tolist() == [36] * 10
    # normalised with the train statistics
    xs = torch.stack([b.train[i][0] for i in range(len(b.train))])
    assert abs(xs.mean().item()) < 1e-4 and abs(xs.std().item() - 1) < 1e-3
    # split is fixed: independent of the run seed, disjoint, complete
    from flatbnn.data.digits import fixed_split

    tr, te = fixed_split()
    assert len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == 1797
    b2 = build_dataset("digits", seed=7)
    assert torch.equal(b.test.images, b2.test.images) and torch.equal(b.train.images, b2.train.images)
    assert torch.equal(b.test.targets, b2.test.targets)
    b.train.set_epoch(3)  # no-op but present


def test_digits_read_from_sklearns_file_equal_load_digits(monkeypatch):
    """The arrays read from scikit-learn's shipped CSV without importing it are load_digits' own, and the fallback
    through load_digits (a release that moved the file) gives the same (red if either path's parsing drifts)."""
    import sys

    from sklearn.datasets import load_digits

    from flatbnn.data import digits

    d = load_digits()
    digits.load_digits_arrays.cache_clear()
    try:
        assert digits._shipped_csv() is not None
        monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # the file path must not import it
        images, labels = digits.load_digits_arrays()
        monkeypatch.undo()
        assert np.array_equal(images, d.images.astype(np.uint8)) and np.array_equal(labels, d.target)
        assert images.dtype == np.uint8 and labels.dtype == np.int64 and images.shape == (1797, 8, 8)
        digits.load_digits_arrays.cache_clear()
        monkeypatch.setattr(digits, "_shipped_csv", lambda: None)
        fallback = digits.load_digits_arrays()
        assert np.array_equal(fallback[0], images) and np.array_equal(fallback[1], labels)
    finally:
        digits.load_digits_arrays.cache_clear()


def test_digits_subsets_val_and_errors():
    b = build_dataset("digits", train_subset=100, test_subset=50, val_split=20, seed=0)
    assert len(b.train) == 80 and len(b.val) == 20 and len(b.test) == 50
    assert np.bincount(b.test.targets.numpy(), minlength=10).tolist() == [5] * 10
    counts = np.bincount(torch.cat([b.train.targets, b.val.targets]).numpy(), minlength=10)
    assert counts.tolist() == [10] * 10
    b2 = build_dataset("digits", train_subset=100, test_subset=50, val_split=20, seed=123)
    assert torch.equal(b.val.images, b2.val.images) and torch.equal(b.train.images, b2.train.images)
    with pytest.raises(ValueError, match="augment"):
        build_dataset("digits", augment="crop_flip")
    with pytest.raises(ValueError, match="num_classes"):
        build_dataset("digits", num_classes=100)
    with pytest.raises(ValueError, match="input_shape"):
        build_dataset("digits", input_shape=[3, 32, 32])


# --------------------------------------------------------------------------- subsets

def test_balanced_subset_properties():
    labels = np.array([0] * 50 + [1] * 30 + [2] * 4)  # class 2 is short
    s = balanced_subset(labels, 12, seed=0)
    assert np.bincount(labels[s]).tolist() == [4, 4, 4]
    s = balanced_subset(labels, 13, seed=0)
    assert sorted(np.bincount(labels[s]).tolist()) == [4, 4, 5]
    s = balanced_subset(labels, 60, seed=0)  # class 2 can give only 4; the others take up the rest
    c = np.bincount(labels[s])
    assert c.tolist() == [28, 28, 4]
    assert np.all(np.diff(s) > 0)
    # fixed RNG: deterministic, nested as n grows
    small, big = balanced_subset(labels, 20, seed=0), balanced_subset(labels, 40, seed=0)
    assert np.array_equal(small, balanced_subset(labels, 20, seed=0)) and set(small) <= set(big)
    assert np.array_equal(balanced_subset(labels, None), np.arange(len(labels)))
    with pytest.raises(ValueError):
        balanced_subset(labels, 1000)
    keep, held = holdout_split(10, 3)
    assert len(held) == 3 and sorted(np.concatenate([keep, held]).tolist()) == list(range(10))
    assert np.array_equal(held, holdout_split(10, 3)[1])


# --------------------------------------------------------------------------- augmentation

def _aug_set(seed=0, n=64):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
    base = ArrayDataset(images, torch.arange(n) % 10, mean=cifar_mod.MEAN, std=cifar_mod.STD)
    return AugmentedDataset(base, seed=seed)


def test_augmentation_deterministic_per_seed_epoch_index():
    a, b = _aug_set(seed=5), _aug_set(seed=5)
    for epoch in (0, 3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        for i in (0, 7, 63):
            assert torch.equal(a[i][0], b[i][0])
    # the order of access does not matter (pure function of (seed, epoch, index))
    a.set_epoch(2)
    first = [a[i][0] for i in range(16)]
    assert all(torch.equal(first[i], a[i][0]) for i in reversed(range(16)))
    # changes with the epoch and with the seed
    p0 = [a.augment_params(i, epoch=0) for i in range(64)]
    p1 = [a.augment_params(i, epoch=1) for i in range(64)]
    assert sum(x != y for x, y in zip(p0, p1)) > 32
    c = _aug_set(seed=6)
    assert sum(a.augment_params(i, 0) != c.augment_params(i, 0) for i in range(64)) > 32
    assert aug_seed(1, 2, 3) == aug_seed(1, 2, 3) != aug_seed(1, 3, 2)
    assert 0 <= aug_seed(2**70, -1, 5) < 2**63
    # the parameters cover the whole range
    allp = [a.augment_params(i, e) for i in range(64) for e in range(4)]
    assert {p[0] for p in allp} == set(range(9)) and {p[2] for p in allp} == {False, True}
    # batched fetch (DataLoader's __getitems__) matches item-wise fetch
    batch = a.__getitems__([3, 1, 4])
    assert all(torch.equal(x, a[i][0]) and y == a[i][1] for (x, y), i in zip(batch, [3, 1, 4]))


def test_augmentation_is_a_crop_of_the_zero_padded_image():
    ds = _aug_set(seed=11)
    base = ds.base
    ds.set_epoch(4)
    for i in range(0, 64, 5):
        x, y = ds[i]
        assert y == int(base.targets[i])
        raw = base.images[i].permute(2, 0, 1)  # uint8 [C, H, W]
        padded = F.pad(raw, (4, 4, 4, 4))  # zeros
        dy, dx, flip = ds.augment_params(i)
        expect = padded[:, dy : dy + 32, dx : dx + 32]
        if flip:
            expect = expect.flip(-1)
        assert torch.equal(x, base.normalize(expect))
        # de-normalised, the output is exactly those raw pixels (zeros where the padding shows)
        back = x * base.std + base.mean
        assert torch.allclose(back * 255, expect.float(), atol=1e-3)
    # (padding, padding, no flip) is the identity
    assert torch.equal(ds.augment_raw(base.raw(0), 4, 4, False), base.raw(0))
    # test/val sets are never augmented
    assert torch.equal(base[5][0], base.normalize(base.raw(5)))


def test_augmented_set_pickles_and_reaches_persistent_workers():
    ds = _aug_set(seed=3, n=32)
    ds.set_epoch(2)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.epoch == 2 and torch.equal(clone[9][0], ds[9][0])

    def expected(epoch):
        ds.set_epoch(epoch)
        return torch.stack([ds[i][0] for i in range(len(ds))])

    want = {e: expected(e) for e in (0, 1)}
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)
    for epoch in (0, 1, 0):
        ds.set_epoch(epoch)
        got = torch.cat([x for x, _ in loader])
        assert torch.equal(got, want[epoch])


# --------------------------------------------------------------------------- fake CIFAR trees

def _fake_image(split: str, c: int, j: int) -> np.ndarray:
    img = np.random.default_rng([0 if split == "train" else 1, c, j]).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    img[0, 0, 0], img[0, 0, 1] = c, j  # label and index are readable from the pixels
    return img


def _fake_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Canonical order (class, then index), as the image folders sort."""
    n = N_TRAIN if split == "train" else N_TEST
    pairs = [(c, j) for c in range(10) for j in range(n)]
    return np.stack([_fake_image(split, c, j) for c, j in pairs]), np.array([c for c, _ in pairs])


def _write_folder_tree(root: Path) -> Path:
    from PIL import Image

    for split in ("train", "test"):
        n = N_TRAIN if split == "train" else N_TEST
        for c, name in enumerate(CLASSES):
            d = root / split / name
            d.mkdir(parents=True)
            for j in range(n):
                Image.fromarray(_fake_image(split, c, j)).save(d / f"{j:04d}.png")
    return root


def _write_torchvision(root: Path) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def interleaved(split):  # classes interleaved as in the real files; per-class order kept
        n = N_TRAIN if split == "train" else N_TEST
        pairs = [(c, j) for j in range(n) for c in range(10)]
        data = np.stack([_fake_image(split, c, j).transpose(2, 0, 1).reshape(-1) for c, j in pairs])
        return data, [c for c, _ in pairs]

    data, labels = interleaved("train")
    for b, idx in enumerate(np.array_split(np.arange(len(labels)), 5)):
        entry = {"batch_label": f"training batch {b + 1} of 5", "data": data[idx], "labels": [labels[i] for i in idx]}
        with open(folder / f"data_batch_{b + 1}", "wb") as f:
            pickle.dump(entry, f)
    data, labels = interleaved("test")
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"batch_label": "testing batch 1 of 1", "data": data, "labels": labels}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(CLASSES), "num_cases_per_batch": 10}, f)
    return root


@pytest.fixture(scope="module")
def fake_cifar(tmp_path_factory):
    base = tmp_path_factory.mktemp("fake_cifar")
    tree = _write_folder_tree(base / "folders")
    nested = base / "nested"
    nested.mkdir()
    (nested / "cifar10_jpeg").symlink_to(tree, target_is_directory=True)
    archive = base / "archives" / "cifar10_jpeg.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(tree, arcname="cifar10_jpeg")
    return {
        "folder": tree,
        "nested": nested,
        "archive": archive,
        "archive_dir": archive.parent,
        "torchvision": _write_torchvision(base / "tv"),
        "base": base,
    }


def _load(root, tmp_path, **kw):
    kw.setdefault("cache_dir", tmp_path / "cache")
    kw.setdefault("augment", "none")
    return build_dataset("cifar10", root=str(root), **kw)


@pytest.mark.parametrize("layout", ["torchvision", "folder", "nested", "archive", "archive_dir"])
def test_cifar_layouts_load_with_correct_labels(fake_cifar, tmp_path, layout):
    b = _load(fake_cifar[layout], tmp_path, num_classes=10, input_shape=[3, 32, 32])
    assert (b.num_classes, b.input_shape, b.name) == (10, (3, 32, 32), "cifar10")
    assert b.meta["classes"] == CLASSES
    for split, ds in (("train", b.train), ("test", b.test)):
        want_x, want_y = _fake_split(split)
        assert torch.equal(ds.images, torch.from_numpy(want_x))
        assert torch.equal(ds.targets, torch.from_numpy(want_y))
        # the label is written into pixel (0, 0, red)
        assert torch.equal(ds.images[:, 0, 0, 0].long(), ds.targets)
    x, y = b.test[4]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and isinstance(y, int)
    mean, std = torch.tensor(cifar_mod.MEAN).view(3, 1, 1), torch.tensor(cifar_mod.STD).view(3, 1, 1)
    assert torch.allclose(x, (b.test.images[4].permute(2, 0, 1) / 255.0 - mean) / std, atol=1e-6)


def test_cifar_subsets_balanced_fixed_and_same_across_layouts(fake_cifar, tmp_path):
    kw = dict(train_subset=20, test_subset=10)
    bundles = {k: _load(fake_cifar[k], tmp_path, **kw, seed=s)
               for s, k in enumerate(["torchvision", "folder", "archive"])}
    for b in bundles.values():
        assert np.bincount(b.train.targets.numpy(), minlength=10).tolist() == [2] * 10
        assert np.bincount(b.test.targets.numpy(), minlength=10).tolist() == [1] * 10
        assert torch.equal(b.train.images, bundles["folder"].train.images)  # same subset everywhere
        assert torch.equal(b.test.images, bundles["folder"].test.images)
    b = _load(fake_cifar["folder"], tmp_path, train_subset=25, val_split=5)
    assert len(b.train) == 20 and len(b.val) == 5
    all_idx = torch.cat([b.train.images, b.val.images])[:, 0, 0, :2]  # (label, index) pairs
    assert len({tuple(p.tolist()) for p in all_idx}) == 25
    # augmentation only on train
    b = build_dataset("cifar10", root=str(fake_cifar["folder"]), augment="crop_flip", seed=1,
                      cache_dir=tmp_path / "c", val_split=4)
    assert isinstance(b.train, AugmentedDataset) and not isinstance(b.test, AugmentedDataset)
    assert not isinstance(b.val, AugmentedDataset)
    with pytest.raises(ValueError, match="augment"):
        _load(fake_cifar["folder"], tmp_path, augment="mixup")


def test_cifar_archive_decodes_only_the_subset_and_caches(fake_cifar, tmp_path, monkeypatch):
    decoded = []
    real_decode = cifar_mod.decode_image

    def counting(data, what="image"):
        decoded.append(what)
        return real_decode(data, what)

    monkeypatch.setattr(cifar_mod, "decode_image", counting)
    cache = tmp_path / "cache"
    b = _load(fake_cifar["archive"], tmp_path, train_subset=10, test_subset=10, cache_dir=cache)
    assert len(decoded) == 20  # of 90 images in the archive
    assert len(list((cache / "cifar10").glob("*.npy"))) == 4
    assert not list((cache / "cifar10").glob("*.tmp"))

    def boom(data, what="image"):
        raise AssertionError("decoded although cached")

    monkeypatch.setattr(cifar_mod, "decode_image", boom)
    b2 = _load(fake_cifar["archive"], tmp_path, train_subset=10, test_subset=10, cache_dir=cache)
    assert torch.equal(b.train.images, b2.train.images) and torch.equal(b.test.targets, b2.test.targets)

    # a changed archive (mtime) is a cache miss
    monkeypatch.setattr(cifar_mod, "decode_image", counting)
    decoded.clear()
    st = fake_cifar["archive"].stat()
    try:
        os.utime(fake_cifar["archive"], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        _load(fake_cifar["archive"], tmp_path, train_subset=10, test_subset=10, cache_dir=cache)
    finally:
        os.utime(fake_cifar["archive"], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(decoded) == 20


def test_cifar_archive_reader_formats(fake_cifar, tmp_path):
    ref = _load(fake_cifar["folder"], tmp_path, train_subset=20, test_subset=10, cache_dir=False)
    long_prefix = "x" * 120 + "/cifar10_jpeg"  # needs pax 'x' / GNU 'L' long-name headers
    variants = {
        "pax.tar.gz": dict(format=tarfile.PAX_FORMAT),
        "gnu.tar": dict(format=tarfile.GNU_FORMAT),
        "global.tgz": dict(format=tarfile.PAX_FORMAT, pax_headers={"comment": "global"}),
    }
    for name, kw in variants.items():
        archive = tmp_path / f"cifar10_{name}"
        with tarfile.open(archive, "w:gz" if name.endswith("gz") else "w", **kw) as tf:
            tf.add(fake_cifar["folder"], arcname=long_prefix)
        members = list(cifar_mod._iter_tar(archive))
        assert len(members) == 90 and all(n.startswith("x" * 120) for n, _ in members)
        b = _load(archive, tmp_path, train_subset=20, test_subset=10)
        assert torch.equal(b.train.images, ref.train.images) and torch.equal(b.test.targets, ref.test.targets)


def test_cifar_missing_data_message(tmp_path):
    for root in (tmp_path / "nothing_here", tmp_path / "missing.tar.gz", tmp_path):
        with pytest.raises(FileNotFoundError) as e:
            build_dataset("cifar10", root=str(root), cache_dir=tmp_path / "c")
        msg = str(e.value)
        assert "\n" not in msg and "dataset.root" in msg and "cifar-10-batches-py" in msg and str(root) in msg


def test_cache_dir_inside_repo_refused(fake_cifar):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    with pytest.raises(ValueError, match="inside the repository"):
        build_dataset("cifar10", root=str(fake_cifar["archive"]), cache_dir=str(REPO / ".cache"))


def test_configs_instantiate(fake_cifar, tmp_path):
    hydra_utils = pytest.importorskip("hydra.utils")
    from omegaconf import OmegaConf

    for name, root in (("digits", None), ("cifar10", fake_cifar["folder"])):
        cfg = OmegaConf.create({"seed": 3, "dataset": OmegaConf.load(REPO / "configs" / "dataset" / f"{name}.yaml")})
        if root is not None:
            cfg.dataset.root = str(root)
            cfg.dataset.cache_dir = str(tmp_path / "c")
        assert cfg.dataset.seed == 3 and cfg.dataset.name == name
        b = hydra_utils.instantiate(cfg.dataset)
        assert isinstance(b, DataBundle) and b.input_shape == tuple(cfg.dataset.input_shape)
        assert b.num_classes == cfg.dataset.num_classes == 10


# --------------------------------------------------------------------------- real data

@pytest.mark.slow
@pytest.mark.real_data
def test_real_cifar10_archive_subset(tmp_path):
    path = Path(os.environ.get("FLATBNN_CIFAR10", REPO.parent / "shared" / "data" / "cifar10_jpeg.tar.gz"))
    if not path.is_file():
        if os.environ.get("FLATBNN_REQUIRE_REAL_DATA") == "1":
            pytest.fail(f"real CIFAR-10 archive not found at {path} (FLATBNN_REQUIRE_REAL_DATA=1)")
        pytest.skip(f"real CIFAR-10 archive not found at {path}; set FLATBNN_CIFAR10")
    kw = dict(root=str(path), train_subset=5000, test_subset=1000, cache_dir=tmp_path / "cache")
    t0 = time.perf_counter()
    b = build_dataset("cifar10", **kw)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    b2 = build_dataset("cifar10", **kw)
    warm = time.perf_counter() - t0
    print(f"cifar10 5k/1k subset from archive: cold {cold:.2f}s, warm {warm:.3f}s")
    assert len(b.train) == 5000 and len(b.test) == 1000
    assert tuple(b.train.images.shape) == (5000, 32, 32, 3) and b.train[0][0].shape == (3, 32, 32)
    assert np.bincount(b.train.targets.numpy(), minlength=10).tolist() == [500] * 10
    assert np.bincount(b.test.targets.numpy(), minlength=10).tolist() == [100] * 10
    mean = b.train.images.float().div(255).mean(dim=(0, 1, 2))
    assert torch.allclose(mean, torch.tensor([0.49, 0.48, 0.45]), atol=0.02), mean
    assert torch.equal(b.train.images, b2.train.images) and warm < cold
    # The arrays the former hand-written tar parser decoded (before tarfile replaced it): byte-identical.
    digests = {s: hashlib.sha256(d.images.numpy().tobytes() + d.targets.numpy().astype(np.int64).tobytes()).hexdigest()
               for s, d in (("train", b.train), ("test", b.test))}
    assert digests == {"train": "93296497e461b875a8655696960f5142d94b28a336710265893af6b28da4713d",
                       "test": "595b975df1dc1ad6b978e708fe3b66a6c65ecda4c90586928f0f48e939f04cf4"}, digests


def test_the_data_fingerprint_names_what_changed_in_files_read_on_access_and_in_npy_rows(tmp_path, monkeypatch):
    """flatbnn/data/fingerprint.py: image files decoded on access are fingerprinted by their listing and each file's
    size and mtime (every k-th beyond STAT_LIMIT files), .npy rows by the file's size / mtime and the rows; the
    differences name the split and what changed (a resume on other data is refused with them: issue 54)."""
    from PIL import Image

    from flatbnn.data import fingerprint as F
    from flatbnn.data.cifar10_c import NpyImageDataset
    from flatbnn.data.imagefolder import ImageFileDataset

    for i in range(4):
        Image.fromarray(np.full((4, 4, 3), 10 * i, np.uint8)).save(tmp_path / f"{i}.png")
    files = ImageFileDataset(tmp_path, [f"{i}.png" for i in range(4)], [0, 1, 0, 1], [0.5] * 3, [0.2] * 3,
                             size=(4, 4))
    np.save(tmp_path / "rows.npy", np.zeros((5, 2, 2, 3), np.uint8))
    rows = NpyImageDataset(tmp_path / "rows.npy", np.arange(3), [0, 1, 2], [0.5] * 3, [0.2] * 3)
    bundle = type("B", (), {"train": files, "test": rows, "val": None, "ood": {}, "shift": {}})()
    before = F.fingerprint(bundle)
    assert before["splits"]["train"]["kind"] == "files" and before["splits"]["test"]["kind"] == "npy"
    assert F.differences(before, F.fingerprint(bundle)) == []
    Image.fromarray(np.full((4, 4, 3), 99, np.uint8)).save(tmp_path / "2.png")   # same name, other image
    os.utime(tmp_path / "2.png", ns=(1, 1))
    [line] = F.differences(before, F.fingerprint(bundle))
    assert line.startswith("train: file sizes / mtimes changed") and line.endswith("4 examples)"), line
    bundle.train = files.subset([0, 1, 3])                                          # another subset
    assert F.differences(before, F.fingerprint(bundle))[0] == "train: 4 -> 3 examples"
    bundle.train, bundle.test = files, NpyImageDataset(tmp_path / "rows.npy", np.array([0, 1, 4]), [0, 1, 2],
                                                        [0.5] * 3, [0.2] * 3)        # other rows of the same file
    assert F.differences(before, F.fingerprint(bundle))[-1].startswith("test: the rows or labels changed")
    monkeypatch.setattr(F, "STAT_LIMIT", 2)  # a big folder: every 3rd file stat'ed, and the fingerprint says so
    assert F.split_fingerprint(files)["stat_every"] == 3
