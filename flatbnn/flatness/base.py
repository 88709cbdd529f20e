"""The flatness seam: *where* the gradient a method uses is evaluated.

A ``Flatness`` receives the parameters the method trains, a forward-only ``loss_fn(batch)`` and
the engine's ``Backprop`` helper, and leaves in ``p.grad`` the gradient the method should step
with. Methods never know which variant they are composed with (F-SWAG = SWAG x SAM).

This base class owns what every variant shares:

* **m-sharpness** (``m``): the batch is cut into ``m`` chunks, each chunk gets its own
  perturbation and its own gradient, and the chunk gradients are averaged (weighted by chunk size,
  so the result is the batch-mean gradient when no perturbation is applied). ``m = 1`` does not
  split at all. Under DDP every worker already perturbs with its own gradient (``no_sync()`` on
  the ascent pass), so the effective m is ``m * world_size``; the accumulated gradient is
  all-reduced once, on the last chunk's backward.
* **an optional adaptive radius**: ``rho_schedule = "lr"`` scales rho with lr / initial lr
  (the engine reports the ratio before every step); ``"constant"`` (default) leaves it alone.
* ``perturb``: which of ``params`` are moved (e.g. mu but not sigma for F-SGVB); all of ``params``
  receive gradients and are reset between the passes.
* ``scaling``: a per-parameter D that a method may supply (geometry: |mu|/sigma).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

LossFn = Callable[[object], torch.Tensor]
RHO_SCHEDULES = ("constant", "lr")


def unzip_named(params) -> tuple[list[str] | None, list[torch.Tensor]]:
    """Accept tensors or (name, tensor) pairs; names let ASAM skip biases as its official code does."""
    params = list(params)
    if params and isinstance(params[0], tuple):
        return [n for n, _ in params], [p for _, p in params]
    return None, params


def split_batch(batch, m: int) -> list[tuple[object, float]]:
    """``m`` chunks along dim 0 of every tensor in ``batch`` with their share of the batch."""
    if m == 1:
        return [(batch, 1.0)]
    tensors = batch if isinstance(batch, (tuple, list)) else (batch,)
    n = tensors[0].shape[0]
    if n < m:
        raise ValueError(f"flatness.m={m} exceeds the per-worker batch size {n}")
    parts = [torch.tensor_split(t, m) if torch.is_tensor(t) else [t] * m for t in tensors]
    chunks = []
    for i in range(m):
        items = tuple(p[i] for p in parts)
        size = items[0].shape[0]
        chunks.append((items if isinstance(batch, (tuple, list)) else items[0], size / n))
    return chunks


class Flatness:
    """Base class of the flatness variants (``none.py``, ``sam.py``, ``asam.py``, ...)."""

    name = "base"
    #: forward/backward passes per step: the cost estimates read it (flatbnn/reproduce/cost.py)
    passes = 1
    #: True if the variant needs a per-parameter scaling from the method (geometry)
    needs_scaling = False

    def __init__(self, rho: float = 0.0, m: int = 1, rho_schedule: str = "constant"):
        if rho < 0:
            raise ValueError(f"flatness.rho must be >= 0, got {rho}")
        if int(m) < 1:
            raise ValueError(f"flatness.m must be >= 1, got {m}")
        if rho_schedule not in RHO_SCHEDULES:
            raise ValueError(f"flatness.rho_schedule must be one of {RHO_SCHEDULES}, got {rho_schedule!r}")
        self.rho = float(rho)
        self.m = int(m)
        self.rho_schedule = rho_schedule
        self.rho_scale = 1.0
        self.generator: torch.Generator | None = None
        # host scalars that change between steps (rho * rho_scale, ...) as float64 device tensors
        # (``device_scalar``): a CUDA graph replays the step without Python, so what it reads must live in memory
        # refilled outside the graph (``set_lr_ratio``), not in a captured constant
        self._scalars: dict[str, list] = {}
        self.world_size = 1  # processes of the run (setup): a per-worker ascent makes the effective m m * world size

    # ---------------------------------------------------------------- engine hooks
    def setup(self, ctx, method) -> None:
        """Called once after ``method.setup``: noise generator, checks that need the method."""
        self.generator = ctx.generator
        self.world_size = int(getattr(ctx, "world_size", 1) or 1)
        check = getattr(method, "check_flatness", None)
        if callable(check):  # methods with their own perturbation (bSAM, VOGN, VSAM, RSAM) refuse here
            check(self)

    def set_lr_ratio(self, ratio: float) -> None:
        """Called by the engine before every step, outside any captured graph: refills the device radius."""
        if self.rho_schedule == "lr":
            self.rho_scale = float(ratio)
        for entry in self._scalars.values():
            self._refill(entry)

    @property
    def radius(self) -> float:
        return self.rho * self.rho_scale

    def device_scalar(self, key: str, value: Callable[[], float], device) -> torch.Tensor:
        """``value()`` in a float64 0-dim tensor on ``device``, refilled in place when it changes (never rebound
        once made). float64 holds the host double exactly, so ``.to(dtype)`` rounds as a Python scalar would."""
        entry = self._scalars.get(key)
        if entry is None or entry[0].device != torch.device(device):
            entry = self._scalars[key] = [torch.zeros((), dtype=torch.float64, device=device), value, None]
        entry[1] = value
        self._refill(entry)
        return entry[0]

    @staticmethod
    def _refill(entry) -> None:
        v = float(entry[1]())  # host floats: a changed rho (schedule, sweep, test) refills; no device read
        if v != entry[2]:
            entry[0].fill_(v)
            entry[2] = v

    def radius_tensor(self, device) -> torch.Tensor:
        """``radius`` (rho * rho_scale) as a device tensor (see ``device_scalar``)."""
        return self.device_scalar("radius", lambda: self.radius, device)

    def saved_buffers(self, params) -> list[torch.Tensor]:
        """The copy of the weights the step restores, allocated once (a captured graph needs fixed addresses)."""
        key = [(p.shape, p.dtype, p.device, p.stride()) for p in params]
        if getattr(self, "_saved_key", None) != key:
            self._saved = [torch.empty_like(p) for p in params]
            self._saved_key = key
        return self._saved

    # ---------------------------------------------------------------- the gradient
    def gradient(
        self,
        params,
        loss_fn: LossFn,
        batch,
        backprop,
        scaling: Sequence[torch.Tensor] | None = None,
        perturb: Sequence[bool] | None = None,
    ) -> torch.Tensor:
        """Leave the gradient in ``p.grad`` (accumulated over chunks); return the first-pass loss."""
        names, params = unzip_named(params)
        keep = [i for i, p in enumerate(params) if p.requires_grad]
        params = [params[i] for i in keep]
        names = [names[i] for i in keep] if names is not None else None
        scaling = [scaling[i] for i in keep] if scaling is not None else None
        perturb = [bool(perturb[i]) for i in keep] if perturb is not None else [True] * len(params)
        if self.needs_scaling and scaling is None:
            raise ValueError(f"flatness={self.name} needs a per-parameter scaling from the method")
        chunks = split_batch(batch, self.m)
        total = None
        for i, (chunk, share) in enumerate(chunks):
            loss = self.chunk_gradient(params, names, loss_fn, chunk, backprop, scaling, perturb,
                                       share=share, sync=i == len(chunks) - 1)
            total = loss * share if total is None else total + loss * share
        return total if len(chunks) > 1 else loss

    def chunk_gradient(self, params, names, loss_fn, chunk, backprop, scaling, perturb, *, share, sync):
        """Add ``share * grad`` of this chunk's (perturbed) loss to ``p.grad``; return the clean loss."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Hyperparameters recorded in results.json."""
        return {"name": self.name, "rho": self.rho, "m": self.m, "rho_schedule": self.rho_schedule}


def scaled(loss: torch.Tensor, share: float) -> torch.Tensor:
    return loss if share == 1.0 else loss * share
