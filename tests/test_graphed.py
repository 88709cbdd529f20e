"""trainer.cuda_graph (flatbnn/engine/graphed.py) on the CPU: everything but the CUDA capture itself. The capture
backend is replaced by one that calls the step on every "replay" and copies its outputs into the static ones, as a
graph does; the protocol around it (static batch, warm-up, in-place restore of every written tensor, RNG and host
counters, scheduler and example count outside the graph, loss copies, eager fallbacks) must then give exactly the
eager run. A GPU run of scripts/gpu_probe.py checks the real capture against eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbnn.engine import graphed
from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import NoFlatness, SAM
from flatbnn.methods import MAP, SWAG, RunContext
from flatbnn.methods.bsam import BSAM

CPU = torch.device("cpu")


DirectCalls = graphed.EagerReplay  # the capture replaced by direct calls


def _setup(method, flatness, opt="sgd", precision="fp32"):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    factory = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4),
               "adam": lambda p: torch.optim.Adam(p, lr=0.01)}[opt]
    ctx = RunContext(model=module, module=module, device=CPU, n_train=64, steps_per_epoch=6, epochs=1,
                     optimizer_factory=factory,
                     scheduler_factory=lambda o, total_steps, steps_per_epoch: torch.optim.lr_scheduler.StepLR(
                         o, step_size=1, gamma=0.7),
                     generator=torch.Generator().manual_seed(4))
    method.setup(ctx)
    flatness.setup(ctx, method)
    method.train()
    return module, Backprop(module, CPU, precision=precision)


def _batches():
    g = torch.Generator().manual_seed(1)
    sizes = [8, 8, 8, 5, 8, 8]  # a short batch in the middle: eager, then the graph again
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def _run(graph: bool, opt="sgd"):
    method, flat = MAP(), SAM(rho=0.05, rho_schedule="lr")
    module, bp = _setup(method, flat, opt)
    lines = []
    backend = DirectCalls()
    step = graphed.GraphedStep(method, flat, bp, capture=backend, log=lines.append) if graph else method.train_step
    losses = []
    for batch in _batches():
        flat.set_lr_ratio(method.lr_ratio())  # what the trainer does before each step
        losses.append(step(batch, flat, bp)["loss"])
    state = [t.detach().clone() for t in module.state_dict().values()]
    momenta = [v.clone() for s in method.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return state, losses, momenta, method.pop_train_accuracy(), method.lr(), lines, backend


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_graphed_protocol_gives_the_eager_run_bit_for_bit(opt):
    eager = _run(False, opt)
    graph = _run(True, opt)
    assert graph[6].warm_ups == 3  # the warm-up really ran steps, and the restore undid them
    for a, b in zip(eager[0], graph[0]):
        assert torch.equal(a, b)
    assert [float(x) for x in eager[1]] == [float(x) for x in graph[1]]  # each step's own loss (copies)
    assert len(eager[2]) == len(graph[2]) and all(torch.equal(a, b) for a, b in zip(eager[2], graph[2]))
    assert eager[3] == graph[3] and eager[4] == graph[4]  # train accuracy counts, lr after 6 scheduler steps
    assert graph[5] == ["trainer.cuda_graph: eager step: a batch of shape (5, 6), the graph holds (8, 6) "
                        "(the short last batch; each other shape would need its own graph)"]  # once, one line


def test_without_the_restore_the_warm_up_would_show():
    """The check above can fail: skipping the in-place restore leaves the warm-up's 3 steps in the weights."""
    orig = graphed.GraphedStep._restore
    graphed.GraphedStep._restore = lambda self, *a: None
    try:
        graph = _run(True)
    finally:
        graphed.GraphedStep._restore = orig
    eager = _run(False)
    assert any(not torch.equal(a, b) for a, b in zip(eager[0], graph[0]))


class _FakeDDP:
    pass


@pytest.mark.parametrize("case,reason", [
    ("fp16", "fp16 (GradScaler.step reads found-inf on the host; use bf16)"),
    ("ddp", "DDP (the all-reduce hooks are not captured yet)"),
    ("swag", "method=swag keeps host-side state in its step"),
    ("bsam", "BSAMOptimizer reads its lr as a host float (no device lr)"),
    ("dropout", "the second pass's dropout-mask replay (torch.cuda.get_rng_state) is not graph-safe yet"),
])
def test_eager_fallbacks_say_why_in_one_line(case, reason):
    method, flat = MAP(), SAM(rho=0.05)
    precision = "fp16" if case == "fp16" else "fp32"
    if case == "swag":
        method = SWAG(swa_start=0)
    if case == "bsam":
        method, flat = BSAM(m=2, num_samples=1), NoFlatness()
    module, bp = _setup(method, flat, precision=precision)
    if case == "ddp":
        bp.ddp = _FakeDDP()
    if case == "dropout":
        method.module.insert(3, nn.Dropout(0.1))
    step = graphed.GraphedStep(method, flat, bp, capture=DirectCalls(), log=lambda s: None)
    assert step.fallback_reason(_batches()[0]) == reason


def test_cuda_graph_is_refused_on_the_cpu_in_one_line(tmp_path):
    from flatbnn.engine.build import build
    from helpers import compose_cfg

    cfg = compose_cfg(["dataset=digits", "model=mlp", "model.hidden=[8]", "trainer.device=cpu",
                       "trainer.cuda_graph=true", "dataset.train_subset=32", "dataset.test_subset=16"])
    with pytest.raises(ValueError, match=r"^trainer.cuda_graph=true captures CUDA graphs and needs a CUDA device "
                                         r"\(trainer.device resolved to cpu\); set trainer.cuda_graph=false$"):
        build(cfg, run_dir=tmp_path)


def test_the_trainer_uses_the_graphed_step_when_set(tmp_path):
    """The trainer hook: with ``train_step`` set it is called instead of method.train_step."""
    from flatbnn.engine import distributed as D
    from flatbnn.engine.trainer import Trainer

    calls = []

    class Method:
        def train(self):
            pass

        def train_step(self, *a):
            raise AssertionError("the eager step was called")

        def on_epoch_end(self, epoch):
            pass

        def pop_train_accuracy(self):
            return 0.0, 0

        def lr(self):
            return 0.1

    class Loader:
        batch_size = 2

        def __len__(self):
            return 3

        def __iter__(self):
            return iter([(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))] * 3)

    sampler = type("S", (), {"skip": 0, "set_epoch": lambda self, e: None})()
    trainer = Trainer(epochs=1, run_dir=tmp_path, info=D.DistInfo(), device=CPU, checkpoint_every=0, progress=False)
    trainer.train_step = lambda batch, flatness, backprop: calls.append(1) or {"loss": torch.tensor(1.0)}
    trainer.fit(Method(), type("F", (), {"rho_schedule": "constant"})(), None, Loader(), sampler, None)
    assert len(calls) == 3
