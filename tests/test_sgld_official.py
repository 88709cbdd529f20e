"""The flat_seeking_bnn official SGLD schedules (docs/flat_bnn_official_code.md (c)) as options of method=sgld.

Expected values are written out from the official formulas (sgld/train_sgld.py `schedule`, sam.py `get_noise`),
not taken from the implementation.
"""

import math

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import NoFlatness
from flatbnn.methods import SGLD, RunContext
from flatbnn.optim.schedulers import inverse_power
from helpers import compose_cfg

CPU = torch.device("cpu")


def _sgd(lr=0.05, momentum=0.9, n=3):
    return torch.optim.SGD([nn.Parameter(torch.zeros(n))], lr=lr, momentum=momentum)


def _lrs(opt, sched, steps):
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


# ---------------------------------------------------------------------------------------- lr schedules
def test_plain_sgld_lr_is_10_over_1000_plus_t_to_the_0_9_per_step():
    opt = _sgd(lr=0.05)  # optimizer.lr is irrelevant: the schedule is absolute
    sched = inverse_power(opt, total_steps=100, steps_per_epoch=7, a=10, b=1000, gamma=0.9, max_lr=None,
                          unit="step", offset=0)
    lrs = _lrs(opt, sched, 40)
    assert lrs[0] == pytest.approx(0.019952623149688802, rel=1e-12)   # 10 / 1000^0.9
    for t in (0, 1, 6, 7, 39):
        assert lrs[t] == pytest.approx(10.0 / (1000.0 + t) ** 0.9, rel=1e-12), t
    assert lrs[39] == pytest.approx(10.0 / 1039.0 ** 0.9, rel=1e-12)
    assert len(set(lrs)) == 40  # changes every step, not every epoch


def test_f_sgld_lr_is_min_0_2_and_0_2_over_0_1_plus_epoch_to_the_0_55_per_epoch():
    spe = 4
    opt = _sgd(lr=1.0)
    sched = inverse_power(opt, total_steps=100, steps_per_epoch=spe, a=0.2, b=0.1, gamma=0.55, max_lr=0.2,
                          unit="epoch", offset=1)
    lrs = _lrs(opt, sched, 5 * spe)
    for e in range(5):
        block = lrs[e * spe:(e + 1) * spe]
        assert all(x == block[0] for x in block), "constant within an epoch"
        assert block[0] == pytest.approx(min(0.2, 0.2 / (0.1 + 1 + e) ** 0.55), rel=1e-12)
    assert lrs[0] == pytest.approx(0.2 / 1.1 ** 0.55, rel=1e-12) and lrs[0] == pytest.approx(0.189786, abs=1e-6)
    assert lrs[4 * spe] == pytest.approx(0.2 / 5.1 ** 0.55, rel=1e-12)
    # the cap: the script's epoch 0 would give 0.2 / 0.1^0.55 = 0.71 -> 0.2
    opt0 = _sgd(lr=0.3)
    s0 = inverse_power(opt0, total_steps=10, steps_per_epoch=2, offset=0)
    assert _lrs(opt0, s0, 3) == pytest.approx([0.2, 0.2, 0.2 / 1.1 ** 0.55], rel=1e-12)
    # --fine_tune from the 300-epoch checkpoint: offset 300
    opt3 = _sgd(lr=0.3)
    s3 = inverse_power(opt3, total_steps=10, steps_per_epoch=2, offset=300)
    assert _lrs(opt3, s3, 1)[0] == pytest.approx(0.2 / 300.1 ** 0.55, rel=1e-12)


def test_inverse_power_is_absolute_per_param_group_and_resumes():
    p1, p2 = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p1], "lr": 0.1}, {"params": [p2], "lr": 0.7}], lr=0.1)
    sched = inverse_power(opt, total_steps=10, steps_per_epoch=1, a=10, b=1000, gamma=0.9, max_lr=None,
                          unit="step", offset=0)
    for _ in range(3):
        opt.step()
        sched.step()
    want = 10.0 / 1003.0 ** 0.9
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([want, want], rel=1e-12)
    state = sched.state_dict()
    opt2 = torch.optim.SGD([{"params": [p1], "lr": 0.1}, {"params": [p2], "lr": 0.7}], lr=0.1)
    sched2 = inverse_power(opt2, total_steps=10, steps_per_epoch=1, a=10, b=1000, gamma=0.9, max_lr=None,
                           unit="step", offset=0)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    assert opt2.param_groups[1]["lr"] == pytest.approx(10.0 / 1004.0 ** 0.9, rel=1e-12)
    with pytest.raises(ValueError, match="unit"):
        inverse_power(_sgd(), total_steps=1, steps_per_epoch=1, unit="iteration")


# ---------------------------------------------------------------------------------------- noise on a zero gradient
class _Wide(nn.Module):
    """Many parameters, a loss with an exactly zero gradient: one step moves the weights by the noise only."""

    def __init__(self, n=200_000):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n, dtype=torch.float64))

    def forward(self, x):
        return (self.w.sum() * 0.0).expand(x.shape[0], 1)


def _ctx(module, steps_per_epoch=5, lr=0.05, momentum=0.9, scheduler_factory=None):
    return RunContext(model=module, module=module, device=CPU, n_train=1000, steps_per_epoch=steps_per_epoch,
                      epochs=4, optimizer_factory=lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum,
                                                                             weight_decay=0.0),
                      scheduler_factory=scheduler_factory, criterion=lambda out, y: out.sum())


def _step_deltas(m, net, steps):
    bp, flat = Backprop(net, CPU), NoFlatness()
    batch = (torch.zeros(2, 1), torch.zeros(2))
    deltas = []
    for _ in range(steps):
        before = net.w.detach().clone()
        m.train_step(batch, flat, bp)
        deltas.append(net.w.detach() - before)
    return deltas


def _assert_std(delta, want, rel=0.01):
    # n = 200k N(0, s^2) draws: the sample std has relative s.e. 1/sqrt(2n) = 0.16%; 1% is > 6 s.e.
    assert delta.mean().abs().item() < 5 * want / math.sqrt(delta.numel())
    assert delta.std().item() == pytest.approx(want, rel=rel)


def test_f_sgld_noise_std_is_5e_4_times_38_0348_over_13928_7_plus_t_to_the_0_9():
    net = _Wide()
    m = SGLD(noise_mode="schedule", noise_factor=5e-4, noise_a=38.0348, noise_b=13928.7, noise_gamma=0.9,
             burn_in=10, lr_schedule=dict(a=0.2, b=0.1, gamma=0.55, max_lr=0.2, unit="epoch", offset=1))
    m.setup(_ctx(net))
    deltas = _step_deltas(m, net, 3)
    for t, d in enumerate(deltas):
        _assert_std(d, 5e-4 * 38.0348 / (13928.7 + t) ** 0.9)
    assert 5e-4 * 38.0348 / 13928.7 ** 0.9 == pytest.approx(3.544e-6, rel=1e-3)
    # the noise does not follow the lr: the method's lr is the per-epoch schedule, not the noise schedule
    assert m.lr() == pytest.approx(0.2 / 1.1 ** 0.55, rel=1e-12)
    # --fine_tune from epoch 300: t starts at 300 * 391
    net2 = _Wide()
    m2 = SGLD(noise_mode="schedule", noise_factor=5e-4, noise_offset=300 * 391, burn_in=10)
    m2.setup(_ctx(net2))
    _assert_std(_step_deltas(m2, net2, 1)[0], 5e-4 * 38.0348 / (13928.7 + 117300) ** 0.9)


def test_scheduled_noise_follows_the_step_counter():
    """With b = 1 the schedule changes fast: std_t = 1e-3 / (1 + t)^0.9 for t = 0, 1, 2, 3."""
    net = _Wide()
    m = SGLD(noise_mode="schedule", noise_factor=1.0, noise_a=1e-3, noise_b=1.0, noise_gamma=0.9, burn_in=10)
    m.setup(_ctx(net))
    for t, d in enumerate(_step_deltas(m, net, 4)):
        _assert_std(d, 1e-3 / (1.0 + t) ** 0.9)


def test_plain_official_sgld_noise_std_is_0_1_times_its_step_lr():
    net = _Wide()
    m = SGLD(noise_mode="linear", noise_factor=0.1, burn_in=10,
             lr_schedule=dict(a=10, b=1000, gamma=0.9, max_lr=None, unit="step", offset=0))
    m.setup(_ctx(net, lr=0.5))  # optimizer.lr 0.5 is replaced by the schedule
    deltas = _step_deltas(m, net, 6)
    for t in (0, 5):
        _assert_std(deltas[t], 0.1 * 10.0 / (1000.0 + t) ** 0.9)


def test_lr_schedule_replaces_the_scheduler_group():
    from functools import partial

    from flatbnn.optim.schedulers import cosine
    net = _Wide(10)
    m = SGLD(noise_mode="linear", lr_schedule=dict(a=10, b=1000, gamma=0.9, max_lr=None, unit="step", offset=0))
    m.setup(_ctx(net, lr=0.1, scheduler_factory=partial(cosine, final_factor=0.001)))
    assert m.lr() == pytest.approx(10.0 / 1000.0 ** 0.9, rel=1e-12)
    m_default = SGLD()
    m_default.setup(_ctx(_Wide(10), lr=0.1, momentum=0.0, scheduler_factory=partial(cosine, final_factor=0.001)))
    assert m_default.lr() == pytest.approx(0.1)  # no lr_schedule: the scheduler group's cosine


def test_unknown_noise_mode_is_refused():
    with pytest.raises(ValueError, match="noise_mode"):
        SGLD(noise_mode="poly")


# ---------------------------------------------------------------------------------------- configs
def test_default_sgld_configs_stay_textbook():
    for ov in (["method=sgld"], ["method=f_sgld"], ["experiment=flat_bnn_cifar10", "method=sgld"]):
        cfg = compose_cfg(ov)
        assert cfg.method.noise_mode == "langevin"
        assert cfg.method.get("lr_schedule") is None
        assert "noise_a" not in cfg.method
        m = instantiate(cfg.method)
        assert m.noise_mode == "langevin" and m.lr_schedule is None
        assert cfg.scheduler._target_ == "flatbnn.optim.schedulers.cosine"
        m.setup(_ctx(_Wide(10), lr=0.1, momentum=0.0))
        assert m.noise_std(0.1, step=123) == pytest.approx(math.sqrt(2 * 0.1 * 1.0 / 1000))


@pytest.mark.parametrize("exp", [[], ["experiment=flat_bnn_cifar100"]])
def test_official_presets_compose_to_the_official_formulas(exp):
    plain = compose_cfg(exp + ["method=sgld_official"])
    assert plain.method.noise_mode == "linear" and plain.method.noise_factor == 0.1
    assert dict(plain.method.lr_schedule) == dict(a=10.0, b=1000.0, gamma=0.9, max_lr=None, unit="step", offset=0)
    assert plain.method.sample_unit == "epoch" and plain.method.sample_every == 1 and plain.method.burn_in == 160
    f = compose_cfg(exp + ["method=f_sgld_official"])
    assert f.flatness._target_.endswith("SAM")
    assert f.method.noise_mode == "schedule"
    noise = (f.method.noise_factor, f.method.noise_a, f.method.noise_b, f.method.noise_gamma)
    assert noise == (5e-4, 38.0348, 13928.7, 0.9)
    assert dict(f.method.lr_schedule) == dict(a=0.2, b=0.1, gamma=0.55, max_lr=0.2, unit="epoch", offset=1)
    m = instantiate(f.method)
    m.setup(_ctx(_Wide(10), steps_per_epoch=3, lr=0.1))
    assert m.lr() == pytest.approx(0.2 / 1.1 ** 0.55, rel=1e-12)
    assert m.noise_std(m.lr(), step=7) == pytest.approx(5e-4 * 38.0348 / 13935.7 ** 0.9, rel=1e-12)


def test_scheduler_group_flat_bnn_sgld_instantiates_the_script_schedule():
    cfg = compose_cfg(["scheduler=flat_bnn_sgld"])
    opt = _sgd(lr=0.1)
    sched = instantiate(cfg.scheduler)(opt, total_steps=20, steps_per_epoch=2)
    assert _lrs(opt, sched, 4) == pytest.approx([0.2 / 1.1 ** 0.55] * 2 + [0.2 / 2.1 ** 0.55] * 2, rel=1e-12)
