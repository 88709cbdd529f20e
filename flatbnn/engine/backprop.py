"""What the engine lends a flatness variant for one step: autocast, GradScaler, no_sync, BN policy.

Keeping these here means no flatness variant or method re-implements mixed precision or DDP.
"""

from __future__ import annotations

import random
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Backprop:
    def __init__(self, module: nn.Module, device: torch.device, precision: str = "fp32",
                 grad_clip: float | None = None, ddp: DistributedDataParallel | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"trainer.precision must be one of {list(PRECISIONS)}, got {precision!r}")
        self.module = module
        self.ddp = ddp
        self.device = device
        self.dtype = PRECISIONS[precision]
        self.grad_clip = grad_clip
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self._bn = [m for m in self.module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self._bn_snapshot: list[torch.Tensor] = []

    # ---------------------------------------------------------------- passes
    def forward(self, loss_fn, batch) -> torch.Tensor:
        ctx = (torch.autocast(self.device.type, dtype=self.dtype) if self.dtype is not None
               else nullcontext())
        with ctx:
            loss = loss_fn(batch)
        return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def no_sync(self):
        """Inside: forward AND backward skip DDP's all-reduce (with the forward alone inside, the backward still
        all-reduces the ascent gradient: davda54/sam#78)."""
        return self.ddp.no_sync() if self.ddp is not None else nullcontext()

    @torch.no_grad()
    def unscaled_grads(self, params) -> list[torch.Tensor]:
        """Current gradients divided by the loss scale (zeros where a parameter got none).

        One multi-tensor multiply by the inverse scale read on the device (``get_scale()`` is a host read every
        step). The scale is a power of two, so its reciprocal is exact in float32 as in the float64 of 1 / float."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        if self.scaler is None or not grads:
            return grads
        return torch._foreach_mul(grads, self.loss_scale().reciprocal())

    def loss_scale(self) -> torch.Tensor:
        """The GradScaler's current scale as a float32 device tensor (after the first scaled backward)."""
        if self.scaler._scale is None:  # nothing scaled yet: the initial scale, as get_scale() would say
            self.scaler._lazy_init_scale_growth_tracker(self.device)
        return self.scaler._scale

    def step(self, optimizer: torch.optim.Optimizer, params=None) -> None:
        """Optimiser step; gradient clipping acts on the final (second-pass) gradient only."""
        if self.scaler is not None:
            if self.grad_clip:
                self.scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(self._params(optimizer), self.grad_clip)
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            if self.grad_clip:
                torch.nn.utils.clip_grad_norm_(self._params(optimizer), self.grad_clip)
            optimizer.step()

    @staticmethod
    def _params(optimizer):
        return [p for g in optimizer.param_groups for p in g["params"]]

    # ---------------------------------------------------------------- BatchNorm policy
    @contextmanager
    def bn_updates(self, enabled: bool):
        """If not ``enabled``, the pass inside uses batch statistics but leaves running stats as they were."""
        if enabled or not self._bn:
            yield
            return
        # one multi-tensor copy each way into buffers allocated once (a captured graph needs fixed addresses)
        buffers = [b for m in self._bn for b in m.buffers(recurse=False)]
        if [(b.shape, b.dtype, b.device) for b in self._bn_snapshot] != [(b.shape, b.dtype, b.device) for b in buffers]:
            self._bn_snapshot = [torch.empty_like(b) for b in buffers]
        with torch.no_grad():
            torch._foreach_copy_(self._bn_snapshot, buffers)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(buffers, self._bn_snapshot)

    # ---------------------------------------------------------------- RNG replay
    def rng_state(self):
        """The global RNG states (the second pass replays the first pass's dropout masks); None while a CUDA graph
        is being captured (torch.cuda.get_rng_state cannot run there; ``engine/graphed.py`` captures only steps
        whose forward draws nothing from the global generators)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        state = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def set_rng_state(self, state) -> None:
        if state is None:  # captured step: nothing to replay (see rng_state)
            return
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def global_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_global_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
