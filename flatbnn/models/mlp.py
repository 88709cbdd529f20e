"""Fully connected network on the flattened input (the small-data / toy-problem backbone)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from . import register_model


class MLP(nn.Sequential):
    """Flatten -> [Linear -> ReLU -> (Dropout)] * len(hidden) -> Linear."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: Sequence[int] = (500, 300),
        dropout: float = 0.0,
    ):
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = int(h)
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)


@register_model("mlp")
def mlp(
    num_classes: int,
    input_shape: Sequence[int] | None,
    hidden: Sequence[int] = (500, 300),
    dropout: float = 0.0,
) -> MLP:
    if input_shape is None:
        raise ValueError("mlp needs input_shape to size its first layer")
    return MLP(math.prod(input_shape), num_classes, hidden=tuple(hidden), dropout=float(dropout))
