"""LeNet-5 (LeCun et al., 1998) for MNIST-like (1x28x28) and CIFAR-like (3x32x32) inputs.

Three readings, chosen with ``variant`` (all ReLU, max-pool, fully connected C3):

* ``"classic"`` (default) -- the paper's layout: conv 6@5x5 - pool - conv 16@5x5 - pool -
  conv 120@5x5 - fc 84 - fc classes, on a 32x32 field: 28x28 inputs are zero-padded by 2 in the first
  conv (the usual MNIST adaptation), so C5 sees 5x5 maps and outputs 1x1x120. 61,706 parameters on
  MNIST, 62,006 on CIFAR (10 classes).
* ``"tfp"`` -- HWA's Bayesian LeNet-5 (Karimi & Li 2020; no code public): TensorFlow Probability's
  ``bayesian_neural_network.py`` example, which trains "LeNet-5" on the same 55,000-image MNIST split
  with Flipout: every conv 'SAME'-padded, 2x2 'SAME' pools, so C5 runs on 7x7 maps and feeds
  7*7*120 = 5,880 features to fc 84. 545,546 parameters on MNIST.
* ``"bsam"`` -- the bSAM code's LeNet-5 (FashionMNIST): 'SAME' convs 6-16-120, each followed by a 3x3
  stride-2 'VALID' max-pool, then fc 64 and the classifier (the code's has classes - 1 outputs, against
  one-hot labels of classes entries: that path cannot train as released; not built in here). 82,126 parameters on FashionMNIST with 10 outputs.

``dropout > 0`` adds an ``nn.Dropout`` before each of the two fully connected layers; with 0 none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from .registry import register_model
from ._common import dropout_or_identity

Variant = Literal["classic", "tfp", "bsam"]


class LeNet5(nn.Module):
    def __init__(
        self,
        num_classes: int,
        input_shape: Sequence[int] = (1, 28, 28),
        variant: Variant = "classic",
        dropout: float = 0.0,
    ):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"lenet5 needs a (C, H, W) input_shape, got {tuple(input_shape)}")
        c, h, w = (int(s) for s in input_shape)
        hidden = 84
        if variant == "classic":
            pad = 2 if min(h, w) < 32 else 0
            conv_pad = [pad, 0, 0]
            pools: list[nn.Module | None] = [nn.MaxPool2d(2, 2), nn.MaxPool2d(2, 2), None]
        elif variant == "tfp":
            conv_pad = [2, 2, 2]
            # 'SAME' 2x2/2 pooling = ceil mode (7x7 -> 4x4 would need it; 28 -> 14 -> 7 does not).
            pools = [nn.MaxPool2d(2, 2, ceil_mode=True), nn.MaxPool2d(2, 2, ceil_mode=True), None]
        elif variant == "bsam":
            conv_pad = [2, 2, 2]
            pools = [nn.MaxPool2d(3, 2), nn.MaxPool2d(3, 2), nn.MaxPool2d(3, 2)]
            hidden = 64
        else:
            raise ValueError(f"variant must be 'classic', 'tfp' or 'bsam', got {variant!r}")
        layers: list[nn.Module] = []
        ch = c
        for out_ch, pad, pool in zip((6, 16, 120), conv_pad, pools):
            layers += [nn.Conv2d(ch, out_ch, 5, padding=pad), nn.ReLU(inplace=True)]
            h, w = h + 2 * pad - 4, w + 2 * pad - 4
            if pool is not None:
                layers.append(pool)
                k, s, ceil = pool.kernel_size, pool.stride, pool.ceil_mode
                rnd = (lambda v: -(-v // s)) if ceil else (lambda v: v // s)
                h, w = rnd(h - k) + 1, rnd(w - k) + 1
            if h < 1 or w < 1:
                raise ValueError(f"input {tuple(input_shape)} is too small for lenet5 ({variant})")
            ch = out_ch
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            dropout_or_identity(dropout),
            nn.Linear(ch * h * w, hidden),
            nn.ReLU(inplace=True),
            dropout_or_identity(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register_model("lenet5")
def lenet5(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    variant: Variant = "classic",
    dropout: float = 0.0,
) -> LeNet5:
    if input_shape is None:
        raise ValueError("lenet5 needs input_shape to size its fully connected layers")
    return LeNet5(num_classes, tuple(input_shape), variant=variant, dropout=float(dropout))
