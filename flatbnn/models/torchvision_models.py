"""ImageNet networks from torchvision: DenseNet-161 and ResNet-152 (flat_seeking_bnn Table 4).

The flat_seeking_bnn ImageNet code builds ``torchvision.models.<name>(pretrained=True)`` and runs
SWAG / SGLD (and their F- versions) from those weights for 10 epochs. Here the torchvision builders are
called with ``weights=None`` (random init, nothing downloaded) and ``num_classes`` from the data set:

* ``pretrained_path``: a local state_dict file (plain, or under 'state_dict' / 'model'; 'module.'
  prefixes and torchvision's legacy DenseNet key names are handled) loaded into the model; a classifier
  of another shape (1000-class weights into a 10-class model) is skipped and left freshly initialised.
  A missing file raises FileNotFoundError.
* ``pretrained: true`` asks torchvision for its ``IMAGENET1K_V1`` weights -- what ``pretrained=True``
  meant when the paper's code ran -- and so downloads them: for users with internet only, off by
  default and never used by the tests. Needs ``num_classes`` 1000.

Inputs: 3 channels, any size >= 32 (adaptive pooling); the papers use 3x224x224.
DenseNet-161: 28,681,000 parameters, ResNet-152: 60,192,808 (1000 classes), as torchvision documents.
* ``stage_blocks``: blocks per stage other than the named net's (ResNet-152: 3-8-36-3, DenseNet-161:
  6-12-36-24), same torchvision class, widths and key names. Only for smoke runs (scripts/reproduce.py
  ``--scale smoke`` sets 1-1-1-1): a full-depth step costs a minute on 2 CPU cores and checks nothing the
  shallow one does not. Refused together with pretrained weights (they would not fit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torchvision
from torch import nn
from torchvision.models.densenet import DenseNet
from torchvision.models.resnet import Bottleneck, ResNet

from .registry import register_model
from ._common import check_file, load_pretrained_


def _build(
    name: str,
    num_classes: int,
    input_shape: Sequence[int] | None,
    pretrained_path: str | None,
    pretrained: bool,
    stage_blocks: Sequence[int] | None = None,
) -> nn.Module:
    if input_shape is not None and (len(input_shape) != 3 or int(input_shape[0]) != 3):
        raise ValueError(f"{name} takes 3-channel (3, H, W) images, got {tuple(input_shape)}")
    path = check_file(pretrained_path)  # fail before the (slow) build
    if pretrained and path is not None:
        raise ValueError("give pretrained_path or pretrained, not both")
    builder: Callable[..., nn.Module] = getattr(torchvision.models, name)
    if stage_blocks is not None:
        blocks = [int(b) for b in stage_blocks]
        if len(blocks) != 4 or min(blocks) < 1:
            raise ValueError(f"{name}: stage_blocks takes 4 positive block counts, got {list(stage_blocks)}")
        if pretrained or path is not None:
            raise ValueError(f"{name}: stage_blocks changes the architecture; the pretrained weights would not fit")
        return _AT_STAGE_BLOCKS[name](blocks, num_classes)
    if pretrained:
        if num_classes != 1000:
            raise ValueError(f"pretrained {name} weights have 1000 classes, not {num_classes}")
        weights = torchvision.models.get_model_weights(name).IMAGENET1K_V1
        return builder(weights=weights)
    model = builder(weights=None, num_classes=num_classes)
    if path is not None:
        load_pretrained_(model, path, head_prefixes=("fc.", "classifier."))
    return model


# the torchvision class and the other arguments the named builder passes it (torchvision/models/resnet.py:
# Bottleneck blocks; densenet.py: growth 48, 96 stem features), with the block counts free
_AT_STAGE_BLOCKS: dict[str, Callable[[list[int], int], nn.Module]] = {
    "resnet152": lambda blocks, num_classes: ResNet(Bottleneck, blocks, num_classes=num_classes),
    "densenet161": lambda blocks, num_classes: DenseNet(48, tuple(blocks), 96, num_classes=num_classes),
}


@register_model("densenet161")
def densenet161(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    pretrained_path: str | None = None,
    pretrained: bool = False,
    stage_blocks: Sequence[int] | None = None,
) -> nn.Module:
    return _build("densenet161", num_classes, input_shape, pretrained_path, bool(pretrained), stage_blocks)


@register_model("resnet152")
def resnet152(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    pretrained_path: str | None = None,
    pretrained: bool = False,
    stage_blocks: Sequence[int] | None = None,
) -> nn.Module:
    return _build("resnet152", num_classes, input_shape, pretrained_path, bool(pretrained), stage_blocks)
