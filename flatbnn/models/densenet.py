"""DenseNet-BC (Huang et al., 2017) with a CIFAR stem; DenseNet-121 for Fisher SAM's Table 1.

DenseNet-121's layout (dense blocks of 6-12-24-16 bottleneck layers, growth rate k = 32, 4k-channel
1x1 bottlenecks, compression 0.5 in the transitions) with the usual CIFAR stem (kuangliu/pytorch-cifar):
a single 3x3 stride-1 conv to 2k channels, no stem BN/ReLU or max-pool. Transitions are
BN-ReLU-conv1x1-avgpool2; after the last block BN-ReLU, global average pooling, linear classifier.
That is torchvision's ``densenet121`` with its 7x7 conv + BN + max-pool stem replaced by the 3x3 conv:
6,956,298 parameters for 10 classes (torchvision's ImageNet model: 7,978,856). FSAM's code is not
public; this is the common CIFAR DenseNet-121.

``stage_blocks`` (smoke runs only) replaces the 6-12-24-16 layer counts, same growth rate and transitions.

``dropout > 0`` adds one ``nn.Dropout`` before the classifier (MC-Dropout); with 0 there is none.
(torchvision's ``drop_rate`` instead drops inside every dense layer through ``F.dropout``, which an
``nn.Dropout``-based MC-Dropout evaluation cannot switch on.) The ImageNet DenseNet-161 is
``densenet161`` in :mod:`flatbnn.models.torchvision_models`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity, he_init_

BLOCKS = {121: (6, 12, 24, 16), 169: (6, 12, 32, 32), 201: (6, 12, 48, 32)}


class DenseLayer(nn.Module):
    """BN-ReLU-conv1x1 (bn_size * k) - BN-ReLU-conv3x3 (k); output concatenated to the input."""

    def __init__(self, in_ch: int, growth: int, bn_size: int = 4):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = nn.Conv2d(in_ch, bn_size * growth, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return torch.cat([x, out], 1)


class Transition(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int):
        super().__init__(
            nn.BatchNorm2d(in_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(in_ch, out_ch, 1, bias=False),
            nn.AvgPool2d(2),
        )


class DenseNetCifar(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 121,
        growth_rate: int = 32,
        compression: float = 0.5,
        dropout: float = 0.0,
        stage_blocks: Sequence[int] | None = None,
    ):
        super().__init__()
        if depth not in BLOCKS:
            raise ValueError(f"DenseNet depth must be one of {sorted(BLOCKS)}, got {depth}")
        if stage_blocks is not None and (len(stage_blocks) != 4 or min(int(b) for b in stage_blocks) < 1):
            raise ValueError(f"DenseNet stage_blocks takes 4 positive layer counts, got {list(stage_blocks)}")
        ch = 2 * growth_rate
        self.stem = nn.Conv2d(in_channels, ch, 3, padding=1, bias=False)
        stages: list[nn.Module] = []
        blocks = tuple(int(b) for b in stage_blocks) if stage_blocks is not None else BLOCKS[depth]
        for i, n in enumerate(blocks):
            layers = []
            for _ in range(n):
                layers.append(DenseLayer(ch, growth_rate))
                ch += growth_rate
            stages.append(nn.Sequential(*layers))
            if i < len(blocks) - 1:
                out_ch = int(ch * compression)
                stages.append(Transition(ch, out_ch))
                ch = out_ch
        self.features = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(ch)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = dropout_or_identity(dropout)
        self.head = nn.Linear(ch, num_classes)
        he_init_(self)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.features(self.stem(x))))
        return self.head(self.dropout(torch.flatten(self.pool(x), 1)))


@register_model("densenet_cifar")
def densenet_cifar(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 121,
    growth_rate: int = 32,
    dropout: float = 0.0,
    stage_blocks: Sequence[int] | None = None,
) -> DenseNetCifar:
    return DenseNetCifar(
        num_classes,
        in_channels=in_channels_of(input_shape),
        depth=int(depth),
        growth_rate=int(growth_rate),
        dropout=float(dropout),
        stage_blocks=stage_blocks,
    )
