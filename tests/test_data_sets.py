"""Every data set's official layout (tiny fixtures), its config, OOD pairings and missing-data messages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from flatbnn.data import DataBundle, build_dataset, list_datasets
from flatbnn.data.ood import adapt_images
from helpers import CONFIGS, compose_cfg
from test_data_fixtures import (C10_TEST, C100_TEST, C100_TRAIN, IN_CLASSES, IN_TRAIN, IN_VAL,
                                MNIST_TEST, MNIST_TRAIN, SVHN_TEST, SVHN_TRAIN, TIN_TRAIN, TIN_VAL, class_colour,
                                data_roots, tin_wnids, write_mnist)

assert data_roots  # the imported fixture is used by name

NAMES = ["digits", "cifar10", "cifar100", "cifar10_c", "tinyimagenet", "imagenet", "mnist", "fashion_mnist", "svhn"]
CIFAR_SIZED = ["cifar10", "cifar100", "svhn", "mnist", "fashion_mnist"]


def _denorm(x: torch.Tensor, mean, std) -> torch.Tensor:
    m = torch.tensor(mean).view(-1, 1, 1)
    s = torch.tensor(std).view(-1, 1, 1)
    return ((x * s + m) * 255).round().clamp(0, 255)


def _check_coded(ds, per_class: int, num_classes: int, mean, std, grey=False):
    """Canonical order (class, then index) and label/index encoded in the pixels."""
    assert len(ds) == per_class * num_classes
    want = np.repeat(np.arange(num_classes), per_class)
    assert torch.equal(ds.targets, torch.from_numpy(want))
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert isinstance(y, int) and y == want[i] and x.dtype == torch.float32
        px = _denorm(x, mean, std)
        label, index = (px[0, 0, 0], px[0, 0, 1]) if grey else (px[0, 0, 0], px[1, 0, 0])
        assert int(label) == y and int(index) == i % per_class


# --------------------------------------------------------------------------- layouts

FINE_GRAINED = ["stanford_cars", "flowers102"]  # 224-px transfer sets: loaders tested in tests/test_fsam_rows.py


def test_registry_has_every_config_name():
    assert set(NAMES + FINE_GRAINED) <= set(list_datasets())
    assert sorted(p.stem for p in (CONFIGS / "dataset").glob("*.yaml")) == sorted(NAMES + FINE_GRAINED)


def test_cifar100_pickles(data_roots):
    from flatbnn.data.cifar import C100_MEAN, C100_STD

    b = build_dataset("cifar100", root=str(data_roots["cifar100"]), augment="none", num_classes=100,
                      input_shape=[3, 32, 32])
    assert (b.num_classes, b.input_shape, b.name) == (100, (3, 32, 32), "cifar100")
    assert b.meta["classes"][7] == "class007"
    _check_coded(b.train, C100_TRAIN, 100, C100_MEAN, C100_STD)
    _check_coded(b.test, C100_TEST, 100, C100_MEAN, C100_STD)
    # root may also be the cifar-100-python folder itself; subsets are balanced
    b = build_dataset("cifar100", root=str(data_roots["cifar100"] / "cifar-100-python"), train_subset=100,
                      test_subset=50)
    assert np.bincount(b.train.targets.numpy(), minlength=100).tolist() == [1] * 100 and len(b.test) == 50


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_mnist_idx(data_roots, name):
    from flatbnn.data.mnist import SETS

    mean, std = SETS[name][2], SETS[name][3]
    root = data_roots[name]
    b = build_dataset(name, root=str(root), num_classes=10, input_shape=[1, 28, 28])  # .gz (mnist) / plain (fashion)
    assert b.input_shape == (1, 28, 28) and b.train[0][0].shape == (1, 28, 28)
    _check_coded(b.train, MNIST_TRAIN, 10, mean, std, grey=True)
    _check_coded(b.test, MNIST_TEST, 10, mean, std, grey=True)
    # root may point at <Folder>/raw too
    b2 = build_dataset(name, root=str(root / SETS[name][0] / "raw"))
    assert torch.equal(b2.test.images, b.test.images)


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_mnist_normalize_false_feeds_pixels_in_0_1_as_the_bsam_code(data_roots, name):
    """dataset.normalize=false: x = raw / 255 (the bSAM code's ToTensor() alone), for the training, test and OOD
    sets; the default standardises with the set's mean / std."""
    from flatbnn.data.mnist import SETS

    mean, std = SETS[name][2][0], SETS[name][3][0]
    other = "fashion_mnist" if name == "mnist" else "mnist"
    kw = dict(root=str(data_roots[name]), ood=[other], ood_roots={other: str(data_roots[other])})
    raw = build_dataset(name, normalize=False, **kw)
    std_ = build_dataset(name, **kw)
    pixels = raw.test.images[7].permute(2, 0, 1).float()  # uint8 [28, 28, 1]
    assert torch.allclose(raw.test[7][0], pixels / 255, atol=1e-6)
    assert torch.allclose(std_.test[7][0], (pixels / 255 - mean) / std, atol=1e-5)
    assert torch.allclose(raw.train[3][0], raw.train.images[3].permute(2, 0, 1).float() / 255, atol=1e-6)
    x = torch.stack([raw.train[i][0] for i in range(len(raw.train))])
    assert x.min() >= 0 and x.max() <= 1 and x.max() > 0.5  # [0, 1], not standardised
    assert raw.meta["mean"] == (0.0,) and raw.meta["std"] == (1.0,)
    ood_pixels = raw.ood[other].images[2].permute(2, 0, 1).float()  # the OOD set takes the run's choice
    assert torch.allclose(raw.ood[other][2][0], ood_pixels / 255, atol=1e-6)
    assert torch.allclose(std_.ood[other][2][0], (ood_pixels / 255 - mean) / std, atol=1e-5)
    with pytest.raises(ValueError, match="normalize must be true or false"):
        build_dataset(name, root=str(data_roots[name]), normalize="no")


def test_svhn_mat(data_roots):
    from flatbnn.data.svhn import MEAN, STD

    b = build_dataset("svhn", root=str(data_roots["svhn"]), num_classes=10, input_shape=[3, 32, 32])
    _check_coded(b.train, SVHN_TRAIN, 10, MEAN, STD)  # label 10 in the file is digit 0
    _check_coded(b.test, SVHN_TEST, 10, MEAN, STD)


def test_tinyimagenet_tree(data_roots):
    from flatbnn.data.imagefolder import TIN_MEAN, TIN_STD, ImageFileDataset

    b = build_dataset("tinyimagenet", root=str(data_roots["tinyimagenet"]), augment="none", num_classes=200,
                      input_shape=[3, 64, 64])
    assert b.meta["classes"] == tuple(tin_wnids())  # sorted wnids, whatever wnids.txt's order
    assert isinstance(b.train, ImageFileDataset) and len(b.train) == 200 * TIN_TRAIN and len(b.test) == 200 * TIN_VAL
    assert torch.equal(b.test.targets, torch.arange(200).repeat_interleave(TIN_VAL))  # canonical order
    for ds in (b.train, b.test):
        for i in (0, 57, len(ds) - 1):
            x, y = ds[i]
            assert x.shape == (3, 64, 64)
            px = _denorm(x, TIN_MEAN, TIN_STD).mean(dim=(1, 2))
            assert torch.allclose(px, torch.tensor(class_colour(y), dtype=torch.float32), atol=3), (i, y, px)
    # crop_flip / autoaugment_cutout work on the lazily decoded images
    for aug in ("crop_flip", "autoaugment_cutout"):
        b = build_dataset("tinyimagenet", root=str(data_roots["tinyimagenet"]), augment=aug, seed=1, train_subset=20)
        b.train.set_epoch(2)
        assert b.train[3][0].shape == (3, 64, 64) and torch.equal(b.train[3][0], b.train[3][0])


def test_imagenet_tree_lazy_and_deterministic(data_roots):
    from flatbnn.data.imagefolder import IN_MEAN, IN_STD, ImageFileDataset, ImageNetTrainDataset

    root = str(data_roots["imagenet"])
    b = build_dataset("imagenet", root=root, seed=4, num_classes=IN_CLASSES, input_shape=[3, 224, 224])
    assert isinstance(b.train, ImageNetTrainDataset) and isinstance(b.test, ImageFileDataset)
    assert b.num_classes == IN_CLASSES and b.input_shape == (3, 224, 224)
    assert not hasattr(b.train.base, "images")  # lazy: files, not arrays
    assert torch.equal(b.train.targets, torch.arange(IN_CLASSES).repeat_interleave(IN_TRAIN))
    assert torch.equal(b.test.targets, torch.arange(IN_CLASSES).repeat_interleave(IN_VAL))
    for ds in (b.train, b.test):
        for i in range(len(ds)):
            x, y = ds[i]
            assert x.shape == (3, 224, 224)
            px = _denorm(x, IN_MEAN, IN_STD).mean(dim=(1, 2))
            assert torch.allclose(px, torch.tensor(class_colour(40 * y + 20), dtype=torch.float32), atol=3)
    # test transform: Resize(256) + CenterCrop(224) of a 300x200 (w x h) image
    from PIL import Image
    from torchvision.transforms import functional as TF

    path = b.test.path(0)
    with Image.open(path) as im:
        want = TF.pil_to_tensor(TF.center_crop(TF.resize(im.convert("RGB"), 256), 224))
    assert torch.equal(b.test.raw(0), want)
    # train: RandomResizedCrop + flip, a pure function of (seed, epoch, index)
    img = b.train.base.decode(1)
    p0 = [b.train.augment_params(1, img, epoch=e) for e in range(6)]
    assert p0 == [b.train.augment_params(1, img, epoch=e) for e in range(6)] and len(set(p0)) > 1
    b2 = build_dataset("imagenet", root=root, seed=4, num_classes=IN_CLASSES)
    b.train.set_epoch(3)
    b2.train.set_epoch(3)
    state = torch.get_rng_state()
    assert torch.equal(b.train[2][0], b2.train[2][0])
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is not consumed
    with pytest.raises(ValueError, match="augment"):
        build_dataset("imagenet", root=root, augment="crop_flip")
    with pytest.raises(ValueError, match="num_classes"):
        build_dataset("imagenet", root=root, num_classes=1000)


# --------------------------------------------------------------------------- missing data

@pytest.mark.parametrize("name,hint", [
    ("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python"), ("mnist", "MNIST/raw"),
    ("fashion_mnist", "FashionMNIST/raw"), ("svhn", "test_32x32.mat"), ("tinyimagenet", "val_annotations.txt"),
    ("imagenet", "train/<wnid>"), ("cifar10_c", "labels.npy"),
])
def test_missing_data_is_a_one_line_error(tmp_path, name, hint):
    root = tmp_path / "nothing_here"
    with pytest.raises(FileNotFoundError) as e:
        build_dataset(name, root=str(root), clean_root=str(root)) if name == "cifar10_c" else \
            build_dataset(name, root=str(root))
    msg = str(e.value)
    assert "\n" not in msg and str(root) in msg and hint in msg and "dataset.root" in msg
    assert "http" in msg or "download" in msg  # where to get it


def test_download_goes_through_torchvision(monkeypatch, tmp_path):
    """download=true calls torchvision's class with download=True (stubbed: no network here)."""
    import torchvision

    calls = []

    class FakeMNIST:
        def __init__(self, root, train=True, download=False):
            calls.append((root, train, download))
            if not (Path(root) / "MNIST").exists():
                write_mnist(Path(root), "MNIST")

    monkeypatch.setattr(torchvision.datasets, "MNIST", FakeMNIST)
    b = build_dataset("mnist", root=str(tmp_path / "dl"), download=True)
    assert calls and all(d for _, _, d in calls) and len(b.test) == 10 * MNIST_TEST


# --------------------------------------------------------------------------- configs

def _overrides(name: str, roots: dict) -> list[str]:
    if name == "digits":
        return []
    if name == "cifar10_c":
        return [f"dataset.root={roots['cifar10_c']}", f"dataset.clean_root={roots['cifar10']}",
                "dataset.corruptions=[gaussian_noise,fog,contrast]", f"dataset.cache_dir={roots['cache']}"]
    out = [f"dataset.root={roots[name]}"]
    if name == "cifar10":
        out.append(f"dataset.cache_dir={roots['cache']}")
    if name == "imagenet":
        out.append(f"dataset.num_classes={IN_CLASSES}")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_config_composes_and_loads_its_fixture(data_roots, name):
    raw = OmegaConf.load(CONFIGS / "dataset" / f"{name}.yaml")
    for key in ("num_classes", "input_shape", "train_subset", "test_subset", "val_split", "augment", "seed", "root",
                "download", "label_noise", "ood", "ood_roots", "ood_subset"):
        assert key in raw, f"{name}.yaml lacks {key}"
    assert OmegaConf.to_container(raw)["seed"] == "${seed}" and raw.name == name
    assert OmegaConf.to_container(raw)["root"] == "${oc.env:FLATBNN_DATA_ROOT,data}"
    assert list(raw.ood) == [] and raw.label_noise == 0.0 and raw.download is False
    assert ("loader" in raw and raw.loader == "cpu") == (name in CIFAR_SIZED or name == "cifar10_c")
    cfg = compose_cfg([f"dataset={name}", "seed=5", *_overrides(name, data_roots)])
    assert cfg.dataset.seed == 5
    b = instantiate(cfg.dataset)
    assert isinstance(b, DataBundle) and b.name == name
    assert b.num_classes == cfg.dataset.num_classes and b.input_shape == tuple(cfg.dataset.input_shape)
    assert b.ood == {} and len(b.test) > 0 and b.train[0][0].shape == b.input_shape
    assert isinstance(b.test[0][1], int)
    if name == "cifar10_c":
        assert len(b.shift) == 15 and len(b.test) == 15 * 10 * C10_TEST
    else:
        assert b.shift == {}


# --------------------------------------------------------------------------- OOD pairings

def test_ood_sets_use_in_distribution_normalisation(data_roots):
    from flatbnn.data.cifar import MEAN, STD

    b = build_dataset("cifar10", root=str(data_roots["cifar10"]), cache_dir=data_roots["cache"], augment="none",
                      ood=["svhn", "cifar100"],
                      ood_roots={"svhn": str(data_roots["svhn"]), "cifar100": str(data_roots["cifar100"])})
    assert list(b.ood) == ["svhn", "cifar100"]
    assert len(b.ood["svhn"]) == 10 * SVHN_TEST and len(b.ood["cifar100"]) == 100 * C100_TEST
    svhn = build_dataset("svhn", root=str(data_roots["svhn"]))
    x = b.ood["svhn"][3][0]
    raw = svhn.test.images[3].permute(2, 0, 1).float()
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    assert torch.allclose(x, (raw / 255 - mean) / std, atol=1e-5)  # CIFAR-10 statistics, not SVHN's
    # the same through Hydra overrides (ood_roots lists every OOD source with null = dataset.root)
    cfg = compose_cfg(["dataset=cifar10", f"dataset.root={data_roots['cifar10']}", f"dataset.cache_dir={data_roots['cache']}",
                       "dataset.ood=[svhn]", f"dataset.ood_roots.svhn={data_roots['svhn']}", "dataset.ood_subset=10"])
    assert len(instantiate(cfg.dataset).ood["svhn"]) == 10
    # ood_subset: class-balanced subset of each OOD test set
    b = build_dataset("cifar10", root=str(data_roots["cifar10"]), cache_dir=data_roots["cache"], ood=["cifar100"],
                      ood_roots={"cifar100": str(data_roots["cifar100"])}, ood_subset=30)
    assert len(b.ood["cifar100"]) == 30


def test_ood_default_root_and_shape_adaptation(tmp_path, data_roots):
    from flatbnn.data.mnist import SETS

    root = tmp_path / "both"
    write_mnist(root, "MNIST")
    write_mnist(root, "FashionMNIST", gz=False)
    b = build_dataset("mnist", root=str(root), ood=["fashion_mnist"])  # default: the same root
    fm = build_dataset("fashion_mnist", root=str(root))
    mean, std = SETS["mnist"][2][0], SETS["mnist"][3][0]
    assert torch.allclose(b.ood["fashion_mnist"][5][0], (fm.test.images[5].permute(2, 0, 1).float() / 255 - mean) / std,
                          atol=1e-5)
    # grey 28x28 OOD images for a 3x32x32 data set: replicated channels, resized
    b = build_dataset("cifar10", root=str(data_roots["cifar10"]), cache_dir=data_roots["cache"], ood=["mnist"],
                      ood_roots={"mnist": str(root)})
    assert b.ood["mnist"][0][0].shape == (3, 32, 32)
    x = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    assert adapt_images(x, (1, 4, 4)).shape == (2, 4, 4, 1) and adapt_images(x[..., :1], (3, 8, 8)).shape == (2, 8, 8, 3)
    # errors: unknown name, the data set itself, a root for a set not listed, a missing OOD root names its key
    with pytest.raises(KeyError, match="unknown OOD"):
        build_dataset("mnist", root=str(root), ood=["nope"])
    with pytest.raises(ValueError, match="its own"):
        build_dataset("mnist", root=str(root), ood=["mnist"])
    with pytest.raises(ValueError, match="ood_roots"):
        build_dataset("mnist", root=str(root), ood=[], ood_roots={"svhn": "x"})
    with pytest.raises(FileNotFoundError, match=r"dataset\.ood_roots\.svhn"):
        build_dataset("mnist", root=str(root), ood=["svhn"])
