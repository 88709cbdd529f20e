"""Adversarial parameter perturbation (FSAM Fig. 4): theta + alpha g/||g||, flatbnn.metrics.perturbation and
``scripts/analyze.py perturb`` on a finished run."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.metrics.perturbation import adversarial_perturbation_curve, gradient_direction


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _data(n=30, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_direction_is_the_normalised_full_batch_gradient_and_step_norm_is_alpha():
    net = _net()
    x, y = _data()
    net.eval()
    # unequal batches (20 + 10): the gradient must be that of the mean over all 30 examples
    direction, norm, loss = gradient_direction(net, F.cross_entropy, [(x[:20], y[:20]), (x[20:], y[20:])])
    full = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    ref_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in full))
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert loss == pytest.approx(float(F.cross_entropy(net(x), y).detach()), rel=1e-6)
    for d, g in zip(direction, full):
        assert torch.allclose(d, g / ref_norm, atol=1e-6)

    before = [p.detach().clone() for p in net.parameters()]
    buffers = [b.detach().clone() for b in net.buffers()]
    net.train()
    alphas = [0.0, 0.1, 1.0, 5.0]
    c = adversarial_perturbation_curve(net, F.cross_entropy, [(x[:20], y[:20]), (x[20:], y[20:])], (x, y), alphas)
    assert net.training is True  # the mode it was called in is restored (it evaluated in eval mode)
    assert c["delta_norm"][0] == 0.0
    for a, dn in zip(alphas, c["delta_norm"]):
        assert dn == pytest.approx(a, rel=1e-5, abs=1e-7)  # ||theta_alpha - theta|| = alpha
    # alpha = 0 is the trained model in eval mode, exactly
    net.eval()
    with torch.no_grad():
        out = net(x)
    assert c["loss"][0] == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-6)
    assert c["accuracy"][0] == float((out.argmax(1) == y).double().mean())
    # moving along the gradient raises the loss (first order: alpha ||g|| > 0 at small alpha)
    assert c["loss"][1] > c["loss"][0] and c["loss"][3] > c["loss"][0]
    # weights and BatchNorm buffers are restored bit for bit
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(buffers, net.buffers()))


def test_theta_alpha_is_theta_plus_alpha_times_unit_gradient():
    """A linear model with MSE: the loss at theta + alpha d has the closed form ||X(w + alpha d) - y||^2 / n."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 1, bias=False)
    x = torch.randn(12, 3)
    y = torch.randn(12, 1)
    mse = lambda out, t: (out - t).pow(2).mean()  # noqa: E731
    w = lin.weight.detach().clone()
    g = (2.0 / 12) * ((x @ w.T - y).T @ x)  # dL/dw
    d = g / g.norm()
    alphas = [0.0, 0.5, 2.0]
    c = adversarial_perturbation_curve(lin, mse, (x, y), (x, y), alphas)
    for a, got in zip(alphas, c["loss"]):
        want = float((x @ (w + a * d).T - y).pow(2).mean())
        assert got == pytest.approx(want, rel=1e-5)
    assert c["accuracy"] == [None, None, None]  # regression outputs: no accuracy


def test_zero_gradient_is_refused():
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.zero_()
    x, y = torch.randn(4, 2), torch.zeros(4, 1)
    with pytest.raises(ValueError, match="zero"):
        adversarial_perturbation_curve(lin, lambda o, t: (o - t).pow(2).mean(), (x, y), (x, y), [1.0])


# --------------------------------------------------------------------------------------------
# scripts/analyze.py perturb on a finished MAP run
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def map_run(tmp_path_factory):
    from omegaconf import OmegaConf

    from helpers import compose_cfg, run_cfg
    over = ["dataset=digits", "model=mlp", "model.hidden=[16]", "method=map", "flatness=fsam", "trainer.epochs=1",
            "trainer.eval_every=0", "trainer.device=cpu"]
    d = tmp_path_factory.mktemp("map_fsam")
    run_cfg(over, d)
    (d / ".hydra").mkdir()
    OmegaConf.save(compose_cfg(over), d / ".hydra" / "config.yaml")
    return d


def test_analyze_perturb_alpha_zero_is_the_runs_accuracy(map_run, tmp_path):
    from flatbnn.tools import analyze

    out = tmp_path / "fig4.png"
    assert analyze.main(["perturb", str(map_run), str(map_run), "--labels", "FSAM", "FSAM", "--device", "cpu",
                         "--alphas", "0,0.5,5", "--out", str(out)]) == 0
    assert out.stat().st_size > 5000
    res = json.loads(out.with_suffix(".json").read_text())
    curve = res["curves"]["FSAM"]
    assert curve["n"] == 2 and curve["alphas"] == [0.0, 0.5, 5.0]
    run = curve["runs"][0]
    acc_json = json.loads((map_run / "results.json").read_text())["metrics"]["accuracy"]
    assert run["accuracy"][0] == pytest.approx(acc_json, abs=1e-12)  # alpha = 0: the run's own test accuracy
    # each run's record names its seed: the claims compare the per-seed degradation (compare.cells_from.runs)
    seed = json.loads((map_run / "results.json").read_text())["meta"]["seed"]
    assert seed is not None and [r["seed"] for r in curve["runs"]] == [seed, seed]
    assert run["test_examples"] == 360  # the whole digits test set
    assert run["delta_norm"] == pytest.approx([0.0, 0.5, 5.0], rel=1e-5, abs=1e-7)
    assert run["loss"][2] > run["loss"][0]
    assert curve["accuracy_std"] == [0.0, 0.0, 0.0]  # the same run twice: equal seeds of one curve


def test_analyze_perturb_bad_alphas_exit_2(map_run, capsys):
    from flatbnn.tools import analyze

    with pytest.raises(SystemExit) as e:
        analyze.main(["perturb", str(map_run), "--alphas", "0,x", "--out", "a.png"])
    assert e.value.code == 2 and "--alphas" in capsys.readouterr().err
