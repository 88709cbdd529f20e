"""Mean-field VI: Bayesian layers, SGVB / SGVB-LRT / Flipout / MFVI, F-SGVB and geometry, RandomSAM."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import SAM, Geometry, NoFlatness, RandomSAM
from flatbnn.methods import MAP, RunContext
from flatbnn.methods.rsam import RandomSAMMethod
from flatbnn.methods.sgvb import SGVB
from flatbnn.nn.bayesian import BayesConv2d, BayesLinear, NoiseBank, bayesian_layers, bayesianize, gaussian_kl
from helpers import run_cfg

CPU = torch.device("cpu")
DIGITS = ["dataset=digits", "model=mlp", "model.hidden=[128]", "trainer.eval_every=0", "trainer.epochs=6"]


def _ctx(module, n_train=100, lr=0.1, momentum=0.0, wd=0.0, seed=0, criterion=None, opt="sgd", **kw):
    def opt_factory(params):
        if opt == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=wd)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd)
    return RunContext(model=module, module=module, device=CPU, n_train=n_train, steps_per_epoch=1, epochs=1,
                      optimizer_factory=opt_factory, scheduler_factory=None, criterion=criterion,
                      generator=torch.Generator().manual_seed(seed), **kw)


def _sgvb(net_fn, seed=0, ctx_kw=None, **kw):
    torch.manual_seed(seed)
    m = SGVB(**kw)
    net = m.prepare_model(net_fn())
    m.setup(_ctx(net, seed=seed, **(ctx_kw or {})))
    return m, net


def _data(n=32, d=5, c=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randint(0, c, (n,), generator=g)


def _mlp64():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


# ------------------------------------------------------------------------------------------ layers
def test_kl_term_is_the_closed_form_gaussian_kl_over_n():
    m, net = _sgvb(_mlp64, prior_variance=0.3, kl_weight=0.5, sigma_init=0.05, ctx_kw={"n_train": 40})
    with torch.no_grad():
        for layer in bayesian_layers(net):
            layer.weight_rho.normal_(-2, 0.5)
            layer.bias_rho.normal_(-2, 0.5)
    p = torch.distributions.Normal(0.0, math.sqrt(0.3))
    expected = 0.0
    for layer in bayesian_layers(net):
        for mu, rho in layer.posterior_pairs():
            q = torch.distributions.Normal(mu, F.softplus(rho))
            expected = expected + torch.distributions.kl_divergence(q, p).sum()
    torch.testing.assert_close(m.kl(), expected)
    torch.testing.assert_close(m.kl_term(), 0.5 * expected / 40)
    # KL is 0 at q = prior
    mu = torch.zeros(10, dtype=torch.float64)
    assert float(gaussian_kl(mu, torch.full_like(mu, math.sqrt(0.3)), 0.3)) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_lrt_preactivation_moments_match_monte_carlo_of_reparam(kind):
    torch.manual_seed(0)
    bank = NoiseBank(torch.Generator().manual_seed(1))
    if kind == "linear":
        layer = BayesLinear(4, 3, sigma_init=0.3, bank=bank).double()
        x = torch.randn(2, 4, dtype=torch.float64)
        op = lambda inp, w, b: F.linear(inp, w, b)  # noqa: E731
    else:
        layer = BayesConv2d(2, 3, 3, padding=1, sigma_init=0.3, bank=bank).double()
        x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
        op = lambda inp, w, b: F.conv2d(inp, w, b, padding=1)  # noqa: E731
    with torch.no_grad():
        layer.weight_rho.uniform_(-2, 0)  # heterogeneous sigma
        mean = op(x, layer.weight_mu, layer.bias_mu)
        var = op(x * x, layer.weight_sigma ** 2, layer.bias_sigma ** 2)
        n = 8000
        outs = {}
        for est in ("reparam", "lrt", "flipout"):
            layer.estimator = est
            outs[est] = torch.stack([layer(x) for _ in range(n)])
    se_mean = (var / n).sqrt()
    for est, out in outs.items():
        assert ((out.mean(0) - mean).abs() < 5 * se_mean).all(), est
        # sample variance of a Gaussian: relative s.e. sqrt(2/n) = 1.6%
        torch.testing.assert_close(out.var(0), var, rtol=0.06, atol=1e-12, msg=est)


def test_bayesianize_converts_lenet_and_resnet20_frn_and_runs_forward_backward():
    from flatbnn.models import create_model
    for name, shape in (("lenet5", (1, 28, 28)), ("resnet20_frn", (3, 32, 32))):
        torch.manual_seed(0)
        net = create_model(name, num_classes=10, input_shape=shape)
        n_lin_conv = sum(type(m) in (nn.Linear, nn.Conv2d) for m in net.modules())
        ref_w = [m.weight.detach().clone() for m in net.modules() if type(m) in (nn.Linear, nn.Conv2d)]
        for est in ("reparam", "lrt", "flipout"):
            bnet = bayesianize(create_model(name, num_classes=10, input_shape=shape), estimator=est) \
                if est != "reparam" else bayesianize(net, estimator=est)
            layers = bayesian_layers(bnet)
            assert len(layers) == n_lin_conv and not any(type(m) in (nn.Linear, nn.Conv2d) for m in bnet.modules())
            if est == "reparam":  # mu starts at the backbone's own init
                for layer, w in zip(layers, ref_w):
                    torch.testing.assert_close(layer.weight_mu.detach(), w)
            x = torch.randn(4, *shape)
            out = bnet(x)
            assert out.shape == (4, 10)
            F.cross_entropy(out, torch.arange(4)).backward()
            assert all(layer.weight_rho.grad is not None and layer.weight_rho.grad.abs().sum() > 0 for layer in layers)


# ------------------------------------------------------------------------------------------ one SGVB step
def test_one_sgvb_step_with_fixed_noise_matches_a_hand_computation():
    torch.manual_seed(0)
    lr, n_train, s2 = 0.3, 50, 0.5
    m, net = _sgvb(lambda: nn.Sequential(nn.Linear(3, 2)).double(), prior_variance=s2, sigma_init=0.2,
                   ctx_kw={"n_train": n_train, "lr": lr})
    layer = bayesian_layers(net)[0]
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0])
    mu_w, rho_w = layer.weight_mu.detach().clone(), layer.weight_rho.detach().clone()
    mu_b, rho_b = layer.bias_mu.detach().clone(), layer.bias_rho.detach().clone()
    # the noise the step will draw: the ctx generator's first two normal draws (weight, then bias)
    g = torch.Generator().manual_seed(0)
    eps_w = torch.randn(mu_w.shape, generator=g, dtype=torch.float64)
    eps_b = torch.randn(mu_b.shape, generator=g, dtype=torch.float64)
    m.train_step((x, y), NoFlatness(), Backprop(net, CPU))
    # by hand
    sw, sb = torch.log1p(rho_w.exp()), torch.log1p(rho_b.exp())
    w, b = mu_w + sw * eps_w, mu_b + sb * eps_b
    p = torch.softmax(x @ w.T + b, dim=1)
    dlogits = (p - F.one_hot(y, 2).double()) / 4
    gw, gb = dlogits.T @ x, dlogits.sum(0)
    sig = lambda r: 1 / (1 + torch.exp(-r))  # noqa: E731  d softplus / d rho
    kl_mu = lambda mu: mu / s2 / n_train  # noqa: E731
    kl_s = lambda s: (s / s2 - 1 / s) / n_train  # noqa: E731
    torch.testing.assert_close(layer.weight_mu.detach(), mu_w - lr * (gw + kl_mu(mu_w)))
    torch.testing.assert_close(layer.bias_mu.detach(), mu_b - lr * (gb + kl_mu(mu_b)))
    torch.testing.assert_close(layer.weight_rho.detach(), rho_w - lr * (gw * eps_w + kl_s(sw)) * sig(rho_w))
    torch.testing.assert_close(layer.bias_rho.detach(), rho_b - lr * (gb * eps_b + kl_s(sb)) * sig(rho_b))


def test_sgvb_recovers_the_bayesian_linear_regression_mean_field_posterior():
    """y = Xw + N(0, s^2), prior N(0, 1/alpha): the mean-field optimum of KL(q || posterior) has the exact
    posterior mean and variances 1 / Lambda_ii (Lambda = X^T X / s^2 + alpha I the posterior precision)."""
    n, d, s, alpha = 64, 2, 0.5, 1.0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.tensor([[1.0, 0.6], [0.0, 0.8]],
                                                                           dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5], dtype=torch.float64) + s * torch.randn(n, generator=g, dtype=torch.float64)
    lam = x.T @ x / s ** 2 + alpha * torch.eye(d, dtype=torch.float64)
    post_mean = torch.linalg.solve(lam, x.T @ y / s ** 2)
    mf_var = 1 / lam.diagonal()
    mse = lambda pred, t: ((pred.squeeze(-1) - t) ** 2).mean() / (2 * s ** 2)  # noqa: E731
    m, net = _sgvb(lambda: nn.Sequential(nn.Linear(d, 1, bias=False)).double(), prior_variance=1 / alpha,
                   sigma_init=0.15, train_samples=16,
                   ctx_kw={"n_train": n, "lr": 0.02, "opt": "adam", "criterion": mse})
    m.scheduler = torch.optim.lr_scheduler.LambdaLR(m.optimizer, lambda t: 1.0 if t < 400 else 0.1)
    layer = bayesian_layers(net)[0]
    bp, flat = Backprop(net, CPU), NoFlatness()
    mus, vars_ = [], []
    for step in range(1200):
        m.train_step((x, y), flat, bp)
        if step >= 600:
            mus.append(layer.weight_mu.detach().view(-1).clone())
            vars_.append(layer.weight_sigma.detach().view(-1).clone() ** 2)
    mu_hat, var_hat = torch.stack(mus).mean(0), torch.stack(vars_).mean(0)
    post_sd = mf_var.sqrt()
    assert ((mu_hat - post_mean).abs() < 0.05 * post_sd).all(), (mu_hat, post_mean)
    torch.testing.assert_close(var_hat, mf_var, rtol=0.05, atol=0)
    # and sigma moved a long way from its initial value (a softplus sigma stuck at its init is a failure users of
    # other VI libraries report: blitz-bayesian-pytorch#50)
    assert (var_hat.sqrt() / 0.15 < 0.6).all()


# ------------------------------------------------------------------------------------------ F-SGVB
def _spy_passes(m, net):
    """Record parameters and the bank's stored noise at every loss_fn call."""
    snaps, orig = [], m.loss_fn

    def spy(batch):
        loss = orig(batch)
        snaps.append({"params": {n: p.detach().clone() for n, p in net.named_parameters()},
                      "noise": {k: v.clone() for k, v in m.bank.stored().items()}})
        return loss
    m.loss_fn = spy
    return snaps, orig


def _nll_grad_at(m, net, snap, loss_fn, batch, names):
    """grad of the batch NLL at snapshot ``snap`` (its params, its noise) w.r.t. ``names``."""
    params = dict(net.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(snap["params"][name])
    m.bank.clear()
    m.bank._store.update(snap["noise"])
    loss = loss_fn(batch)
    return torch.autograd.grad(loss, [params[n] for n in names])


@pytest.mark.parametrize("estimator", ["reparam", "lrt", "flipout"])
def test_f_sgvb_uses_the_same_noise_in_both_passes_and_perturbs_mu_only(estimator):
    m, net = _sgvb(_mlp64, estimator=estimator, sigma_init=0.05)
    x, y = _data()
    snaps, orig = _spy_passes(m, net)
    rho = 0.07
    m.train_step((x, y), SAM(rho=rho), Backprop(net, CPU))
    assert len(snaps) == 2
    a, b = snaps
    assert a["noise"].keys() == b["noise"].keys() and len(a["noise"]) > 0
    for k in a["noise"]:
        assert torch.equal(a["noise"][k], b["noise"][k])
    mu_names = [n for n in a["params"] if not n.endswith("_rho")]
    for name in a["params"]:
        if name.endswith("_rho"):
            assert torch.equal(a["params"][name], b["params"][name]), name
    # the ascent: mu' - mu = rho * g / ||g||, g = grad_mu NLL(mu + sigma eps) with that eps
    grads = _nll_grad_at(m, net, a, orig, (x, y), mu_names)
    norm = torch.sqrt(sum((g_ ** 2).sum() for g_ in grads))
    for name, g_ in zip(mu_names, grads):
        torch.testing.assert_close(b["params"][name] - a["params"][name], rho * g_ / norm, msg=name)


def test_geometry_scaling_is_abs_mu_over_sigma_and_drives_the_ascent():
    m, net = _sgvb(_mlp64, sigma_init=0.05)
    with torch.no_grad():
        for layer in bayesian_layers(net):
            layer.weight_rho.uniform_(-4, -2)
    scaling = m.flatness_scaling()
    named = m.named_parameters()
    params = dict(net.named_parameters())
    for (name, p), d in zip(named, scaling):
        if name.endswith("_mu"):
            torch.testing.assert_close(d, p.detach().abs() / F.softplus(params[name[:-3] + "_rho"].detach()))
        else:
            assert torch.equal(d, torch.ones_like(p))
    geo = Geometry(rho=0.1)
    geo.setup(m.ctx, m)
    with pytest.raises(ValueError, match="geometry"):
        Geometry(rho=0.1).setup(m.ctx, MAP())
    x, y = _data()
    snaps, orig = _spy_passes(m, net)
    m.train_step((x, y), geo, Backprop(net, CPU))
    a, b = snaps
    mu_names = [n for n, _ in named if n.endswith("_mu")]
    d_of = {n: d for (n, _), d in zip(named, scaling)}
    grads = _nll_grad_at(m, net, a, orig, (x, y), mu_names)
    dg = [d_of[n] * g_ for n, g_ in zip(mu_names, grads)]
    norm = torch.sqrt(sum((t ** 2).sum() for t in dg))
    for name, t in zip(mu_names, dg):  # mu' = mu + rho D g / ||D g||
        torch.testing.assert_close(b["params"][name] - a["params"][name], 0.1 * t / norm, msg=name)
    for name in a["params"]:
        if name.endswith("_rho"):
            assert torch.equal(a["params"][name], b["params"][name])


@pytest.mark.parametrize("estimator", ["reparam", "lrt", "flipout"])
def test_f_sgvb_with_rho_zero_is_plain_sgvb_bit_for_bit(estimator):
    x, y = _data(n=48)
    finals = []
    for flat in (NoFlatness(), SAM(rho=0.0), SAM(rho=0.0, m=3)):
        m, net = _sgvb(_mlp64, estimator=estimator, sigma_init=0.05, ctx_kw={"momentum": 0.9})
        bp = Backprop(net, CPU)
        for step in range(4):
            idx = torch.arange(12) + 12 * step
            m.train_step((x[idx], y[idx]), flat, bp)
        finals.append([p.detach().clone() for p in net.parameters()])
    for p, q in zip(finals[0], finals[1]):
        assert torch.equal(p, q)
    # m = 3 chunks draw their own noise: different, but still finite and close
    assert any(not torch.equal(p, q) for p, q in zip(finals[0], finals[2]))


def test_flatness_random_composes_with_sgvb_and_leaves_sigma_alone():
    m, net = _sgvb(_mlp64, sigma_init=0.05)
    x, y = _data()
    out = m.train_step((x, y), RandomSAM(rho=0.05), Backprop(net, CPU))
    assert math.isfinite(out["loss"]) and out["kl"] > 0


# ------------------------------------------------------------------------------------------ RandomSAM
@pytest.mark.parametrize("prior_coef", [0.0, 0.02])
def test_rsam_method_equals_map_with_flatness_random(prior_coef):
    x, y = _data(n=40)
    results = []
    for path in ("method", "flatness"):
        torch.manual_seed(3)
        net = _mlp64()
        if path == "method":
            meth, flat = RandomSAMMethod(rho=0.5, prior_coef=prior_coef), NoFlatness()
            meth.setup(_ctx(net, lr=0.1, momentum=0.9, seed=5))
        else:
            meth, flat = MAP(), RandomSAM(rho=0.5)
            meth.setup(_ctx(net, lr=0.1, momentum=0.9, wd=prior_coef, seed=5))
            flat.setup(meth.ctx, meth)
        bp = Backprop(net, CPU)
        grads = []
        for step in range(3):
            idx = torch.arange(10) + 10 * step
            meth.train_step((x[idx], y[idx]), flat, bp)
            grads.append([p.grad.clone() for p in net.parameters()])
        results.append(([p.detach().clone() for p in net.parameters()], grads))
    (pa, ga), (pb, gb) = results
    if prior_coef == 0.0:  # the same gradient and trajectory, bit for bit
        for p, q in zip(pa, pb):
            assert torch.equal(p, q)
        for a, b in zip(ga, gb):
            for p, q in zip(a, b):
                assert torch.equal(p, q)
    else:  # weight decay is added inside SGD, the prior term before it: equal to rounding
        for p, q in zip(pa, pb):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_rsam_refuses_a_flatness_variant():
    net = _mlp64()
    meth = RandomSAMMethod()
    meth.setup(_ctx(net))
    x, y = _data()
    with pytest.raises(ValueError, match="flatness=none"):
        meth.train_step((x, y), SAM(), Backprop(net, CPU))


# ------------------------------------------------------------------------------------------ state
def test_sgvb_state_dict_round_trip_resumes_exactly():
    x, y = _data(n=60)
    batches = [(x[i * 10:(i + 1) * 10], y[i * 10:(i + 1) * 10]) for i in range(6)]

    def fresh():
        return _sgvb(_mlp64, estimator="lrt", sigma_init=0.05, ctx_kw={"momentum": 0.9})
    a, net_a = fresh()
    bp = Backprop(net_a, CPU)
    for bt in batches:
        a.train_step(bt, SAM(rho=0.05), bp)
    b, net_b = fresh()
    for bt in batches[:3]:
        b.train_step(bt, SAM(rho=0.05), Backprop(net_b, CPU))
    state = {k: v for k, v in b.state_dict().items()}
    import copy
    state, gen_state = copy.deepcopy(state), b.ctx.generator.get_state()
    c, net_c = fresh()
    c.load_state_dict(state)
    c.ctx.generator.set_state(gen_state)
    for bt in batches[3:]:
        c.train_step(bt, SAM(rho=0.05), Backprop(net_c, CPU))
    for p, q in zip(net_a.parameters(), net_c.parameters()):
        assert torch.equal(p, q)


def test_predict_uses_one_weight_sample_for_every_set_and_is_reproducible():
    m, net = _sgvb(_mlp64, estimator="lrt", sigma_init=0.3, num_samples=3)
    x, y = _data(n=20)
    loader = [(x[:10], y[:10]), (x[10:], y[10:])]
    runs = [list(m.predict({"a": loader, "b": loader[::-1]})) for _ in range(2)]
    assert len(runs[0]) == 3
    for s1, s2 in zip(*runs):
        assert torch.equal(s1["a"], s2["a"])
        # the same weights on every batch: set b is set a with its batches swapped
        torch.testing.assert_close(s1["b"], torch.cat([s1["a"][10:], s1["a"][:10]]))
    assert not torch.equal(runs[0][0]["a"], runs[0][1]["a"])


# ------------------------------------------------------------------------------------------ Hydra runs
@pytest.mark.parametrize("method,extra,min_acc", [
    ("sgvb", [], 0.93),
    ("sgvb_lrt", [], 0.93),
    ("f_sgvb", [], 0.93),
    ("f_sgvb_lrt", ["flatness=geometry", "flatness.rho=0.05"], 0.93),
    ("bbb_flipout", [], 0.93),
    ("mfvi", [], 0.93),
    ("rsam", [], 0.93),
])
def test_vi_method_runs_end_to_end_on_digits(method, extra, min_acc, tmp_path):
    res = run_cfg(DIGITS + [f"method={method}", "method.num_samples=5"] + extra, tmp_path)
    metrics, meta = res["metrics"], res["meta"]
    assert metrics["accuracy"] >= min_acc, metrics
    for k in ("nll", "ece", "brier"):
        assert k in metrics and math.isfinite(metrics[k])
    assert metrics["nll"] < 0.3
    assert metrics["num_samples"] == 5
    if method.startswith("f_"):
        assert meta["flatness"]["name"] in ("sam", "geometry")
