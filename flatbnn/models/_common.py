"""Small pieces shared by the model families: optional dropout, He init, local weight files."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)


def dropout_or_identity(p: float) -> nn.Module:
    """``nn.Dropout(p)`` for p > 0, else ``nn.Identity()``.

    Identity has no parameters or buffers, so a network built with ``dropout=0`` has the same
    parameter count, state_dict keys and outputs as one without the option; and MC-Dropout
    (``model.apply(enable_dropout)``, which switches ``nn.Dropout`` modules to train mode) finds no
    dropout module in it.
    """
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    return nn.Dropout(p) if p > 0 else nn.Identity()


def projection_shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    """1x1 conv + BN shortcut when the shape changes, identity otherwise (He et al. option B)."""
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))


def he_init_(model: nn.Module) -> None:
    """He-normal (fan_out) convolutions with zero biases; BatchNorm weight 1, bias 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def spatial_of(input_shape: Sequence[int] | None, default: tuple[int, int]) -> tuple[int, int]:
    """(H, W) of a (C, H, W) input shape."""
    if input_shape is None:
        return default
    if len(input_shape) != 3:
        raise ValueError(f"conv nets need a (C, H, W) input_shape, got {tuple(input_shape)}")
    return int(input_shape[1]), int(input_shape[2])


def check_file(path: str | Path | None) -> Path | None:
    """``Path(path)`` if given; a clear FileNotFoundError (never a download) if it does not exist."""
    if path is None or str(path) == "":
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"pretrained_path {str(path)!r} does not exist (weights are never downloaded by "
            "pretrained_path; put a state_dict file there or leave pretrained_path null)"
        )
    return p


# torchvision's old DenseNet checkpoints name "norm.1" what the modules now call "norm1".
_LEGACY_DENSENET_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state_dict from a local file: plain, or under 'state_dict' / 'model' (DeiT, SWAG, Lightning
    checkpoints); 'module.' prefixes (DataParallel/DDP) removed; legacy DenseNet keys renamed."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a state_dict (mapping of tensors), got {type(obj).__name__}")
    out = {}
    for k, v in obj.items():
        k = k[len("module.") :] if k.startswith("module.") else k
        m = _LEGACY_DENSENET_KEY.match(k)
        out[m.group(1) + m.group(2) if m else k] = v
    return out


def load_pretrained_(
    model: nn.Module, path: Path, head_prefixes: Sequence[str] = ("fc.", "classifier.", "head.")
) -> list[str]:
    """Load ``path`` into ``model``; classifier tensors whose shape differs (a 1000-class checkpoint
    into a 10-class model) are skipped and left at their fresh initialisation. Everything else must
    match exactly. Returns the names of the skipped tensors."""
    state = read_state_dict(path)
    own = model.state_dict()
    skipped = [
        k
        for k, v in state.items()
        if k.startswith(tuple(head_prefixes)) and k in own and own[k].shape != v.shape
    ]
    for k in skipped:
        del state[k]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in skipped]
    if missing or unexpected:
        raise RuntimeError(
            f"{path}: state_dict does not match the model (missing {missing[:5]}..., "
            f"unexpected {unexpected[:5]}...)"
        )
    if skipped:
        log.warning("%s: classifier shape differs, kept fresh %s", path, ", ".join(skipped))
    return skipped
