"""Symmetric label noise for FSAM Table 4 (rows/fsam_t4.yaml): the rate, the convention, train-only, fixed per run.

Convention (stated in rows/fsam_t4.yaml): exactly round(rate * n) training labels are flipped, each to a uniformly
drawn *different* class, so the fraction of wrong labels IS the rate (not rate * (K - 1) / K as when a flipped
label is redrawn over all K classes).
"""

import numpy as np
import pytest
import torch

from flatbnn.data import build_dataset
from flatbnn.data.fake import write_cifar10_torchvision
from flatbnn.data.transforms import symmetric_label_noise


@pytest.mark.parametrize("rate", [0.2, 0.4, 0.6, 0.8])
def test_fraction_of_wrong_labels_is_the_rate_in_every_class(rate):
    labels = np.repeat(np.arange(10), 5000)  # CIFAR-10's 50k training labels
    noisy, mask = symmetric_label_noise(labels, rate, 10)
    wrong = noisy != labels
    assert wrong.sum() == round(rate * 50000)          # exact, not rate * 9/10
    assert np.array_equal(wrong, mask)
    per_class = np.array([wrong[labels == c].mean() for c in range(10)])
    assert np.all(np.abs(per_class - rate) < 0.03)     # symmetric: no class is spared
    # the new labels are spread over the other classes: no (true -> noisy) pair takes more than its share
    pairs = np.bincount(labels[wrong] * 10 + noisy[wrong], minlength=100).reshape(10, 10)
    assert np.all(np.diag(pairs) == 0)
    share = np.broadcast_to(pairs.sum(1, keepdims=True) / 9, (10, 10))
    off = ~np.eye(10, dtype=bool)
    assert np.all(np.abs(pairs[off] - share[off]) < 4.5 * np.sqrt(share[off]))  # Poisson-like spread, 4.5 sigma


def test_cifar10_loader_noise_train_only_fixed_and_served(tmp_path):
    root = write_cifar10_torchvision(tmp_path / "c10")
    clean = build_dataset("cifar10", root=str(root), augment="none", seed=0)
    noisy = build_dataset("cifar10", root=str(root), augment="crop_flip", label_noise=0.4, seed=0)
    n = len(noisy.train)
    mask = noisy.meta["noisy_mask"]
    assert mask.sum() == round(0.4 * n) and noisy.meta["label_noise"]["rate"] == 0.4
    assert np.array_equal(noisy.meta["clean_targets"], clean.train.targets.numpy())
    served = np.array([noisy.train[i][1] for i in range(n)])  # through the augmentation wrapper
    assert np.array_equal(served != clean.train.targets.numpy(), mask)
    # the test set is untouched
    assert torch.equal(noisy.test.targets, clean.test.targets)
    assert [noisy.test[i][1] for i in range(len(noisy.test))] == clean.test.targets.tolist()
    # fixed per run: another run seed (augmentation, init) keeps the same corrupted set
    other = build_dataset("cifar10", root=str(root), augment="crop_flip", label_noise=0.4, seed=7)
    assert torch.equal(other.train.targets, noisy.train.targets)
    # ... and label_noise_seed picks another one
    alt = build_dataset("cifar10", root=str(root), augment="crop_flip", label_noise=0.4, label_noise_seed=1, seed=0)
    assert not np.array_equal(alt.meta["noisy_mask"], mask)


def test_noise_applies_to_the_subset_the_row_trains_on(tmp_path):
    """rows/fsam_t4.yaml's cpu scale: the exact rate holds on the class-balanced train subset."""
    root = write_cifar10_torchvision(tmp_path / "c10")
    b = build_dataset("cifar10", root=str(root), train_subset=20, label_noise=0.6, seed=0)
    assert len(b.train) == 20 and b.meta["noisy_mask"].sum() == 12


def test_fsam_t4_groups_by_noise_rate():
    from flatbnn.reproduce.launch import compose_cell
    from flatbnn.reproduce.spec import load_row

    row = load_row("fsam_t4")
    assert row.axes[0] == "noise"  # the table's rows are the noise rates
    cells = {c.id: c for c in row.cells_for("paper")}
    assert len(cells) == 16
    cfg = compose_cell(cells["n80/fsam"].overrides)
    assert cfg.dataset.label_noise == 0.8 and cfg.flatness.eta == 0.001 and cfg.flatness.rho == 0.1
    cpu = [c.id for c in row.cells_for("cpu")]
    assert {c.split("/")[0] for c in cpu} == {"n20", "n40"}
    # the cpu scale's reduced network (the deep ResNet-32 diverges at lr 0.1 in 400 steps: rows/fsam_t4.yaml)
    assert compose_cell(row.cells_for("cpu")[0].overrides).model.depth == 20
