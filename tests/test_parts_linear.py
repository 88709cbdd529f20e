"""flatbnn/nn/parts_linear.py (issue 52): a Linear-only network run on m parts at once, part k at its own weights, gives
each part's gradient, their sum and the sums of squared per-example gradients as m separate passes do; and bSAM's
and VOGN's batched parts through it give the loop's weights (float64, 3 steps, the tolerance of
tests/test_batched_parts.py: ||w_path - w_loop|| <= 1e-10 ||w_loop - w_0||)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import NoFlatness
from flatbnn.methods import RunContext
from flatbnn.methods.bsam import BSAM
from flatbnn.methods.vogn import VOGN
from flatbnn.models import create_model
from flatbnn.nn.parts_linear import (NotPartRows, in_param_order, layer_views, pair_leaves, param_views, parts_weights,
                                     phantom_pairs)

CPU = torch.device("cpu")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ELU(), nn.Linear(5, 4, bias=False), nn.ReLU(),
                         nn.Linear(4, 3)).double()


def test_parts_linear_gradients_are_the_per_part_passes():
    m, b = 3, 4
    net = _mlp()
    params = list(net.parameters())
    layers = [mod for mod in net if isinstance(mod, nn.Linear)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(m * b, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (m * b,), generator=g)
    flat = torch.cat([p.detach().reshape(-1) for p in params]) + 0.3 * torch.randn(
        m, sum(p.numel() for p in params), generator=g, dtype=torch.float64)
    # the reference: part k alone at its weights -- its gradient and its per-example gradients, squared and summed
    per_part, squares = [], []
    for k in range(m):
        w = [v[k].detach().clone().requires_grad_(True) for v in param_views(flat, params)]
        out = torch.func.functional_call(net, {n: t for (n, _), t in zip(net.named_parameters(), w)},
                                         (x[k * b:(k + 1) * b],))
        per_part.append(torch.autograd.grad(F.cross_entropy(out, y[k * b:(k + 1) * b]), w))
        sq = [torch.zeros_like(t) for t in w]
        for i in range(k * b, (k + 1) * b):
            o = torch.func.functional_call(net, {n: t for (n, _), t in zip(net.named_parameters(), w)},
                                           (x[i:i + 1],))
            for acc, gi in zip(sq, torch.autograd.grad(F.cross_entropy(o, y[i:i + 1]) / b, w)):
                acc.add_(gi.square())
        squares.append(sq)

    leaves = [tuple(None if t is None else t.detach().requires_grad_(True) for t in pair)
              for pair in layer_views(flat, params, layers)]
    sums, sq_ph = phantom_pairs(layers), phantom_pairs(layers)
    with parts_weights(layers, m, m * b, leaves, sums, sq_ph):
        logits = net(x)
    loss = F.cross_entropy(logits, y, reduction="none").view(m, b).mean(1).sum()
    got = torch.autograd.grad(loss, pair_leaves(leaves) + pair_leaves(sums) + pair_leaves(sq_ph))
    n = len(params)
    for i in range(n):  # params and the layers' tensors are in the same order here
        torch.testing.assert_close(got[i], torch.stack([per_part[k][i] for k in range(m)]), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got[n + i], sum(per_part[k][i] for k in range(m)), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got[2 * n + i], sum(squares[k][i] for k in range(m)), rtol=1e-12, atol=1e-14)
    assert all("forward" not in vars(mod) for mod in layers)  # the layers are put back


def test_in_param_order_maps_the_layers_order_to_the_parameters():
    a, b = nn.Linear(3, 2), nn.Linear(2, 4, bias=False)
    by_layer = ["a.weight", "a.bias", "b.weight"]  # what pair_leaves lists: each layer's weight, then its bias
    assert [t.shape for t in pair_leaves(phantom_pairs([a, b]))] == [a.weight.shape, a.bias.shape, b.weight.shape]
    assert in_param_order([a, b], [b.weight, a.bias, a.weight], by_layer) == ["b.weight", "a.bias", "a.weight"]


def test_parts_linear_refuses_rows_it_does_not_cover():
    lin = nn.Linear(3, 2).double()
    w = layer_views(torch.zeros(2, 8, dtype=torch.float64), list(lin.parameters()), [lin])
    with parts_weights([lin], 2, 4, w), pytest.raises(NotPartRows, match=r"ran on \(2, 3, 3\)"):
        lin(torch.zeros(2, 3, 3, dtype=torch.float64))
    with parts_weights([lin], 2, 4, w), pytest.raises(NotPartRows, match="call 2"):
        lin(lin(torch.zeros(4, 3, dtype=torch.float64)).repeat(1, 2)[:, :3])


METHODS = {"bsam": lambda b: BSAM(m=4, lr=0.1, num_samples=1, batched_parts=b),
           "bsam_no_noise": lambda b: BSAM(m=4, lr=0.1, num_samples=1, noise=False, batched_parts=b),
           "vogn": lambda b: VOGN(m=4, lr=0.1, s_init=1.0, damping=0.1, prior_precision=25.0, num_samples=1,
                                  batched_parts=b)}


def _run(method: str, path: str, steps: int = 3, net=None):
    torch.manual_seed(0)
    net = create_model("mlp", 10, (1, 28, 28), hidden=[50, 30]).double() if net is None else net
    start = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    meth = METHODS[method](path != "loop")
    meth.setup(RunContext(model=net, module=net, device=CPU, n_train=1000, steps_per_epoch=1, epochs=1,
                          optimizer_factory=None, scheduler_factory=None, generator=torch.Generator().manual_seed(3)))
    if path == "vmap":
        meth._linear = None  # the general batched path, as on a network with other layers
    bp = Backprop(net, CPU)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = (torch.randn(8, 1, 28, 28, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g))
        losses.append(meth.train_step(batch, NoFlatness(), bp)["loss"])
    w = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    s = torch.cat([meth.optimizer.state[p]["precision"].reshape(-1) for p in net.parameters()])
    return start, w, s, torch.stack(losses), meth.pop_train_accuracy(), meth


@pytest.mark.parametrize("method", list(METHODS))
def test_linear_parts_give_the_loops_weights(method):
    w0, w_loop, s_loop, l_loop, acc_loop, _ = _run(method, "loop")
    _, w_lin, s_lin, l_lin, acc_lin, meth = _run(method, "linear")
    _, w_vmap, _, _, _, _ = _run(method, "vmap")
    assert isinstance(meth._linear, list) and len(meth._linear) == 3  # this path ran, and results.json says so
    assert meth.describe()["parts_path"] == "linear"
    _, _, _, _, _, loop = _run(method, "loop", steps=1)
    loop.load_state_dict(meth.state_dict())  # a resume keeps the paths the steps before it took
    assert loop.describe()["parts_path"] == "linear,loop"
    assert float((w_loop - w0).norm()) > 1e-3  # the steps moved the weights
    for w in (w_lin, w_vmap):
        assert float((w - w_loop).norm()) <= 1e-10 * float((w_loop - w0).norm())
    torch.testing.assert_close(s_lin, s_loop, rtol=1e-12, atol=0)
    torch.testing.assert_close(l_lin, l_loop, rtol=1e-12, atol=0)
    assert acc_lin == acc_loop


class _Shared(nn.Module):
    """One Linear run twice per forward (weight sharing): not the parts-Linear path's rows."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(784, 784), nn.Linear(784, 10)

    def forward(self, x):
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x.flatten(1))))))


def test_a_linear_run_twice_takes_the_vmap_path_said_once(capsys):
    torch.manual_seed(0)
    _, _, _, _, _, meth = _run("bsam", "linear", steps=2, net=_Shared().double())
    assert meth._linear is None and meth.describe()["parts_path"] == "vmap"
    assert capsys.readouterr().err.count("torch.func.vmap over the parts") == 1
