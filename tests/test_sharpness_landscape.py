"""Sharpness (max-in-ball, Hessian eigenvalue / trace), loss landscapes, overlaid reliability
diagrams and scripts/analyze.py, against closed forms on quadratics and linear regression."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbnn.metrics.classification import ece
from flatbnn.metrics.landscape import loss_surface_1d, loss_surface_2d, random_direction
from flatbnn.metrics.reliability import reliability_overlay, reliability_overlay_figure
from flatbnn.metrics.sharpness import hessian_top_eigenvalue, hessian_trace, max_loss_in_ball, mean_loss

D = torch.float64


# --------------------------------------------------------------------------------------------
# fixtures: models with known losses
# --------------------------------------------------------------------------------------------
class Quadratic(nn.Module):
    """L(theta) = 0.5 theta^T H theta + b^T theta (theta a [2, 3] matrix, flattened row-major)."""

    def __init__(self, h, b, theta):
        super().__init__()
        self.theta = nn.Parameter(theta.clone().reshape(2, 3))
        self.register_buffer("h", h)
        self.register_buffer("b", b)

    def forward(self, x):
        t = self.theta.reshape(-1)
        return (0.5 * t @ self.h @ t + self.b @ t).expand(x.shape[0])


def mean_of(out, y):
    return out.mean()


def spd(eigs, seed=0):
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=torch.Generator().manual_seed(seed), dtype=D))
    return q @ torch.diag(torch.tensor(eigs, dtype=D)) @ q.T, q


EIGS = [5.0, 2.0, 1.0, 0.5, 0.25, 0.1]
DUMMY = [(torch.zeros(3, 1, dtype=D), torch.zeros(3, dtype=D))]


def quadratic(theta=None, b=None, seed=0):
    h, q = spd(EIGS, seed)
    g = torch.Generator().manual_seed(seed + 1)
    theta = torch.randn(6, generator=g, dtype=D) if theta is None else theta
    b = torch.randn(6, generator=g, dtype=D) if b is None else b
    return Quadratic(h, b, theta), h, q


def trust_region_max(h, g, rho):
    """max_{||e|| <= rho} g.e + 0.5 e^T H e (reference: secular equation by bisection, float64)."""
    lam, v = torch.linalg.eigh(h)
    c = v.T @ g
    lo, hi = float(lam.max()) + 1e-15, float(lam.max()) + float(g.norm()) / rho + 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(((c / (mid - lam)) ** 2).sum().sqrt()) > rho:
            lo = mid
        else:
            hi = mid
    e = v @ (c / (hi - lam))
    return float(g @ e + 0.5 * e @ h @ e)


def linear_regression(n_a=6, n_b=4, d=4, seed=0, diagonal=False):
    """Linear model + 0.5 * mean squared error over two batches of unequal size:
    Hessian over (weight, bias) = A^T A / N with A = [X, 1]."""
    g = torch.Generator().manual_seed(seed)
    n = n_a + n_b
    x = torch.randn(n, d, generator=g, dtype=D)
    if diagonal:  # columns orthogonal to each other and to 1: A^T A is diagonal
        q, _ = torch.linalg.qr(torch.cat([torch.ones(n, 1, dtype=D), x], 1))
        x = q[:, 1:] * torch.tensor([3.0, 2.0, 1.5, 0.7], dtype=D)
    y = torch.randn(n, generator=g, dtype=D)
    model = nn.Linear(d, 1).double()
    batches = [(x[:n_a], y[:n_a]), (x[n_a:], y[n_a:])]
    a = torch.cat([x, torch.ones(n, 1, dtype=D)], 1)
    return model, batches, a.T @ a / n

def mse(out, y):
    return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1))


def bn_data(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, 4, generator=g), torch.randint(0, 5, (n,), generator=g)


def snapshot(model):
    return ([p.detach().clone() for p in model.parameters()], [b.detach().clone() for b in model.buffers()],
            [m.training for m in model.modules()])


def assert_same(model, snap):
    ps, bs, flags = snap
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ps))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), bs))
    assert [m.training for m in model.modules()] == flags
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Hessian
# --------------------------------------------------------------------------------------------
def test_hessian_top_eigenvalue_and_trace_of_linear_regression_are_exact():
    model, batches, h = linear_regression()
    top = hessian_top_eigenvalue(model, mse, batches, iters=300, seed=0)
    assert top["eigenvalue"] == pytest.approx(float(torch.linalg.eigvalsh(h).max()), abs=1e-6)
    assert top["residual"] < 1e-5
    # a diagonal Hessian: every Rademacher probe gives the trace exactly
    model, batches, h = linear_regression(diagonal=True)
    assert float((h - torch.diag(torch.diagonal(h))).abs().max()) < 1e-12
    tr = hessian_trace(model, mse, batches, samples=3, seed=5)
    assert tr["trace"] == pytest.approx(float(torch.trace(h)), abs=1e-9)
    assert all(e == pytest.approx(float(torch.trace(h)), abs=1e-9) for e in tr["estimates"])


def test_hutchinson_probes_are_rademacher_and_estimates_are_v_h_v():
    model, batches, h = linear_regression(seed=3)
    tr = hessian_trace(model, mse, batches, samples=4, seed=11)
    g = torch.Generator().manual_seed(11)
    for est in tr["estimates"]:  # probes drawn per parameter in parameters() order: weight [1, 4], bias [1]
        v = torch.cat([torch.randint(0, 2, (1, 4), generator=g).reshape(-1), torch.randint(0, 2, (1,), generator=g)])
        v = v.to(D) * 2 - 1
        assert est == pytest.approx(float(v @ h @ v), abs=1e-10)
    assert tr["trace"] == pytest.approx(sum(tr["estimates"]) / 4, abs=1e-12)


# --------------------------------------------------------------------------------------------
# max-in-ball sharpness
# --------------------------------------------------------------------------------------------
def test_sam_step_and_top_eigenvector_closed_forms():
    rho = 0.3
    # gradient along the top eigenvector: the maximiser is rho * v1, one SAM step finds it
    _, q = spd(EIGS)
    c = 0.8
    model, h, q = quadratic(theta=torch.zeros(6, dtype=D), b=c * q[:, 0])
    r = max_loss_in_ball(model, mean_of, DUMMY, rho, steps=1)
    assert r["sharpness"] == pytest.approx(c * rho + 0.5 * rho ** 2 * EIGS[0], rel=1e-12)
    assert r["eps_norm"] == pytest.approx(rho, rel=1e-12)
    # a generic point: one step = rho ||g|| + 0.5 rho^2 g^T H g / ||g||^2
    model, h, _ = quadratic(seed=2)
    t = model.theta.detach().reshape(-1)
    g = h @ t + model.b
    r = max_loss_in_ball(model, mean_of, DUMMY, rho, steps=1)
    assert r["grad_norm"] == pytest.approx(float(g.norm()), rel=1e-12)
    assert r["sharpness"] == pytest.approx(float(rho * g.norm() + 0.5 * rho ** 2 * (g @ h @ g) / (g @ g)), rel=1e-12)


def test_projected_ascent_reaches_the_trust_region_maximum():
    rho = 0.5
    model, h, _ = quadratic(seed=4)
    t = model.theta.detach().reshape(-1)
    ref = trust_region_max(h, h @ t + model.b, rho)
    one = max_loss_in_ball(model, mean_of, DUMMY, rho, steps=1)["sharpness"]
    many = max_loss_in_ball(model, mean_of, DUMMY, rho, steps=80)
    assert one < ref - 1e-3  # SAM's single step is a strict lower bound here
    assert many["sharpness"] == pytest.approx(ref, abs=1e-7)
    assert many["sharpness"] <= ref + 1e-12 and many["eps_norm"] <= rho * (1 + 1e-12)
    # exactly at the minimum (g = 0): random start, converges to rho^2 lambda_max / 2
    model, h, _ = quadratic(theta=torch.zeros(6, dtype=D), b=torch.zeros(6, dtype=D))
    r = max_loss_in_ball(model, mean_of, DUMMY, rho, steps=80, seed=1)
    assert r["grad_norm"] == 0.0
    assert r["sharpness"] == pytest.approx(0.5 * rho ** 2 * EIGS[0], rel=1e-7)


def test_mean_loss_weights_examples_not_batches():
    model, batches, _ = linear_regression(n_a=7, n_b=2)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    with torch.no_grad():
        full = float(mse(model(x), y))
    assert mean_loss(model, mse, batches) == pytest.approx(full, rel=1e-13)
    assert max_loss_in_ball(model, mse, batches, 0.1)["loss"] == pytest.approx(full, rel=1e-13)


def test_everything_restores_weights_buffers_modes_bit_for_bit():
    torch.manual_seed(0)
    model = BNNet()
    x, y = bn_data()
    with torch.no_grad():  # non-trivial running statistics
        model.train()
        model(x)
    model.fc.eval()  # mixed flags must come back as they were
    snap = snapshot(model)
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]
    for mode in ("eval", "train"):
        max_loss_in_ball(model, F.cross_entropy, batches, 0.05, steps=3, mode=mode)
        hessian_top_eigenvalue(model, F.cross_entropy, batches, iters=2, mode=mode)
        hessian_trace(model, F.cross_entropy, batches, samples=2, mode=mode)
        loss_surface_1d(model, F.cross_entropy, batches, [-0.5, 0.0, 0.5], mode=mode)
        loss_surface_2d(model, F.cross_entropy, batches, [-0.5, 0.5], mode=mode)
        assert_same(model, snap)


def test_eval_mode_uses_running_statistics():
    torch.manual_seed(0)
    model = BNNet()
    x, y = bn_data()
    with torch.no_grad():
        model.train()
        model(x * 2 + 1)  # running statistics that differ from the batch's
        model.eval()
        expected = float(F.cross_entropy(model(x), y))
    model.train()
    assert mean_loss(model, F.cross_entropy, (x, y)) == expected
    assert max_loss_in_ball(model, F.cross_entropy, (x, y), 0.01)["loss"] == expected
    torch.manual_seed(1)
    assert mean_loss(model, F.cross_entropy, (x, y), mode="train") != expected
    assert model.training


# --------------------------------------------------------------------------------------------
# landscapes
# --------------------------------------------------------------------------------------------
def test_filter_normalisation_matches_weight_filter_norms_and_zeroes_bias_bn():
    torch.manual_seed(0)
    model = BNNet()
    with torch.no_grad():
        model.conv.weight[1].mul_(7.0)  # filters of different norms
    d = random_direction(model, seed=3)
    for (name, p), t in zip(model.named_parameters(), d):
        if p.dim() <= 1:
            assert torch.count_nonzero(t) == 0, name
        else:
            wn = p.detach().reshape(p.shape[0], -1).norm(dim=1)
            dn = t.reshape(t.shape[0], -1).norm(dim=1)
            torch.testing.assert_close(dn, wn, rtol=1e-6, atol=0)
    d2 = random_direction(model, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(d, d2))  # reproducible


def test_curves_along_directions_equal_the_quadratic_closed_form():
    model, h, _ = quadratic(seed=5)
    t = model.theta.detach().reshape(-1).clone()
    g = h @ t + model.b
    l0 = float(0.5 * t @ h @ t + model.b @ t)
    alphas = [-1.0, -0.25, 0.0, 0.5, 1.0]
    (d,) = random_direction(model, seed=7)
    assert torch.count_nonzero(d) == 6  # theta is a [2, 3] matrix: filter-normalised, not zeroed
    r = loss_surface_1d(model, mean_of, DUMMY, alphas, seed=7)
    dv = d.reshape(-1)
    for a, loss in zip(alphas, r["loss"]):
        assert loss == pytest.approx(l0 + a * float(g @ dv) + 0.5 * a * a * float(dv @ h @ dv), rel=1e-12)
    assert r["accuracy"] is None  # not a classifier
    gen = torch.Generator().manual_seed(7)
    d1 = random_direction(model, generator=gen)[0].reshape(-1)
    d2 = random_direction(model, generator=gen)[0].reshape(-1)
    assert torch.equal(d1, dv)
    s = loss_surface_2d(model, mean_of, DUMMY, [-1.0, 0.0, 0.5], [0.0, 2.0], seed=7)
    for i, a in enumerate(s["alphas"]):
        for j, b in enumerate(s["betas"]):
            e = a * d1 + b * d2
            assert s["loss"][i][j] == pytest.approx(l0 + float(g @ e) + 0.5 * float(e @ h @ e), rel=1e-12)


def test_alpha_zero_is_the_models_loss_and_accuracy_exactly():
    torch.manual_seed(0)
    model = BNNet()
    x, y = bn_data(n=16)
    with torch.no_grad():
        model.train()
        model(x)
        model.eval()
        logits = model(x)
    loss, acc = float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).double().mean())
    r = loss_surface_1d(model, F.cross_entropy, (x, y), torch.linspace(-1, 1, 5), seed=2)
    assert r["loss"][2] == loss and r["accuracy"][2] == acc
    assert r["loss"][0] != loss
    s = loss_surface_2d(model, F.cross_entropy, (x, y), [-1.0, 0.0], [0.0, 1.0], seed=2)
    assert s["loss"][1][0] == loss and s["accuracy"][1][0] == acc


def test_landscape_plots_write_pngs(tmp_path):
    from flatbnn.metrics.landscape import plot_curves_1d, plot_surfaces_2d
    model, _, _ = quadratic(seed=1)
    c = {f"m{i}": loss_surface_1d(model, mean_of, DUMMY, [-1, 0, 1], seed=i) for i in range(2)}
    s = {"m": loss_surface_2d(model, mean_of, DUMMY, [-1, 0, 1], seed=0)}
    for path in (plot_curves_1d(c, tmp_path / "a.png", styles={"m0": {"color": "k"}}),
                 plot_surfaces_2d(s, tmp_path / "b.png", levels=5)):
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# overlaid reliability diagrams
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_bins,binning,edges", [(20, "width", "right"), (10, "mass", "strict")])
def test_overlay_legend_ece_equals_the_metric(tmp_path, n_bins, binning, edges):
    g = torch.Generator().manual_seed(0)
    runs = {}
    for i, temp in enumerate([0.5, 2.0]):
        logits = torch.randn(300, 5, generator=g) * 3
        targets = torch.randint(0, 5, (300,), generator=g)
        targets[:150] = logits[:150].argmax(1)
        runs[f"run{i}"] = (torch.softmax(logits / temp, 1), targets)
    fig, stats = reliability_overlay_figure(runs, n_bins=n_bins, binning=binning, edges=edges)
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    for label, (p, t) in runs.items():
        expected = ece(p, t, n_bins=n_bins, binning=binning, edges=edges)
        assert stats[label]["ece"] == expected
        (line,) = [s for s in texts if s.startswith(f"{label}:")]
        assert float(re.search(r"ECE = ([0-9.]+)", line).group(1)) == float(f"{expected:.4f}")
        assert len(stats[label]["count"]) == n_bins
    assert stats["run0"]["ece"] != stats["run1"]["ece"]
    title = fig.axes[0].get_legend().get_title().get_text()
    assert title == f"{n_bins} {binning} bins, edges={edges}"
    out = reliability_overlay(runs, tmp_path / "rel.png", n_bins=n_bins, binning=binning, edges=edges)
    assert out == stats and (tmp_path / "rel.png").stat().st_size > 0


# --------------------------------------------------------------------------------------------
# scripts/analyze.py on finished runs
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    """One trained F-SWAG run (digits MLP, 1 epoch, collection every step) and a copy whose config
    asks for other posterior samples (method.eval_seed=2): two runs, one training."""
    import shutil

    from omegaconf import OmegaConf

    from helpers import compose_cfg, run_cfg
    over = ["dataset=digits", "model=mlp", "model.hidden=[16]", "method=f_swag", "method.swa_start=0",
            "method.collect_unit=step", "method.num_samples=3", "trainer.epochs=1", "trainer.eval_every=0",
            "trainer.device=cpu", "metrics.ece_bins=20"]
    a = tmp_path_factory.mktemp("fswag")
    run_cfg(over, a)
    (a / ".hydra").mkdir()
    OmegaConf.save(compose_cfg(over), a / ".hydra" / "config.yaml")
    b = tmp_path_factory.mktemp("fswag_seed2") / "run"
    shutil.copytree(a, b)
    OmegaConf.save(compose_cfg(over + ["method.eval_seed=2"]), b / ".hydra" / "config.yaml")
    return a, b


def _analyze():
    from flatbnn.tools import analyze
    return analyze


def test_analyze_cli_sharpness_landscape_reliability(finished_runs, tmp_path):
    analyze = _analyze()
    runs = [str(r) for r in finished_runs]
    common = ["--device", "cpu", "--examples", "200", "--batch-size", "100"]
    out = analyze.main(["sharpness", *runs, "--samples", "2", "--rho", "0.05", *common,
                        "--eigen-iters", "3", "--trace-samples", "2", "--out", str(tmp_path / "s.png")])
    assert out == 0 and (tmp_path / "s.png").stat().st_size > 0
    s = json.loads((tmp_path / "s.json").read_text())
    labels = list(s["runs"])
    assert labels == [f"swag+sam ({finished_runs[0].name})", f"swag+sam ({finished_runs[1].name})"]
    for r in s["runs"].values():
        assert r["num_samples"] == 2 and r["examples"] == 200
        a, b = r["samples"]
        assert a["loss"] != b["loss"]  # two different SWAG samples
        assert all(math.isfinite(x[k]) for x in (a, b) for k in ("sharpness", "hessian_top_eigenvalue",
                                                                   "hessian_trace"))
        assert r["summary"]["sharpness"]["mean"] == pytest.approx((a["sharpness"] + b["sharpness"]) / 2)
    # the copy's eval_seed gives other samples of the same posterior
    assert s["runs"][labels[0]]["samples"][0]["loss"] != s["runs"][labels[1]]["samples"][0]["loss"]

    assert analyze.main(["landscape", *runs, "--samples", "2", "--points", "5", *common, "--labels", "A", "B",
                         "--out", str(tmp_path / "l.png")]) == 0
    curves = json.loads((tmp_path / "l.json").read_text())["curves"]
    assert list(curves) == ["A #1", "A #2", "B #1", "B #2"]
    # alpha = 0 of sample i is the loss `sharpness` measured there (same subset, same samples)
    for lab, full in zip("AB", labels):
        for i in range(2):
            c = curves[f"{lab} #{i + 1}"]
            assert c["alphas"][2] == 0.0
            assert c["loss"][2] == pytest.approx(s["runs"][full]["samples"][i]["loss"], rel=1e-6)
    assert (tmp_path / "l.png").stat().st_size > 0

    assert analyze.main(["reliability", *runs, "--device", "cpu", "--bins", "20", "--labels", "A", "B",
                         "--out", str(tmp_path / "r.png")]) == 0
    rel = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert all(r["predictive"] == "re-predicted" and r["results_json_conventions"]["ece_bins"] == 20
               for r in rel.values())
    assert rel["A"]["ece"] == rel["A"]["results_json_ece"]  # reload + re-predict = the run's own evaluation
    assert rel["B"]["ece"] != rel["B"]["results_json_ece"]  # (the copy samples with eval_seed=2)
