"""Posterior methods I: SWA/SWAG/SWAG-Diag, SGLD, MC-Dropout, deep ensembles (unit level)."""

import math

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import NoFlatness
from flatbnn.methods import SGLD, SWAG, DeepEnsemble, MCDropout, RunContext
from flatbnn.methods.batchnorm import refresh_batchnorm
from flatbnn.metrics.evaluate import evaluate

CPU = torch.device("cpu")


def _linear_problem(n=200, d=3, noise=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_true = torch.tensor([1.0, -2.0, 0.5][:d], dtype=torch.float64)
    y = x @ w_true + noise * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y


def _ctx(module, n_train, lr, wd=0.0, momentum=0.0, criterion=None, epochs=1, steps=1, **kw):
    return RunContext(model=module, module=module, device=CPU, n_train=n_train, steps_per_epoch=steps,
                      epochs=epochs, optimizer_factory=lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum,
                                                                                  weight_decay=wd),
                      scheduler_factory=None, criterion=criterion, **kw)


def _mse(sigma):
    return lambda pred, y: ((pred.squeeze(-1) - y) ** 2).mean() / (2 * sigma ** 2)


# ---------------------------------------------------------------------------------------- SWAG
@pytest.mark.parametrize("mode", ["swag", "swag_diag"])
def test_swag_moments_deviations_and_samples_match_the_definition(mode):
    torch.manual_seed(0)
    x, y = _linear_problem()
    lin = nn.Linear(3, 1, bias=False).double()
    m = SWAG(mode=mode, swa_start=1, collect_every=1, collect_unit="step", max_rank=5)
    m.setup(_ctx(lin, len(y), lr=0.05, criterion=_mse(0.5), epochs=10))
    bp, flat = Backprop(lin, CPU), NoFlatness()
    for step in range(100):  # epoch 1 (before swa_start): no collection
        m.train_step((x[step % 10 * 20:][:20], y[step % 10 * 20:][:20]), flat, bp)
    m.on_epoch_end(0)
    assert m.n_collected == 0
    iterates = []
    for step in range(40):  # constant-lr SGD on minibatches of 20: iterates bounce around the optimum
        idx = torch.arange(step * 20, step * 20 + 20) % len(y)
        m.train_step((x[idx], y[idx]), flat, bp)
        iterates.append(parameters_to_vector(lin.parameters()).detach().clone())
    W = torch.stack(iterates)
    torch.testing.assert_close(m.mean, W.mean(0))
    torch.testing.assert_close(m.sq_mean, (W ** 2).mean(0))
    assert m.n_collected == 40
    var = W.var(0, unbiased=False)
    if mode == "swag":
        # last 5 deviations, each from the running mean *after* including that iterate
        running = torch.cumsum(W, 0) / torch.arange(1, 41, dtype=W.dtype).unsqueeze(1)
        torch.testing.assert_close(m.deviations, (W - running)[-5:])
        expected_cov = 0.5 * (torch.diag(var) + m.deviations.T @ m.deviations / 4)
    else:
        assert m.deviations.shape[0] == 0
        expected_cov = torch.diag(var)
    g = torch.Generator().manual_seed(1)
    S = torch.stack([m.sample_vector(g) for _ in range(20000)])
    std = expected_cov.diagonal().sqrt()
    assert ((S.mean(0) - W.mean(0)).abs() < 5 * std / math.sqrt(20000)).all()
    # sampling error of a covariance entry ~ sqrt(c_ii c_jj / n) = 0.7% of the diagonal at n = 20000
    torch.testing.assert_close(torch.cov(S.T), expected_cov, rtol=0.05, atol=0.03 * expected_cov.diagonal().max())
    # the SWA mean sits near the least-squares solution of the full problem
    ols = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    assert (m.mean - ols).abs().max() < 0.1


def test_swag_state_roundtrip_restores_collected_posterior():
    lin = nn.Linear(3, 1, bias=False).double()
    x, y = _linear_problem()
    a = SWAG(mode="swag", swa_start=0, collect_unit="step", max_rank=3)
    a.setup(_ctx(lin, len(y), lr=0.05, criterion=_mse(0.5)))
    for _ in range(6):
        a.train_step((x[:20], y[:20]), NoFlatness(), Backprop(lin, CPU))
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in a.state_dict().items()}
    lin2 = nn.Linear(3, 1, bias=False).double()
    b = SWAG(mode="swag", swa_start=0, collect_unit="step", max_rank=3)
    b.setup(_ctx(lin2, len(y), lr=0.05, criterion=_mse(0.5)))
    b.load_state_dict(state)
    assert b.n_collected == 6
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    torch.testing.assert_close(a.sample_vector(g1), b.sample_vector(g2))


def test_batchnorm_refresh_is_a_cumulative_average():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    data = [(torch.randn(16, 4) * 3 + 1, torch.zeros(16)) for _ in range(5)]
    with torch.no_grad():
        net[1].running_mean.fill_(100.0)
        feats = [net[0](xb) for xb, _ in data]
    refresh_batchnorm(net, data, CPU)
    torch.testing.assert_close(net[1].running_mean, torch.cat(feats).mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(net[1].running_var, torch.stack([f.var(0) for f in feats]).mean(0),
                               rtol=1e-5, atol=1e-5)
    refresh_batchnorm(net, data, CPU, fraction=0.2)  # first batch only
    torch.testing.assert_close(net[1].running_mean, feats[0].mean(0), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- SGLD
def test_sgld_samples_match_the_bayesian_linear_regression_posterior():
    """Full-batch SGLD on y = Xw + N(0, s^2), prior N(0, 1/alpha): posterior N(m, S) in closed form."""
    torch.manual_seed(0)
    n, s, alpha = 100, 1.0, 1.0
    x, y = _linear_problem(n=n, d=2, noise=s)
    S = torch.linalg.inv(x.T @ x / s ** 2 + alpha * torch.eye(2, dtype=torch.float64))
    mean = S @ x.T @ y / s ** 2
    lin = nn.Linear(2, 1, bias=False).double()
    m = SGLD(temperature=1.0, burn_in=0, sample_every=1000, sample_unit="step", max_samples=5)
    # weight decay = prior precision / N: the mean-loss objective's Gaussian prior
    m.setup(_ctx(lin, n, lr=0.05, wd=alpha / n, criterion=_mse(s)))
    bp, flat = Backprop(lin, CPU), NoFlatness()
    draws = []
    for step in range(7000):
        m.train_step((x, y), flat, bp)
        if step >= 500:
            draws.append(lin.weight.detach().view(-1).clone())
    D = torch.stack(draws)
    sd = S.diagonal().sqrt()
    # iterates are autocorrelated (~1/(lr * curvature) = 20 steps): ~320 effective draws, so the variance is known to
    # ~8 % (sqrt(2 / 320)) and the mean to ~0.06 sd
    assert ((D.mean(0) - mean).abs() < 0.25 * sd).all(), (D.mean(0), mean)
    # Euler discretisation inflates the variance by ~1/(1 - lr*h/2) ~ 2.5% here
    torch.testing.assert_close(D.var(0), S.diagonal(), rtol=0.2, atol=0)
    assert len(m.samples) == 5  # kept every 1000 steps, latest 5


def test_sgld_noise_scale_is_sqrt_2_lr_T_over_N():
    lin = nn.Linear(2, 1, bias=False).double()
    m = SGLD(temperature=2.0)
    m.setup(_ctx(lin, 50, lr=0.1))
    assert m.noise_std(0.1) == pytest.approx(math.sqrt(2 * 0.1 * 2.0 / 50))
    lin_m = SGLD(noise_mode="linear", noise_factor=0.1)
    lin_m.setup(_ctx(nn.Linear(2, 1).double(), 50, lr=0.1))
    assert lin_m.noise_std(0.3) == pytest.approx(0.03)


# ---------------------------------------------------------------------------------------- MC-Dropout / ensembles
def _loader(n=64, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs, ys = torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, n, 16)], ys


def test_mc_dropout_passes_differ_and_map_eval_is_deterministic():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.BatchNorm1d(32), nn.Linear(32, 3))
    loader, _ = _loader()
    m = MCDropout(num_samples=3)
    m.setup(_ctx(net, 64, lr=0.1))
    bn_before = net[3].running_mean.clone()
    passes = [s["test"] for s in m.predict({"test": loader})]
    assert len(passes) == 3 and not torch.allclose(passes[0], passes[1])
    assert torch.equal(net[3].running_mean, bn_before), "BatchNorm must stay in eval mode"
    again = [s["test"] for s in m.predict({"test": loader})]
    assert all(torch.equal(a, b) for a, b in zip(passes, again)), "fixed evaluation seed"
    mon = [next(m.monitor({"test": loader}))["test"] for _ in range(2)]
    assert torch.equal(mon[0], mon[1])
    with pytest.raises(ValueError, match="model.dropout"):
        MCDropout().setup(_ctx(nn.Linear(6, 3), 64, lr=0.1))


def test_ensemble_nll_is_minus_log_of_mean_probability():
    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    loader, targets = _loader()
    m = DeepEnsemble(num_members=3)
    m.setup(_ctx(net, 64, lr=0.1, epochs=1, steps=1, model_factory=lambda seed: (torch.manual_seed(seed), nn.Linear(6, 3))[1]))
    for e in range(3):
        m.on_epoch_end(e)  # each "member" = one epoch here; re-initialised from seed + i
    assert len(m.members) == 3
    assert not torch.equal(m.members[0]["weight"], m.members[1]["weight"])
    res = evaluate(m, {"test": loader}, targets)
    probs = torch.stack([s["test"].exp() for s in m.predict({"test": loader})])  # [M, N, C]
    p_y = probs.mean(0)[torch.arange(64), targets]
    assert res["nll"] == pytest.approx(-p_y.log().mean().item(), rel=1e-5)
    mean_of_nlls = -(probs[:, torch.arange(64), targets].log()).mean().item()
    assert res["nll"] < mean_of_nlls  # Jensen: the ensemble's NLL is below the members' average
    assert res["single_sample"]["nll"] == pytest.approx(mean_of_nlls, rel=1e-5)
    assert res["num_samples"] == 3
