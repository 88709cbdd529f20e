"""trainer.compile turns Inductor's mix-order-reduction fusion off on every torch not verified on a GPU (issue 33
item 3: the ``AssertionError: 32 v.s. 6400`` of torch 2.11 on an H200 and a reported wrong-gradient case; issue 41:
torch 2.12-2.14 too), and the compile cache
is kept per torch version and device between runs (``trainer.compile_cache``)."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor

from flatbnn.engine import compiling
from helpers import compose_cfg


@pytest.fixture
def restore_flag():
    had = hasattr(inductor.triton, "mix_order_reduction")
    saved = getattr(inductor.triton, "mix_order_reduction", None)
    yield
    if had:
        inductor.triton.mix_order_reduction = saved


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu130", "2.12.0", "2.13.1", "2.14.1+cu130", "3.0.0"])
def test_mix_order_reduction_is_off_on_every_unverified_torch(version, restore_flag, monkeypatch):
    """Issue 41: off on every torch (2.12-2.14 included) unless that version is listed as verified on a GPU."""
    if not hasattr(inductor.triton, "mix_order_reduction"):
        pytest.skip("this torch has no mix_order_reduction flag")
    inductor.triton.mix_order_reduction = True
    assert compiling.inductor_workarounds(version) == {"inductor.triton.mix_order_reduction": False}
    assert inductor.triton.mix_order_reduction is False
    # a version with the GPU evidence keeps Inductor's default; the others stay off
    monkeypatch.setattr(compiling, "MIX_ORDER_REDUCTION_VERIFIED", frozenset({compiling.torch_version(version)}))
    inductor.triton.mix_order_reduction = True
    assert compiling.inductor_workarounds(version) == {}
    assert inductor.triton.mix_order_reduction is True
    assert compiling.inductor_workarounds("9.9.0") == {"inductor.triton.mix_order_reduction": False}


def test_compile_model_applies_the_workaround_and_loads_the_cache(tmp_path, monkeypatch, restore_flag):
    if not hasattr(inductor.triton, "mix_order_reduction"):
        pytest.skip("this torch has no mix_order_reduction flag")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    inductor.triton.mix_order_reduction = True
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda b: loaded.append(b))
    f = compiling.cache_file(tmp_path, torch.device("cpu"))
    assert f.name == "torch-2.11.0_cu130-cpu.bin"  # another torch or device model gets another file
    f.write_bytes(b"kernels")
    model = compiling.compile_model(torch.nn.Linear(2, 2), torch.device("cpu"), str(tmp_path))
    assert inductor.triton.mix_order_reduction is False and loaded == [b"kernels"]
    assert callable(model)  # torch.compile is lazy: nothing compiled yet


def test_save_compile_cache_writes_atomically(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"abc", object()))
    f = compiling.save_compile_cache(torch.device("cpu"), str(tmp_path / "cache"))
    assert f.read_bytes() == b"abc" and [p.name for p in f.parent.iterdir()] == [f.name]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    assert compiling.save_compile_cache(torch.device("cpu"), str(tmp_path / "none")) is None
    assert compiling.save_compile_cache(torch.device("cpu"), None) is None


def test_the_config_has_the_keys():
    t = compose_cfg([]).trainer
    assert t.compile_cache is None and t.cuda_graph is False
