"""ResNet-10/18/34 (He et al., 2016, ImageNet widths 64-128-256-512) with a CIFAR stem.

The usual CIFAR adaptation (kuangliu/pytorch-cifar; the bSAM code's ResNet-18 says it follows it):
the 7x7 stride-2 conv + max-pool stem becomes a 3x3 stride-1 conv (64 channels) + BN + ReLU, so a
32x32 image reaches the last stage at 4x4. Four stages of post-activation basic blocks with strides
1-2-2-2; 1x1 conv + BN projection shortcuts where the shape changes (option B); global average
pooling; linear classifier. Blocks per stage: ResNet-10 (1,1,1,1), ResNet-18 (2,2,2,2),
ResNet-34 (3,4,6,3). ResNet-18 has 11,173,962 parameters for 10 classes.

Used by: flat_seeking_bnn Table 3 (ResNet10/18, SGVB; its code is not public -- the standard CIFAR
ResNet is assumed); bSAM Table 2 (ResNet-18; that code outputs num_classes - 1 logits and
zero-initialises the classifier -- a method choice, not built in here); Fisher SAM Fig. 4 (ResNet-34,
adversarial parameter perturbation on CIFAR-10).

``dropout > 0`` adds one ``nn.Dropout`` before the classifier (MC-Dropout); with 0 there is none.
Init: He-normal (fan_out) convs, as torchvision's ResNet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity, he_init_, projection_shortcut

BLOCKS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = projection_shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 18,
        dropout: float = 0.0,
    ):
        super().__init__()
        if depth not in BLOCKS:
            raise ValueError(f"depth must be one of {sorted(BLOCKS)}, got {depth}")
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
        )
        stages, in_ch = [], 64
        for stage, n in enumerate(BLOCKS[depth]):
            out_ch = 64 * 2**stage
            blocks = []
            for i in range(n):
                blocks.append(BasicBlock(in_ch, out_ch, 2 if stage > 0 and i == 0 else 1))
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


@register_model("resnet")
def resnet(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 18,
    dropout: float = 0.0,
) -> ResNet:
    return ResNet(
        num_classes, in_channels=in_channels_of(input_shape), depth=int(depth), dropout=float(dropout)
    )
