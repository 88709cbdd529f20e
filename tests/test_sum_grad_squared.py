"""sum_i g_i^2 without per-example gradients (flatbnn/nn/sum_grad_squared.py; VOGN's ``sum_grad_squared=layers``)
equals the per-example vmap reference (``sum_grad_squared=per_example``) to 1e-5 relative on the MLP, LeNet-5 and
ResNet-20-FRN; Conv2d squares each example's gradient after its sum over positions; what the rules cannot cover
(another layer type, a module run twice) is handed to the per-example path and named once in the log."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import NoFlatness
from flatbnn.methods import RunContext
from flatbnn.methods.vogn import VOGN
from flatbnn.models import create_model
from flatbnn.nn.sum_grad_squared import count_calls, tap_plan, tapped

CPU = torch.device("cpu")
NETS = {"mlp": ("mlp", (1, 28, 28), {"hidden": [50, 30]}), "lenet5": ("lenet5", (1, 28, 28), {"variant": "bsam"}),
        "resnet20_frn": ("resnet20_frn", (3, 8, 8), {})}


def _net(key, dtype=torch.float32):
    torch.manual_seed(0)
    name, shape, kw = NETS[key]
    return create_model(name, 10, shape, **kw).to(dtype), shape


def _per_example_sum_squares(net, x, y):
    weights = {n: p.detach() for n, p in net.named_parameters()}

    def one(w, xi, yi):
        return F.cross_entropy(functional_call(net, w, (xi[None],)), yi[None])
    per_example = vmap(grad(one), in_dims=(None, 0, 0))(weights, x, y)
    return {n: g.square().sum(0) for n, g in per_example.items()}


@pytest.mark.parametrize("key", list(NETS))
def test_layer_rules_equal_per_example_gradients_in_float64(key):
    net, shape = _net(key, torch.float64)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, *shape, generator=g, dtype=torch.float64), torch.randint(0, 10, (6,), generator=g)
    names = [n for n, _ in net.named_parameters()]
    with count_calls(net) as calls:
        net(x[:1])
    covered, other = tap_plan(net, names, calls)
    assert covered and set(other.values()) <= {"FilterResponseNorm2d"}
    phantoms = {n: torch.zeros_like(p).requires_grad_(True) for n, p in net.named_parameters() if n in covered}
    with tapped(net, phantoms):
        loss = F.cross_entropy(net(x), y)  # the mean over 6 examples: the sums come out scaled by 1 / 6^2
    sums = dict(zip(phantoms, torch.autograd.grad(loss, list(phantoms.values()))))
    ref = _per_example_sum_squares(net, x, y)
    for n in covered:
        torch.testing.assert_close(sums[n] * 36, ref[n], rtol=1e-10, atol=1e-14, msg=n)


def test_conv_squares_each_examples_gradient_after_its_sum_over_positions():
    """Not a square per output position: a 1x1 conv on a 2x2 image with one channel, written out by hand."""
    conv = nn.Conv2d(1, 1, 1, bias=True).double()
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]], [[[0.5, -1.0], [2.0, 0.0]]]], dtype=torch.float64)
    pw, pb = torch.zeros_like(conv.weight).requires_grad_(True), torch.zeros_like(conv.bias).requires_grad_(True)
    with tapped(conv, {"weight": pw, "bias": pb}):
        loss = conv(x).sum()  # d = 1 at every position: g_i(w) = sum of example i's pixels, g_i(b) = 4
    sw, sb = torch.autograd.grad(loss, (pw, pb))
    assert float(sw) == pytest.approx(10.0 ** 2 + 1.5 ** 2)  # not 1+4+9+16 + 0.25+1+4+0 (a square per position)
    assert float(sb) == pytest.approx(4.0 ** 2 + 4.0 ** 2)


class _Tokens(nn.Module):
    """A Linear on [B, T, features] (a ViT's layers see tokens so): each example's gradient is a sum over its rows."""

    def __init__(self):
        super().__init__()
        self.mix, self.head = nn.Linear(4, 5), nn.Linear(15, 10)

    def forward(self, x):
        return self.head(torch.relu(self.mix(x.view(x.shape[0], 3, 4))).flatten(1))


def test_linear_on_tokens_squares_each_examples_gradient_and_keeps_the_weight_gradient():
    """The multi-row Linear branch: sum_i g_i^2 of the per-example reference (each example's gradient summed over its
    tokens before the square), and the weight / bias gradients asked for beside it are the plain backward's."""
    torch.manual_seed(0)
    net = _Tokens().double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 12, generator=g, dtype=torch.float64), torch.randint(0, 10, (6,), generator=g)
    phantoms = {n: torch.zeros_like(p).requires_grad_(True) for n, p in net.named_parameters()}
    params = list(net.parameters())
    with tapped(net, phantoms):
        loss = F.cross_entropy(net(x), y)
    out = torch.autograd.grad(loss, params + list(phantoms.values()))
    plain = torch.autograd.grad(F.cross_entropy(net(x), y), params)
    for n, got, want in zip(phantoms, out[:len(params)], plain):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=n)
    ref = _per_example_sum_squares(net, x, y)
    for n, got in zip(phantoms, out[len(params):]):
        torch.testing.assert_close(got * 36, ref[n], rtol=1e-10, atol=1e-14, msg=n)


def test_a_module_run_twice_and_other_layers_go_to_the_per_example_path():
    lin = nn.Linear(4, 4)
    net = nn.Sequential(lin, nn.ReLU(), lin, nn.LayerNorm(4), nn.Linear(4, 3))
    names = [n for n, _ in net.named_parameters()]
    with count_calls(net) as calls:
        net(torch.randn(2, 4))
    covered, other = tap_plan(net, names, calls)
    assert covered == ["4.weight", "4.bias"]
    assert other == {"0.weight": "Linear run 2 times per forward", "0.bias": "Linear run 2 times per forward",
                     "3.weight": "LayerNorm", "3.bias": "LayerNorm"}


def _vogn_h(key, mode, batched=False):
    """g_hat and h_hat of one VOGN m = 2 step (what the optimiser is handed), fp32."""
    net, shape = _net(key)
    method = VOGN(m=2, num_samples=1, batched_parts=batched, sum_grad_squared=mode)
    method.setup(RunContext(model=net, module=net, device=CPU, n_train=1000, steps_per_epoch=1, epochs=1,
                            optimizer_factory=None, scheduler_factory=None, generator=torch.Generator().manual_seed(3)))
    seen = {}
    update = method.apply_update
    method.apply_update = lambda params, g, h, bp: (seen.update(g=[t.clone() for t in g], h=[t.clone() for t in h]),
                                                    update(params, g, h, bp))
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, *shape, generator=gen), torch.randint(0, 10, (8,), generator=gen))
    method.train_step(batch, NoFlatness(), Backprop(net, CPU))
    return seen


@pytest.mark.parametrize("key", list(NETS))
@pytest.mark.parametrize("batched", [False, True], ids=["loop", "batched"])
def test_vogn_layers_path_equals_the_per_example_reference_to_1e5_relative(key, batched, capsys):
    ref, fast = _vogn_h(key, "per_example"), _vogn_h(key, "layers", batched)
    for what in ("g", "h"):
        for a, b in zip(fast[what], ref[what]):
            assert float((a - b).norm() / b.norm()) <= 1e-5, what
    logged = capsys.readouterr().err
    if key == "resnet20_frn":  # FRN's gamma / beta / tau: named once, as the per-example path's
        assert logged.count("from per-example gradients") == 1 and "FilterResponseNorm2d" in logged
    else:
        assert "per-example" not in logged
