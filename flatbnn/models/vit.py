"""Vision transformers from timm: DeiT-B/16 and ViT-B/16 (Fisher SAM Sec. 5.2-5.3).

* ``deit_base`` -- timm ``deit_base_patch16_224`` (Touvron et al. 2021; 86,567,656 parameters with
  1000 classes, "86M" in the paper): Fisher SAM's ImageNet extra-training from the public DeiT-B
  weights (81.94% top-1 before).
* ``vit_b16`` -- timm ``vit_base_patch16_224`` (Dosovitskiy et al. 2021): the same architecture
  (patch 16, width 768, depth 12, 12 heads, class token); Fisher SAM fine-tunes an ImageNet-pretrained
  checkpoint on CIFAR-100, Stanford Cars and Flowers. ``timm_name`` selects another timm name or
  pretrained tag (e.g. ``vit_base_patch16_224.orig_in21k``).

Both are built with ``pretrained=False`` (random init, nothing downloaded), ``img_size`` and
``in_chans`` from ``input_shape`` (the papers: 3x224x224) and ``num_classes`` from the data set:

* ``pretrained_path``: a local checkpoint (timm/DeiT ``.pth``/``.safetensors``, or the original JAX
  ``.npz``) loaded through timm's own loader, which remaps foreign key names, resamples the position
  embedding to ``img_size`` and drops a classifier of another size. A missing file raises
  FileNotFoundError.
* ``pretrained: true`` lets timm fetch its default weights for ``timm_name`` from the Hugging Face
  hub -- for users with internet only, off by default and never used by the tests.
* ``dropout`` is timm's ``drop_rate``: the ``nn.Dropout`` before the classifier head (MC-Dropout);
  ``drop_path`` its stochastic-depth rate. timm always creates its Dropout modules (p = 0 when off),
  so unlike the CIFAR families a ViT has ``nn.Dropout`` modules even with ``dropout=0``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .registry import register_model
from ._common import check_file


def _timm():
    try:
        import timm
    except ImportError as err:  # pragma: no cover - timm is in the [timm] extra
        raise ImportError("deit_base / vit_b16 need timm: pip install 'flatbnn[timm]'") from err
    return timm


def build_timm_vit(
    timm_name: str,
    num_classes: int,
    input_shape: Sequence[int] | None,
    pretrained_path: str | None = None,
    pretrained: bool = False,
    dropout: float = 0.0,
    drop_path: float = 0.0,
) -> nn.Module:
    timm = _timm()
    shape = (3, 224, 224) if input_shape is None else tuple(int(s) for s in input_shape)
    if len(shape) != 3:
        raise ValueError(f"{timm_name} needs a (C, H, W) input_shape, got {shape}")
    path = check_file(pretrained_path)
    if pretrained and path is not None:
        raise ValueError("give pretrained_path or pretrained, not both")
    kw = dict(
        num_classes=num_classes,
        img_size=shape[1:],
        in_chans=shape[0],
        drop_rate=float(dropout),
        drop_path_rate=float(drop_path),
    )
    if path is not None:
        overlay = {"file": str(path), "custom_load": path.suffix == ".npz"}
        return timm.create_model(timm_name, pretrained=True, pretrained_cfg_overlay=overlay, **kw)
    return timm.create_model(timm_name, pretrained=bool(pretrained), **kw)


@register_model("deit_base")
def deit_base(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    pretrained_path: str | None = None,
    pretrained: bool = False,
    dropout: float = 0.0,
    drop_path: float = 0.0,
    timm_name: str = "deit_base_patch16_224",
) -> nn.Module:
    return build_timm_vit(
        timm_name, num_classes, input_shape, pretrained_path, pretrained, dropout, drop_path
    )


@register_model("vit_b16")
def vit_b16(
    num_classes: int,
    input_shape: Sequence[int] | None = None,
    pretrained_path: str | None = None,
    pretrained: bool = False,
    dropout: float = 0.0,
    drop_path: float = 0.0,
    timm_name: str = "vit_base_patch16_224",
) -> nn.Module:
    return build_timm_vit(
        timm_name, num_classes, input_shape, pretrained_path, pretrained, dropout, drop_path
    )
