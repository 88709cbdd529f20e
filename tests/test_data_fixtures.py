"""Tiny fixture files in each data set's official on-disk layout (written under tmp_path), shared by
the tests/test_data_*.py modules. The writers live in flatbnn/data/fake.py (the reproduction runner's smoke
scale uses them too); every image's label (and its position) is coded in its pixels so the tests can check
labels and order through the real loaders."""

from __future__ import annotations

import pytest

from flatbnn.data.fake import (C10_TEST, C10_TRAIN, C10C_CORRUPTIONS, C100_TEST, C100_TRAIN, IN_CLASSES,  # noqa: F401
                               IN_TRAIN, IN_VAL, MNIST_TEST, MNIST_TRAIN, SVHN_TEST, SVHN_TRAIN, TIN_TRAIN, TIN_VAL,
                               cifar10_clean_test_in_file_order, class_colour, coded_image, interleaved, tin_wnids,
                               write_all, write_cifar10_c, write_cifar10_torchvision, write_cifar100, write_imagenet,
                               write_mnist, write_svhn, write_tinyimagenet)


@pytest.fixture(scope="session")
def data_roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("data_roots")
    return {**write_all(base), "cache": base / "cache", "base": base}
