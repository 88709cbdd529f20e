"""Fully connected network on the flattened input (the small-data / toy-problem backbone).

``mlp`` with ``hidden: [500, 300]`` on 1x28x28 inputs is bSAM's MNIST MLP 784-500-300-classes
(545,810 parameters for 10 classes). The paper says ReLU and classes - 1 outputs; the bSAM code uses ELU (and a
0.05 bias init, not built in here) and one output per class, as here: ``activation="elu"`` gives the code's ELU.
``dropout > 0`` adds an ``nn.Dropout`` after every hidden activation; with 0 there is none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from torch import nn

from .registry import register_model

Activation = Literal["relu", "elu"]
_ACTIVATIONS = {"relu": nn.ReLU, "elu": nn.ELU}


class MLP(nn.Sequential):
    """Flatten -> [Linear -> activation -> (Dropout)] * len(hidden) -> Linear."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: Sequence[int] = (500, 300),
        dropout: float = 0.0,
        activation: Activation = "relu",
    ):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, int(h)), _ACTIVATIONS[activation]()]
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
    activation: Activation = "relu",
) -> MLP:
    if input_shape is None:
        raise ValueError("mlp needs input_shape to size its first layer")
    return MLP(
        math.prod(input_shape),
        num_classes,
        hidden=tuple(hidden),
        dropout=float(dropout),
        activation=activation,
    )
