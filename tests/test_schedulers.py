"""The per-step learning rates of ``flatbnn.optim.schedulers`` are pinned bit for bit.

Committed runs reproduce only if every lr is the same float: the sequences below (two param groups,
1,500 steps) were recorded from the closed forms; a reordered formula or a switch to torch's
chainable schedulers (which differ in the last bits, see the module docstring) changes the digest.
"""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
import torch

from flatbnn.optim import schedulers as S

TOTAL, PER_EPOCH = 1500, 50
CASES = {  # name: (factory, arguments, sha256[:16] of the float64 lrs of both groups, step by step)
    "cosine": (S.cosine, dict(warmup_epochs=2, final_factor=1e-3), "b3ca4d2590e05053"),
    "cosine_to_zero": (S.cosine, {}, "d0bfaa0eb78a5824"),
    "multistep": (S.multistep, dict(milestones=(0.3, 0.6, 0.8), gamma=0.2), "a2f5013d7100b80d"),
    "swa": (S.swa, dict(swa_start=0.75, swa_lr_factor=0.05), "0746ad29e434b29a"),
    "cyclical": (S.cyclical, dict(cycles=4), "60bc7fd191898e26"),
    "inverse_power": (S.inverse_power, {}, "3477d9f28f10e313"),
}


def _optimizer():
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    return torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.03}], lr=0.1)


def _lrs(opt, sched, steps):
    out = []
    for _ in range(steps):
        out.extend(g["lr"] for g in opt.param_groups)
        opt.step()
        sched.step()
    return out


def _digest(lrs):
    return hashlib.sha256(struct.pack(f"<{len(lrs)}d", *lrs)).hexdigest()[:16]


@pytest.mark.parametrize("name", list(CASES))
def test_per_step_lrs_are_pinned(name):
    factory, kw, digest = CASES[name]
    opt = _optimizer()
    lrs = _lrs(opt, factory(opt, total_steps=TOTAL, steps_per_epoch=PER_EPOCH, **kw), TOTAL)
    assert _digest(lrs) == digest


def test_known_values():
    opt = _optimizer()
    lrs = _lrs(opt, S.cosine(opt, total_steps=TOTAL, steps_per_epoch=PER_EPOCH, warmup_epochs=2), TOTAL)[0::2]
    assert lrs[0] == 0.1 / 100 and lrs[99] == 0.1  # linear warm-up over 100 steps, then the peak
    assert lrs[100 + 700] == pytest.approx(0.05, abs=1e-15)  # half way through the cosine
    assert lrs[-1] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 1399 / 1400)), abs=1e-18)
    opt = _optimizer()
    lrs = _lrs(opt, S.multistep(opt, total_steps=TOTAL, steps_per_epoch=PER_EPOCH), TOTAL)[0::2]
    assert (lrs[749], lrs[750], lrs[1124], lrs[1125]) == (0.1, 0.1 * 0.1, 0.1 * 0.1, 0.1 * 0.1**2)


@pytest.mark.parametrize("name", list(CASES))
def test_resume_from_state_dicts_is_bit_identical(name):
    """A run restored at step k (optimizer + scheduler state dicts into fresh objects) continues with
    the same lrs as one that never stopped."""
    factory, kw, _ = CASES[name]
    build = lambda opt: factory(opt, total_steps=TOTAL, steps_per_epoch=PER_EPOCH, **kw)  # noqa: E731
    opt = _optimizer()
    sched = build(opt)
    _lrs(opt, sched, 600)
    state = (opt.state_dict(), sched.state_dict())
    straight = _lrs(opt, sched, TOTAL - 600)
    opt2 = _optimizer()
    sched2 = build(opt2)
    opt2.load_state_dict(state[0])
    sched2.load_state_dict(state[1])
    assert _lrs(opt2, sched2, TOTAL - 600) == straight
