"""Lists of weight tensors <-> one flat vector, for the methods that keep moments or all-reduce in one piece.

In logical (NCHW) element order, whatever each tensor's memory format: ``torch.nn.utils.parameters_to_vector``
uses ``view(-1)``, which raises on a ``channels_last`` conv weight (``trainer=gpu_fast``), and
``vector_to_parameters`` swaps each ``.data`` for a contiguous view, dropping that layout mid-run."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor: every tensor's elements in logical order (``reshape`` copies a non-contiguous one)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``like`` (contiguous; the inverse of :func:`flatten`)."""
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in like]), like)]


@torch.no_grad()
def copy_flat_(tensors: Iterable[torch.Tensor], flat: torch.Tensor) -> None:
    """Write ``flat`` into ``tensors`` in place: each keeps its storage, memory format and Parameter identity."""
    tensors = list(tensors)
    torch._foreach_copy_(tensors, unflatten(flat, tensors))
