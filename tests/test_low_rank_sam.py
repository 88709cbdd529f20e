"""``flatness.batched_chunks=true`` on a network whose parameters are all nn.Linear's (the MNIST MLP): SAM's m chunks
in two whole-batch passes with a low-rank term per chunk (flatbnn/flatness/low_rank.py) give the loop's step, and
everything the low-rank algebra cannot see (a layer called twice, an in-place op on a layer's output, a parameter
outside a Linear) goes down the vmap path, which says so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import SAM
from flatbnn.methods import MAP, RunContext

CPU = torch.device("cpu")


def _mlp(bias=True, inplace=False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 12, bias=bias), nn.ReLU(inplace=inplace), nn.Linear(12, 7),
                         nn.ELU(), nn.Linear(7, 3)).double()


class _Shared(nn.Module):
    """One Linear called twice in a forward (weight sharing): its gradient is not one d^T a."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(36, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.mid(torch.tanh(self.inp(x.flatten(1))))))))


def _steps(flatness, module, steps=3, batch_size=16, label_smoothing=0.0):
    method = MAP()
    module = method.prepare_model(module)
    ctx = RunContext(model=module, module=module, device=CPU, n_train=64, steps_per_epoch=steps, epochs=1,
                     optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduler_factory=None,
                     label_smoothing=label_smoothing)
    method.setup(ctx)
    flatness.setup(ctx, method)
    bp = Backprop(module, CPU)
    method.train()
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        batch = (torch.randn(batch_size, 1, 6, 6, generator=g, dtype=torch.float64),
                 torch.randint(0, 3, (batch_size,), generator=g))
        losses.append(method.train_step(batch, flatness, bp)["loss"])
    return [p.detach().clone() for p in module.parameters()], torch.stack(losses), method


def _compare(make, m=4, **kw):
    w_loop, l_loop, m_loop = _steps(SAM(rho=0.5, m=m), make(), **kw)
    flat = SAM(rho=0.5, m=m, batched_chunks=True)
    w_fast, l_fast, m_fast = _steps(flat, make(), **kw)
    start = [p.detach() for p in make().parameters()]
    moved = max(float((a - b).abs().max()) for a, b in zip(w_loop, start))
    err = max(float((a - b).abs().max()) for a, b in zip(w_loop, w_fast))
    return flat, moved, err, (l_loop, l_fast), (m_loop.pop_train_accuracy(), m_fast.pop_train_accuracy())


@pytest.mark.parametrize("bias", [True, False])
def test_low_rank_chunks_equal_the_loop_in_float64(bias):
    flat, moved, err, (l_loop, l_fast), (acc_loop, acc_fast) = _compare(lambda: _mlp(bias=bias))
    assert flat.chunk_algorithm == "low_rank" and flat.describe()["chunk_algorithm"] == "low_rank"
    assert moved > 1e-2 and err < 1e-13 * max(moved, 1.0), (err, moved)
    torch.testing.assert_close(l_loop, l_fast, rtol=1e-13, atol=0)
    assert acc_loop == acc_fast  # chunk 0's first pass, both ways


def test_low_rank_with_label_smoothing_and_m_equal_to_the_batch():
    """m = batch size (one example a chunk: per-example ascents) and the smoothed loss the loop also takes."""
    flat, moved, err, (l_loop, l_fast), _ = _compare(_mlp, m=8, batch_size=8, label_smoothing=0.1)
    assert flat.chunk_algorithm == "low_rank" and moved > 1e-2 and err < 1e-13 * max(moved, 1.0), (err, moved)
    torch.testing.assert_close(l_loop, l_fast, rtol=1e-13, atol=0)


def test_the_perturbation_matters_a_plain_gradient_would_be_red():
    """Guard for the comparisons above: the SAM step is measurably not the plain step on this problem, so a path
    that dropped the low-rank term would fail them."""
    w_sam, _, _ = _steps(SAM(rho=0.5, m=4, batched_chunks=True), _mlp())
    w_plain, _, _ = _steps(SAM(rho=0.0, m=4, batched_chunks=True), _mlp())
    assert max(float((a - b).abs().max()) for a, b in zip(w_sam, w_plain)) > 1e-3


def _conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(32, 3)).double()


@pytest.mark.parametrize("make", [lambda: _Shared().double(), lambda: _mlp(inplace=True), _conv],
                         ids=["shared_layer", "inplace_relu", "conv"])
def test_what_the_low_rank_algebra_cannot_see_takes_the_vmap_path_with_the_loops_step(make):
    flat, moved, err, (l_loop, l_fast), _ = _compare(make)
    assert flat.chunk_algorithm == "vmap" and flat.describe()["chunk_algorithm"] == "vmap"
    assert moved > 1e-3 and err < 1e-12 * max(moved, 1.0), (err, moved)
    torch.testing.assert_close(l_loop, l_fast, rtol=1e-6, atol=0)  # the loss is float32 (Method.loss_fn)


@pytest.mark.parametrize("cell,expected", [
    ("mnist/mlp/sam_sgd", ["flatness.batched_chunks=true"]),          # SAM m = 8 on the MLP: the low-rank path
    ("mnist/mlp/sam_adam", ["flatness.batched_chunks=true"]),
    ("fashion_mnist/lenet5/sam_sgd", []),                             # convs: the vmap path, slower than the loop
    ("mnist/mlp/sgd", []),                                            # no SAM
])
def test_the_cpu_campaign_takes_the_low_rank_path_exactly_where_it_applies(cell, expected):
    """bSAM Table 6's cells as the CPU campaign composes them (scripts/campaign.py without a GPU self-check)."""
    from flatbnn.bench.selfcheck import cpu_step_overrides
    from flatbnn.reproduce import launch, spec

    [c] = [c for c in spec.load_row("bsam_t6").cells_for("paper") if c.id == cell]
    cfg = launch.compose_cell(c.overrides)
    assert cpu_step_overrides(cfg) == expected
    if expected:  # the same cell with dropout, or at m = 1, keeps the loop
        assert cpu_step_overrides(launch.compose_cell(c.overrides + ["model.dropout=0.1"])) == []
        assert cpu_step_overrides(launch.compose_cell(c.overrides + ["flatness.m=1"])) == []


def test_under_bf16_autocast_the_low_rank_step_is_as_close_to_the_fp32_step_as_the_loops():
    """bf16: the rows are bf16 and of mixed dtypes (the first layer's input is the float32 batch); the norm is taken in
    float32. The low-rank step then differs from the float32 loop by bf16 rounding, no more than the bf16 loop does."""
    def weights(batched, precision):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Flatten(), nn.Linear(36, 12), nn.ReLU(), nn.Linear(12, 3))
        method = MAP()
        module = method.prepare_model(module)
        ctx = RunContext(model=module, module=module, device=CPU, n_train=64, steps_per_epoch=3, epochs=1,
                         optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduler_factory=None)
        method.setup(ctx)
        flat = SAM(rho=0.5, m=4, batched_chunks=batched)
        flat.setup(ctx, method)
        bp = Backprop(module, CPU, precision=precision)
        method.train()
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            method.train_step((torch.randn(16, 1, 6, 6, generator=g), torch.randint(0, 3, (16,), generator=g)), flat, bp)
        assert flat.chunk_algorithm == ("low_rank" if batched else None)
        return [p.detach().clone() for p in module.parameters()]

    def dist(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))
    exact = weights(False, "fp32")
    assert dist(weights(True, "fp32"), exact) < 1e-6
    assert dist(weights(True, "bf16"), exact) <= dist(weights(False, "bf16"), exact)
