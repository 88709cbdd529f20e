"""ResNet-20 with Filter Response Normalisation (FRN) instead of BatchNorm.

Used by the HMC reference posterior of Izmailov et al. (2021) and by the bSAM code (Möllenhoff &
Khan, 2023) because FRN has no batch statistics: the likelihood of one example does not depend on
the rest of the mini-batch, which sampling / Bayesian methods need. Choices, following the bSAM code:

* every normalisation is FRN + TLU (``max(gamma * x_hat + beta, tau)``, Singh & Krishnan 2020) with
  the constant ``eps = 1e-6``; TLU is the only non-linearity (no swish, nothing after the residual
  sum), i.e. Izmailov et al.'s network with its swish replaced by identity;
* convolutions have biases; stage changes use a 1x1 conv + FRN projection shortcut;
* He-normal (fan-in) initialisation; global average pooling, so any spatial size works.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .registry import in_channels_of, register_model


def _he_normal_truncated_(w: torch.Tensor) -> None:
    """haiku's VarianceScaling(2.0, 'fan_in', 'truncated_normal'): std corrected for the truncation."""
    fan_in = w[0].numel()
    std = math.sqrt(2.0 / fan_in) / 0.87962566103423978
    nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


class _TLU(torch.autograd.Function):
    """``torch.maximum(z, tau)`` with a leaner backward, bit-identical to autograd's.

    Why: autograd's backward of ``maximum`` builds both gradients separately (``eq``, ``where``, ``masked_fill`` twice),
    and with 21 TLUs that was ~25 % of a ResNet-20-FRN CPU step (profile, 2026-11-26). The same values from one mask:
    ``g`` above tau, ``g / 2`` on a tie (autograd's rule), 0 below; tau gets the rest, ``g - grad_z``, summed over its
    broadcast dims like autograd's ``sum_to``. Finite gradients match to the bit (tests/test_models.py), so runs
    trained before and after this are the same runs. Differentiable again (Hessian-vector products) and vmap-able
    (VOGN's per-example gradients)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(z: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return torch.maximum(z, tau)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        z, tau = ctx.saved_tensors
        grad_z = torch.where(z > tau, g, torch.where(z == tau, g * 0.5, 0.0))
        return grad_z, (g - grad_z).sum_to_size(tau.shape)


class FilterResponseNorm2d(nn.Module):
    """FRN + TLU: ``max(gamma * x * rsqrt(mean_{H,W}(x^2) + eps) + beta, tau)``, per channel."""

    def __init__(self, num_features: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(1, num_features, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, num_features, 1, 1))
        self.tau = nn.Parameter(torch.zeros(1, num_features, 1, 1))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The FRN step alone: each (example, channel) map scaled to unit mean square."""
        nu2 = x.square().mean(dim=(2, 3), keepdim=True)
        return x * torch.rsqrt(nu2 + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.gamma * self.normalize(x) + self.beta
        if torch.compiler.is_compiling():  # the same values and gradients (tests/test_batched_chunks.py); traced
            return torch.maximum(z, self.tau)  # without the custom Function, which broke compile(fullgraph) of vmap
        return _TLU.apply(z, self.tau)

    def extra_repr(self) -> str:
        return f"{self.gamma.shape[1]}, eps={self.eps}"


def _conv_frn(in_ch: int, out_ch: int, kernel_size: int = 3, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2, bias=True),
        FilterResponseNorm2d(out_ch),
    )


class BasicBlockFRN(nn.Module):
    """(conv3x3-FRN/TLU) x 2 plus the (possibly projected) input."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv_frn(in_ch, out_ch, 3, stride)
        self.conv2 = _conv_frn(out_ch, out_ch, 3)
        self.shortcut = (
            _conv_frn(in_ch, out_ch, 1, stride) if stride != 1 or in_ch != out_ch else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x)) + self.shortcut(x)


class ResNetFRN(nn.Module):
    """CIFAR ResNet (depth 6n+2, widths w-2w-4w) with FRN/TLU."""

    def __init__(self, num_classes: int, in_channels: int = 3, depth: int = 20, width: int = 16):
        super().__init__()
        if (depth - 2) % 6 != 0:
            raise ValueError(f"depth must be 6n+2 (20, 32, 44, ...), got {depth}")
        n = (depth - 2) // 6
        self.stem = _conv_frn(in_channels, width)
        blocks: list[nn.Module] = []
        in_ch = width
        for stage in range(3):
            out_ch = width * 2**stage
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlockFRN(in_ch, out_ch, stride))
                in_ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_ch, num_classes)
        # He-normal (fan-in, truncated at 2 std) for every conv and the head, zero biases: the
        # bSAM code's init. (A zero-initialised head was tried: no faster start, so we stay faithful.)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                _he_normal_truncated_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.blocks(self.stem(x)))
        return self.head(torch.flatten(x, 1))


@register_model("resnet20_frn")
def resnet20_frn(num_classes: int, input_shape: Sequence[int] | None = None) -> ResNetFRN:
    return ResNetFRN(num_classes, in_channels=in_channels_of(input_shape), depth=20)
