"""The fast path (``trainer=gpu_fast``: bf16, channels_last, optional torch.compile; the trainer's
deferred loss read) checked on the CPU: the switches change speed, not results."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from flatbnn.engine import distributed as D
from flatbnn.engine.backprop import Backprop
from flatbnn.engine.trainer import Diverged, Trainer
from flatbnn.flatness import SAM
from flatbnn.methods import MAP, RunContext
from helpers import compose_cfg, run_cfg


# ---------------------------------------------------------------------------------------------- config
def test_gpu_fast_selects_every_speed_switch():
    t = compose_cfg(["trainer=gpu_fast"]).trainer
    assert (t.device, t.precision, t.channels_last, t.num_workers) == ("cuda", "bf16", True, 8)
    assert t.compile is False  # opt in: the first steps pay the compile
    # everything else is the default trainer's (epochs, batch, resume, ...)
    default = compose_cfg([]).trainer
    same = {k for k in default if k not in ("device", "precision", "channels_last", "num_workers", "compile")}
    assert all(t[k] == default[k] for k in same)


# ------------------------------------------------------------------------------ layout / precision / compile
def _fake_cifar(tmp_path: Path) -> list[str]:
    from flatbnn.data.fake import write_cifar10_torchvision
    root = write_cifar10_torchvision(tmp_path / "c10")
    return ["dataset=cifar10", f"dataset.root={root}", f"dataset.cache_dir={tmp_path / 'cache'}",
            "model=resnet20_frn", "method=map", "flatness=sam", "trainer.epochs=1", "trainer.batch_size=10",
            "trainer.eval_every=0", "trainer.checkpoint_every=0", "optimizer.lr=0.05"]


def _metrics(res: dict) -> dict:
    return {k: v for k, v in res["metrics"].items() if isinstance(v, float) and "seconds" not in k}


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=tol, abs_tol=tol), (k, a[k], b[k])


@pytest.mark.parametrize("method", [[], ["method=f_swag", "method.swa_start=0", "method.num_samples=2"]],
                         ids=["map", "f_swag"])
def test_channels_last_run_gives_the_eager_metrics(method, tmp_path):
    """Same data, init and SAM steps through the whole engine in NCHW and NHWC: same test metrics. F-SWAG
    flattens the weights to collect and writes samples back (parameters_to_vector raised on NHWC weights)."""
    base = _fake_cifar(tmp_path) + method
    eager = run_cfg(base, tmp_path / "eager")
    nhwc = run_cfg(base + ["trainer.channels_last=true"], tmp_path / "nhwc")
    # 3 SAM steps amplify float rounding to ~4e-4 relative in ECE (measured); a layout bug is O(1)
    _close(_metrics(eager), _metrics(nhwc), 2e-3)
    assert _metrics(eager)["nll"] > 0


def test_fused_sgd_run_gives_the_foreach_metrics(tmp_path):
    """``+optimizer.fused=true`` (the fused kernels, also on CPU): the same run within float rounding."""
    base = ["dataset=digits", "model=mlp", "method=map", "flatness=sam", "trainer.epochs=1",
            "trainer.eval_every=0", "trainer.checkpoint_every=0"]
    plain = run_cfg(base, tmp_path / "plain")
    fused = run_cfg(base + ["+optimizer.fused=true"], tmp_path / "fused")
    _close(_metrics(plain), _metrics(fused), 1e-5)


def _sam_steps(steps: int = 3, precision: str = "fp32", channels_last: bool = False, compile: bool = False):
    """Weights and losses after ``steps`` MAP x SAM steps of a small conv net with BatchNorm."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                           nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                           nn.Linear(8, 10))
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    model = torch.compile(module) if compile else module
    cpu = torch.device("cpu")
    method = MAP()
    ctx = RunContext(model=model, module=module, device=cpu, n_train=16, steps_per_epoch=steps, epochs=1,
                     optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                     scheduler_factory=None, channels_last=channels_last)
    method.setup(ctx)
    flat = SAM(rho=0.05)
    flat.setup(ctx, method)
    bp = Backprop(module, cpu, precision=precision)
    method.train()
    losses = [float(method.train_step((x, y), flat, bp)["loss"]) for _ in range(steps)]
    return [p.detach().clone() for p in module.parameters()], losses


def test_channels_last_sam_steps_match_contiguous():
    w0, l0 = _sam_steps()
    w1, l1 = _sam_steps(channels_last=True)
    for a, b in zip(w0, w1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert l0 == pytest.approx(l1, rel=1e-5)


def test_bf16_autocast_on_cpu_runs_and_stays_close_to_fp32():
    w0, l0 = _sam_steps()
    w1, l1 = _sam_steps(precision="bf16")
    assert all(math.isfinite(v) for v in l1)
    assert l1 == pytest.approx(l0, rel=2e-2)  # bf16 keeps 8 bits of mantissa: ~0.4 % per op
    drift = max(float((a - b).abs().max()) for a, b in zip(w0, w1))
    moved = max(float((a - b).abs().max()) for a, b in zip(w0, _sam_steps(steps=0)[0]))
    assert 0 < drift < 0.05 * moved  # close to fp32, but not identical (autocast did act)


@pytest.mark.slow
def test_torch_compile_sam_steps_match_eager():
    """torch.compile of the backbone on the CPU (inductor, C++ codegen): same SAM steps as eager.
    Measured on the shared 2-core dev machine (load average ~13): 197 s, nearly all of it the compile."""
    try:
        t0 = time.perf_counter()
        w1, l1 = _sam_steps(compile=True)
        print(f"compiled SAM steps: {time.perf_counter() - t0:.1f} s")
    except Exception as e:  # no C++ compiler on this machine: that is the environment, not our code
        if "compiler" in str(e).lower() or "InductorError" in type(e).__name__:
            pytest.skip(f"torch.compile unavailable here: {str(e).splitlines()[0][:120]}")
        raise
    w0, l0 = _sam_steps()
    for a, b in zip(w0, w1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert l1 == pytest.approx(l0, rel=1e-4)


# ---------------------------------------------------------------------------------------------- no host sync per step
class _Loader:
    batch_size = 2

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter([(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))] * self.n)


class _Sampler:
    skip = 0

    def set_epoch(self, epoch):
        pass


class _Flatness:
    rho_schedule = "constant"


class _Method:
    """Returns the given per-step losses as 0-dim tensors (what a real method returns)."""

    def __init__(self, losses):
        self.losses = iter([torch.tensor(v) for v in losses])

    def train(self):
        pass

    def train_step(self, batch, flatness, backprop):
        return {"loss": next(self.losses)}

    def on_epoch_end(self, epoch):
        pass

    def pop_train_accuracy(self):
        return 0.0, 0

    def lr(self):
        return 0.1


def _fit(tmp_path, losses, **kw):
    trainer = Trainer(epochs=1, run_dir=tmp_path, info=D.DistInfo(), device=torch.device("cpu"),
                      checkpoint_every=0, progress=False, **kw)
    trainer.fit(_Method(losses), _Flatness(), None, _Loader(len(losses)), _Sampler(), None)
    return trainer


def _count_reads(monkeypatch) -> dict:
    """Counts every device->host read of a tensor (float(), .item(), .tolist(), .cpu())."""
    counts = {"n": 0}
    for name in ("__float__", "__bool__", "item", "tolist", "cpu"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            counts["n"] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def test_trainer_reads_the_loss_per_interval_not_per_step(tmp_path, monkeypatch):
    """With the default interval (50 steps) an epoch of 10 steps and one of 40 read the same number of
    times: the loss stays on the device between reads (a per-step read is a GPU sync)."""
    counts = _count_reads(monkeypatch)
    _fit(tmp_path / "a", [1.0] * 10)
    short = counts["n"]
    counts["n"] = 0
    _fit(tmp_path / "b", [1.0] * 40)
    assert counts["n"] == short
    counts["n"] = 0
    _fit(tmp_path / "c", [1.0] * 40, log_every=10)  # 4 reads of 10 steps instead of 1 of 40
    assert counts["n"] > short


def test_deferred_read_keeps_the_epoch_loss_and_names_the_first_bad_step(tmp_path):
    losses = [0.5, 1.25, 2.0, 0.125, 3.0, 1.0, 0.25]
    t = _fit(tmp_path / "ok", losses, log_every=3)  # reads after steps 3, 6 and at the epoch end
    assert t.history_tail["train/loss"] == sum(losses) / len(losses)
    bad = [1.0] * 6 + [float("nan")] + [1.0] * 3
    with pytest.raises(Diverged, match=r"at epoch 1, step 7 \(global step 7"):
        _fit(tmp_path / "bad", bad, log_every=4)  # read after step 8: step 7 is still named


def test_a_map_sam_step_reads_nothing_back_from_the_device(monkeypatch):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    cpu = torch.device("cpu")
    method = MAP()
    ctx = RunContext(model=module, module=module, device=cpu, n_train=8, steps_per_epoch=1, epochs=1,
                     optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduler_factory=None)
    method.setup(ctx)
    flat = SAM(rho=0.05)
    flat.setup(ctx, method)
    bp = Backprop(module, cpu)
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    counts = _count_reads(monkeypatch)
    for _ in range(3):
        method.train_step(batch, flat, bp)
    assert counts["n"] == 0


def _method_for_sync_check(name: str, module: nn.Module):
    """VOGN (per-example gradients, its own optimiser) and VSAM (ellipsoid ascent + Sigma step), set up on CPU."""
    from flatbnn.methods.vogn import VOGN
    from flatbnn.methods.vsam import VariationalSAM

    gen = torch.Generator().manual_seed(0)
    if name == "vogn":
        method = VOGN(m=2, num_samples=2, lr=0.1, beta1=0.9, beta2=0.999, prior_precision=1.0, damping=0.0,
                      s_init=1.0)
        factory = None
    else:
        method = VariationalSAM(rho=0.5, init_radius=0.3, init_count=4.0, m_lr=0.1, prior_std=1.0)
        factory = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    method.setup(RunContext(model=module, module=module, device=torch.device("cpu"), n_train=8, steps_per_epoch=1,
                            epochs=1, optimizer_factory=factory, scheduler_factory=None, generator=gen))
    return method


@pytest.mark.parametrize("name", ["vogn", "vsam"])
def test_vogn_and_vsam_steps_read_nothing_back_from_the_device(name, monkeypatch):
    """The per-chunk train accuracy (VOGN) and the finite-gradient guard (VSAM) stay on the device: a `.cpu()`
    or an `if tensor:` there is a host sync on every GPU step."""
    from flatbnn.flatness import NoFlatness

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    method = _method_for_sync_check(name, module)
    flat = NoFlatness()
    flat.setup(method.ctx, method)
    bp = Backprop(module, torch.device("cpu"))
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    counts = _count_reads(monkeypatch)
    for _ in range(3):
        method.train_step(batch, flat, bp)
    assert counts["n"] == 0
    monkeypatch.undo()
    correct, seen = method.pop_train_accuracy()  # the count kept on the device is still the right one
    assert seen == 24 and 0 <= correct <= 24


@pytest.mark.parametrize("step_s, agreed", [(0.01, [1, 2, 6]), (2.0, [1, 2, 4, 6, 8])])
def test_ddp_stop_flag_is_agreed_at_most_every_log_every_steps_and_at_least_every_few_seconds(
        monkeypatch, step_s, agreed):
    """Every rank must stop at the same step; agreeing costs a collective and a host read, so under DDP it is not
    done after every step: after two steps that time the step (the all-reduced mean, so every rank picks the same
    steps), every log_every steps for fast steps, but at least every STOP_AGREE_SECONDS (5 s) for slow ones --
    torchrun kills a worker 30 s after its SIGTERM, and 50 slow steps take longer (issue 43)."""
    from flatbnn.engine import trainer as trainer_mod
    calls, clock = [], [0.0]

    def fake_all_reduce(values, info, device):  # both ranks send the same values: the sum is twice them
        calls.append(list(values))
        return [v * info.world_size for v in values]
    monkeypatch.setattr(D, "all_reduce_sum", fake_all_reduce)
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: clock[0])
    trainer = Trainer(epochs=1, run_dir=Path("unused"), info=D.DistInfo(), device=torch.device("cpu"),
                      checkpoint_every=0, progress=False, log_every=4)
    trainer.info = D.DistInfo(rank=0, world_size=2, local_rank=0)
    stop = type("Stop", (), {"raised": True})()
    seen = []
    for step in range(1, 10):
        trainer.global_step, clock[0] = step, step * step_s
        seen.append(trainer._stop_requested(stop))
    assert [s for s, flag in zip(range(1, 10), seen) if flag] == agreed and len(calls) == len(agreed)


@pytest.mark.parametrize("chunk", [2, 5])
def test_stacked_sample_predictive_equals_one_by_one(chunk):
    """trainer.eval_sample_chunk > 1 evaluates K weight samples per vmapped forward: the same samples (same
    generator order, a chunk that does not divide K included) through an eval-mode BN net give the per-sample
    log-probabilities of the one-by-one loop, and the module's weights are untouched afterwards."""
    from flatbnn.methods.vsam import VariationalSAM

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 5))
    with torch.no_grad():  # non-trivial running statistics
        net(torch.randn(16, 3, 6, 6) * 2 + 1)
    x = torch.randn(10, 3, 6, 6)
    loaders = {"test": [(x[:6], None), (x[6:], None)], "ood/x": [(x.flip(0), None)]}

    def samples(chunk_size):
        m = VariationalSAM(rho=0.5, init_radius=0.3, init_count=4.0, m_lr=0.1, prior_std=1.0, num_samples=7)
        m.setup(RunContext(model=net, module=net, device=torch.device("cpu"), n_train=8, steps_per_epoch=1, epochs=1,
                           optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1), scheduler_factory=None,
                           generator=torch.Generator().manual_seed(0), eval_sample_chunk=chunk_size))
        before = [p.detach().clone() for p in net.parameters()]
        out = list(m.predict(loaders))
        assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        return out

    one, stacked = samples(1), samples(chunk)
    assert len(one) == len(stacked) == 7
    for a, b in zip(one, stacked):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    assert not torch.allclose(one[0]["test"], one[1]["test"])  # the samples differ: a real check of the order
