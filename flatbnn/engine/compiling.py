"""``trainer.compile``: torch.compile of the backbone with the Inductor workarounds this torch needs, and a compile
cache kept between runs (``trainer.compile_cache``).

torch 2.10-2.11: Inductor's mix-order-reduction fusion fails (``AssertionError: 32 v.s. 6400``, ResNet-20-FRN under
bf16 on an H200, docs/cluster.md) and is reported to give silently wrong gradients with bf16 conv biases. Fixes
landed after the 2.11 branch, but no run of ours has shown compiled gradients equal to eager on any later torch
either, so the fusion stays off (``TORCHINDUCTOR_MIX_ORDER_REDUCTION=0``) on every torch version except those in
:data:`MIX_ORDER_REDUCTION_VERIFIED` (issue 41)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

#: torch (major, minor) versions on which a GPU run showed compiled gradients equal to eager with the fusion on
#: (add one only with that evidence, e.g. scripts/gpu_probe.py's compiled section run with the flag left on)
MIX_ORDER_REDUCTION_VERIFIED: frozenset[tuple[int, int]] = frozenset()


def torch_version(version: str | None = None) -> tuple[int, int]:
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def inductor_workarounds(version: str | None = None) -> dict[str, object]:
    """Set the Inductor flags this torch needs before compiling; return what was set (for results.json)."""
    import torch._inductor.config as inductor

    if torch_version(version) not in MIX_ORDER_REDUCTION_VERIFIED and hasattr(inductor.triton, "mix_order_reduction"):
        inductor.triton.mix_order_reduction = False
        return {"inductor.triton.mix_order_reduction": False}
    return {}


def cache_file(cache_dir: str | os.PathLike, device: torch.device) -> Path:
    """One artifact file per torch version and device model: another torch or GPU cannot reuse the kernels."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"torch-{torch.__version__}-{name}")
    return Path(cache_dir) / f"{safe}.bin"


def compile_model(model: torch.nn.Module, device: torch.device, cache_dir: str | None = None):
    """torch.compile(model) after the workarounds; loads the cache first if there is one."""
    inductor_workarounds()
    if cache_dir:
        f = cache_file(cache_dir, device)
        if f.exists():
            torch.compiler.load_cache_artifacts(f.read_bytes())
    return torch.compile(model)


def save_compile_cache(device: torch.device, cache_dir: str | None) -> Path | None:
    """Write what this process compiled to ``cache_dir`` (atomically); None when nothing was compiled."""
    if not cache_dir:
        return None
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return None
    f = cache_file(cache_dir, device)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    tmp.write_bytes(artifacts[0])
    os.replace(tmp, f)
    return f
