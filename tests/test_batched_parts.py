"""``method.batched_parts`` (issue 52 item 2): bSAM's and VOGN's m parts as vmap-ed passes over all parts give the loop's
weights and precisions -- the same noise (one draw per step) and the same element-wise arithmetic, only the sums over
parts in another order. Stated tolerance, float64, 3 steps: ||w_batched - w_loop|| <= 1e-10 ||w_loop - w_0|| (measured
1e-14 on ResNet-20-FRN), precisions to 1e-12 relative; the loss and the train accuracy as the loop's. What the batched
path cannot run is refused in one line (true) or takes the loop with a note (auto)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import NoFlatness
from flatbnn.methods import RunContext
from flatbnn.methods.bsam import BSAM
from flatbnn.methods.vogn import VOGN
from flatbnn.models import create_model

CPU = torch.device("cpu")
NETS = {"mlp": ("mlp", (1, 28, 28), {"hidden": [50, 30]}), "lenet5": ("lenet5", (1, 28, 28), {"variant": "bsam"}),
        "resnet20_frn": ("resnet20_frn", (3, 8, 8), {})}
METHODS = {"bsam": lambda b: BSAM(m=4, lr=0.1, num_samples=1, batched_parts=b),
           "vogn": lambda b: VOGN(m=4, lr=0.1, s_init=1.0, damping=0.1, prior_precision=25.0, num_samples=1,
                                  batched_parts=b)}


def _run(method: str, key: str, batched: bool, steps: int = 3):
    torch.manual_seed(0)
    name, shape, kw = NETS[key]
    net = create_model(name, 10, shape, **kw).double()
    start = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    meth = METHODS[method](batched)
    meth.setup(RunContext(model=net, module=net, device=CPU, n_train=1000, steps_per_epoch=1, epochs=1,
                          optimizer_factory=None, scheduler_factory=None, generator=torch.Generator().manual_seed(3)))
    bp = Backprop(net, CPU)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = (torch.randn(8, *shape, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g))
        losses.append(meth.train_step(batch, NoFlatness(), bp)["loss"])
    w = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    s = torch.cat([meth.optimizer.state[p]["precision"].reshape(-1) for p in net.parameters()])
    return start, w, s, torch.stack(losses), meth.pop_train_accuracy()


@pytest.mark.parametrize("key", list(NETS))
@pytest.mark.parametrize("method", list(METHODS))
def test_batched_parts_give_the_loops_weights(method, key):
    w0, w_loop, s_loop, l_loop, acc_loop = _run(method, key, False)
    _, w_vmap, s_vmap, l_vmap, acc_vmap = _run(method, key, True)
    assert float((w_loop - w0).norm()) > 1e-3  # the steps moved the weights
    assert float((w_vmap - w_loop).norm()) <= 1e-10 * float((w_loop - w0).norm())
    torch.testing.assert_close(s_vmap, s_loop, rtol=1e-12, atol=0)
    torch.testing.assert_close(l_vmap, l_loop, rtol=1e-12, atol=0)
    assert acc_vmap == acc_loop  # every part's examples, at their noisy weights


def test_batched_parts_refusals_in_one_line_and_auto_takes_the_loop(capsys):
    bn = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))

    def ctx(module):
        return RunContext(model=module, module=module, device=CPU, n_train=100, steps_per_epoch=1, epochs=1,
                          optimizer_factory=None, scheduler_factory=None, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^method.batched_parts=true: BatchNorm") as e:
        BSAM(m=2, batched_parts=True).setup(ctx(bn))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="batched_parts must be auto, true or false"):
        BSAM(batched_parts="sometimes")
    # auto where batched is the rule but cannot run: the loop, said once
    method = BSAM(m=2, num_samples=1, batched_parts="auto")
    method.setup(ctx(bn))
    batch = (torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))
    method.ctx.device = torch.device("cuda")  # the rule's device (nothing runs on it: the refusal comes first)
    assert method.parts_path(batch, 2, Backprop(bn, CPU)) == "loop"
    assert method.parts_path(batch, 2, Backprop(bn, CPU)) == "loop"
    assert capsys.readouterr().err.count("batched_parts=auto): BatchNorm") == 1


@pytest.mark.parametrize("method", list(METHODS))
def test_auto_on_a_cpu_loops_on_a_conv_net_and_batches_a_linear_only_one(method):
    """The measured rule (methods/diag_gaussian.batched_by_default): on one CPU thread the vmap parts were slower than
    the loop (or tied) on every conv net measured, for both methods (VOGN m = 8: 106 vs 128 ms on the classic LeNet-5
    at 3x32x32, 2.21 vs 2.72 s on ResNet-20-FRN; results/bench/cpu-2026-11-30-*-parts-paths.md), the parts-Linear path
    faster on the MLP. VOGN took the vmap parts on a conv net until 2026-11-30 (its class said it measured faster batched)."""
    for key, want in (("lenet5", {"loop"}), ("resnet20_frn", {"loop"}), ("mlp", {"linear"})):
        torch.manual_seed(0)
        name, shape, kw = NETS[key]
        net = create_model(name, 10, shape, **kw)
        meth = METHODS[method]("auto")
        meth.setup(RunContext(model=net, module=net, device=CPU, n_train=100, steps_per_epoch=1, epochs=1,
                              optimizer_factory=None, scheduler_factory=None,
                              generator=torch.Generator().manual_seed(0)))
        meth.train_step((torch.randn(8, *shape), torch.randint(0, 10, (8,))), NoFlatness(), Backprop(net, CPU))
        assert meth.parts_taken == want, (key, meth.parts_taken)
