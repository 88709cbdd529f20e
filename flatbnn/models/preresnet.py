"""Pre-activation ResNet (He et al., 2016, "Identity Mappings in Deep Residual Networks") for CIFAR.

The depth / block rule follows the SWAG reference code: bottleneck blocks (expansion 4, depth 9n+2)
for depth >= 44, basic blocks (depth 6n+2) below, so PreResNet-164 has 18 bottlenecks per stage.
Projection shortcuts are a bias-free 1x1 conv applied, as in the paper, to the pre-activated input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import in_channels_of, register_model

BlockKind = Literal["auto", "basic", "bottleneck"]


def _conv(in_ch: int, out_ch: int, kernel_size: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)


class _PreActBlock(nn.Module):
    """Shared forward: BN-ReLU once, reused by the projection shortcut when there is one."""

    shortcut: nn.Module | None

    def residual(self, o: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = F.relu(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(o)
        return self.residual(o) + shortcut


class PreActBasic(_PreActBlock):
    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int = 1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = _conv(in_ch, planes, 3, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv(planes, planes, 3)
        self.shortcut = _conv(in_ch, planes, 1, stride) if stride != 1 or in_ch != planes else None

    def residual(self, o: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.bn2(self.conv1(o))))


class PreActBottleneck(_PreActBlock):
    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int = 1):
        super().__init__()
        out_ch = planes * self.expansion
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = _conv(in_ch, planes, 1)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv(planes, planes, 3, stride)
        self.bn3 = nn.BatchNorm2d(planes)
        self.conv3 = _conv(planes, out_ch, 1)
        self.shortcut = _conv(in_ch, out_ch, 1, stride) if stride != 1 or in_ch != out_ch else None

    def residual(self, o: torch.Tensor) -> torch.Tensor:
        o = self.conv1(o)
        o = self.conv2(F.relu(self.bn2(o)))
        return self.conv3(F.relu(self.bn3(o)))


class PreResNet(nn.Module):
    """3x3 conv stem (16 ch), three stages of planes 16-32-64, final BN-ReLU, avg pool, linear."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, depth: int = 164, block: BlockKind = "auto"
    ):
        super().__init__()
        if block == "auto":
            block = "bottleneck" if depth >= 44 else "basic"
        if block == "bottleneck":
            cls, per_block = PreActBottleneck, 9
        elif block == "basic":
            cls, per_block = PreActBasic, 6
        else:
            raise ValueError(f"block must be 'auto', 'basic' or 'bottleneck', got {block!r}")
        if (depth - 2) % per_block != 0:
            raise ValueError(f"{block} PreResNet depth must be {per_block}n+2, got {depth}")
        n = (depth - 2) // per_block

        self.stem = _conv(in_channels, 16, 3)
        stages = []
        in_ch = 16
        for stage, planes in enumerate((16, 32, 64)):
            blocks = []
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(cls(in_ch, planes, stride))
                in_ch = planes * cls.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(in_ch)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stages(self.stem(x))))
        return self.head(torch.flatten(self.pool(x), 1))


@register_model("preresnet")
def preresnet(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 164,
    block: BlockKind = "auto",
) -> PreResNet:
    return PreResNet(
        num_classes, in_channels=in_channels_of(input_shape), depth=int(depth), block=block
    )
