"""Wide ResNet (Zagoruyko & Komodakis, 2016) for CIFAR-sized inputs.

Default = the original WRN: pre-activation basic blocks ``BN-ReLU-conv3x3-BN-ReLU-(dropout)-conv3x3``,
stride on the first conv, bias-free convolutions, and a 1x1 conv shortcut reading the pre-activated
input when the shape changes. WRN-28-10 has 36,479,194 parameters (36.5M in the paper).

The flat_seeking_bnn tables come from the SWAG reference code's ``WideResNet28x10`` /
``WideResNet28x10Drop`` (ported from meliketoy/wide-resnet.pytorch), which differs in four places;
each is an option here (the ``wrn28x10_swag`` config sets all four):

* ``stride_on="second"``: a block's stride sits on its second conv (~13% more FLOPs, same parameters);
* ``dropout_placement="swag"``: dropout on the first conv's output (before BN2), plus one before the
  classifier -- ``WideResNet28x10Drop`` with p = 0.05 is ``wrn28x10_swag`` with ``dropout=0.05``.
  ``"original"`` (default) is the WRN paper's dropout between BN2-ReLU and the second conv, none at
  the classifier;
* ``conv_bias=True``: every conv has a bias (+10,096 parameters for WRN-28-10: 36,489,290);
* ``shortcut_input="raw"``: the 1x1 shortcut reads the block input, not its BN-ReLU output.

Two more SWAG-code details are options too, off by default: ``init="torch_default"`` keeps PyTorch's own
layer init (the SWAG code's ``conv_init`` is never called; default ``"he"``: He-normal convs, zero biases), and
``final_bn_momentum=0.9`` is its final BatchNorm's ``momentum=0.9`` (PyTorch convention: the new batch's
weight; default 0.1). They matter most where no BN refresh follows training (MC-Dropout, Deep-ens, SGLD).
``init="fan_in_zero_head"`` is the init of davda54/sam's ``WideResNet`` (the VariationalSAM authors' notebooks):
He-normal convs with fan_in (not fan_out) and an all-zero classifier (weight and bias).
With ``dropout=0`` no Dropout module exists, whatever the placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity

StrideOn = Literal["first", "second"]
DropoutPlacement = Literal["original", "swag"]
ShortcutInput = Literal["preact", "raw"]
Init = Literal["he", "torch_default", "fan_in_zero_head"]


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1, bias: bool = False) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=bias)


class WideBasic(nn.Module):
    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        stride: int,
        dropout: float,
        stride_on: StrideOn,
        dropout_placement: DropoutPlacement = "original",
        conv_bias: bool = False,
        shortcut_input: ShortcutInput = "preact",
    ):
        super().__init__()
        self.dropout_placement = dropout_placement
        self.shortcut_input = shortcut_input
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = _conv3x3(in_ch, out_ch, stride if stride_on == "first" else 1, conv_bias)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.dropout = dropout_or_identity(dropout)
        self.conv2 = _conv3x3(out_ch, out_ch, stride if stride_on == "second" else 1, conv_bias)
        self.shortcut = (
            nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=conv_bias)
            if stride != 1 or in_ch != out_ch
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = F.relu(self.bn1(x))
        if self.shortcut is None:
            residual = x
        else:
            residual = self.shortcut(o if self.shortcut_input == "preact" else x)
        out = self.conv1(o)
        if self.dropout_placement == "swag":
            out = self.conv2(F.relu(self.bn2(self.dropout(out))))
        else:
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
        dropout_placement: DropoutPlacement = "original",
        conv_bias: bool = False,
        shortcut_input: ShortcutInput = "preact",
        init: Init = "he",
        final_bn_momentum: float = 0.1,
    ):
        super().__init__()
        if init not in ("he", "torch_default", "fan_in_zero_head"):
            raise ValueError(f"init must be 'he', 'torch_default' or 'fan_in_zero_head', got {init!r}")
        if (depth - 4) % 6 != 0:
            raise ValueError(f"WRN depth must be 6n+4 (16, 22, 28, 40, ...), got {depth}")
        if stride_on not in ("first", "second"):
            raise ValueError(f"stride_on must be 'first' or 'second', got {stride_on!r}")
        if dropout_placement not in ("original", "swag"):
            raise ValueError(
                f"dropout_placement must be 'original' or 'swag', got {dropout_placement!r}"
            )
        if shortcut_input not in ("preact", "raw"):
            raise ValueError(f"shortcut_input must be 'preact' or 'raw', got {shortcut_input!r}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.stem = _conv3x3(in_channels, widths[0], bias=conv_bias)
        stages = []
        in_ch = widths[0]
        for stage, out_ch in enumerate(widths[1:]):
            blocks = []
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(
                    WideBasic(
                        in_ch, out_ch, stride, dropout, stride_on,
                        dropout_placement, conv_bias, shortcut_input,
                    )
                )
                in_ch = out_ch
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(in_ch, momentum=float(final_bn_momentum))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head_dropout = dropout_or_identity(dropout if dropout_placement == "swag" else 0.0)
        self.head = nn.Linear(in_ch, num_classes)
        for m in self.modules() if init != "torch_default" else ():
            if isinstance(m, nn.Conv2d):
                mode = "fan_in" if init == "fan_in_zero_head" else "fan_out"
                nn.init.kaiming_normal_(m.weight, mode=mode, nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                if init == "fan_in_zero_head":
                    nn.init.zeros_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stages(self.stem(x))))
        return self.head(self.head_dropout(torch.flatten(self.pool(x), 1)))


@register_model("wrn")
def wrn(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 28,
    widen_factor: int = 10,
    dropout: float = 0.0,
    stride_on: StrideOn = "first",
    dropout_placement: DropoutPlacement = "original",
    conv_bias: bool = False,
    shortcut_input: ShortcutInput = "preact",
    init: Init = "he",
    final_bn_momentum: float = 0.1,
) -> WideResNet:
    return WideResNet(
        num_classes,
        in_channels=in_channels_of(input_shape),
        depth=int(depth),
        widen_factor=int(widen_factor),
        dropout=float(dropout),
        stride_on=stride_on,
        dropout_placement=dropout_placement,
        conv_bias=bool(conv_bias),
        shortcut_input=shortcut_input,
        init=init,
        final_bn_momentum=float(final_bn_momentum),
    )
