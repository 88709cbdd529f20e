"""CIFAR-10-C: the official layout (fixture), shift sets on the cifar10 bundle, the cifar10_c data set,
and scripts/make_cifar10_c.py on a slice of the real CIFAR-10 (skipped without the archive)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flatbnn.data import build_dataset
from flatbnn.data.cifar import MEAN, STD
from flatbnn.data.cifar10_c import CORRUPTIONS, GROUPS, parse_corruptions
from flatbnn.data.corruptions import corrupt, implemented
from test_data_fixtures import C10_TEST, C10C_CORRUPTIONS, data_roots

assert data_roots

REPO = Path(__file__).resolve().parents[1]


def _load_script():
    from flatbnn.tools import make_cifar10_c
    return make_cifar10_c


def _raw_images(ds) -> torch.Tensor:
    """uint8 [N, H, W, C] back from normalised items (exact for x = (raw/255 - mean) / std)."""
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    m, s = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return ((x * s + m) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


# --------------------------------------------------------------------------- groups and names

def test_groups_are_table5():
    assert GROUPS == {
        "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
        "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
        "weather": ("snow", "frost", "fog", "brightness"),
        "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
    }
    assert len(CORRUPTIONS) == 15 and parse_corruptions("all") == list(CORRUPTIONS)
    assert parse_corruptions(["noise", "fog", "shot_noise"]) == ["gaussian_noise", "shot_noise", "impulse_noise", "fog"]
    with pytest.raises(ValueError, match="unknown"):
        parse_corruptions(["rain"])


# --------------------------------------------------------------------------- official layout

def test_shift_sets_on_the_cifar10_bundle(data_roots):
    root = data_roots["cifar10_c"]
    b = build_dataset("cifar10", root=str(data_roots["cifar10"]), cache_dir=data_roots["cache"], augment="none",
                      shift_root=str(root), shift_corruptions=list(C10C_CORRUPTIONS), shift_severities=[1, 3, 5])
    assert sorted(b.shift) == sorted(f"{c}/{s}" for c in C10C_CORRUPTIONS for s in (1, 3, 5))
    assert b.meta["shift_groups"] == {"gaussian_noise": "noise", "fog": "weather", "contrast": "digital"}
    clean = _raw_images(b.test)
    for k, c in enumerate(C10C_CORRUPTIONS):
        for s in (1, 3, 5):
            ds = b.shift[f"{c}/{s}"]
            assert torch.equal(ds.targets, b.test.targets)  # same labels, same (canonical) order
            img = _raw_images(ds)
            assert torch.equal(img[:, 0, 0, :2], clean[:, 0, 0, :2])  # (label, index) of the clean image
            assert torch.all(img[:, 0, 0, 2] == 10 * s + k)  # severity block s of corruption k
            assert torch.equal(img[:, 1:], clean[:, 1:])
            x, y = ds[4]
            xc, yc = b.test[4]
            assert y == yc and torch.allclose(x[:, 1:], xc[:, 1:])  # same normalisation as the clean test set
    # test_subset: the same fixed subset of the clean test set
    b = build_dataset("cifar10", root=str(data_roots["cifar10"]), cache_dir=data_roots["cache"], test_subset=10,
                      shift_root=str(root.parent), shift_corruptions="fog")  # root holding CIFAR-10-C/
    assert set(b.shift) == {f"fog/{s}" for s in range(1, 6)}
    assert torch.equal(_raw_images(b.shift["fog/2"])[:, 0, 0, :2], _raw_images(b.test)[:, 0, 0, :2])
    # batched fetch == item fetch
    ds = b.shift["fog/2"]
    assert all(torch.equal(x, ds[i][0]) for (x, _), i in zip(ds.__getitems__([7, 2, 5]), [7, 2, 5]))


def test_cifar10_c_dataset_and_errors(data_roots, tmp_path):
    root = data_roots["cifar10_c"]
    b = build_dataset("cifar10_c", root=str(root), clean_root=str(data_roots["cifar10"]), corruptions=["fog", "contrast"],
                      severities=[2, 4], cache_dir=data_roots["cache"])
    assert list(b.shift) == ["fog/2", "fog/4", "contrast/2", "contrast/4"]
    assert len(b.test) == 4 * 10 * C10_TEST and len(b.train) == 10 * 3
    n = 10 * C10_TEST
    for j, key in enumerate(b.shift):
        assert torch.equal(b.test[j * n + 3][0], b.shift[key][3][0])
    assert torch.equal(b.test.targets, torch.cat([d.targets for d in b.shift.values()]))
    # 'all' needs all 15 files: a one-line message naming the missing ones and the key
    with pytest.raises(FileNotFoundError) as e:
        build_dataset("cifar10_c", root=str(root), clean_root=str(data_roots["cifar10"]), cache_dir=data_roots["cache"])
    msg = str(e.value)
    assert "\n" not in msg and "snow.npy" in msg and "dataset.root" in msg
    with pytest.raises(FileNotFoundError, match="dataset.clean_root"):
        build_dataset("cifar10_c", root=str(root), clean_root=str(tmp_path / "none"), corruptions="fog")
    with pytest.raises(FileNotFoundError, match="dataset.shift_root"):
        build_dataset("cifar10", root=str(data_roots["cifar10"]), cache_dir=data_roots["cache"],
                      shift_root=str(tmp_path / "none"))
    bad = tmp_path / "bad"
    bad.mkdir()
    np.save(bad / "labels.npy", np.zeros(50, np.uint8))
    np.save(bad / "fog.npy", np.zeros((50, 32, 32, 1), np.uint8))
    with pytest.raises(ValueError, match="shape"):
        build_dataset("cifar10_c", root=str(bad), clean_root=str(data_roots["cifar10"]), corruptions="fog")
    with pytest.raises(ValueError, match="severities"):
        build_dataset("cifar10_c", root=str(root), clean_root=str(data_roots["cifar10"]), corruptions="fog",
                      severities=[0, 6])


# --------------------------------------------------------------------------- generated = marked

def test_a_generated_folder_warns_once_and_results_json_says_generated(data_roots, tmp_path, capsys):
    """scripts/make_cifar10_c.py is the fallback where the official release is absent: a folder it wrote is
    told apart from the release (its marker file), the user gets one warning line, and a run's results.json
    records which was read -- a number from our own corruptions is never presented as a CIFAR-10-C number."""
    from helpers import run_cfg

    gen = tmp_path / "gen"
    _load_script().generate(str(data_roots["cifar10"]), gen, corruptions=["fog"], seed=3,
                            cache_dir=data_roots["cache"], verbose=False)
    capsys.readouterr()
    common = ["dataset=cifar10", f"dataset.root={data_roots['cifar10']}", f"dataset.cache_dir={data_roots['cache']}",
              "dataset.shift_corruptions=[fog]", "dataset.shift_severities=[2]", "dataset.augment=none",
              "model=mlp", "model.hidden=[8]", "trainer.epochs=1", "trainer.batch_size=30", "trainer.eval_every=0"]
    meta = run_cfg(common + [f"dataset.shift_root={gen}"], tmp_path / "run_gen")["meta"]
    assert meta["shift_data"] == {"generator": "scripts/make_cifar10_c.py", "seed": 3, "test_images": 10 * C10_TEST,
                                  "corruptions": ["fog"], "clean_layout": meta["shift_data"]["clean_layout"],
                                  "source": "generated"}
    warned = [line for line in capsys.readouterr().err.splitlines() if "not the official release" in line]
    assert len(warned) == 1 and str(gen) in warned[0] and "meta.shift_data.source" in warned[0], warned
    official = run_cfg(common + [f"dataset.shift_root={data_roots['cifar10_c']}"], tmp_path / "run_official")
    assert official["meta"]["shift_data"] == {"source": "official"}
    assert "not the official release" not in capsys.readouterr().err


# --------------------------------------------------------------------------- corruption functions

def test_corruption_helpers_match_references():
    import colorsys

    from scipy import ndimage

    from flatbnn.data.corruptions import _clipped_zoom, brightness

    x = np.random.default_rng(0).random((2, 32, 32, 3)).astype(np.float32)
    for z in (1.03, 1.17, 1.25):  # our bilinear zoom == scipy.ndimage.zoom(order=1)
        ch = math.ceil(32 / z)
        top = (32 - ch) // 2
        ref = ndimage.zoom(x[:, top:top + ch, top:top + ch], (1, z, z, 1), order=1)
        t = (ref.shape[1] - 32) // 2
        assert np.allclose(_clipped_zoom(x, z), ref[:, t:t + 32, t:t + 32], atol=1e-5)
    img = np.random.default_rng(1).integers(0, 256, (1, 4, 4, 3), dtype=np.uint8)
    img[0, 0, 0] = 0  # a black pixel (saturation 0)
    out = brightness(img, 3, None)
    for r, c in [(0, 0), (1, 2), (3, 3)]:  # HSV: value + 0.15, clipped
        h, s, v = colorsys.rgb_to_hsv(*(img[0, r, c] / 255.0))
        want = np.array(colorsys.hsv_to_rgb(h, s, min(v + 0.15, 1.0)))
        assert np.allclose(out[0, r, c] / 255.0, want, atol=1 / 255 + 1e-9)


def test_corruptions_shapes_determinism():
    x = np.random.default_rng(2).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    assert "frost" not in implemented() and len(implemented()) == 14
    assert all(g in {c for c in implemented()} for g in ("gaussian_noise", "defocus_blur", "fog", "contrast"))
    for c in implemented():
        y = corrupt(x, c, 3, seed=1)
        assert y.shape == x.shape and y.dtype == np.uint8 and not np.array_equal(y, x)
        assert np.array_equal(y, corrupt(x, c, 3, seed=1))
    assert not np.array_equal(corrupt(x, "gaussian_noise", 3, seed=1), corrupt(x, "gaussian_noise", 3, seed=2))
    with pytest.raises(KeyError):
        corrupt(x, "frost", 1)


# --------------------------------------------------------------------------- generator on real data

# Published CIFAR-10-C parameters that are not monotone in pixel deviation (see flatbnn/data/corruptions.py)
NOT_MONOTONE = {"glass_blur", "elastic_transform"}
EQUAL_SEVERITIES = {"motion_blur": (3, 4)}  # (6, 2) vs (8, 2): identical up to the random angle


@pytest.mark.slow
@pytest.mark.real_data
def test_generator_on_real_cifar10_and_monotone_severity(cifar10_archive, tmp_path):
    script = _load_script()
    out = tmp_path / "CIFAR-10-C-gen"
    n = 100
    summary = script.generate(str(cifar10_archive), out, subset=n, corruptions=implemented(), seed=0,
                              cache_dir=tmp_path / "cache", verbose=False)
    assert summary["n"] == n and sorted(p.stem for p in out.glob("*.npy")) == sorted(implemented() + ["labels"])
    labels = np.load(out / "labels.npy")
    assert labels.shape == (5 * n,) and np.bincount(labels[:n], minlength=10).tolist() == [10] * 10
    # read back by the real loader, against the clean test set of the same loader
    b = build_dataset("cifar10_c", root=str(out), clean_root=str(cifar10_archive), corruptions=implemented(),
                      train_subset=100, test_subset=n, cache_dir=tmp_path / "cache")
    clean = build_dataset("cifar10", root=str(cifar10_archive), train_subset=100, test_subset=n,
                          cache_dir=tmp_path / "cache").test
    assert len(b.shift) == 5 * 14 and len(b.test) == 5 * 14 * n
    clean_img = clean.images.numpy().astype(np.float64)
    for c in implemented():
        arr = np.load(out / f"{c}.npy")
        assert arr.shape == (5 * n, 32, 32, 3) and arr.dtype == np.uint8
        mad = []
        for s in range(1, 6):
            ds = b.shift[f"{c}/{s}"]
            assert torch.equal(ds.targets, clean.targets)
            img = ds.images.numpy()
            assert np.array_equal(img, arr[(s - 1) * n:s * n])  # generated in the clean set's canonical order
            x, _ = ds[0]
            assert torch.allclose(x, clean.normalize(torch.from_numpy(img[0]).permute(2, 0, 1)))
            mad.append(np.abs(img.astype(np.float64) - clean_img).mean())
        assert min(mad) > 0.5, (c, mad)
        if c in NOT_MONOTONE:
            continue
        for s in range(1, 5):
            if EQUAL_SEVERITIES.get(c) == (s, s + 1):
                assert mad[s] >= mad[s - 1], (c, mad)
            else:
                assert mad[s] > mad[s - 1], (c, mad)  # deviation grows with severity
    # deterministic in the seed; refuses to write into the repository
    again = tmp_path / "again"
    script.generate(str(cifar10_archive), again, subset=n, corruptions=["shot_noise"], seed=0,
                    cache_dir=tmp_path / "cache", verbose=False)
    assert np.array_equal(np.load(again / "shot_noise.npy"), np.load(out / "shot_noise.npy"))
    with pytest.raises(SystemExit):
        script.generate(str(cifar10_archive), REPO / "data" / "c10c", subset=10, corruptions=["fog"], verbose=False)
