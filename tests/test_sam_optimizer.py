"""flatbnn.SAMOptimizer (issue 44): davda54/sam's interface on flatbnn's SAM / ASAM / Fisher-SAM.

The oracle is ``flatbnn.bench.reference.ReferenceSAM`` (davda54/sam's algorithm written from its documentation, with
its BatchNorm recipe ``frozen_bn_stats``: momentum 0 on the second pass); the loop below is the shape of davda54's
example train.py (first pass -> first_step(zero_grad=True) -> second pass with BN frozen -> second_step(zero_grad=True),
accuracy from the first pass's predictions, an lr schedule on the shared param groups), run unchanged with either
optimiser. Side by side with the fetched davda54/sam (3c3afdb) outside the project: WRN-16-8, one step, max|dw| = 0
for SAM and for adaptive; WRN-10-1, 8 steps, 0 for SAM.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn import ASAM, SAM, Backprop, FisherSAM, FisherSAMOptimizer, SAMOptimizer, keep_bn_stats
from flatbnn.bench.reference import ReferenceSAM, frozen_bn_stats

CPU = torch.device("cpu")
# davda54's loop never calls optimizer.step(), which LRScheduler's check expects; the schedule still applies
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
BASE = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(24, 5))


def _batches(steps, n=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(steps)]


def davda54_loop(model, optimizer, batches, second_pass_bn=frozen_bn_stats):
    """davda54's example loop; returns the first pass's accuracy per step, as their log does."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    model.train()
    accuracy = []
    for x, y in batches:
        predictions = model(x)
        loss = F.cross_entropy(predictions, y, label_smoothing=0.1)
        loss.backward()
        optimizer.first_step(zero_grad=True)
        with second_pass_bn(model):
            F.cross_entropy(model(x), y, label_smoothing=0.1).backward()
        optimizer.second_step(zero_grad=True)
        accuracy.append(float((predictions.argmax(1) == y).float().mean()))
        scheduler.step()
    return accuracy


def _rel_all(a, b) -> float:
    """max|a - b| / max|b| over all tensors together (a tensor of tiny entries, e.g. a conv bias before BatchNorm with
    gradient ~1e-17, does not dominate)."""
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a, b)) / max(float(q.abs().max()) for q in b)


def _max_rel(a, b) -> float:
    """max over tensors of max|a - b| / max|b|."""
    with torch.no_grad():
        return max(float((p - q).abs().max() / q.abs().max()) for p, q in zip(a, b))


def test_davda54_loop_with_sam_optimizer_gives_the_reference_weights_bit_for_bit():
    ref, ours = _net(), _net()
    acc_ref = davda54_loop(ref, ReferenceSAM(ref.parameters(), torch.optim.SGD, rho=0.05, **BASE), _batches(3))
    acc_ours = davda54_loop(ours, SAMOptimizer(ours.parameters(), torch.optim.SGD, rho=0.05, **BASE), _batches(3))
    assert acc_ours == acc_ref
    for (k, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k  # weights and BatchNorm buffers, 3 steps
    sgd = _net()
    opt = torch.optim.SGD(sgd.parameters(), **BASE)
    for x, y in _batches(1):
        F.cross_entropy(sgd(x), y, label_smoothing=0.1).backward()
        opt.step()
    one = _net()
    davda54_loop(one, SAMOptimizer(one.parameters(), torch.optim.SGD, rho=0.05, **BASE), _batches(1))
    assert _max_rel(one.parameters(), sgd.parameters()) > 1e-4  # the ascent moved the step away from plain SGD


def test_davda54_adaptive_matches_after_one_step_and_is_asam_eta0_on_every_tensor():
    ref, ours = _net(), _net()
    davda54_loop(ref, ReferenceSAM(ref.parameters(), torch.optim.SGD, rho=2.0, adaptive=True, **BASE), _batches(1))
    davda54_loop(ours, SAMOptimizer(ours.parameters(), torch.optim.SGD, rho=2.0, adaptive=True, **BASE),
                 _batches(1))
    assert _max_rel(ours.parameters(), ref.parameters()) <= 1e-6
    for a, b in zip(ours.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)

    # davda54's e_w for adaptive=True, read off its first_step (float64: w + e - w loses no digits of e), against
    # flatbnn's ASAM perturbations
    x, y = _batches(1)[0]
    net = _net().double()
    F.cross_entropy(net(x.double()), y).backward()
    named = [(n, p) for n, p in net.named_parameters()]
    grads = [p.grad.clone() for _, p in named]
    w0 = [p.detach().clone() for _, p in named]
    opt = ReferenceSAM(net.parameters(), torch.optim.SGD, rho=2.0, adaptive=True, lr=0.1)
    opt.first_step()
    e_ref = [p.detach() - w for (_, p), w in zip(named, w0)]

    def asam_eps(**kw):
        return ASAM(rho=2.0, **kw).perturbation(w0, grads, names=[n for n, _ in named])
    assert _rel_all(asam_eps(eta=0.0, only_weights=False), e_ref) <= 1e-6
    assert _rel_all(asam_eps(eta=0.01, only_weights=True), e_ref) > 1e-2  # the official ASAM's defaults differ
    assert _rel_all(asam_eps(eta=0.0, only_weights=True), e_ref) > 1e-2   # ... and so does scaling weights only


def test_step_with_closure_is_first_step_closure_second_step_and_returns_the_closures_value():
    x, y = _batches(1)[0]
    a, b = _net(), _net()
    oa = SAMOptimizer(a.parameters(), torch.optim.SGD, rho=0.05, **BASE)
    ob = SAMOptimizer(b.parameters(), torch.optim.SGD, rho=0.05, **BASE)
    F.cross_entropy(a(x), y).backward()
    oa.first_step(zero_grad=True)
    second = F.cross_entropy(a(x), y)
    second.backward()
    oa.second_step()

    def closure():
        loss = F.cross_entropy(b(x), y)
        loss.backward()
        return loss
    F.cross_entropy(b(x), y).backward()
    out = ob.step(closure)
    assert torch.equal(out, second)
    for p, q in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(p, q)


def test_keep_bn_stats_gives_the_running_stats_of_the_momentum_zero_recipe_and_counts_first_passes_only():
    ref, ours = _net(), _net()
    davda54_loop(ref, SAMOptimizer(ref.parameters(), torch.optim.SGD, rho=0.05, **BASE), _batches(3))
    davda54_loop(ours, SAMOptimizer(ours.parameters(), torch.optim.SGD, rho=0.05, **BASE), _batches(3),
                 second_pass_bn=keep_bn_stats)
    assert torch.equal(ours[1].running_mean, ref[1].running_mean)
    assert torch.equal(ours[1].running_var, ref[1].running_var)
    assert int(ours[1].num_batches_tracked) == 3 and int(ref[1].num_batches_tracked) == 6


def test_sam_optimizer_is_the_engine_step_and_fisher_sam_the_flatness_class():
    """Against flatbnn's own loop (Flatness.gradient + SGD; same_noise=False and BN from the first pass, as in the
    optimiser's loop): SAM and Fisher-SAM give the same bits."""
    for opt_cls, flat, kw in ((SAMOptimizer, SAM(rho=0.05, same_noise=False), dict(rho=0.05)),
                              (FisherSAMOptimizer, FisherSAM(rho=0.1, eta=1.0, same_noise=False), {})):
        ours, engine = _net(), _net()
        davda54_loop(ours, opt_cls(ours.parameters(), torch.optim.SGD, **kw, **BASE), _batches(2),
                     second_pass_bn=keep_bn_stats)
        opt = torch.optim.SGD(engine.parameters(), **BASE)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        bp = Backprop(engine, CPU)
        engine.train()
        for x, y in _batches(2):
            flat.gradient(list(engine.parameters()), lambda b: F.cross_entropy(engine(b[0]), b[1], label_smoothing=0.1),
                          (x, y), bp)
            opt.step()
            opt.zero_grad()
            scheduler.step()
        for (k, a), (_, b) in zip(ours.state_dict().items(), engine.state_dict().items()):
            assert torch.equal(a, b), (opt_cls.__name__, k)
    fisher, sam = _net(), _net()
    davda54_loop(fisher, FisherSAMOptimizer(fisher.parameters(), torch.optim.SGD, rho=0.1, **BASE), _batches(1))
    davda54_loop(sam, SAMOptimizer(sam.parameters(), torch.optim.SGD, rho=0.1, **BASE), _batches(1))
    assert _max_rel(fisher.parameters(), sam.parameters()) > 1e-6  # eta = 1 is not SAM


def test_state_dict_holds_the_base_optimizers_momentum_and_a_resume_continues_bit_for_bit():
    batches = _batches(3)
    whole = _net()
    davda54_loop(whole, SAMOptimizer(whole.parameters(), torch.optim.SGD, rho=0.05, **BASE), batches)
    first = _net()
    opt = SAMOptimizer(first.parameters(), torch.optim.SGD, rho=0.05, **BASE)
    davda54_loop(first, opt, batches[:2])
    state = copy.deepcopy(opt.state_dict())
    assert all("momentum_buffer" in s for s in state["state"].values()) and len(state["state"]) == 6
    resumed = copy.deepcopy(first)
    opt2 = SAMOptimizer(resumed.parameters(), torch.optim.SGD, rho=0.05, **BASE)
    opt2.load_state_dict(state)
    for group in opt2.param_groups:
        group["lr"] = BASE["lr"] * 0.5 ** 2  # where the schedule stood
    resumed.train()
    x, y = batches[2]
    F.cross_entropy(resumed(x), y, label_smoothing=0.1).backward()
    opt2.first_step(zero_grad=True)
    with frozen_bn_stats(resumed):
        F.cross_entropy(resumed(x), y, label_smoothing=0.1).backward()
    opt2.second_step(zero_grad=True)
    for p, q in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(p, q)


def test_rho_is_read_from_the_param_groups_and_groups_that_disagree_are_refused():
    x, y = _batches(1)[0]
    zero, sgd = _net(), _net()
    opt = SAMOptimizer(zero.parameters(), torch.optim.SGD, rho=0.05, **BASE)
    for group in opt.param_groups:
        group["rho"] = 0.0  # a schedule setting rho: 0 is the base optimiser exactly
    zero.eval(), sgd.eval()
    F.cross_entropy(zero(x), y).backward()
    opt.first_step(zero_grad=True)
    F.cross_entropy(zero(x), y).backward()
    opt.second_step()
    base = torch.optim.SGD(sgd.parameters(), **BASE)
    F.cross_entropy(sgd(x), y).backward()
    base.step()
    for p, q in zip(zero.parameters(), sgd.parameters()):
        assert torch.equal(p, q)

    net = _net()
    split = SAMOptimizer([{"params": net[0].parameters(), "rho": 0.1}, {"params": net[5].parameters()}],
                         torch.optim.SGD, rho=0.05, lr=0.1)
    F.cross_entropy(net(x), y).backward()
    with pytest.raises(ValueError, match="param group 1 has .*must agree"):
        split.first_step()


def test_misuse_is_one_clear_error():
    net = _net()
    opt = SAMOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="no parameter has a gradient"):
        opt.first_step()
    with pytest.raises(RuntimeError, match="second_step without first_step"):
        opt.second_step()
    with pytest.raises(ValueError, match="needs a closure"):
        opt.step()
    with pytest.raises(ValueError, match="rho must be >= 0"):
        SAMOptimizer(net.parameters(), torch.optim.SGD, rho=-1.0, lr=0.1)


def test_the_first_pass_logits_of_flatbnn_sam_gradient_are_the_loss_fns_first_call():
    """docs/migrating.md's recipe: the first call of loss_fn in a step is the pass at w (davda54's accuracy)."""
    net = _net()
    net.eval()  # BN in eval: the forward is a pure function of w, so 'at w' is checkable
    x, y = _batches(1)[0]
    at_w = net(x).detach()
    seen = []

    def loss_fn(batch):
        logits = net(batch[0])
        seen.append(logits.detach())
        return F.cross_entropy(logits, batch[1])
    SAM(rho=0.5).gradient(list(net.parameters()), loss_fn, (x, y), Backprop(net, CPU))
    assert len(seen) == 2 and torch.equal(seen[0], at_w) and not torch.allclose(seen[1], at_w)
