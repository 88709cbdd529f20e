"""Wide ResNet (Zagoruyko & Komodakis, 2016) for CIFAR-sized inputs.

Pre-activation basic blocks ``BN-ReLU-conv3x3-BN-ReLU-(dropout)-conv3x3`` with a 1x1 conv shortcut on
the pre-activated input when the shape changes, as in the original code; convolutions have no bias.
``stride_on="second"`` moves a block's stride onto its second conv, as the SWAG reference code does;
the parameters are identical, only where the resolution drops (and so the FLOPs) differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import in_channels_of, register_model

StrideOn = Literal["first", "second"]


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


class WideBasic(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int, dropout: float, stride_on: StrideOn):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = _conv3x3(in_ch, out_ch, stride if stride_on == "first" else 1)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv2 = _conv3x3(out_ch, out_ch, stride if stride_on == "second" else 1)
        self.shortcut = (
            nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)
            if stride != 1 or in_ch != out_ch
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = F.relu(self.bn1(x))
        residual = x if self.shortcut is None else self.shortcut(o)
        out = self.conv1(o)
        out = self.conv2(self.dropout(F.relu(self.bn2(out))))
        return out + residual


class WideResNet(nn.Module):
    """WRN-depth-k: three stages of (depth-4)/6 blocks, widths 16k-32k-64k, final BN-ReLU."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 28,
        widen_factor: int = 10,
        dropout: float = 0.0,
        stride_on: StrideOn = "first",
    ):
        super().__init__()
        if (depth - 4) % 6 != 0:
            raise ValueError(f"WRN depth must be 6n+4 (16, 22, 28, 40, ...), got {depth}")
        if stride_on not in ("first", "second"):
            raise ValueError(f"stride_on must be 'first' or 'second', got {stride_on!r}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.stem = _conv3x3(in_channels, widths[0])
        stages = []
        in_ch = widths[0]
        for stage, out_ch in enumerate(widths[1:]):
            blocks = []
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(WideBasic(in_ch, out_ch, stride, dropout, stride_on))
                in_ch = out_ch
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(in_ch)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stages(self.stem(x))))
        return self.head(torch.flatten(self.pool(x), 1))


@register_model("wrn")
def wrn(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 28,
    widen_factor: int = 10,
    dropout: float = 0.0,
    stride_on: StrideOn = "first",
) -> WideResNet:
    return WideResNet(
        num_classes,
        in_channels=in_channels_of(input_shape),
        depth=int(depth),
        widen_factor=int(widen_factor),
        dropout=float(dropout),
        stride_on=stride_on,
    )
