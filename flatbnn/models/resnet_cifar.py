"""ResNet for CIFAR with BatchNorm (He et al., 2016, "Deep Residual Learning", Sec. 4.2).

Depth 6n + 2: a 3x3 conv (16 channels) + BN + ReLU; three stages of n post-activation basic blocks
(conv3x3-BN-ReLU-conv3x3-BN, add, ReLU) with 16-32-64 channels, the first block of stages 2 and 3
halving the resolution; global average pooling; a linear classifier. ResNet-20/32/56 are the paper's
0.27M / 0.46M / 0.85M networks (its Table 6).

Shortcut where the shape changes (``shortcut``):

* ``"A"`` (default) -- the paper's CIFAR choice ("option A"): the input subsampled with stride 2 and
  zero-padded with the extra channels; parameter-free, which is what gives the published counts.
  Fisher SAM's label-noise ResNet-32 and its ResNet-20/56 are read as this standard network.
* ``"B"`` -- a 1x1 conv (stride 2) + BN projection, as in homura's ``cifar_resnet`` (the model zoo
  the public ASAM example imports, and Fisher SAM follows ASAM's setup); 2,752 more parameters.

``dropout > 0`` adds one ``nn.Dropout`` before the classifier (MC-Dropout); with 0 there is none.
He-normal (fan_out) conv init, as the paper ("initialize the weights as in [He et al. 2015]").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity, he_init_, projection_shortcut

Shortcut = Literal["A", "B"]


class _PadShortcut(nn.Module):
    """Option A: ``x[:, :, ::s, ::s]`` with zero channels appended (no parameters)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.extra, self.stride = out_ch - in_ch, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, 0, self.extra)) if self.extra else x

    def extra_repr(self) -> str:
        return f"stride={self.stride}, pad_channels={self.extra}"


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int, shortcut: Shortcut):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        if stride == 1 and in_ch == out_ch:
            self.shortcut: nn.Module = nn.Identity()
        elif shortcut == "A":
            self.shortcut = _PadShortcut(in_ch, out_ch, stride)
        else:
            self.shortcut = projection_shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 20,
        width: int = 16,
        shortcut: Shortcut = "A",
        dropout: float = 0.0,
    ):
        super().__init__()
        if (depth - 2) % 6 != 0:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 56, 110, ...), got {depth}")
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages, in_ch = [], width
        for stage in range(3):
            out_ch = width * 2**stage
            blocks = []
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(in_ch, out_ch, stride, shortcut))
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


@register_model("resnet_cifar")
def resnet_cifar(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 20,
    shortcut: Shortcut = "A",
    dropout: float = 0.0,
) -> CifarResNet:
    return CifarResNet(
        num_classes,
        in_channels=in_channels_of(input_shape),
        depth=int(depth),
        shortcut=shortcut,
        dropout=float(dropout),
    )
