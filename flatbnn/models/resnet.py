"""ResNet-10/18/34 (He et al., 2016, ImageNet widths 64-128-256-512) with a CIFAR stem: torchvision's
``ResNet`` with ``BasicBlock``.

The usual CIFAR adaptation (kuangliu/pytorch-cifar; the bSAM code's ResNet-18 says it follows it):
the 7x7 stride-2 conv + max-pool stem becomes a 3x3 stride-1 conv (64 channels) + BN + ReLU, so a
32x32 image reaches the last stage at 4x4. Everything else is torchvision's: four stages of
post-activation basic blocks with strides 1-2-2-2; 1x1 conv + BN projection shortcuts where the shape
changes (option B); global average pooling; linear classifier; He-normal (fan_out) convs, BN 1/0.
Blocks per stage: ResNet-10 (1,1,1,1), ResNet-18 (2,2,2,2), ResNet-34 (3,4,6,3). ResNet-18 has
11,173,962 parameters for 10 classes. State-dict keys are torchvision's (``conv1``, ``layer1.0``,
``downsample``, ``fc``); checkpoints of the former hand-written module (``stem``, ``stages``,
``shortcut``, ``head``) still load (:func:`_rename_legacy_keys`).

Used by: flat_seeking_bnn Table 3 (ResNet10/18, SGVB; its code is not public -- the standard CIFAR
ResNet is assumed); bSAM Table 2 (ResNet-18; that code outputs num_classes logits, as here, and
zero-initialises the classifier -- not built in here); Fisher SAM Fig. 4 (ResNet-34,
adversarial parameter perturbation on CIFAR-10).

``dropout > 0`` adds one ``nn.Dropout`` before the classifier (MC-Dropout); with 0 there is none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torchvision.models.resnet as tv
from torch import nn

from .registry import in_channels_of, register_model
from ._common import dropout_or_identity, he_init_

BLOCKS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}

# former key -> torchvision key, at the start of a key or after a block index
_LEGACY_KEYS = ((re.compile(r"^stem\.0\."), "conv1."), (re.compile(r"^stem\.1\."), "bn1."),
                (re.compile(r"^stages\.(\d+)\."), lambda m: f"layer{int(m.group(1)) + 1}."),
                (re.compile(r"^(layer\d+\.\d+\.)shortcut\."), r"\1downsample."), (re.compile(r"^head\."), "fc."))


def _rename_legacy_keys(module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: rename the former module's keys (under ``prefix``) in place, so the
    checkpoints of earlier runs resume and evaluate. (``trainer.init_from`` compares key names before
    it loads and so refuses them in one line naming the unexpected keys.)"""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = key[len(prefix):]
        for pattern, repl in _LEGACY_KEYS:
            new = pattern.sub(repl, new)
        if prefix + new != key:
            state_dict[prefix + new] = state_dict.pop(key)


class ResNet(tv.ResNet):
    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        depth: int = 18,
        dropout: float = 0.0,
    ):
        if depth not in BLOCKS:
            raise ValueError(f"depth must be one of {sorted(BLOCKS)}, got {depth}")
        # Built on the meta device (no RNG drawn, no memory), then initialised below in module order:
        # the ImageNet stem torchvision builds and discards would otherwise shift the RNG stream, and a
        # seed would no longer give the weights it gave before (the blocks' default inits, then He init).
        device = torch.get_default_device()  # meta when counted under torch.device("meta")
        with torch.device("meta"):
            super().__init__(tv.BasicBlock, list(BLOCKS[depth]), num_classes=num_classes)
            self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.maxpool = nn.Identity()
        self.dropout = dropout_or_identity(dropout)
        self.to_empty(device=device)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear)):
                m.reset_parameters()
        he_init_(self)
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))


@register_model("resnet")
def resnet(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    depth: int = 18,
    dropout: float = 0.0,
) -> ResNet:
    return ResNet(
        num_classes, in_channels=in_channels_of(input_shape), depth=int(depth), dropout=float(dropout)
    )
