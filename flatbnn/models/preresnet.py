"""Pre-activation ResNet (He et al., 2016, "Identity Mappings in Deep Residual Networks") for CIFAR.

The depth / block rule follows the SWAG reference code: bottleneck blocks (expansion 4, depth 9n+2)
for depth >= 44, basic blocks (depth 6n+2) below, so PreResNet-164 has 18 bottlenecks per stage
(1.70M parameters, the paper's figure). ``block="basic"`` forces basic blocks: PreResNet-110 of He et
al. (1.7M) is ``depth=110, block="basic"`` (the SWAG code's PreResNet110 is the bottleneck one).

Options, each defaulting to the paper and offering what the flat_seeking_bnn / SWAG code does:

* ``shortcut_input``: where the 1x1 projection shortcut reads from -- ``"preact"`` (default, the
  paper's code: the block's BN-ReLU output) or ``"raw"`` (the block input ``x``, as in the SWAG code,
  ported from bearpaw/pytorch-classification). Same parameters.
* ``dropout`` (MC-Dropout; 0 = no Dropout modules): placed as the SWAG code's ``PreResNet164Drop``
  (used for the MC-Dropout rows of flat_seeking_bnn Tables 1-2, p = 0.01): an ``nn.Dropout`` before
  every convolution of the residual branch (after its BN-ReLU), before the projection-shortcut conv,
  and before the classifier.
* ``depth_rule``: ``"he"`` (default) derives blocks per stage from the depth as above;
  ``"swag_dropout"`` reproduces the SWAG code's ``PreResNetDrop``, which computes n = (depth - 2) // 6
  for bottleneck nets too, so its "PreResNet164Drop" has 27 bottlenecks per stage (245 layers,
  2.49M parameters) -- that is the network behind the papers' PreResNet-164 MC-Dropout numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity

BlockKind = Literal["auto", "basic", "bottleneck"]
ShortcutInput = Literal["preact", "raw"]
DepthRule = Literal["he", "swag_dropout"]


def _conv(in_ch: int, out_ch: int, kernel_size: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)


class _PreActBlock(nn.Module):
    """Shared forward: BN-ReLU once, reused by the projection shortcut when there is one."""

    shortcut: nn.Module | None

    def _init_shortcut(
        self, in_ch: int, out_ch: int, stride: int, dropout: float, shortcut_input: ShortcutInput
    ) -> None:
        if shortcut_input not in ("preact", "raw"):
            raise ValueError(f"shortcut_input must be 'preact' or 'raw', got {shortcut_input!r}")
        self.shortcut_input = shortcut_input
        if stride != 1 or in_ch != out_ch:
            self.shortcut_drop = dropout_or_identity(dropout)
            self.shortcut = _conv(in_ch, out_ch, 1, stride)
        else:
            self.shortcut = None

    def residual(self, o: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = F.relu(self.bn1(x))
        if self.shortcut is None:
            shortcut = x
        else:
            shortcut = self.shortcut(self.shortcut_drop(o if self.shortcut_input == "preact" else x))
        return self.residual(o) + shortcut


class PreActBasic(_PreActBlock):
    expansion = 1

    def __init__(
        self,
        in_ch: int,
        planes: int,
        stride: int = 1,
        dropout: float = 0.0,
        shortcut_input: ShortcutInput = "preact",
    ):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.drop1 = dropout_or_identity(dropout)
        self.conv1 = _conv(in_ch, planes, 3, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.drop2 = dropout_or_identity(dropout)
        self.conv2 = _conv(planes, planes, 3)
        self._init_shortcut(in_ch, planes, stride, dropout, shortcut_input)

    def residual(self, o: torch.Tensor) -> torch.Tensor:
        o = self.conv1(self.drop1(o))
        return self.conv2(self.drop2(F.relu(self.bn2(o))))


class PreActBottleneck(_PreActBlock):
    expansion = 4

    def __init__(
        self,
        in_ch: int,
        planes: int,
        stride: int = 1,
        dropout: float = 0.0,
        shortcut_input: ShortcutInput = "preact",
    ):
        super().__init__()
        out_ch = planes * self.expansion
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.drop1 = dropout_or_identity(dropout)
        self.conv1 = _conv(in_ch, planes, 1)
        self.bn2 = nn.BatchNorm2d(planes)
        self.drop2 = dropout_or_identity(dropout)
        self.conv2 = _conv(planes, planes, 3, stride)
        self.bn3 = nn.BatchNorm2d(planes)
        self.drop3 = dropout_or_identity(dropout)
        self.conv3 = _conv(planes, out_ch, 1)
        self._init_shortcut(in_ch, out_ch, stride, dropout, shortcut_input)

    def residual(self, o: torch.Tensor) -> torch.Tensor:
        o = self.conv1(self.drop1(o))
        o = self.conv2(self.drop2(F.relu(self.bn2(o))))
        return self.conv3(self.drop3(F.relu(self.bn3(o))))


class PreResNet(nn.Module):
    """3x3 conv stem (16 ch), three stages of planes 16-32-64, final BN-ReLU, avg pool, linear."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 164,
        block: BlockKind = "auto",
        dropout: float = 0.0,
        shortcut_input: ShortcutInput = "preact",
        depth_rule: DepthRule = "he",
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
        if depth_rule == "swag_dropout":
            per_block = 6  # the SWAG code's PreResNetDrop: n = (depth - 2) // 6 for every block kind
        elif depth_rule != "he":
            raise ValueError(f"depth_rule must be 'he' or 'swag_dropout', got {depth_rule!r}")
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
                blocks.append(cls(in_ch, planes, stride, dropout, shortcut_input))
                in_ch = planes * cls.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(in_ch)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = dropout_or_identity(dropout)
        self.head = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stages(self.stem(x))))
        return self.head(self.dropout(torch.flatten(self.pool(x), 1)))


@register_model("preresnet")
def preresnet(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 164,
    block: BlockKind = "auto",
    dropout: float = 0.0,
    shortcut_input: ShortcutInput = "preact",
    depth_rule: DepthRule = "he",
) -> PreResNet:
    return PreResNet(
        num_classes,
        in_channels=in_channels_of(input_shape),
        depth=int(depth),
        block=block,
        dropout=float(dropout),
        shortcut_input=shortcut_input,
        depth_rule=depth_rule,
    )
