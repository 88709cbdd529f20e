"""VGG (Simonyan & Zisserman, 2015) for CIFAR-sized inputs, and the Bayesian VGG of the HWA paper.

``vgg`` -- the CIFAR VGG: the ImageNet VGG's 3x3 conv stacks (biased convs; BN after each with
``batch_norm=True``) and five 2x2 max-pools, so a 32x32 image ends at 1x1x512, then one of two heads:

* ``head="linear"``: ``Linear(512, classes)`` -- kuangliu/pytorch-cifar and bearpaw/pytorch-classification
  (whose README prints 20.04M for vgg19_bn, CIFAR-10). No Fisher SAM code is public and the public ASAM
  code it follows imports no VGG, so this classic head is our reading of FSAM's VGG-19-BN;
* ``head="mlp"``: ``Dropout-Linear(512,512)-ReLU-Dropout-Linear(512,512)-ReLU-Linear(512,classes)``
  with dropout ``head_dropout`` (0.5) -- the SWAG reference code's VGG16/VGG16BN/VGG19BN (the
  flat_seeking_bnn code base), the same as chenyaofo/pytorch-cifar-models (15.25M for vgg16_bn).
  These two Dropout(0.5) modules are part of that architecture (active in training like any
  dropout); set ``head_dropout=0`` to remove them.

``dropout > 0`` (MC-Dropout) follows the SWAG code's ``VGG16Drop``/``VGG16BNDrop`` (p = 0.05): an
``nn.Dropout`` before every conv, and before the classifier (linear head) -- for the mlp head the
SWAG code instead sets its two head dropouts to p, i.e. ``head_dropout=p``. Init as the SWAG code:
He-normal (fan_out) convs with zero bias; BN weight 1, bias 0.

``vgg_hwa`` -- the "Bayesian VGG" of HWA (Karimi & Li, 2020). No code is public. The paper trains
it on CIFAR-10 with Flipout and "standard hyperparameters ... such as the annealing constant or the
number of MC samples", which is TensorFlow Probability's ``cifar10_bnn.py`` example (Flipout, KL
annealing, ``num_monte_carlo``; its MNIST twin ``bayesian_neural_network.py`` is HWA's LeNet-5 and
uses the same 55,000-image MNIST split). The smallest faithful reading is therefore that example's
``bayesian_vgg``: five blocks of two 3x3 convs (64-128-256-512-512 filters, biased, each followed by
BN and ReLU), a 2x2 max-pool after each block, flatten, one dense layer to the classes. Built here as
a deterministic network (point-estimate weights; the variational method turns every conv/linear
weight into (mu, sigma)); BN uses Keras' eps 1e-3 and momentum 0.99 (PyTorch momentum 0.01:
``bn_momentum``). That momentum needs a few hundred steps to forget BN's initial (0, 1) statistics
(0.99^160 = 0.2 of them remain after 160 steps), so a short run evaluated in eval mode predicts one class;
short budgets set ``model.bn_momentum=0.1`` (PyTorch's default).
9,416,010 parameters for 10 classes. ``dropout > 0`` puts one ``nn.Dropout`` before the dense layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity, he_init_, spatial_of

Head = Literal["linear", "mlp"]

CONFIGS: dict[int, list[int | str]] = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
         512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 16,
        batch_norm: bool = True,
        head: Head = "linear",
        head_dropout: float = 0.5,
        dropout: float = 0.0,
    ):
        super().__init__()
        if depth not in CONFIGS:
            raise ValueError(f"VGG depth must be one of {sorted(CONFIGS)}, got {depth}")
        layers: list[nn.Module] = []
        ch = in_channels
        for v in CONFIGS[depth]:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            # an Identity when dropout == 0, so the state_dict keys do not depend on dropout
            layers.append(dropout_or_identity(dropout))
            layers.append(nn.Conv2d(ch, int(v), 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(int(v)))
            layers.append(nn.ReLU(inplace=True))
            ch = int(v)
        self.features = nn.Sequential(*layers)
        # 1x1 after five pools on 32x32 (where this is the identity); any larger input is averaged.
        self.pool = nn.AdaptiveAvgPool2d(1)
        if head == "linear":
            self.classifier = nn.Sequential(dropout_or_identity(dropout), nn.Linear(ch, num_classes))
        elif head == "mlp":
            self.classifier = nn.Sequential(
                dropout_or_identity(head_dropout),
                nn.Linear(ch, 512),
                nn.ReLU(inplace=True),
                dropout_or_identity(head_dropout),
                nn.Linear(512, 512),
                nn.ReLU(inplace=True),
                nn.Linear(512, num_classes),
            )
        else:
            raise ValueError(f"head must be 'linear' or 'mlp', got {head!r}")
        he_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


@register_model("vgg")
def vgg(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 16,
    batch_norm: bool = True,
    head: Head = "linear",
    head_dropout: float = 0.5,
    dropout: float = 0.0,
) -> VGG:
    return VGG(
        num_classes,
        in_channels=in_channels_of(input_shape),
        depth=int(depth),
        batch_norm=bool(batch_norm),
        head=head,
        head_dropout=float(head_dropout),
        dropout=float(dropout),
    )


class VGGHWA(nn.Module):
    """TFP's ``bayesian_vgg`` as a deterministic network (see the module docstring)."""

    FILTERS = (64, 128, 256, 512, 512)

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        spatial: tuple[int, int] = (32, 32),
        dropout: float = 0.0,
        bn_momentum: float = 0.01,
    ):
        super().__init__()
        if not 0.0 < bn_momentum <= 1.0:
            raise ValueError(f"vgg_hwa: bn_momentum must be in (0, 1] (PyTorch convention: the new batch's weight), "
                             f"got {bn_momentum}")
        layers: list[nn.Module] = []
        ch = in_channels
        h, w = spatial
        for f in self.FILTERS:
            for _ in range(2):
                layers += [
                    nn.Conv2d(ch, f, 3, padding=1),
                    nn.BatchNorm2d(f, eps=1e-3, momentum=bn_momentum),
                    nn.ReLU(inplace=True),
                ]
                ch = f
            layers.append(nn.MaxPool2d(2, 2))  # Keras MaxPooling2D default padding 'valid': floor
            h, w = h // 2, w // 2
        if h < 1 or w < 1:
            raise ValueError(f"vgg_hwa needs inputs of at least 32x32, got {spatial}")
        self.features = nn.Sequential(*layers)
        self.dropout = dropout_or_identity(dropout)
        self.head = nn.Linear(ch * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(torch.flatten(self.features(x), 1)))


@register_model("vgg_hwa")
def vgg_hwa(
    num_classes: int, input_shape: Sequence[int] | None = None, dropout: float = 0.0,
    bn_momentum: float = 0.01,
) -> VGGHWA:
    return VGGHWA(
        num_classes,
        in_channels=in_channels_of(input_shape),
        spatial=spatial_of(input_shape, (32, 32)),
        dropout=float(dropout),
        bn_momentum=float(bn_momentum),
    )
