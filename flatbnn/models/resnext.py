"""ResNeXt for CIFAR (Xie et al., 2017, Sec. 5.3): ResNeXt-29 with cardinality C and bottleneck width d.

Depth 9n + 2 (29: n = 3 blocks per stage): a 3x3 conv (64 channels) + BN + ReLU; three stages with
output widths 256-512-1024 (stride 1-2-2); each block is the post-activation bottleneck
conv1x1 (C*d*2^s) - BN - ReLU - grouped conv3x3 (C groups, stride) - BN - ReLU - conv1x1 - BN, added
to the input (1x1 conv + BN projection where the shape changes), then ReLU; global average pooling,
linear classifier. "32x4d" means C = 32 groups of d = 4 channels in the first stage (group width
128-256-512 across the stages).

Published CIFAR ResNeXts check this structure: ``cardinality=8, base_width=64`` gives 34,426,698 and
``16, 64`` 68,155,210 parameters (10 classes) -- Xie et al. print 34.4M for 8x64d (their 68.1M for
16x64d looks truncated), bearpaw/pytorch-classification 34.43M and 68.16M. Fisher SAM's
ResNeXt-29-32x4d (after ASAM, whose public example imports homura's ``resnext29_32x4d`` -- the same
layout) has 4,775,754 parameters for 10 classes; no paper prints a figure for it.

``dropout > 0`` adds one ``nn.Dropout`` before the classifier (MC-Dropout); with 0 there is none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity, he_init_, projection_shortcut


class ResNeXtBlock(nn.Module):
    def __init__(self, in_ch: int, group_width: int, out_ch: int, cardinality: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, group_width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(group_width)
        self.conv2 = nn.Conv2d(
            group_width, group_width, 3, stride=stride, padding=1, groups=cardinality, bias=False
        )
        self.bn2 = nn.BatchNorm2d(group_width)
        self.conv3 = nn.Conv2d(group_width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut = projection_shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ResNeXtCifar(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 29,
        cardinality: int = 32,
        base_width: int = 4,
        dropout: float = 0.0,
    ):
        super().__init__()
        if (depth - 2) % 9 != 0:
            raise ValueError(f"ResNeXt depth must be 9n+2 (29, ...), got {depth}")
        n = (depth - 2) // 9
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
        )
        stages, in_ch = [], 64
        for stage in range(3):
            group_width = cardinality * base_width * 2**stage
            out_ch = 256 * 2**stage
            blocks = []
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(ResNeXtBlock(in_ch, group_width, out_ch, cardinality, stride))
                in_ch = out_ch
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = dropout_or_identity(dropout)
        self.head = nn.Linear(in_ch, num_classes)
        he_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.pool(self.stages(self.stem(x))), 1)
        return self.head(self.dropout(x))


@register_model("resnext_cifar")
def resnext_cifar(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 29,
    cardinality: int = 32,
    base_width: int = 4,
    dropout: float = 0.0,
) -> ResNeXtCifar:
    return ResNeXtCifar(
        num_classes,
        in_channels=in_channels_of(input_shape),
        depth=int(depth),
        cardinality=int(cardinality),
        base_width=int(base_width),
        dropout=float(dropout),
    )
