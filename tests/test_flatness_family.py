"""ASAM, Fisher-SAM, geometry, RandomSAM and m-sharpness: closed forms, hand-computed steps, the BN-stats,
noise-replay and DDP-ascent options, resume, configs."""

import copy
import math
import time

import pytest
import torch
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import ASAM, SAM, FisherSAM, Geometry, NoFlatness, RandomSAM
from flatbnn.flatness.base import split_batch

from helpers import compose_cfg, run_cfg

CPU = torch.device("cpu")


def _tensors(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (7,), (2, 2, 3)]
    params = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    grads = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    return params, grads


def _flat(ts):
    return torch.cat([t.flatten() for t in ts])


# ---------------------------------------------------------------------------- closed forms
def test_asam_perturbation_matches_closed_form():
    params, grads = _tensors()
    rho, eta = 0.7, 0.01
    eps = ASAM(rho=rho, eta=eta).perturbation(params, grads)
    w, g = _flat(params), _flat(grads)
    t = w.abs() + eta
    expected = rho * t * t * g / torch.linalg.vector_norm(t * g)
    torch.testing.assert_close(_flat(eps), expected, rtol=1e-12, atol=1e-14)
    # the ellipsoid constraint ||T^-1 eps|| = rho holds (ASAM's normalised ball)
    assert torch.linalg.vector_norm(_flat(eps) / t).item() == pytest.approx(rho, rel=1e-10)


def test_asam_scales_only_weight_tensors_when_named():
    params, grads = _tensors()
    names = ["fc.weight", "fc.bias", "bn.weight"]
    rho, eta = 0.5, 0.1
    eps = ASAM(rho=rho, eta=eta).perturbation(params, grads, names=names)
    t = [params[0].abs() + eta, torch.ones_like(params[1]), params[2].abs() + eta]
    tg = [ti * gi for ti, gi in zip(t, grads)]
    norm = torch.linalg.vector_norm(_flat(tg))
    for e, ti, tgi in zip(eps, t, tg):
        torch.testing.assert_close(e, rho * ti * tgi / norm, rtol=1e-12, atol=1e-14)
    # only_weights=false scales the bias as well
    eps_all = ASAM(rho=rho, eta=eta, only_weights=False).perturbation(params, grads, names=names)
    assert not torch.allclose(eps_all[1], eps[1])


def test_asam_with_unit_operator_is_sam():
    _, grads = _tensors()
    zeros = [torch.zeros_like(g) for g in grads]  # T = |0| + 1 = 1
    a = ASAM(rho=0.3, eta=1.0).perturbation(zeros, grads)
    s = SAM(rho=0.3).perturbation(zeros, grads)
    for x, y in zip(a, s):
        torch.testing.assert_close(x, y, rtol=1e-14, atol=0)


def test_fisher_sam_perturbation_matches_closed_form():
    params, grads = _tensors(1)
    rho, eta = 0.1, 1.0
    eps = FisherSAM(rho=rho, eta=eta).perturbation(params, grads)
    g = _flat(grads)
    inv_f = 1.0 / (1.0 + eta * g ** 2)
    expected = rho * inv_f * g / torch.sqrt(g @ (inv_f * g))
    torch.testing.assert_close(_flat(eps), expected, rtol=1e-12, atol=1e-14)
    # it lies on the Fisher ellipsoid eps^T F eps = rho^2 with F = diag(1 + eta g^2)
    e = _flat(eps)
    assert (e @ ((1 + eta * g ** 2) * e)).item() == pytest.approx(rho ** 2, rel=1e-10)


def test_fisher_sam_with_eta_zero_is_sam_bit_for_bit():
    params, grads = _tensors(2, dtype=torch.float32)
    f = FisherSAM(rho=0.05, eta=0.0).perturbation(params, grads)
    s = SAM(rho=0.05).perturbation(params, grads)
    for x, y in zip(f, s):
        assert torch.equal(x, y)


def test_geometry_uses_the_methods_scaling_and_refuses_point_estimates():
    params, grads = _tensors(3)
    mu, sigma = params, [torch.rand_like(p) + 0.1 for p in params]
    scaling = [m.abs() / s for m, s in zip(mu, sigma)]
    eps = Geometry(rho=0.2).perturbation(params, grads, scaling)
    d = _flat(scaling) * _flat(grads)
    torch.testing.assert_close(_flat(eps), 0.2 * d / torch.linalg.vector_norm(d), rtol=1e-12, atol=1e-14)

    class PointEstimate:
        name = "map"

    class Ctx:
        generator = None

    with pytest.raises(ValueError, match="flatness=geometry needs a variational method"):
        Geometry().setup(Ctx(), PointEstimate())
    with pytest.raises(ValueError, match="needs a per-parameter scaling"):
        Geometry().gradient([torch.zeros(2, requires_grad=True)], lambda b: torch.zeros(()), None,
                            Backprop(nn.Identity(), CPU))


def test_perturb_mask_leaves_unmasked_parameters_and_their_norm_out():
    params, grads = _tensors(4)
    eps = SAM(rho=0.3).perturbation(params, grads, perturb=[True, False, True])
    assert torch.equal(eps[1], torch.zeros_like(eps[1]))
    kept = _flat([grads[0], grads[2]])
    torch.testing.assert_close(_flat([eps[0], eps[2]]), 0.3 * kept / kept.norm(), rtol=1e-12, atol=1e-14)


def test_random_sam_noise_statistics_and_default_sigma():
    params = [torch.zeros(200, 50), torch.zeros(1000)]
    r = RandomSAM(rho=0.05)
    r.generator = torch.Generator().manual_seed(0)
    eps = _flat(r.perturbation(params))
    p = eps.numel()
    assert eps.std().item() == pytest.approx(0.05 / math.sqrt(p), rel=0.03)
    assert eps.mean().abs().item() < 4 * 0.05 / p  # 4 standard errors
    # E||eps|| ~ rho
    assert torch.linalg.vector_norm(eps).item() == pytest.approx(0.05, rel=0.02)
    r2 = RandomSAM(sigma=5e-5)
    r2.generator = torch.Generator().manual_seed(0)
    assert _flat(r2.perturbation(params)).std().item() == pytest.approx(5e-5, rel=0.03)


def test_random_sam_gradient_is_the_gradient_at_the_noisy_point():
    lin = nn.Linear(3, 2).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    w0 = [p.detach().clone() for p in lin.parameters()]
    r = RandomSAM(rho=0.5)
    r.generator = torch.Generator().manual_seed(5)
    r.gradient(list(lin.parameters()), lambda b: nn.functional.cross_entropy(lin(b[0]), b[1]), (x, y),
               Backprop(lin, CPU))
    got = [p.grad.clone() for p in lin.parameters()]
    r.generator = torch.Generator().manual_seed(5)
    eps = r.perturbation(w0)
    probe = copy.deepcopy(lin)
    with torch.no_grad():
        for p, w, e in zip(probe.parameters(), w0, eps):
            p.copy_(w + e)
    expected = torch.autograd.grad(nn.functional.cross_entropy(probe(x), y), list(probe.parameters()))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for p, w in zip(lin.parameters(), w0):
        assert torch.equal(p.detach(), w)


def test_random_sam_with_m_chunks_averages_the_chunks_gradients_at_their_own_noise():
    lin = nn.Linear(3, 2).double()
    x, y = torch.randn(9, 3, dtype=torch.float64), torch.randint(0, 2, (9,))
    r = RandomSAM(rho=0.5, m=2)
    r.generator = torch.Generator().manual_seed(5)
    r.gradient(list(lin.parameters()), _ce(lin), (x, y), Backprop(lin, CPU))
    r.generator = torch.Generator().manual_seed(5)
    expected = [torch.zeros_like(p) for p in lin.parameters()]
    for xc, yc in zip(x.tensor_split(2), y.tensor_split(2)):  # 5 and 4 examples: weights 5/9 and 4/9
        probe = copy.deepcopy(lin)
        with torch.no_grad():
            for p, e in zip(probe.parameters(), r.perturbation(list(lin.parameters()))):
                p.add_(e)
        for acc, gc in zip(expected, torch.autograd.grad(_ce(probe)((xc, yc)), list(probe.parameters()))):
            acc += gc * len(yc) / 9
    for p, e in zip(lin.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------- m-sharpness
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3)).double()


def _grad(flatness, net, batch):
    net.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    flatness.gradient(list(net.parameters()), lambda b: nn.functional.cross_entropy(net(b[0]), b[1]),
                      batch, Backprop(net, CPU))
    return [p.grad.clone() for p in net.parameters()]


def _batch(n=12):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _ce(net):
    return lambda b: nn.functional.cross_entropy(net(b[0]), b[1])


def _hand_sam(net, batch, ascent, *, replay=True, seed=11):
    """One SAM step written out with autograd, no flatness code: g at w (dropout drawn from ``seed``),
    eps = ascent(names, w, g), then the gradient at w + eps -- with the first pass's dropout masks
    (``replay``) or the RNG stream's next ones. Returns (gradient, eps, BN inputs at w and at w + eps)."""
    probe = copy.deepcopy(net)
    names, params = zip(*probe.named_parameters())
    torch.manual_seed(seed)
    g = torch.autograd.grad(_ce(probe)(batch), params)
    with torch.no_grad():
        h_w = probe[0](batch[0])
        eps = ascent(names, [p.detach().clone() for p in params], g)
        for p, e in zip(params, eps):
            p.add_(e)
        h_eps = probe[0](batch[0])
    if replay:
        torch.manual_seed(seed)
    return list(torch.autograd.grad(_ce(probe)(batch), params)), eps, h_w, h_eps


def _sam_ascent(rho):
    def ascent(names, w, g):
        norm = torch.sqrt(sum((gi ** 2).sum() for gi in g))
        return [rho * gi / norm for gi in g]
    return ascent


def _asam_ascent(rho, eta):  # T = |w| + eta on *weight* tensors, 1 elsewhere
    def ascent(names, w, g):
        t = [wi.abs() + eta if "weight" in n else torch.ones_like(wi) for n, wi in zip(names, w)]
        norm = torch.sqrt(sum(((ti * gi) ** 2).sum() for ti, gi in zip(t, g)))
        return [rho * ti * ti * gi / norm for ti, gi in zip(t, g)]
    return ascent


def _fsam_ascent(rho, eta):  # F^-1 = 1 / (1 + eta g^2)
    def ascent(names, w, g):
        inv_f = [1.0 / (1.0 + eta * gi ** 2) for gi in g]
        norm = torch.sqrt(sum((gi * fi * gi).sum() for gi, fi in zip(g, inv_f)))
        return [rho * fi * gi / norm for fi, gi in zip(inv_f, g)]
    return ascent


@pytest.mark.parametrize("variant,ascent", [(SAM(rho=0.3), _sam_ascent(0.3)),
                                            (ASAM(rho=0.5, eta=0.1), _asam_ascent(0.5, 0.1)),
                                            (FisherSAM(rho=0.3, eta=1.0), _fsam_ascent(0.3, 1.0))])
def test_m_equal_one_is_the_hand_computed_step_on_the_whole_batch(variant, ascent):
    """BatchNorm in train mode couples the examples, so any split of the batch would change the gradient."""
    net, batch = _net(), _batch()
    assert variant.m == 1
    work = copy.deepcopy(net)
    torch.manual_seed(11)
    variant.gradient(list(work.named_parameters()), _ce(work), batch, Backprop(work, CPU))
    expected, *_ = _hand_sam(net, batch, ascent)
    for p, e in zip(work.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-13)
    # the step is not the plain gradient (rho matters at this size)
    plain = torch.autograd.grad((torch.manual_seed(11), _ce(net)(batch))[1], list(net.parameters()))
    assert not torch.allclose(_flat(expected), _flat(plain), rtol=1e-3)


@pytest.mark.parametrize("policy,passes", [("first", ["w"]), ("second", ["w+eps"]), ("both", ["w", "w+eps"]),
                                           ("none", [])])
def test_bn_stats_policy_decides_which_pass_moves_the_running_stats(policy, passes):
    """Running stats after one step = the momentum updates of the chosen passes' batch statistics."""
    net, batch = _net(), _batch()
    with torch.no_grad():  # non-default stats, so "left alone" and "reset" are told apart
        net[1].running_mean.fill_(0.5)
        net[1].running_var.fill_(2.0)
    work = copy.deepcopy(net)
    torch.manual_seed(11)
    SAM(rho=0.5, bn_stats=policy).gradient(list(work.named_parameters()), _ce(work), batch, Backprop(work, CPU))
    _, _, h_w, h_eps = _hand_sam(net, batch, _sam_ascent(0.5))
    assert (h_w.mean(0) - h_eps.mean(0)).abs().max() > 1e-2  # the two passes' statistics differ
    mean, var = net[1].running_mean.clone(), net[1].running_var.clone()
    for h in [{"w": h_w, "w+eps": h_eps}[k] for k in passes]:
        mean = 0.9 * mean + 0.1 * h.mean(0)   # BatchNorm1d momentum 0.1, unbiased batch variance
        var = 0.9 * var + 0.1 * h.var(0)
    torch.testing.assert_close(work[1].running_mean, mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(work[1].running_var, var, rtol=1e-12, atol=1e-14)
    assert int(work[1].num_batches_tracked) == len(passes)


@pytest.mark.parametrize("same_noise", [True, False])
def test_same_noise_decides_whether_the_second_pass_reuses_the_dropout_masks(same_noise):
    net, batch = _net(), _batch()
    work = copy.deepcopy(net)
    torch.manual_seed(11)
    SAM(rho=0.2, same_noise=same_noise).gradient(list(work.named_parameters()), _ce(work), batch,
                                                 Backprop(work, CPU))
    expected, *_ = _hand_sam(net, batch, _sam_ascent(0.2), replay=same_noise)
    other, *_ = _hand_sam(net, batch, _sam_ascent(0.2), replay=not same_noise)
    assert not torch.allclose(_flat(expected), _flat(other), rtol=1e-3)  # the masks matter for this net
    for p, e in zip(work.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-13)


def test_m_sharpness_is_the_mean_of_per_chunk_sam_gradients():
    net, (x, y) = _net(), _batch(12)
    net.eval()  # no BN batch statistics / dropout, so a chunk's gradient depends on that chunk only
    got = _grad(SAM(rho=0.2, m=3), copy.deepcopy(net), (x, y))
    per_chunk = [_grad(SAM(rho=0.2), copy.deepcopy(net), (xc, yc))
                 for xc, yc in zip(x.tensor_split(3), y.tensor_split(3))]
    for i, g in enumerate(got):
        torch.testing.assert_close(g, sum(c[i] for c in per_chunk) / 3, rtol=1e-12, atol=1e-14)
    # the chunks were perturbed differently: the split differs from one global perturbation
    whole = _grad(SAM(rho=0.2), copy.deepcopy(net), (x, y))
    assert not torch.allclose(_flat(whole), _flat(got), rtol=1e-6)


def test_m_sharpness_with_rho_zero_is_the_batch_gradient():
    net, batch = _net(), _batch(12)
    net.eval()
    a = _grad(SAM(rho=0.0, m=4), copy.deepcopy(net), batch)
    b = _grad(NoFlatness(), copy.deepcopy(net), batch)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


def test_split_batch_shares_and_errors():
    x, y = torch.arange(10.0), torch.arange(10)
    chunks = split_batch((x, y), 3)
    assert [c[0][0].shape[0] for c in chunks] == [4, 3, 3]
    assert sum(s for _, s in chunks) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="flatness.m=20 exceeds"):
        split_batch((x, y), 20)


@pytest.mark.parametrize("variant", [SAM, ASAM, FisherSAM, RandomSAM])
def test_every_variant_leaves_bn_stats_to_the_first_pass_and_restores_weights(variant):
    net = _net().float()
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    ref = copy.deepcopy(net)
    w0 = copy.deepcopy(net.state_dict())
    f = variant(rho=0.3)
    f.generator = torch.Generator().manual_seed(0)
    f.gradient(list(net.named_parameters()), lambda b: nn.functional.cross_entropy(net(b[0]), b[1]), (x, y),
               Backprop(net, CPU))
    ref.train()
    ref(x)
    if variant is not RandomSAM:  # RandomSAM's only pass is at the noisy point, so its stats are too
        torch.testing.assert_close(net[1].running_mean, ref[1].running_mean)
    assert int(net[1].num_batches_tracked) == 1
    for k, v in net.state_dict().items():
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(v, w0[k]), k


@pytest.mark.parametrize("variant", [ASAM, FisherSAM, RandomSAM])
@pytest.mark.parametrize("precision,tol", [("bf16", 0.03), ("fp16", 0.005)])
def test_mixed_precision_gradient_is_the_fp32_gradient_up_to_rounding(variant, precision, tol):
    """The gradient the step uses (loss scale removed) matches fp32: measured relative errors are
    ~4e-3 (bf16) and ~6e-4 (fp16). A Fisher-SAM ascent on still-scaled fp16 gradients is far off."""
    net = _net().float()
    net[3] = nn.Identity()  # dropout masks drawn on bf16 tensors differ from fp32 ones
    g = torch.Generator().manual_seed(5)
    batch = torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g)
    grads = {}
    for prec in ("fp32", precision):
        work = copy.deepcopy(net)
        bp = Backprop(work, CPU, precision=prec)
        f = variant(rho=0.5, m=2)
        f.generator = torch.Generator().manual_seed(0)
        loss = f.gradient(list(work.named_parameters()), _ce(work), batch, bp)
        assert torch.isfinite(loss)
        grads[prec] = _flat(bp.unscaled_grads(list(work.parameters())))
    rel = (grads[precision] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert rel.item() < tol, rel


def test_fp16_ascent_is_taken_on_unscaled_gradients():
    """The GradScaler multiplies the loss by 2^16; the perturbation must not see that factor."""
    net = nn.Linear(4, 3)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    seen = {}

    class Spy(FisherSAM):
        def perturbation(self, params, grads, *a, **k):
            seen["g"] = [g.clone() for g in grads]
            return super().perturbation(params, grads, *a, **k)

    Spy(rho=0.1, eta=1.0).gradient(list(net.parameters()),
                                   lambda b: nn.functional.cross_entropy(net(b[0]), b[1]), (x, y),
                                   Backprop(net, CPU, precision="fp16"))
    true = torch.autograd.grad(nn.functional.cross_entropy(net(x), y), list(net.parameters()))
    for a, b in zip(seen["g"], true):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)


def test_adaptive_rho_follows_the_lr_ratio():
    f = SAM(rho=0.1, rho_schedule="lr")
    f.set_lr_ratio(0.25)
    assert f.radius == pytest.approx(0.025)
    g = SAM(rho=0.1)
    g.set_lr_ratio(0.25)
    assert g.radius == 0.1
    with pytest.raises(ValueError, match="rho_schedule"):
        SAM(rho_schedule="cosine")


# ---------------------------------------------------------------------------- DDP ascent
def _mlp():
    torch.manual_seed(0)  # no BatchNorm / dropout: a rank's gradient depends on its shard only
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _ddp_sam_worker(rank, store, out, rho):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        x, y = _batch(12)
        shard = x.tensor_split(2)[rank], y.tensor_split(2)[rank]
        grads = {}
        for sync in (True, False):
            net = _mlp()
            ddp = DistributedDataParallel(net)
            SAM(rho=rho, sync_ascent=sync).gradient(list(net.named_parameters()), _ce(ddp), shard,
                                                    Backprop(net, CPU, ddp=ddp))
            grads[sync] = [p.grad.clone() for p in net.parameters()]
            del ddp  # its reducer must not outlive the process group
        torch.save(grads, out / f"rank{rank}.pt")
        dist.barrier()  # neither rank tears gloo down while its peer is still in a collective (SIGABRT ~1 in 4)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sync_ascent_is_the_global_ascent_and_its_absence_the_per_rank_ascent(tmp_path):
    """Two gloo ranks, half the batch each, rho > 0. sync_ascent=true: one perturbation from the
    all-reduced gradient = single-process SAM on the whole batch; false: each rank perturbs with its
    own shard's gradient and the perturbed gradients are averaged."""
    import torch.multiprocessing as mp

    rho = 0.5
    ctx = mp.start_processes(_ddp_sam_worker, args=(tmp_path / "store", tmp_path, rho), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.time() + 300
    while not ctx.join(timeout=5):
        assert time.time() < deadline, "DDP workers hung"
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    x, y = _batch(12)
    synced, *_ = _hand_sam(_mlp(), (x, y), _sam_ascent(rho))
    shards = [_hand_sam(_mlp(), (xs, ys), _sam_ascent(rho))[0] for xs, ys in zip(x.tensor_split(2), y.tensor_split(2))]
    per_rank = [(a + b) / 2 for a, b in zip(*shards)]
    assert not torch.allclose(_flat(synced), _flat(per_rank), rtol=1e-3)  # the two ascents differ here
    for rank in (0, 1):
        for g, e in zip(got[rank][True], synced):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-13)
        for g, e in zip(got[rank][False], per_rank):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------------------- through the engine
DIGITS = ["dataset=digits", "model=mlp", "dataset.train_subset=300", "trainer.epochs=1", "trainer.batch_size=30"]


def test_fsam_eta_zero_is_the_same_run_as_sam(tmp_path):
    sam = run_cfg(DIGITS + ["flatness=sam", "flatness.rho=0.1"], tmp_path / "sam")
    fsam = run_cfg(DIGITS + ["flatness=fsam", "flatness.rho=0.1", "flatness.eta=0"], tmp_path / "fsam")
    assert fsam["meta"]["flatness"]["name"] == "fsam"
    for k in ("accuracy", "nll", "ece", "brier"):
        assert fsam["metrics"][k] == sam["metrics"][k], k


def test_m_through_config_reaches_the_gradient(tmp_path):
    a = run_cfg(DIGITS + ["flatness=asam"], tmp_path / "a")  # m defaults to 1
    c = run_cfg(DIGITS + ["flatness=asam", "flatness.m=3"], tmp_path / "c")
    assert a["meta"]["flatness"]["m"] == 1 and c["meta"]["flatness"]["m"] == 3
    assert c["metrics"]["nll"] != a["metrics"]["nll"]


class _Crash(Exception):
    pass


def test_random_flatness_run_killed_mid_run_resumes_bit_identically(tmp_path, monkeypatch):
    """The noise comes from the engine's checkpointed generator: a run that dies in epoch 2 and is
    resumed from its epoch-1 checkpoint ends with the very weights of an uninterrupted run."""
    args = DIGITS + ["flatness=random", "flatness.rho=0.5", "trainer.epochs=3"]  # 10 steps per epoch
    ref = run_cfg(args, tmp_path / "ref")
    original, calls = RandomSAM.chunk_gradient, []

    def dies_at_step_15(self, *a, **k):
        calls.append(1)
        if len(calls) == 15:
            raise _Crash
        return original(self, *a, **k)

    monkeypatch.setattr(RandomSAM, "chunk_gradient", dies_at_step_15)
    with pytest.raises(_Crash):
        run_cfg(args, tmp_path / "resumed")
    assert torch.load(tmp_path / "resumed" / "checkpoints" / "last.pt", weights_only=False)["epoch"] == 1
    monkeypatch.setattr(RandomSAM, "chunk_gradient", original)
    resumed = run_cfg(args, tmp_path / "resumed")
    final = [torch.load(tmp_path / d / "checkpoints" / "last.pt", weights_only=False)["method"]["model"]
             for d in ("ref", "resumed")]
    for k, v in final[0].items():
        assert torch.equal(v, final[1][k]), k
    for k in ("accuracy", "nll", "ece", "brier"):
        assert resumed["metrics"][k] == ref["metrics"][k], k
    other_seed = run_cfg(args + ["seed=1"], tmp_path / "seed1")
    assert other_seed["metrics"]["nll"] != ref["metrics"]["nll"]


def test_geometry_on_a_point_estimate_is_refused_with_one_line(tmp_path):
    with pytest.raises(ValueError, match="flatness=geometry needs a variational method"):
        run_cfg(DIGITS + ["flatness=geometry"], tmp_path / "g")


@pytest.mark.parametrize("name,target", [("asam", "asam.ASAM"), ("fsam", "fsam.FisherSAM"), ("random", "random.RandomSAM"),
                                         ("geometry", "geometry.Geometry")])
def test_every_variant_config_has_the_shared_keys(name, target):
    cfg = compose_cfg([f"flatness={name}"])
    assert cfg.flatness._target_ == f"flatbnn.flatness.{target}"
    assert {"rho", "m", "rho_schedule"} <= set(cfg.flatness)
