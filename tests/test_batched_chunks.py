"""``flatness.batched_chunks=true`` (issue 33 item 4): SAM m-sharpness as two vmapped passes equals the loop of 2m
passes (float64: the issue measured 3e-15 on ResNet-20-FRN; fp32 differs ~3e-3 through the TLU kinks), and every
case it cannot reproduce is refused with one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import ASAM, SAM
from flatbnn.methods import MAP, RunContext
from flatbnn.models.resnet_frn import ResNetFRN, _TLU
from flatbnn.methods.sgvb import SGVB

CPU = torch.device("cpu")


def _frn() -> nn.Module:
    torch.manual_seed(0)
    return ResNetFRN(num_classes=3, in_channels=1, depth=8, width=4).double()


def _steps(flatness, module, steps=2, method=None, batch=None):
    method = method or MAP()
    module = method.prepare_model(module)
    ctx = RunContext(model=module, module=module, device=CPU, n_train=64, steps_per_epoch=steps, epochs=1,
                     optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduler_factory=None)
    method.setup(ctx)
    flatness.setup(ctx, method)
    bp = Backprop(module, CPU)
    method.train()
    g = torch.Generator().manual_seed(2)
    batch = batch or (torch.randn(8, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
    losses = [method.train_step(batch, flatness, bp)["loss"] for _ in range(steps)]
    return [p.detach().clone() for p in module.parameters()], torch.stack(losses), method


def test_vmapped_chunks_equal_the_loop_in_float64():
    w_loop, l_loop, m_loop = _steps(SAM(rho=0.05, m=4), _frn())
    w_vmap, l_vmap, m_vmap = _steps(SAM(rho=0.05, m=4, batched_chunks=True), _frn())
    start = [p.detach() for p in _frn().parameters()]
    moved = max(float((a - b).abs().max()) for a, b in zip(w_loop, start))
    err = max(float((a - b).abs().max()) for a, b in zip(w_loop, w_vmap))
    assert moved > 1e-3 and err < 1e-12 * max(moved, 1.0), (err, moved)
    torch.testing.assert_close(l_loop, l_vmap, rtol=1e-13, atol=0)
    assert m_loop.pop_train_accuracy() == m_vmap.pop_train_accuracy()  # chunk 0's first pass, both ways


def test_rho_zero_batched_is_the_plain_gradient():
    w_none, _, _ = _steps(SAM(rho=0.0, m=1), _frn())
    w_vmap, _, _ = _steps(SAM(rho=0.0, m=4, batched_chunks=True), _frn())
    for a, b in zip(w_none, w_vmap):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case,match", [
    ("batchnorm", "BatchNorm needs batched running statistics"),
    ("asam", "plain SAM"),
    ("sgvb", "plain loss"),
])
def test_what_the_batched_path_cannot_reproduce_is_refused_in_one_line(case, match):
    module, flat, method = _frn(), SAM(rho=0.05, m=4, batched_chunks=True), None
    if case == "batchnorm":
        module = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 3)).double()
    elif case == "asam":
        flat = ASAM(rho=0.5, m=4, batched_chunks=True)
    elif case == "sgvb":
        method, module = SGVB(num_samples=1), nn.Sequential(nn.Flatten(), nn.Linear(36, 3))
        module = module.double()
    with pytest.raises(ValueError, match=match) as e:
        _steps(flat, module, steps=1, method=method)
    assert "\n" not in str(e.value)


def test_tlu_maximum_and_the_custom_function_agree_to_the_bit():
    """The compiled path uses torch.maximum instead of _TLU: same values and gradients, ties included."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 3, 5, 5, generator=g).round(decimals=1).requires_grad_()  # rounding makes ties with tau
    tau = torch.randn(1, 3, 1, 1, generator=g).round(decimals=1).requires_grad_()
    up = torch.randn(4, 3, 5, 5, generator=g)
    a = _TLU.apply(z, tau)
    ga = torch.autograd.grad(a, (z, tau), up)
    b = torch.maximum(z, tau)
    gb = torch.autograd.grad(b, (z, tau), up)
    assert bool((z == tau).any())
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_compiled_frn_forward_uses_maximum_without_graph_breaks():
    """torch.compile(fullgraph=True, aot_eager) of a vmapped FRN gradient: no break at the TLU, eager values."""
    from torch.func import functional_call, grad, vmap

    from flatbnn.models.resnet_frn import FilterResponseNorm2d

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), FilterResponseNorm2d(2), nn.Flatten(), nn.Linear(32, 3))
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(2, 3, 1, 6, 6)

    def loss(p, xb):
        return functional_call(net, p, (xb,)).square().mean()

    fn = vmap(grad(loss), in_dims=(None, 0))
    eager = fn(params, x)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(params, x)
    for k in eager:
        torch.testing.assert_close(eager[k], compiled[k], rtol=1e-6, atol=1e-7)


def test_a_short_last_batch_takes_the_loop_with_the_loops_step():
    """Issue 41: the epoch's short last batch (29 images at m = 4 on digits) ran through the whole epoch and then
    stopped the run; it now runs through the loop, so its step is the loop's to the bit."""
    g = torch.Generator().manual_seed(5)
    short = (torch.randn(7, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,), generator=g))
    w_loop, l_loop, m_loop = _steps(SAM(rho=0.05, m=4), _frn(), batch=short)
    w_flag, l_flag, m_flag = _steps(SAM(rho=0.05, m=4, batched_chunks=True), _frn(), batch=short)
    assert all(torch.equal(a, b) for a, b in zip(w_loop, w_flag)) and torch.equal(l_loop, l_flag)
    assert m_loop.pop_train_accuracy() == m_flag.pop_train_accuracy()
    start = [p.detach() for p in _frn().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(w_flag, start))


@pytest.mark.parametrize("overrides,match", [
    (["trainer.batch_size=30"], r"^flatness.batched_chunks=true needs the per-process batch size \(30\) divisible "
                                r"by flatness.m=4 \(only an epoch's short last batch runs through the loop\)$"),
    (["trainer.precision=fp16"], "not fp16"),
    (["trainer.compile=true"], "trainer.compile"),
    (["flatness=asam"], "plain SAM"),
    (["method=sgvb"], "plain loss"),
    ([], None),
])
def test_what_the_config_rules_out_is_refused_before_any_data_load(overrides, match, monkeypatch):
    """validate_config (run.py calls it before build loads anything) refuses a batch size that m does not divide,
    fp16, compile and non-plain SAM / loss -- an epoch no longer trains before the run stops."""
    from flatbnn.engine.validate import ConfigError, validate_config
    from helpers import compose_cfg

    flat = [o for o in overrides if o.startswith("flatness=")] or ["flatness=sam"]
    rest = [o for o in overrides if not o.startswith("flatness=")]
    cfg = compose_cfg(["dataset=digits", "model=mlp", "trainer.device=cpu", "trainer.batch_size=64", *flat,
                       "flatness.m=4", "flatness.batched_chunks=true", *rest])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if match is None:
        validate_config(cfg)
        cfg.flatness.batched_chunks = False  # the flag off: nothing to refuse
        cfg.trainer.batch_size = 30
        validate_config(cfg)
        return
    with pytest.raises(ValueError, match=match) as e:
        validate_config(cfg)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)
