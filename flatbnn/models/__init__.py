"""Model registry: one file per architecture family, builders registered by name.

A builder is ``fn(num_classes, input_shape, **kw) -> nn.Module`` returning logits. Configs call
:func:`create_model` (``configs/model/<name>.yaml``), so everything an experiment can vary about a
backbone is a builder keyword argument.
"""

from __future__ import annotations

from flatbnn.models.registry import Builder, create_model, in_channels_of, list_models, register_model  # noqa: F401

__all__ = ["create_model", "list_models", "register_model"]

# Every family module, so that each registers its builders (they import models/registry.py, not this package).
from . import (  # noqa: F401
    densenet,
    lenet,
    mlp,
    preresnet,
    pyramidnet,
    resnet,
    resnet_cifar,
    resnet_frn,
    resnext,
    torchvision_models,
    vgg,
    vit,
    wrn,
)
