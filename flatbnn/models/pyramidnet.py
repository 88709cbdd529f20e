"""PyramidNet (Han, Kim & Kim, 2017, "Deep Pyramidal Residual Networks") for CIFAR, bottleneck form.

Instead of doubling at each stage, the width grows by alpha / N after every one of the N = 3n
residual blocks (depth 9n + 2; block k has round(16 + k * alpha / N) "planes", Python's ``round`` as
in the authors' PyTorch code). Each block is the paper's unit without the first ReLU,
BN - conv1x1 - BN - ReLU - conv3x3(stride) - BN - ReLU - conv1x1 (4x planes) - BN, with a
parameter-free shortcut: 2x2 average pooling where the resolution halves, zero channels appended
where the width grows. Stem: 3x3 conv (16) + BN; after the last stage BN - ReLU, global average
pooling, linear classifier.

Fisher SAM's PyramidNet-272 (after SAM/ASAM) is depth 272, alpha = 200: 26,288,692 parameters for
CIFAR-100 (26,210,842 for CIFAR-10). The paper prints 26.0M (with 26.6M for 200/240,
26.8M for 236/220 and 1.7M for 164/48): those figures are this network's convolution + linear
parameters for 10 classes, i.e. without BatchNorm's scale and shift (25,999,978 for 272/200) -- all
four agree to the printed digit, which is how the tests check the structure. SAM trained it with
ShakeDrop; Fisher SAM's text does not mention ShakeDrop, which has no parameters and is not built in.

``dropout > 0`` adds one ``nn.Dropout`` before the classifier (MC-Dropout); with 0 there is none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity, he_init_


class PyramidBottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int):
        super().__init__()
        out_ch = planes * self.expansion
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = nn.Conv2d(in_ch, planes, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_ch, 1, bias=False)
        self.bn4 = nn.BatchNorm2d(out_ch)
        # parameter-free shortcut: 2x2 average pool where the resolution halves, zero channels
        self.pool = nn.AvgPool2d(2, 2, ceil_mode=True) if stride != 1 else None
        self.extra = out_ch - in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(self.bn1(x))
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.bn4(self.conv3(F.relu(self.bn3(out))))
        shortcut = x if self.pool is None else self.pool(x)
        if self.extra:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, 0, self.extra))
        return out + shortcut


class PyramidNet(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 272,
        alpha: float = 200,
        dropout: float = 0.0,
    ):
        super().__init__()
        if (depth - 2) % 9 != 0:
            raise ValueError(f"bottleneck PyramidNet depth must be 9n+2 (164, 272, ...), got {depth}")
        n = (depth - 2) // 9
        add_rate = alpha / (3 * n)

        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        )
        width = 16.0  # un-rounded planes of the latest block
        in_ch = 16
        stages = []
        for stage in range(3):
            blocks = []
            for i in range(n):
                width += add_rate
                planes = int(round(width))
                blocks.append(PyramidBottleneck(in_ch, planes, 2 if stage > 0 and i == 0 else 1))
                in_ch = planes * PyramidBottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(in_ch)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = dropout_or_identity(dropout)
        self.head = nn.Linear(in_ch, num_classes)
        he_init_(self)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stages(self.stem(x))))
        return self.head(self.dropout(torch.flatten(self.pool(x), 1)))


@register_model("pyramidnet")
def pyramidnet(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 272,
    alpha: float = 200,
    dropout: float = 0.0,
) -> PyramidNet:
    return PyramidNet(
        num_classes,
        in_channels=in_channels_of(input_shape),
        depth=int(depth),
        alpha=float(alpha),
        dropout=float(dropout),
    )
