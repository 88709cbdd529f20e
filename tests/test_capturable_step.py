"""Issue 33, "make the step capturable": every rewrite of the step (flat SAM perturbation, device radius,
preallocated weight / BatchNorm snapshots, unscaled gradients without get_scale(), in-place train-accuracy count,
device-side fp16 finiteness decisions) gives the SAME BITS as the code it replaced (tests/frozen_step.py), and
the step reads nothing back to the host and rebinds none of the tensors it writes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import frozen_step as old
from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import ASAM, SAM, FisherSAM, Geometry, NoFlatness, RandomSAM
from flatbnn.methods import MAP, RunContext
from flatbnn.methods.bsam import BSAM
from flatbnn.methods.rsam import RandomSAMMethod
from flatbnn.methods.sgvb import SGVB
from flatbnn.methods.vsam import VariationalSAM

CPU = torch.device("cpu")


def _net() -> nn.Module:
    """Conv + BatchNorm + dropout: every policy of the step has something to act on."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.25),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _setup(method, flatness, precision="fp32", backprop_cls=Backprop, init_scale=None):
    torch.manual_seed(0)
    module = method.prepare_model(_net())
    factory = None if isinstance(method, BSAM) else (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    ctx = RunContext(model=module, module=module, device=CPU, n_train=64, steps_per_epoch=3, epochs=1,
                     optimizer_factory=factory, scheduler_factory=None, generator=torch.Generator().manual_seed(5))
    method.setup(ctx)
    flatness.setup(ctx, method)
    bp = backprop_cls(module, CPU, precision=precision)
    if init_scale is not None:
        bp.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    method.train()
    return module, bp


def _train(method, flatness, steps=3, **kw):
    module, bp = _setup(method, flatness, **kw)
    batch = _batch()
    losses = [torch.as_tensor(method.train_step(batch, flatness, bp)["loss"]).clone() for _ in range(steps)]
    state = [t.detach().clone() for t in module.state_dict().values()]
    return state, torch.stack(losses) if losses else torch.zeros(0), method, bp


def _assert_same_bits(a, b, rounding=False):
    """Bit for bit; ``rounding``: to float32 rounding, for a step whose arithmetic was reassociated after the frozen
    copy (bSAM: rho / s and sqrt(s) once a step, not per part; tests/test_bsam.py holds it to the five lines)."""
    tol = dict(rtol=1e-5, atol=1e-6) if rounding else dict(rtol=0.0, atol=0.0)
    sa, la = a[0], a[1]
    sb, lb = b[0], b[1]
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        torch.testing.assert_close(x, y, **tol)
    torch.testing.assert_close(la.float(), lb.float(), **tol)


# one step rewrite per case: (new method, new flatness) vs (frozen method, frozen flatness) and the frozen Backprop
CASES = {
    "map-sam": (lambda: (MAP(), SAM(rho=0.05)), lambda: (MAP(), old.OldSAM(rho=0.05))),
    "map-sam-m2-bn-second": (lambda: (MAP(), SAM(rho=0.05, m=2, bn_stats="second", bn_chunks="first")),
                             lambda: (MAP(), old.OldSAM(rho=0.05, m=2, bn_stats="second", bn_chunks="first"))),
    "map-sam-lr-schedule": (lambda: (MAP(), SAM(rho=0.05, rho_schedule="lr")),
                            lambda: (MAP(), old.OldSAM(rho=0.05, rho_schedule="lr"))),
    "map-asam": (lambda: (MAP(), ASAM(rho=0.5)), lambda: (MAP(), old.OldASAM(rho=0.5))),
    "map-fsam": (lambda: (MAP(), FisherSAM(rho=0.1, m=2)), lambda: (MAP(), old.OldFisherSAM(rho=0.1, m=2))),
    "map-random": (lambda: (MAP(), RandomSAM(rho=0.05, m=2)), lambda: (MAP(), old.OldRandomSAM(rho=0.05, m=2))),
    "sgvb-sam": (lambda: (SGVB(num_samples=1), SAM(rho=0.05)), lambda: (old.OldSGVB(num_samples=1), old.OldSAM(rho=0.05))),
    "sgvb-geometry": (lambda: (SGVB(num_samples=1), Geometry(rho=0.05)),
                      lambda: (old.OldSGVB(num_samples=1), old.OldGeometry(rho=0.05))),
    "rsam": (lambda: (RandomSAMMethod(rho=0.05), NoFlatness()),
             lambda: (old.OldRandomSAMMethod(rho=0.05), NoFlatness())),
    "bsam-m2": (lambda: (BSAM(m=2, num_samples=1, bn_stats="first"), NoFlatness()),
                lambda: (old.OldBSAM(m=2, num_samples=1, bn_stats="first"), NoFlatness())),
    "vsam": (lambda: (VariationalSAM(rho=0.5, init_radius=0.3, init_count=4.0, m_lr=0.1), NoFlatness()),
             lambda: (VariationalSAM(rho=0.5, init_radius=0.3, init_count=4.0, m_lr=0.1), NoFlatness())),
}


def _lr_ratios(method, flatness, steps):
    """rho_schedule=lr: the engine reports a changing lr ratio before each step (refills the device radius)."""
    ratios = iter([1.0, 0.5, 0.25, 0.125][:steps])
    orig = method.train_step

    def step(batch, flat, bp):
        flat.set_lr_ratio(next(ratios))
        return orig(batch, flat, bp)
    method.train_step = step


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_rewritten_step_gives_the_frozen_codes_bits(case, precision):
    new_pair, old_pair = CASES[case][0](), CASES[case][1]()
    if "schedule" in case:
        _lr_ratios(*new_pair, 3)
        _lr_ratios(*old_pair, 3)
    a = _train(*new_pair, precision=precision)
    b = _train(*old_pair, precision=precision, backprop_cls=old.OldBackprop)
    _assert_same_bits(a, b, rounding=case.startswith("bsam"))
    moved = _train(*CASES[case][0](), steps=0)[0]  # the steps did change the weights
    assert any(not torch.equal(x, y) for x, y in zip(a[0], moved))


@pytest.mark.parametrize("case", ["map-sam", "sgvb-sam", "rsam", "vsam", "bsam-m2"])
def test_rewritten_fp16_step_gives_the_frozen_codes_bits(case):
    """fp16 (GradScaler on the CPU): the unscaling by the device scale, the KL / prior / Sigma-step scaling and
    bSAM's device-side overflow decisions give the old host-decided bits."""
    a = _train(*CASES[case][0](), precision="fp16")
    b = _train(*CASES[case][1](), precision="fp16", backprop_cls=old.OldBackprop)
    _assert_same_bits(a, b, rounding=case.startswith("bsam"))
    assert a[3].scaler.get_scale() == b[3].scaler.get_scale()


def test_bsam_fp16_overflow_skips_the_step_and_backs_off_on_the_device():
    """An infinite loss scale overflows every gradient: the old code skipped the update after a host check; the
    device-side revert must leave weights, momentum and precision exactly as they were and halve the scale."""
    a = _train(BSAM(m=2, num_samples=1), NoFlatness(), steps=2, precision="fp16", init_scale=float("inf"))
    b = _train(old.OldBSAM(m=2, num_samples=1), NoFlatness(), steps=2, precision="fp16", init_scale=float("inf"),
               backprop_cls=old.OldBackprop)
    _assert_same_bits(a, b)
    fresh = _train(BSAM(m=2, num_samples=1), NoFlatness(), steps=0, precision="fp16")
    # no weight moved (the forward passes did update the BatchNorm statistics, in the old code too)
    assert all(torch.equal(x, y) for x, y in zip(a[2].optimizer.params(), fresh[2].optimizer.params()))
    opt_a, opt_b = a[2].optimizer, b[2].optimizer
    for p, q in zip(opt_a.params(), opt_b.params()):
        for k in ("momentum", "precision"):
            assert torch.equal(opt_a.state[p][k], opt_b.state[q][k])
    assert a[3].scaler.get_scale() == b[3].scaler.get_scale() == float("inf")


def test_rho_zero_is_still_the_base_optimiser():
    """flatness.rho=0 (same_noise, BN first): the same bits as flatness=none."""
    a = _train(MAP(), SAM(rho=0.0))
    b = _train(MAP(), NoFlatness())
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)


def test_train_accuracy_count_is_accumulated_in_place():
    """A captured graph keeps writing the tensor it saw: the count must never be rebound, also across
    pop_train_accuracy, and must still count right."""
    method, flat = MAP(), SAM(rho=0.05)
    module, bp = _setup(method, flat)
    batch = _batch()
    method.train_step(batch, flat, bp)
    counter = method._correct
    method.train_step(batch, flat, bp)
    assert method._correct is counter
    with torch.no_grad():
        module.eval()
        expected = (module(batch[0]).argmax(1) == batch[1]).sum()  # not the same weights; a range check below
    correct, seen = method.pop_train_accuracy()
    assert seen == 16 and 0 <= correct <= 16 and correct == int(correct)
    assert method._correct is counter and float(counter) == 0.0
    del expected


def test_flat_perturbation_matches_per_tensor_in_float64_with_a_mask():
    """The flat perturbation against the frozen per-tensor one, float64, perturb mask, non-finite gradient."""
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64),
              torch.randn(2, 2, generator=g, dtype=torch.float64)]
    grads = [torch.randn_like(p) for p in params]
    for new, ref in ((SAM(rho=0.3), old.OldSAM(rho=0.3)), (ASAM(rho=0.3), old.OldASAM(rho=0.3)),
                     (FisherSAM(rho=0.3), old.OldFisherSAM(rho=0.3))):
        for perturb in (None, [True, False, True]):
            names = ["a.weight", "a.bias", "b.weight"]
            a = new.perturbation(params, grads, names=names, perturb=perturb)
            b = ref.perturbation(params, grads, names=names, perturb=perturb)
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    bad = [g.clone() for g in grads]
    bad[1][0] = float("inf")
    assert all(torch.equal(e, torch.zeros_like(e)) for e in SAM(rho=0.3).perturbation(params, bad))


@pytest.mark.parametrize("name", ["bsam", "vogn"])
def test_precision_optimisers_foreach_step_gives_the_per_tensor_bits(name):
    """bSAM / VOGN update in foreach form (a few launches per group instead of several per tensor): the frozen
    per-tensor step's bits, over two parameter groups, a parameter without a gradient, 3 steps."""
    from flatbnn.optim.bsam import BSAMOptimizer
    from flatbnn.optim.vogn import VOGNOptimizer

    def run(step):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g)),
                  torch.nn.Parameter(torch.randn(2, 2, generator=g))]
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.03}]
        opt = (BSAMOptimizer(groups, lr=0.1, rho=0.01, prior_precision=2.0, n_data=50.0) if name == "bsam" else
               VOGNOptimizer(groups, lr=0.1, prior_precision=2.0, n_data=50.0, damping=1e-3))
        for k in range(3):
            for i, p in enumerate(params):
                p.grad = None if (i == 1 and k == 0) else torch.randn(p.shape, generator=g)
            curvature = [torch.rand(p.shape, generator=g) for p in params]
            step(opt, curvature)
        return [p.detach().clone() for p in params] + [t.clone() for st in opt.state.values() for t in st.values()]

    new = run(lambda opt, h: opt.step(curvature=h))
    ref = run(old.old_precision_step)
    assert len(new) == len(ref) == 9
    assert all(torch.equal(a, b) for a, b in zip(new, ref))
