"""SAM: the perturbation, the two-pass gradient, rho=0 and the BatchNorm policy."""

import copy

import pytest
import torch
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import SAM, NoFlatness

CPU = torch.device("cpu")


class Quadratic(nn.Module):
    """L(w) = 1/2 w^T A w - b^T w, so grad L(v) = A v - b in closed form."""

    def __init__(self, d=5, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        m = torch.randn(d, d, generator=g, dtype=torch.float64)
        self.register_buffer("A", m @ m.T + torch.eye(d, dtype=torch.float64))
        self.register_buffer("b", torch.randn(d, generator=g, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(d, generator=g, dtype=torch.float64))

    def loss(self, _batch):
        return 0.5 * self.w @ self.A @ self.w - self.b @ self.w


def test_perturbation_has_norm_rho_and_gradient_direction():
    torch.manual_seed(0)
    params = [torch.randn(3, 4), torch.randn(7)]
    grads = [torch.randn(3, 4), torch.randn(7)]
    eps = SAM(rho=0.3).perturbation(params, grads)
    flat_e = torch.cat([e.flatten() for e in eps])
    flat_g = torch.cat([g.flatten() for g in grads])
    assert torch.linalg.vector_norm(flat_e).item() == pytest.approx(0.3, rel=1e-6)
    cos = torch.dot(flat_e, flat_g) / (flat_e.norm() * flat_g.norm())
    assert cos.item() == pytest.approx(1.0, abs=1e-6)


def test_sam_gradient_matches_closed_form_on_quadratic():
    q = Quadratic()
    w0 = q.w.detach().clone()
    rho = 0.2
    SAM(rho=rho).gradient([q.w], q.loss, None, Backprop(q, CPU))
    g = q.A @ w0 - q.b
    eps = rho * g / g.norm()
    expected = q.A @ (w0 + eps) - q.b
    torch.testing.assert_close(q.w.grad, expected, rtol=1e-10, atol=1e-10)
    assert torch.equal(q.w.detach(), w0), "weights must be restored exactly after the second pass"


def test_sam_gradient_matches_finite_differences_on_nonquadratic():
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randint(0, 4, (16,))
    lin = nn.Linear(3, 4).double()

    def loss_at(module):
        return nn.functional.cross_entropy(module(x), y)

    w0 = [p.detach().clone() for p in lin.parameters()]
    rho = 0.1
    SAM(rho=rho).gradient(list(lin.parameters()), lambda _b: loss_at(lin), None, Backprop(lin, CPU))
    sam_grad = [p.grad.clone() for p in lin.parameters()]

    # perturbed point from the plain gradient, then central differences of the loss there
    probe = copy.deepcopy(lin)
    g = torch.autograd.grad(loss_at(probe), list(probe.parameters()))
    norm = torch.sqrt(sum((t ** 2).sum() for t in g))
    with torch.no_grad():
        for p, gi in zip(probe.parameters(), g):
            p.add_(rho * gi / norm)
    h = 1e-6
    for p, sg in zip(probe.parameters(), sam_grad):
        fd = torch.zeros_like(p)
        for i in range(p.numel()):
            with torch.no_grad():
                p.view(-1)[i] += h
                up = loss_at(probe).item()
                p.view(-1)[i] -= 2 * h
                down = loss_at(probe).item()
                p.view(-1)[i] += h
            fd.view(-1)[i] = (up - down) / (2 * h)
        torch.testing.assert_close(sg, fd, rtol=1e-5, atol=1e-7)
    for p, w in zip(lin.parameters(), w0):
        assert torch.equal(p.detach(), w)


def _bn_dropout_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))


def _train_steps(flatness, steps=5):
    net = _bn_dropout_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    bp = Backprop(net, CPU)
    torch.manual_seed(123)
    data = [(torch.randn(10, 4), torch.randint(0, 3, (10,))) for _ in range(steps)]
    torch.manual_seed(7)
    for batch in data:
        opt.zero_grad(set_to_none=True)
        flatness.gradient(list(net.parameters()), lambda b: nn.functional.cross_entropy(net(b[0]), b[1]),
                          batch, bp)
        opt.step()
    return net


def test_rho_zero_equals_base_optimizer_exactly():
    """With BatchNorm and dropout in the net: bit-identical weights and running stats (davda54/sam#80)."""
    a = _train_steps(SAM(rho=0.0))
    b = _train_steps(NoFlatness())
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_bn_running_stats_updated_on_first_pass_only():
    net = _bn_dropout_net()
    bn = net[1]
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    ref = copy.deepcopy(net)
    ref.train()
    ref(x)  # one forward = one running-stat update
    net.train()
    SAM(rho=0.5, bn_stats="first").gradient(
        list(net.parameters()), lambda b: nn.functional.cross_entropy(net(b[0]), b[1]), (x, y), Backprop(net, CPU))
    torch.testing.assert_close(bn.running_mean, ref[1].running_mean)
    torch.testing.assert_close(bn.running_var, ref[1].running_var)
    assert int(bn.num_batches_tracked) == 1

    both = _bn_dropout_net()
    SAM(rho=0.5, bn_stats="both").gradient(
        list(both.parameters()), lambda b: nn.functional.cross_entropy(both(b[0]), b[1]), (x, y), Backprop(both, CPU))
    assert int(both[1].num_batches_tracked) == 2
    assert not torch.allclose(both[1].running_mean, ref[1].running_mean)


def test_sam_rejects_negative_rho_and_unknown_bn_policy():
    with pytest.raises(ValueError, match="rho"):
        SAM(rho=-1)
    with pytest.raises(ValueError, match="bn_stats"):
        SAM(bn_stats="sometimes")


def test_sam_bf16_autocast_gives_finite_gradient():
    net = _bn_dropout_net()
    bp = Backprop(net, CPU, precision="bf16")
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    loss = SAM(rho=0.05).gradient(list(net.parameters()),
                                  lambda b: nn.functional.cross_entropy(net(b[0]), b[1]), (x, y), bp)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


def test_a_non_finite_gradient_gives_no_ascent_and_a_finite_one_the_exact_sam_step():
    # decided on the device (torch.where), not by `if`: a NaN/inf gradient must give eps = 0, never NaN
    from flatbnn.flatness import SAM

    p = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    flat = SAM(rho=0.5)
    for bad in (float("inf"), float("nan")):
        g = [torch.tensor([1.0, bad, 2.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64)]
        eps = flat.perturbation(p, g)
        assert all(torch.equal(e, torch.zeros_like(e)) for e in eps)
    g = [torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64), torch.tensor([4.0, 0.0], dtype=torch.float64)]
    eps = flat.perturbation(p, g)  # ||g|| = 5: eps = 0.5 g / 5
    assert torch.allclose(eps[0], torch.tensor([0.3, 0.0, 0.0], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(eps[1], torch.tensor([0.4, 0.0], dtype=torch.float64), atol=1e-12)
