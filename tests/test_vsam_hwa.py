"""VariationalSAM (Ujvary et al.) and HWA (Karimi & Li): unit checks against hand computations + digits runs."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import SAM, NoFlatness
from flatbnn.methods import RunContext
from flatbnn.methods.hwa import HWA
from flatbnn.methods.param_vector import unflatten
from flatbnn.methods.vsam import VariationalSAM
from flatbnn.nn.bayesian import bayesian_layers
from helpers import run_cfg

CPU = torch.device("cpu")
DIGITS = ["dataset=digits", "model=mlp", "model.hidden=[128]", "trainer.eval_every=0", "trainer.epochs=6"]


def _ctx(module, n_train=100, lr=0.1, momentum=0.0, wd=0.0, seed=0, epochs=1, steps=1, **kw):
    return RunContext(model=module, module=module, device=CPU, n_train=n_train, steps_per_epoch=steps, epochs=epochs,
                      optimizer_factory=lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum, weight_decay=wd),
                      scheduler_factory=None, generator=torch.Generator().manual_seed(seed), **kw)


def _data(n=32, d=5, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, c, (n,), generator=g)


def _mlp64():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _grads(net, x, y, params=None):
    loss = F.cross_entropy(net(x), y)
    return torch.autograd.grad(loss, list(params or net.parameters()))


# ------------------------------------------------------------------------------------------ VSAM
def test_vsam_initial_perturbation_has_the_sam_radius():
    torch.manual_seed(0)
    net = _mlp64()
    m = VariationalSAM(rho=1000.0, init_radius=0.05, init_count=1e6)
    m.setup(_ctx(net))
    x, y = _data()
    eps = m.ascent(_grads(net, x, y))
    assert math.sqrt(sum(float((e ** 2).sum()) for e in eps)) == pytest.approx(0.05, rel=1e-6)  # 1e-12 in the norm


def test_vsam_step_matches_a_hand_computation():
    """mu <- mu - lr grad L(mu + eps), eps = rho (g/M^2)/sqrt(sum g^2/M^2); M <- M - m_lr dL_M/dM."""
    torch.manual_seed(0)
    net = _mlp64()
    lr, m_lr, n_train, rho, sp = 0.1, 0.5, 40, 2.0, 0.7
    m = VariationalSAM(rho=rho, init_radius=0.3, init_count=4.0, m_lr=m_lr, prior_std=sp)
    m.setup(_ctx(net, n_train=n_train, lr=lr))
    with torch.no_grad():  # heterogeneous M
        for mm in m.M:
            mm.uniform_(2.0, 8.0)
    M0 = [mm.detach().clone() for mm in m.M]
    mu0 = [p.detach().clone() for p in net.parameters()]
    x, y = _data()
    g = _grads(net, x, y)
    s = math.sqrt(sum(float((gi ** 2 / Mi ** 2).sum()) for gi, Mi in zip(g, M0)))
    eps = [rho * gi / Mi ** 2 / s for gi, Mi in zip(g, M0)]
    with torch.no_grad():
        for p, e in zip(net.parameters(), eps):
            p.add_(e)
    g_pert = _grads(net, x, y)
    with torch.no_grad():
        for p, w in zip(net.parameters(), mu0):
            p.copy_(w)
    dM = [rho * (-(gi ** 2) / Mi ** 3) / s + (1 / (2 * n_train)) * (-2 / (Mi ** 3 * sp) + 2 / Mi)
          for gi, Mi in zip(g, M0)]
    m.train_step((x, y), NoFlatness(), Backprop(net, CPU))
    for p, w, gp in zip(net.parameters(), mu0, g_pert):
        torch.testing.assert_close(p.detach(), w - lr * gp)
    for mm, Mi, d in zip(m.M, M0, dM):
        torch.testing.assert_close(mm.detach(), Mi - m_lr * d)


def test_vsam_closed_form_m_gradient_equals_autograd_of_its_objective():
    """The step uses m_grad (closed form, one flat vector); it must be the gradient of m_loss, the objective."""
    torch.manual_seed(0)
    net = _mlp64()
    m = VariationalSAM(rho=3.0, init_radius=0.3, init_count=4.0, prior_std=0.7)
    m.setup(_ctx(net, n_train=40))
    with torch.no_grad():
        for mm in m.M:
            mm.uniform_(0.5, 8.0)
    g = _grads(net, *_data())
    auto = torch.autograd.grad(m.m_loss(g), m.M)
    closed = unflatten(m.m_grad(*m._ellipsoid(g)), m.M)
    for a, c in zip(auto, closed):
        torch.testing.assert_close(c, a, rtol=1e-12, atol=1e-15)


def test_vsam_non_finite_gradient_gives_no_ascent():
    # fp16 overflow: the scaler will skip the step, but the second pass must not run (and update BatchNorm) at
    # weights + inf/nan
    torch.manual_seed(0)
    net = _mlp64()
    m = VariationalSAM(rho=1.0, init_radius=0.1, init_count=1.0)
    m.setup(_ctx(net))
    g = [gi.clone() for gi in _grads(net, *_data())]
    g[0][0, 0] = float("inf")
    assert all(torch.equal(e, torch.zeros_like(e)) for e in m.ascent(g))


def test_vsam_refuses_a_flatness_variant_and_round_trips_its_state():
    torch.manual_seed(0)
    net = _mlp64()
    m = VariationalSAM(rho=1.0, init_radius=0.1, init_count=1.0, m_lr=0.1)
    m.setup(_ctx(net, momentum=0.9, wd=1e-3))
    x, y = _data(n=40)
    with pytest.raises(ValueError, match="flatness=none"):
        m.train_step((x, y), SAM(), Backprop(net, CPU))
    for i in range(2):
        m.train_step((x[i * 10:(i + 1) * 10], y[i * 10:(i + 1) * 10]), NoFlatness(), Backprop(net, CPU))
    state = copy.deepcopy(m.state_dict())
    net2 = copy.deepcopy(net)
    m2 = VariationalSAM(rho=1.0, init_radius=0.1, init_count=1.0, m_lr=0.1)
    m2.setup(_ctx(net2, momentum=0.9, wd=1e-3))
    m2.load_state_dict(state)
    for a, b in ((m, net), (m2, net2)):
        for i in (2, 3):
            a.train_step((x[i * 10:(i + 1) * 10], y[i * 10:(i + 1) * 10]), NoFlatness(), Backprop(b, CPU))
    for p, q in zip(list(net.parameters()) + m.M, list(net2.parameters()) + m2.M):
        assert torch.equal(p, q)


@pytest.mark.slow  # two torchrun jobs of gloo processes
def test_vsam_on_two_processes_perturbs_with_the_global_gradient(tmp_path):
    """2 CPU ranks = 1 process with the same global batch: the first pass is all-reduced, so both ranks take the
    ascent (and the M step) of the global batch's gradient -- a per-rank ascent (no_sync) would be m-sharpness
    with m = 2 and change the run (issue 42)."""
    from helpers import results, train_cli
    base = ["dataset=digits", "model=mlp", "model.hidden=[64]", "method=vsam", "method.rho=1.0",
            "method.init_count=1.0", "method.init_radius=0.05", "dataset.train_subset=1400",
            "trainer.batch_size=56", "trainer.epochs=2", "trainer.device=cpu", "trainer.eval_every=0",
            "trainer.reliability_diagram=false"]
    train_cli(base, tmp_path / "single")
    train_cli(base, tmp_path / "ddp", torchrun=2)
    single, ddp = results(tmp_path / "single"), results(tmp_path / "ddp")
    assert ddp["meta"]["budget"]["world_size"] == 2 and ddp["meta"]["method"]["effective_m"] == 1
    for k in ("accuracy", "nll", "ece", "brier"):
        assert ddp["metrics"][k] == pytest.approx(single["metrics"][k], abs=2e-5), k


# ------------------------------------------------------------------------------------------ HWA
def _hwa(seed=0, **kw):
    torch.manual_seed(seed)
    m = HWA(sigma_init=0.05, lr_cycles=None, **kw)
    net = m.prepare_model(_mlp64())
    m.setup(_ctx(net, momentum=0.9, epochs=1, steps=12))
    return m, net


@pytest.mark.parametrize("covariance", ["diag", "lowrank"])
def test_hwa_averaging_follows_eq4_by_hand(covariance):
    m, net = _hwa(cycle_length=2, start=0.25, covariance=covariance, max_rank=3,  # start = step 3 of 12
                  train_from="svi")  # snapshots of the SVI trajectory itself (Alg. 2's restart: tested below)
    assert m.start_step == 3 and m.cycle_length == 2
    x, y = _data(n=120)
    bp = Backprop(net, CPU)
    layers = bayesian_layers(net)
    snaps = []
    for k in range(1, 13):
        idx = torch.arange(10) + 10 * (k - 1)
        m.train_step((x[idx], y[idx]), NoFlatness(), bp)
        if k >= 3 and (k - 3) % 2 == 0:  # steps 3, 5, 7, 9, 11
            mu = torch.cat([p.detach().reshape(-1) for layer in layers for p in (layer.weight_mu, layer.bias_mu)])
            var = torch.cat([F.softplus(r.detach()).reshape(-1) ** 2 for layer in layers
                             for r in (layer.weight_rho, layer.bias_rho)])
            snaps.append((mu, var))
    assert m.n_models == 5
    # Eq. (4) recursively, by hand
    mu_h = sq_h = v_h = None
    devs = []
    for n, (mu, var) in enumerate(snaps):
        if n == 0:
            mu_h, sq_h, v_h = mu.clone(), mu ** 2, var.clone()
        else:
            mu_h = (n * mu_h + mu) / (n + 1)
            sq_h = (n * sq_h + mu ** 2) / (n + 1)
            v_h = (n * v_h + var) / (n + 1)
        devs.append(mu - mu_h)
    torch.testing.assert_close(m.mu_avg, mu_h)
    torch.testing.assert_close(m.sq_avg, sq_h)
    torch.testing.assert_close(m.var_avg, v_h)
    M = torch.stack([s[0] for s in snaps])
    torch.testing.assert_close(m.mu_avg, M.mean(0))
    torch.testing.assert_close(m.trajectory_variance, M.var(0, unbiased=False))
    m.variance_mode = "eq4"
    torch.testing.assert_close(m.diag_variance, M.var(0, unbiased=False))
    m.variance_mode = "mixture"
    svi = torch.stack([s[1] for s in snaps]).mean(0) * (2 if covariance == "lowrank" else 1)  # Eq. 5 halves it
    torch.testing.assert_close(m.diag_variance, M.var(0, unbiased=False) + svi)
    if covariance == "lowrank":
        k = min(m._dev_count, m.max_rank)
        assert k == 3
        # ring buffer of the last 3 deviations (mean updated first): rows 2, 0, 1 = collections 3, 4, 5
        torch.testing.assert_close(m._dev[[2, 0, 1]], torch.stack(devs[-3:]))


def test_hwa_lowrank_samples_have_the_eq5_covariance():
    m, net = _hwa(cycle_length=1, start=0.0, covariance="lowrank", max_rank=4)
    d = m.mu_avg.numel()
    g = torch.Generator().manual_seed(0)
    m.mu_avg = torch.randn(d, generator=g, dtype=torch.float64)
    m.sq_avg = m.mu_avg ** 2 + 0.01
    m.var_avg = torch.full((d,), 0.02, dtype=torch.float64)
    m._dev = torch.randn(4, d, generator=g, dtype=torch.float64) * 0.2
    m._dev_count = 4
    m.n_models = 4
    diag = 0.05 * torch.ones(d, dtype=torch.float64)  # mixture: 2 * 0.02 (learned part, halved by Eq. 5) + 0.01
    cov = 0.5 * torch.diag(diag) + m._dev.T @ m._dev / (2 * 3)
    S = torch.stack([m.sample_vector(g) for _ in range(20000)])
    sub = slice(0, 6)
    torch.testing.assert_close(torch.cov(S[:, sub].T), cov[sub, sub], rtol=0.08, atol=0.004)
    assert ((S.mean(0) - m.mu_avg).abs() < 5 * cov.diagonal().sqrt() / math.sqrt(20000)).all()


def test_hwa_state_round_trip_resumes_exactly_and_predicts_from_the_average():
    x, y = _data(n=120)
    a, net_a = _hwa(cycle_length=2, start=0.0, covariance="lowrank", max_rank=3, num_samples=2)
    for k in range(6):
        a.train_step((x[10 * k:10 * k + 10], y[10 * k:10 * k + 10]), NoFlatness(), Backprop(net_a, CPU))
    state, gen = copy.deepcopy(a.state_dict()), a.ctx.generator.get_state()
    b, net_b = _hwa(seed=1, cycle_length=2, start=0.0, covariance="lowrank", max_rank=3, num_samples=2)
    b.load_state_dict(state)
    b.ctx.generator.set_state(gen)
    for k in range(6, 12):
        for meth, net in ((a, net_a), (b, net_b)):
            meth.train_step((x[10 * k:10 * k + 10], y[10 * k:10 * k + 10]), NoFlatness(), Backprop(net, CPU))
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(p, q)
    assert a.n_models == b.n_models == 6
    torch.testing.assert_close(a.mu_avg, b.mu_avg, rtol=0, atol=0)
    before = [p.detach().clone() for p in net_a.parameters()]
    pa = list(a.predict({"t": [(x[:10], y[:10])]}))
    pb = list(b.predict({"t": [(x[:10], y[:10])]}))
    assert len(pa) == 2 and torch.equal(pa[0]["t"], pb[0]["t"])
    for p, q in zip(before, net_a.parameters()):  # prediction leaves the SVI state untouched
        assert torch.equal(p, q)


@pytest.mark.parametrize("variance", ["mixture", "eq4", "svi"])
def test_hwa_alg2_restarts_the_svi_iterate_from_the_averaged_q(variance):
    x, y = _data(n=120)
    m, net = _hwa(cycle_length=3, start=0.0, variance=variance)  # averages at steps 3, 6, 9, 12
    ref, net_ref = _hwa(cycle_length=3, start=0.0, variance=variance, train_from="svi")
    layers = bayesian_layers(net)
    sig2 = lambda: torch.cat([F.softplus(r.detach()).reshape(-1) ** 2 for layer in layers  # noqa: E731
                              for r in (layer.weight_rho, layer.bias_rho)])
    for k in range(6):
        batch = (x[10 * k:10 * k + 10], y[10 * k:10 * k + 10])
        before = m.mean_vector().clone()
        m.train_step(batch, NoFlatness(), Backprop(net, CPU))
        ref.train_step(batch, NoFlatness(), Backprop(net_ref, CPU))
        if k == 2:  # first average: q_HWA = the iterate itself, the restart changes nothing (up to rounding)
            torch.testing.assert_close(m.mean_vector(), ref.mean_vector(), rtol=0, atol=1e-15)
            if variance != "eq4":
                torch.testing.assert_close(sig2(), ref.variance_vector(), rtol=1e-9, atol=1e-15)
        if k == 5:  # second average: the iterate IS the averaged q (mean and diagonal)
            torch.testing.assert_close(m.mean_vector(), m.mu_avg, rtol=0, atol=0)
            expect = m.diag_variance.clamp_min(1e-16)
            torch.testing.assert_close(sig2(), expect, rtol=1e-9, atol=1e-15)
            assert not torch.equal(m.mean_vector(), before)
            # and it differs from training on from the SVI iterate
            assert (m.mean_vector() - ref.mean_vector()).abs().max() > 1e-4
    # a step after the restart is an ordinary SVI step from (mu_HWA, sigma_HWA)
    batch = (x[60:70], y[60:70])
    assert m.n_models == 2
    m.train_step(batch, NoFlatness(), Backprop(net, CPU))
    assert m.n_models == 2 and not torch.equal(m.mean_vector(), m.mu_avg)


def test_hwa_alg2_lowrank_training_sample_and_its_exact_kl():
    """With covariance=lowrank the training weights are mu + sigma*eps + U z (Eq. 5) and the KL term is the
    closed-form KL of that full-covariance Gaussian to the prior (checked against torch.distributions)."""
    x, y = _data(n=200)
    m, net = _hwa(cycle_length=1, start=0.0, covariance="lowrank", max_rank=3, train_samples=1)
    for k in range(5):  # 5 averages -> 3 deviation columns, iterate = averaged q
        m.train_step((x[10 * k:10 * k + 10], y[10 * k:10 * k + 10]), NoFlatness(), Backprop(net, CPU))
    U = m.lowrank_factor()
    assert U.shape == (m.mu_avg.numel(), 3)
    # the sample: gradient of the data term at mu + U z with the layers' eps; mu itself untouched
    gen_state = m.ctx.generator.get_state()
    mu0 = m.mean_vector().clone()
    batch = (x[100:110], y[100:110])
    m.optimizer.zero_grad(set_to_none=True)
    m.bank.clear()
    nll = m.data_gradient(batch, NoFlatness(), Backprop(net, CPU))
    assert torch.equal(m.mean_vector(), mu0)
    g_hwa = [p.grad.clone() for p in m.mean_params]
    m.ctx.generator.set_state(gen_state)
    z = torch.randn(3, generator=m.ctx.generator, dtype=U.dtype)
    m.write_mean_vector(mu0 + U @ z)
    m.optimizer.zero_grad(set_to_none=True)
    loss = m.loss_fn(batch)  # the bank still holds this step's eps: replayed
    grads = torch.autograd.grad(loss, m.mean_params)
    m.write_mean_vector(mu0)
    assert abs(float(loss.detach()) - nll) < 1e-12
    for a, b in zip(g_hwa, grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    m.bank.clear()
    # KL of N(mu_b, diag(sigma^2) + U_b U_b^T) to N(0, s^2 I) over the Bayesian coordinates
    m._lowrank_step = m._lowrank_rows()
    kl = m.kl()
    m._lowrank_step = None
    mask = m._bayes_mask
    sigma = torch.cat([F.softplus(m._sigma_of[id(p)]).reshape(-1) for p in m.mean_params if id(p) in m._sigma_of])
    cov = torch.diag(sigma.detach() ** 2) + U[mask] @ U[mask].T
    q = torch.distributions.MultivariateNormal(mu0[mask], covariance_matrix=cov)
    p = torch.distributions.MultivariateNormal(torch.zeros_like(mu0[mask]),
                                               covariance_matrix=m.prior_variance * torch.eye(int(mask.sum()),
                                                                                              dtype=U.dtype))
    torch.testing.assert_close(kl.detach(), torch.distributions.kl_divergence(q, p), rtol=1e-9, atol=1e-9)
    assert abs(float(kl.detach()) - float(m.kl().detach())) > 1e-3  # the low-rank part is not ignored


# ------------------------------------------------------------------------------------------ Hydra runs
@pytest.mark.parametrize("method,extra,min_acc", [
    ("vsam", [], 0.93),
    ("vsam", ["method.num_samples=3"], 0.93),
    ("hwa", ["method.num_samples=5"], 0.93),
    ("hwa", ["method.num_samples=5", "method.covariance=lowrank", "method.cycle_length=5"], 0.93),
])
def test_vsam_and_hwa_run_end_to_end_on_digits(method, extra, min_acc, tmp_path):
    res = run_cfg(DIGITS + [f"method={method}"] + extra, tmp_path)
    metrics, meta = res["metrics"], res["meta"]
    assert metrics["accuracy"] >= min_acc, metrics
    for k in ("nll", "ece", "brier"):
        assert k in metrics and math.isfinite(metrics[k])
    assert metrics["nll"] < 0.3
    if method == "hwa":
        assert meta["method"]["n_models"] > 0 and meta["method"]["lr_cycles"] == 4
    if method == "vsam":
        with pytest.raises(Exception, match="flatness=none"):
            run_cfg(DIGITS + ["method=vsam", "flatness=sam", "trainer.epochs=1"], tmp_path / "refused")
