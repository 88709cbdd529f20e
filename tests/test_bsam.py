"""bSAM (flatbnn/methods/bsam.py, flatbnn/optim/bsam.py): the update equals a hand-computed step,
resume is exact, other flatness variants are refused, and a digits run learns."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import SAM, NoFlatness
from flatbnn.methods import RunContext
from flatbnn.methods.bsam import BSAM
from flatbnn.optim.bsam import BSAMOptimizer

from helpers import compose_cfg, run_cfg

CPU = torch.device("cpu")
HP = dict(lr=0.3, beta1=0.8, beta2=0.95, rho=0.05, prior_precision=4.0, n_data_factor=2.0, damping=0.1,
          s_init=1.5)
N_TRAIN = 50


def _data(n=8, d=3, c=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, c, (n,), generator=g)


def _linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(3, 2).double()


def _ce64(logits, y):  # the default criterion casts logits to float32; stay in float64 here
    return F.cross_entropy(logits, y)


def _ctx(module, generator=None, scheduler_factory=None, **kw):
    return RunContext(model=module, module=module, device=CPU, n_train=N_TRAIN, steps_per_epoch=1, epochs=10,
                      optimizer_factory=None, scheduler_factory=scheduler_factory, generator=generator,
                      criterion=_ce64, **kw)


def _hand_steps(w, b, batches, m, seed, steps, lr_factors):
    """bSAM's five lines written out for y = softmax(x W^T + b), with the method's noise order."""
    gen = torch.Generator().manual_seed(seed)
    N = N_TRAIN * HP["n_data_factor"]
    delta = HP["prior_precision"] / N
    b1, b2, rho = HP["beta1"], HP["beta2"], HP["rho"]
    params = [w.clone(), b.clone()]
    s = [torch.full_like(p, HP["s_init"]) for p in params]
    mom = [torch.zeros_like(p) for p in params]

    def grad_at(ps, x, y):
        ps = [p.clone().requires_grad_(True) for p in ps]
        loss = F.cross_entropy(x @ ps[0].T + ps[1], y)
        return torch.autograd.grad(loss, ps)

    for t in range(steps):
        x, y = batches[t]
        parts = list(zip(torch.tensor_split(x, m), torch.tensor_split(y, m)))
        gp_avg = [torch.zeros_like(p) for p in params]
        h_avg = [torch.zeros_like(p) for p in params]
        # the noise of every part in ONE draw [parts, P], row k for part k, split into the parameters in order (issue 52:
        # one normal_ per step instead of one per tensor and part -- the same distribution, another stream)
        draws = torch.randn(m, sum(p.numel() for p in params), generator=gen, dtype=params[0].dtype)
        for k, (xk, yk) in enumerate(parts):
            noise = [d.view(p.shape) for d, p in zip(draws[k].split([p.numel() for p in params]), params)]
            noisy = [p + n * torch.sqrt(1.0 / (N * si)) for p, n, si in zip(params, noise, s)]
            g = grad_at(noisy, xk, yk)
            gp = grad_at([p + rho * gi / si for p, gi, si in zip(params, g, s)], xk, yk)
            h = [torch.sqrt(si) * gi.abs() for si, gi in zip(s, g)]
            for i in range(2):
                gp_avg[i] += gp[i] / m
                h_avg[i] += h[i] / m
        mom = [b1 * mi + (1 - b1) * (gi + delta * p) for mi, gi, p in zip(mom, gp_avg, params)]
        params = [p - HP["lr"] * lr_factors[t] * mi / si for p, mi, si in zip(params, mom, s)]
        s = [b2 * si + (1 - b2) * (hi + HP["damping"] + delta) for si, hi in zip(s, h_avg)]
    return params, s, mom


@pytest.mark.parametrize("m", [1, 2])
def test_bsam_step_equals_the_five_lines(m):
    lin = _linear()
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    batches = [_data(seed=i) for i in range(3)]
    factors = [1.0, 0.5, 0.25]
    method = BSAM(m=m, num_samples=4, **HP)
    method.setup(_ctx(lin, generator=torch.Generator().manual_seed(123),
                      scheduler_factory=lambda opt, total_steps, steps_per_epoch:
                      torch.optim.lr_scheduler.LambdaLR(opt, lambda k: factors[k] if k < 3 else 0.0)))
    bp = Backprop(lin, CPU)
    for batch in batches:
        out = method.train_step(batch, NoFlatness(), bp)
        assert torch.isfinite(out["loss"])
    params, s, mom = _hand_steps(w0, b0, batches, m, seed=123, steps=3, lr_factors=factors)
    torch.testing.assert_close(lin.weight.detach(), params[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lin.bias.detach(), params[1], rtol=1e-12, atol=1e-12)
    opt = method.optimizer
    for p, s_ref, m_ref in zip(opt.params(), s, mom):
        torch.testing.assert_close(opt.state[p]["precision"], s_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["momentum"], m_ref, rtol=1e-12, atol=1e-12)
    # the precision moved away from s_init, so the three steps exercised the old-s / new-s order
    assert not torch.allclose(opt.state[opt.params()[0]]["precision"], torch.full_like(w0, HP["s_init"]))


def test_bsam_m_is_the_global_split_each_of_k_processes_takes_m_over_k_parts():
    """method.m=4 on 2 processes: this process cuts its share into 2 parts (before the all-reduce, absent here) --
    the five lines with m=2 on its share; 4 parts per process would be a silent m-sharpness of 8 (issue 42)."""
    lin = _linear()
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    batches = [_data(seed=i) for i in range(2)]
    method = BSAM(m=4, num_samples=4, **HP)
    method.setup(_ctx(lin, generator=torch.Generator().manual_seed(7), world_size=2))
    for batch in batches:
        method.train_step(batch, NoFlatness(), Backprop(lin, CPU))
    params, _, _ = _hand_steps(w0, b0, batches, 2, seed=7, steps=2, lr_factors=[1.0, 1.0])
    torch.testing.assert_close(lin.weight.detach(), params[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lin.bias.detach(), params[1], rtol=1e-12, atol=1e-12)


def test_bsam_rho_zero_takes_the_gradient_at_the_mean_not_the_noisy_point():
    """rho = 0: g_p is the gradient at the mean w (the ascent starts from w, not the noisy point)."""
    lin = _linear()
    x, y = _data()
    hp = {**HP, "rho": 0.0}
    method = BSAM(m=1, **hp)
    method.setup(_ctx(lin, generator=torch.Generator().manual_seed(0)))
    w = [p.detach().clone().requires_grad_(True) for p in lin.parameters()]
    g_mean = torch.autograd.grad(F.cross_entropy(x @ w[0].T + w[1], y), w)
    method.train_step((x, y), NoFlatness(), Backprop(lin, CPU))
    delta = hp["prior_precision"] / (N_TRAIN * hp["n_data_factor"])
    for p, w0, g in zip(lin.parameters(), w, g_mean):
        expected = w0 - hp["lr"] * (1 - hp["beta1"]) * (g + delta * w0) / hp["s_init"]
        torch.testing.assert_close(p.detach(), expected.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("engine_generator", [True, False])
def test_bsam_state_roundtrip_resumes_exactly(engine_generator):
    batches = [_data(seed=i) for i in range(4)]

    def make(seed):
        lin = _linear(seed)
        meth = BSAM(m=2, **HP)
        gen = torch.Generator().manual_seed(7) if engine_generator else None
        meth.setup(_ctx(lin, generator=gen, scheduler_factory=lambda opt, total_steps, steps_per_epoch:
                        torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))))
        return lin, meth

    lin_a, a = make(0)
    bp = Backprop(lin_a, CPU)
    for batch in batches[:2]:
        a.train_step(batch, NoFlatness(), bp)
    state = copy.deepcopy(a.state_dict())
    a.train_step(batches[2], NoFlatness(), bp)
    a.train_step(batches[3], NoFlatness(), bp)

    lin_b, b = make(1)  # a different init and generator state, overwritten by the checkpoint
    b.generator.manual_seed(999)
    b.load_state_dict(state)
    bp_b = Backprop(lin_b, CPU)
    b.train_step(batches[2], NoFlatness(), bp_b)
    b.train_step(batches[3], NoFlatness(), bp_b)
    for pa, pb in zip(lin_a.parameters(), lin_b.parameters()):
        assert torch.equal(pa, pb)
    for pa, pb in zip(a.optimizer.params(), b.optimizer.params()):
        assert torch.equal(a.optimizer.state[pa]["precision"], b.optimizer.state[pb]["precision"])
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]


def test_bsam_predictive_samples_have_the_posterior_std():
    lin = _linear()
    method = BSAM(m=1, num_samples=3, **HP)
    method.setup(_ctx(lin))
    std = method.optimizer.posterior_std()
    N = N_TRAIN * HP["n_data_factor"]
    torch.testing.assert_close(std[0], torch.full_like(lin.weight, 1 / math.sqrt(N * HP["s_init"])))
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([method.sample_weights(g)[0] for _ in range(4000)])
    assert abs(draws.std(0).mean().item() / std[0].mean().item() - 1) < 0.05
    torch.testing.assert_close(draws.mean(0), lin.weight.detach(), atol=5 * std[0].max().item() / 60, rtol=0)
    # predict restores the mean weights and yields num_samples samples (0 = the mean alone)
    x, y = _data()
    loader = [(x, y)]
    before = lin.weight.detach().clone()
    assert len(list(method.predict({"test": loader}))) == 3
    assert torch.equal(lin.weight.detach(), before)
    # every predictive sample is drawn around the mean (not around the previous sample)
    devs = []
    for _ in method.predict({"test": loader}, num_samples=300):
        devs.append(((lin.weight.detach() - before) / std[0]) ** 2)
    assert torch.equal(lin.weight.detach(), before)
    ratio = torch.stack(devs).mean().item()
    assert 0.8 < ratio < 1.2, ratio
    (only,) = list(method.predict({"test": loader}, num_samples=0))
    torch.testing.assert_close(only["test"], torch.log_softmax(lin(x), 1).detach().float())


def test_bsam_optimizer_needs_curvature_and_takes_no_closure():
    p = nn.Parameter(torch.ones(2))
    opt = BSAMOptimizer([p])
    with pytest.raises(ValueError, match="curvature"):
        opt.step()
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0, curvature=[torch.zeros(2)])


def test_bsam_refuses_other_flatness_variants():
    lin = _linear()
    method = BSAM(m=1)
    method.setup(_ctx(lin))
    with pytest.raises(ValueError, match="flatness=sam") as e:
        SAM(rho=0.05).setup(method.ctx, method)  # the engine's composition check
    assert "\n" not in str(e.value)
    NoFlatness().setup(method.ctx, method)  # none is fine
    with pytest.raises(ValueError, match="flatness=sam"):
        method.train_step(_data(), SAM(rho=0.05), Backprop(lin, CPU))


def test_bsam_config_refuses_flatness_sam_through_hydra(tmp_path):
    with pytest.raises(ValueError, match="flatness=sam") as e:
        run_cfg(["method=bsam", "flatness=sam", "trainer.epochs=1", "trainer.limit_train_batches=1"], tmp_path)
    assert "\n" not in str(e.value)


def test_bsam_learns_digits_and_writes_uncertainty_metrics(tmp_path):
    # the config's defaults (the paper's CIFAR-10 row: alpha 0.5, rho 0.01, prior precision 40, M 8)
    res = run_cfg(["dataset=digits", "model=mlp", "model.hidden=[128]", "method=bsam", "method.num_samples=8",
                   "trainer.epochs=15", "trainer.eval_every=0", "trainer.checkpoint_every=0", "seed=0"], tmp_path)
    m = res["metrics"]
    assert m["num_samples"] == 8
    assert m["accuracy"] >= 0.92, m  # measured 0.964 (8 or 32 samples); MAP-SGD 0.975 (15 epochs, seed 0)
    for key in ("nll", "ece", "auroc_misclassification"):
        assert math.isfinite(m[key]), key
    assert m["nll"] < 0.4 and m["auroc_misclassification"] > 0.85, m
    meta = res["meta"]["method"]
    assert meta["name"] == "bsam" and meta["n_data"] == 1437 and meta["m"] == 8


@pytest.mark.slow
def test_bsam_ddp_all_reduces_g_p_and_h_once(tmp_path):
    """method.m=2 on 2 CPU ranks (1 part each) = 1 process with m=2 parts: with rho=0 the ascent gradient does
    not depend on the (per-rank) noise and beta2 ~ 1 freezes s, so only a wrong reduction of g_p
    (missing, doubled, or DDP's own all-reduce on top) would change the run."""
    from helpers import results, train_cli
    base = ["dataset=digits", "model=mlp", "model.hidden=[64]", "method=bsam", "dataset.train_subset=1400",
            "trainer.batch_size=56", "trainer.epochs=2", "trainer.device=cpu", "method.rho=0",
            "method.beta2=0.999999", "method.num_samples=0", "trainer.eval_every=0"]
    train_cli(base + ["method.m=2"], tmp_path / "single")
    train_cli(base + ["method.m=2"], tmp_path / "ddp", torchrun=2)  # m: the global split (issue 42)
    single, ddp = results(tmp_path / "single"), results(tmp_path / "ddp")
    assert ddp["meta"]["budget"]["world_size"] == 2
    assert ddp["meta"]["method"]["effective_m"] == single["meta"]["method"]["effective_m"] == 2
    for k in ("accuracy", "nll", "ece", "brier"):
        assert ddp["metrics"][k] == pytest.approx(single["metrics"][k], abs=1e-5), k


@pytest.mark.parametrize("method", ["bsam", "vogn"])
def test_engine_checkpoint_resume_is_exact(method, tmp_path, capsys):
    """1 epoch, then resume to 2 in the same run dir == 2 epochs straight (engine checkpoint path)."""
    base = ["dataset=digits", "model=mlp", "model.hidden=[32]", f"method={method}", "method.m=2",
            "method.num_samples=2", "scheduler=constant", "trainer.eval_every=0", "dataset.train_subset=400"]
    ref = run_cfg(base + ["trainer.epochs=2"], tmp_path / "ref")
    run_cfg(base + ["trainer.epochs=1"], tmp_path / "resumed")
    capsys.readouterr()
    # more epochs on a resume is a deliberate change (else the run dir refuses another config)
    res = run_cfg(base + ["trainer.epochs=2", "trainer.resume_overrides=[trainer.epochs]"], tmp_path / "resumed")
    assert "resuming from" in capsys.readouterr().err
    assert res["meta"]["budget"]["steps"] == ref["meta"]["budget"]["steps"]
    for k in ("accuracy", "nll", "ece", "brier"):
        assert res["metrics"][k] == ref["metrics"][k], k


def test_sam_adam_preset_is_a_composition(tmp_path):
    cfg = compose_cfg(["method=sam_adam"])
    assert cfg.method._target_ == "flatbnn.methods.map.MAP"
    assert cfg.optimizer._target_ == "torch.optim.Adam" and cfg.flatness._target_ == "flatbnn.flatness.sam.SAM"
    assert cfg.flatness.m == 8
    cfg = compose_cfg(["method=sam_adam", "flatness.m=4", "flatness.rho=0.1", "optimizer.lr=3e-4"])
    assert (cfg.flatness.m, cfg.flatness.rho, cfg.optimizer.lr) == (4, 0.1, 3e-4)
    res = run_cfg(["method=sam_adam", "trainer.epochs=1", "trainer.limit_train_batches=1", "trainer.eval_every=0",
                   "dataset.test_subset=50"], tmp_path)
    assert res["meta"]["flatness"]["m"] == 8 and res["meta"]["method"]["name"] == "map"
