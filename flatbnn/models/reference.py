"""What each ``configs/model/<name>.yaml`` is, the input it is counted at, and the published size.

One table read by ``scripts/param_counts.py`` (and so ``docs/models.md``) and by
``tests/test_models.py``: the shape and class count a config is sized at in the papers, whether a
CIFAR-100 count is quoted too, and the parameter count the literature prints for that network (in
millions, as printed, so its precision is the number of digits given).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

CIFAR = (3, 32, 32)
MNIST = (1, 28, 28)
IMAGENET = (3, 224, 224)


@dataclass(frozen=True)
class ModelRef:
    network: str  # the name the papers use
    used_in: str  # where our five papers use it
    input_shape: tuple[int, int, int] = CIFAR
    num_classes: int = 10
    cifar100: bool = False  # also report the 100-class count (a paper runs it on CIFAR-100)
    published: str | None = None  # millions, as printed, e.g. "36.5"
    published_by: str | None = None
    # What the published figure counts: every parameter, or (PyramidNet's paper) only convolution
    # and linear layers, i.e. without BatchNorm's scale and shift; and at how many classes.
    published_basis: Literal["all", "conv_linear"] = "all"
    published_classes: int | None = None


MODEL_REFS: dict[str, ModelRef] = {
    "mlp": ModelRef("MLP 784-500-300", "bSAM (MNIST)", MNIST),
    "lenet5": ModelRef(
        "LeNet-5", "bSAM (FashionMNIST), HWA (MNIST)", MNIST, published="0.06",
        published_by="LeCun et al. 1998 ('about 60,000'; their C3 is sparsely connected)",
    ),
    "resnet20_frn": ModelRef(
        "ResNet-20-FRN", "bSAM Tables 1-2", cifar100=True, published="0.27",
        published_by="Izmailov et al. 2021 / He et al. 2016",
    ),
    "resnet20": ModelRef(
        "ResNet-20", "Fisher SAM Table 1", cifar100=True, published="0.27",
        published_by="He et al. 2016, Table 6",
    ),
    "resnet32": ModelRef(
        "ResNet-32", "Fisher SAM Table 4 (label noise)", published="0.46",
        published_by="He et al. 2016, Table 6",
    ),
    "resnet56": ModelRef(
        "ResNet-56", "Fisher SAM Table 1", cifar100=True, published="0.85",
        published_by="He et al. 2016, Table 6",
    ),
    "resnet10": ModelRef("ResNet-10 (CIFAR stem)", "flat_seeking_bnn Table 3", cifar100=True),
    "resnet18": ModelRef(
        "ResNet-18 (CIFAR stem)", "flat_seeking_bnn Table 3, bSAM Table 2", cifar100=True,
        published="11.2", published_by="the usual CIFAR ResNet-18 figure; = torchvision resnet18 "
        "with a 3x3 stem, 10 classes (tested)",
    ),
    "resnet34": ModelRef(
        "ResNet-34 (CIFAR stem)", "Fisher SAM Fig. 4",
        published_by="none printed; = torchvision resnet34 with a 3x3 stem, 10 classes (tested)",
    ),
    "preresnet110": ModelRef(
        "PreResNet-110", "(SWAG code family)", published="1.7",
        published_by="He et al. 2016 (ResNet-110; the pre-activation net adds two 1x1 projections)",
    ),
    "preresnet164": ModelRef(
        "PreResNet-164", "flat_seeking_bnn Tables 1-2, 5", cifar100=True, published="1.70",
        published_by="He et al. 2016b",
    ),
    "preresnet164_drop": ModelRef(
        "PreResNet164Drop (SWAG code)", "flat_seeking_bnn Tables 1-2 (MC-Dropout rows)",
        cifar100=True,
    ),
    "wrn16x4": ModelRef(
        "WRN-16-4", "(small WRN)", published="2.7", published_by="Zagoruyko & Komodakis 2016"
    ),
    "wrn28x2": ModelRef(
        "WRN-28-2", "VariationalSAM, Fisher SAM Table 1", cifar100=True, published="1.5",
        published_by="Berthelot et al. 2019 (MixMatch), the usual WRN-28-2 figure",
    ),
    "wrn28x10": ModelRef(
        "WRN-28-10", "VariationalSAM, Fisher SAM Table 1 / Fig. 5", cifar100=True, published="36.5",
        published_by="Zagoruyko & Komodakis 2016",
    ),
    "wrn28x10_swag": ModelRef(
        "WideResNet28x10(Drop) (SWAG code)", "flat_seeking_bnn Tables 1-2", cifar100=True,
        published="36.5", published_by="Zagoruyko & Komodakis 2016",
    ),
    "vgg16_bn": ModelRef(
        "VGG-16-BN (SWAG head)", "(SWAG code family)", published="15.25",
        published_by="chenyaofo/pytorch-cifar-models README (same architecture)",
    ),
    "vgg19_bn": ModelRef(
        "VGG-19-BN", "Fisher SAM Table 1", cifar100=True, published="20.04",
        published_by="bearpaw/pytorch-classification README",
    ),
    "vgg_hwa": ModelRef("Bayesian VGG (TFP bayesian_vgg)", "HWA Fig. 1 (CIFAR-10)"),
    "densenet121": ModelRef(
        "DenseNet-121 (CIFAR stem)", "Fisher SAM Table 1", cifar100=True,
        published_by="none printed for CIFAR; = torchvision densenet121 (7.98M) with a 3x3 stem, "
        "10 classes (tested)",
    ),
    "resnext29_32x4d": ModelRef(
        "ResNeXt-29 32x4d", "Fisher SAM Table 1", cifar100=True,
        published_by="none printed; the 8x64d / 16x64d members match Xie et al. / bearpaw (tested)",
    ),
    "pyramidnet272": ModelRef(
        "PyramidNet-272, alpha=200", "Fisher SAM Table 1 (CIFAR-10/100)", num_classes=100, cifar100=True,
        published="26.0", published_by="Han et al. 2017 (counts conv + linear only, 10 classes)",
        published_basis="conv_linear", published_classes=10,
    ),
    "densenet161": ModelRef(
        "DenseNet-161", "flat_seeking_bnn Table 4 (ImageNet)", IMAGENET, 1000, published="28.7",
        published_by="torchvision docs",
    ),
    "resnet152": ModelRef(
        "ResNet-152", "flat_seeking_bnn Table 4 (ImageNet)", IMAGENET, 1000, published="60.2",
        published_by="torchvision docs",
    ),
    "deit_base": ModelRef(
        "DeiT-B/16", "Fisher SAM Table 2 (ImageNet)", IMAGENET, 1000, published="86.6",
        published_by="timm model card (DeiT paper: 86M)",
    ),
    "vit_b16": ModelRef(
        "ViT-B/16", "Fisher SAM Table 3 (transfer; CIFAR-100 at 224)", IMAGENET, 1000, cifar100=True,
        published="86.6", published_by="timm model card (ViT paper: 86M)",
    ),
}


def count_parameters(model: nn.Module, basis: str = "all") -> int:
    """All parameters, or only those of convolution and linear layers (``basis="conv_linear"``)."""
    if basis == "all":
        return sum(p.numel() for p in model.parameters())
    if basis == "conv_linear":
        return sum(
            p.numel()
            for m in model.modules()
            if isinstance(m, (nn.Conv2d, nn.Linear))
            for p in m.parameters(recurse=False)
        )
    raise ValueError(f"basis must be 'all' or 'conv_linear', got {basis!r}")
