"""IVON (flatbnn/methods/ivon.py, flatbnn/optim/ivon.py): the update equals the authors' ivon-opt 0.1.3 (GPLv3+, a
test-only reference: skipped where it is not installed, CI installs it) fed the same noise; it composes with a
flatness variant as written out by hand; a state round trip resumes exactly; the graph protocol adds nothing; and a
digits run learns."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.engine import graphed
from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import SAM, NoFlatness
from flatbnn.methods import RunContext
from flatbnn.methods.ivon import IVON

from helpers import run_cfg

CPU = torch.device("cpu")
N_TRAIN = 50
# beta2 far from 1 and a finite clip radius, so the Hessian update and the clipping both act within a few steps
HP = dict(lr=0.05, ess=40.0, hess_init=0.3, beta1=0.8, beta2=0.9, weight_decay=2e-3, clip_radius=0.5)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3))


def _batches(n=4, size=8):
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(size, 3, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


FACTORS = [1.0, 0.7, 0.4, 0.2, 0.1]


def _method(net, mc_samples=1, seed=5, **kw):
    method = IVON(mc_samples=mc_samples, num_samples=2, **{**HP, **kw})
    ctx = RunContext(model=net, module=net, device=CPU, n_train=N_TRAIN, steps_per_epoch=1, epochs=10,
                     optimizer_factory=None, generator=torch.Generator().manual_seed(seed),
                     scheduler_factory=lambda opt, total_steps, steps_per_epoch:
                     torch.optim.lr_scheduler.LambdaLR(opt, lambda k: FACTORS[k] if k < len(FACTORS) else 0.0))
    method.setup(ctx)
    method.train()
    return method


def _state(method):
    opt = method.optimizer
    return ([p.detach().clone() for p in opt.params()], [opt.state[p]["momentum"].clone() for p in opt.params()],
            [opt.state[p]["hess"].clone() for p in opt.params()])


# ---------------------------------------------------------------- against the authors' package
@pytest.mark.parametrize("mc_samples, rescale_lr", [(1, True), (3, True), (2, False)])
def test_ivon_update_equals_ivon_opt_fed_the_same_noise(mc_samples, rescale_lr):
    """ivon-opt draws its noise from torch's global generator (one randn over all weights per sample), ours from the
    run's generator in the same order: seeded alike before each step, both see the same noise, and the weights,
    momentum and Hessian estimate agree to 1e-6 after every one of 4 steps (a changing lr included)."""
    ivon = pytest.importorskip("ivon", reason="ivon-opt (GPLv3+) is a test-only reference: pip install ivon-opt==0.1.3")
    ours_net, ref_net = _net(), _net()
    method = _method(ours_net, mc_samples=mc_samples, rescale_lr=rescale_lr)
    ref = ivon.IVON(ref_net.parameters(), lr=HP["lr"], ess=HP["ess"], hess_init=HP["hess_init"],
                    beta1=HP["beta1"], beta2=HP["beta2"], weight_decay=HP["weight_decay"],
                    mc_samples=mc_samples, clip_radius=HP["clip_radius"], rescale_lr=rescale_lr)
    bp = Backprop(ours_net, CPU)
    moved = 0.0
    for step, (x, y) in enumerate(_batches()):
        method.generator.manual_seed(100 + step)
        method.train_step((x, y), NoFlatness(), bp)
        torch.manual_seed(100 + step)
        ref.param_groups[0]["lr"] = HP["lr"] * FACTORS[step]
        for _ in range(mc_samples):
            with ref.sampled_params(train=True):
                ref.zero_grad()
                F.cross_entropy(ref_net(x), y).backward()
        ref.step()
        params, moms, hess = _state(method)
        ref_params = torch.cat([p.detach().flatten() for p in ref_net.parameters()])
        group = ref.param_groups[0]
        for ours, theirs in ((params, ref_params), (moms, group["momentum"]), (hess, group["hess"])):
            torch.testing.assert_close(torch.cat([t.flatten() for t in ours]), theirs, rtol=1e-6, atol=1e-6)
        moved = max(moved, float((group["hess"] - HP["hess_init"]).abs().max()))
    assert moved > 1e-2  # the Hessian estimate really moved (a frozen h would pass the comparison trivially)


# ---------------------------------------------------------------- composition with a flatness variant, by hand
def _loss(params, x, y):
    w1, b1, w2, b2 = params
    return F.cross_entropy(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)


def _grad(params, x, y):
    ps = [p.clone().requires_grad_(True) for p in params]
    return list(torch.autograd.grad(_loss(ps, x, y), ps))


def _hand_ivon(start, batches, mc_samples, seed_of_step, rho):
    """Alg. 1 written out on plain tensors; ``rho`` > 0: the gradient at each sample is SAM's, taken at
    theta_k + rho g / ||g|| with g the gradient at theta_k."""
    lr, ess, h0, b1, b2, wd, r = (HP[k] for k in ("lr", "ess", "hess_init", "beta1", "beta2", "weight_decay",
                                                   "clip_radius"))
    m = [p.clone() for p in start]
    mom = [torch.zeros_like(p) for p in m]
    h = [torch.full_like(p, h0) for p in m]
    for t, (x, y) in enumerate(batches, start=1):
        gen = torch.Generator().manual_seed(seed_of_step(t - 1))
        g_bar = [torch.zeros_like(p) for p in m]
        h_hat = [torch.zeros_like(p) for p in m]
        for _ in range(mc_samples):
            n = torch.randn(sum(p.numel() for p in m), generator=gen).split([p.numel() for p in m])
            sigma = [1 / torch.sqrt(ess * (hi + wd)) for hi in h]
            theta = [mi + ni.view(mi.shape) * si for mi, ni, si in zip(m, n, sigma)]
            g = _grad(theta, x, y)
            if rho > 0:
                norm = torch.sqrt(sum((gi ** 2).sum() for gi in g))
                g = _grad([th + rho * gi / (norm + 1e-12) for th, gi in zip(theta, g)], x, y)
            for i in range(len(m)):
                g_bar[i] += g[i] / mc_samples
                h_hat[i] += g[i] * (theta[i] - m[i]) / sigma[i] ** 2 / mc_samples
        mom = [b1 * mo + (1 - b1) * gb for mo, gb in zip(mom, g_bar)]
        h = [b2 * hi + (1 - b2) * hh + 0.5 * (1 - b2) ** 2 * (hi - hh) ** 2 / (hi + wd) for hi, hh in zip(h, h_hat)]
        alpha = lr * FACTORS[t - 1] * (h0 + wd)
        m = [mi - alpha * torch.clamp((mo / (1 - b1 ** t) + wd * mi) / (hi + wd), -r, r)
             for mi, mo, hi in zip(m, mom, h)]
    return m, mom, h


@pytest.mark.parametrize("flatness", ["none", "sam"])
def test_ivon_step_equals_algorithm_1_with_the_gradient_where_the_flatness_variant_takes_it(flatness):
    """F-IVON (method=ivon flatness=sam): each sample's gradient is SAM's ascent gradient from the sampled weights,
    and that gradient enters both the mean and the Hessian estimate. 2 MC samples, 3 steps, to 1e-5."""
    net = _net()
    start = [p.detach().clone() for p in net.parameters()]
    method = _method(net, mc_samples=2)
    flat = SAM(rho=0.1) if flatness == "sam" else NoFlatness()
    flat.setup(method.ctx, method)
    bp = Backprop(net, CPU)
    batches = _batches(3)
    for step, batch in enumerate(batches):
        method.generator.manual_seed(100 + step)
        method.train_step(batch, flat, bp)
    m, mom, h = _hand_ivon(start, batches, 2, lambda t: 100 + t, rho=0.1 if flatness == "sam" else 0.0)
    params, moms, hess = _state(method)
    for ours, ref in ((params, m), (moms, mom), (hess, h)):
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if flatness == "sam":  # and it is not the plain step: the ascent changed the update
        plain, _, _ = _hand_ivon(start, batches, 2, lambda t: 100 + t, rho=0.0)
        assert max(float((a - b).abs().max()) for a, b in zip(params, plain)) > 1e-4


def test_ivon_state_roundtrip_resumes_exactly_and_the_posterior_std_is_the_definition():
    batches = _batches(4)
    net_a = _net(0)
    a = _method(net_a, mc_samples=2)
    flat = SAM(rho=0.05)
    bp = Backprop(net_a, CPU)
    for batch in batches[:2]:
        a.train_step(batch, flat, bp)
    state = copy.deepcopy(a.state_dict())
    for batch in batches[2:]:
        a.train_step(batch, flat, bp)
    net_b = _net(1)
    b = _method(net_b, mc_samples=2, seed=99)
    b.load_state_dict(state)
    bp_b = Backprop(net_b, CPU)
    for batch in batches[2:]:
        b.train_step(batch, flat, bp_b)
    for pa, pb in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(pa, pb)
        for k in ("momentum", "hess", "steps"):
            assert torch.equal(a.optimizer.state[pa][k], b.optimizer.state[pb][k]), k
    assert float(a.optimizer.state[next(net_a.parameters())]["steps"]) == 4
    p, std = next(net_a.parameters()), a.optimizer.posterior_std()[0]
    torch.testing.assert_close(std, 1 / torch.sqrt(HP["ess"] * (a.optimizer.state[p]["hess"] + HP["weight_decay"])))


def test_ivon_refuses_bad_settings_in_one_line():
    for kw, match in (({"mc_samples": 0}, "mc_samples"), ({"ess": 0}, "ess"), ({"clip_radius": -1}, "clip_radius")):
        with pytest.raises(ValueError, match=match) as e:
            IVON(**kw)
        assert "\n" not in str(e.value)
    net = _net()
    method = _method(net)
    with pytest.raises(ValueError, match="fp16"):
        method.train_step(_batches(1)[0], NoFlatness(), Backprop(net, CPU, precision="fp16"))


def test_ivon_graph_protocol_with_a_device_lr_adds_nothing():
    """trainer.cuda_graph: IVON is captured (no host-side state: the step count is a device tensor); the protocol
    around the capture, run on the CPU with a tensor lr, gives the eager steps within 1e-6 and the direct calls bit
    for bit."""
    def run(device_lr, graph):
        net = _net()
        method = _method(net, mc_samples=2)
        flat = SAM(rho=0.05)
        flat.setup(method.ctx, method)
        bp = Backprop(net, CPU)
        if device_lr:
            for group in method.optimizer.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]))
        step = graphed.GraphedStep(method, flat, bp, capture=graphed.EagerReplay(), log=lambda s: None) if graph \
            else method.train_step
        batch = _batches(1)[0]
        assert not graph or step.fallback_reason(batch) is None
        for _ in range(4):
            step(batch, flat, bp)
        return _state(method)

    eager, graph, direct = run(False, False), run(True, True), run(True, False)
    for a, b, c in zip(sum(eager, []), sum(graph, []), sum(direct, [])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert torch.equal(b, c)


@pytest.mark.parametrize("flatness", ["none", "sam"])
def test_ivon_learns_digits_alone_and_with_sam(flatness, tmp_path):
    res = run_cfg(["dataset=digits", "model=mlp", "model.hidden=[128]", "method=ivon", f"flatness={flatness}",
                   "method.num_samples=8", "trainer.epochs=10", "trainer.eval_every=0", "trainer.checkpoint_every=0",
                   "seed=0"], tmp_path)
    m, meta = res["metrics"], res["meta"]
    assert m["num_samples"] == 8 and meta["flatness"]["name"] == flatness
    assert meta["method"]["ess"] == 1437.0  # ess = null: the training-set size
    assert m["accuracy"] >= 0.9 and m["nll"] < 0.4, m
    assert math.isfinite(m["ece"]) and m["auroc_misclassification"] > 0.8, m
