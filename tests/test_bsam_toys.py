"""bSAM paper toys (flatbnn/toys/logreg2d.py, twomoons.py; scripts/reproduce_bsam_*.py): the exact
posterior's grid integration on cases with known answers, the Gaussian tools, and the key numbers of
the stored reproductions (results/reproduce/bsam_logreg/paper_summary.json, likewise bsam_twomoons)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flatbnn.toys import logreg2d as L

REPO = Path(__file__).resolve().parents[1]


def _gauss_logpdf(m, S):
    P = np.linalg.inv(S)
    return lambda W: -0.5 * np.einsum("ni,ij,nj->n", W - m, P, W - m)


def test_grid_integration_recovers_a_gaussians_moments():
    m = np.array([0.5, -0.3])
    S = np.array([[0.4, 0.15], [0.15, 0.2]])
    post = L.grid_moments(_gauss_logpdf(m, S), lim=4.0, n=401)
    np.testing.assert_allclose(post.mean, m, atol=1e-8)
    np.testing.assert_allclose(post.cov, S, atol=1e-6)
    assert post.edge_mass < 1e-7
    np.testing.assert_allclose(post.mode, m, atol=4.0 / 400 * 1.01)


def test_grid_predictive_equals_gaussian_quadrature_and_monte_carlo():
    m = np.array([1.0, -0.5])
    S = np.array([[0.5, 0.2], [0.2, 0.3]])
    post = L.grid_moments(_gauss_logpdf(m, S), lim=5.0, n=401)
    Xq = np.array([[1.0, 2.0], [-3.0, 0.5], [0.2, 0.1], [4.0, 4.0]])
    p_grid = L.predictive_grid(Xq, post)
    p_gh = L.predictive_gaussian(Xq, m, S)
    np.testing.assert_allclose(p_grid, p_gh, atol=3e-5)  # midpoint rule, spacing 0.025
    rng = np.random.default_rng(0)
    W = rng.multivariate_normal(m, S, 400_000)
    np.testing.assert_allclose(L.sigmoid(Xq @ W.T).mean(1), p_gh, atol=3e-3)
    np.testing.assert_allclose(L.predictive_gaussian(Xq, m, None), L.sigmoid(Xq @ m))


def test_gaussian_kl_and_w2_known_values():
    m0, m1 = np.zeros(2), np.array([3.0, 4.0])
    S = np.diag([2.0, 0.5])
    assert L.gaussian_kl(m0, S, m0, S) == pytest.approx(0.0, abs=1e-12)
    assert L.gaussian_w2(m0, S, m1, S) == pytest.approx(5.0)
    assert L.gaussian_w2(m1, np.zeros((2, 2)), m1, S) == pytest.approx(math.sqrt(2.5))
    # 1-D per coordinate: KL(N(0, a) || N(0, b)) = (a/b - 1 - log(a/b)) / 2
    a, b = np.diag([1.0, 1.0]), np.diag([2.0, 2.0])
    assert L.gaussian_kl(m0, a, m0, b) == pytest.approx(2 * 0.5 * (0.5 - 1 - math.log(0.5)))
    # W2 between zero-mean diagonal Gaussians: ||sqrt(a) - sqrt(b)||
    assert L.gaussian_w2(m0, a, m0, b) == pytest.approx(math.sqrt(2) * (math.sqrt(2) - 1))


def test_logreg_data_exact_posterior_and_laplace_at_sam():
    X, y = L.make_data()
    assert X.shape == (60, 2) and y.sum() == 30
    assert L.separation_margin(X, y) > 1.0  # separable by a line through the origin, as in the paper
    ex = L.exact_posterior(X, y, prior_var=1.0, n=301)
    np.testing.assert_allclose(ex.mean, [1.630, 1.051], atol=5e-3)
    np.testing.assert_allclose(np.sqrt(np.diag(ex.cov)), [0.485, 0.411], atol=5e-3)
    assert ex.edge_mass < 1e-12
    # Laplace at the SAM solution (rho 0.5) is broader than the exact posterior: underconfident
    w = L.fit_sam(X, y, 1.0, rho=0.5, steps=1500)
    np.testing.assert_allclose(w, [1.6565, 1.0633], atol=2e-3)
    assert (np.sqrt(np.diag(L.laplace(w, X, 1.0))) > np.sqrt(np.diag(ex.cov))).all()
    # the MAP (rho 0) is the grid mode up to the grid spacing
    np.testing.assert_allclose(L.fit_sam(X, y, 1.0, rho=0.0, steps=1500), ex.mode, atol=0.08)


def test_bsam_toy_fit_runs_the_flatbnn_method():
    X, y = L.make_data()
    w, cov, info = L.fit_bsam(X, y, 1.0, m=10, steps=60)
    assert np.isfinite(w).all() and (np.diag(cov) > 0).all() and info["m"] == 10
    np.testing.assert_allclose(np.diag(cov), 1.0 / (60 * np.array(info["s"])))


def _summary(name):
    p = REPO / "results" / "reproduce" / name / "paper_summary.json"
    assert p.is_file(), f"{p}: the committed reproduction is gone (make reproduce-{name.replace('_', '-')})"
    return json.loads(p.read_text())


def test_stored_logreg_reproduction_key_numbers():
    s = _summary("bsam_logreg")
    main = s["results"][0]
    assert main["prior_var"] == 1.0
    np.testing.assert_allclose(main["exact"]["mean"], [1.630, 1.051], atol=5e-3)
    m = main["methods"]
    c = s["claims_main_prior"]
    # what holds on this problem (prior N(0, I), SAM rho 0.5):
    assert c["sam_overconfident"] and c["laplace_at_sam_underconfident"] and c["laplace_at_sam_broader_than_exact"]
    assert c["bsam_closest_predictive"]  # bSAM's predictive is the closest to exact Bayes ...
    assert m["bsam"]["predictive_mae"] < 0.5 * min(v["predictive_mae"] for k, v in m.items() if k != "bsam")
    # ... but in KL / W2 a Laplace approximation at a SAM solution is (slightly) closer than bSAM
    assert not c["bsam_closest_diagonal_gaussian_by_kl"]
    assert m["bsam"]["kl_q_to_exact_mm"] < m["laplace_map_diag"]["kl_q_to_exact_mm"]


def test_stored_twomoons_reproduction_key_numbers():
    s = _summary("bsam_twomoons")
    assert s["claims"]["bsam_more_uncertain_far_from_data_every_seed"]
    assert s["claims"]["bsam_fits_training_data_(acc>=0.95)"]
    mean = s["mean_over_seeds"]
    assert mean["bsam"]["entropy_far"] > 2 * mean["sam"]["entropy_far"]


def test_twomoons_bsam_predictive_is_more_uncertain_than_its_mean():
    from flatbnn.toys.twomoons import binary_entropy, make_data, predictive, train_bsam
    torch.set_num_threads(1)
    X, y = make_data()
    method = train_bsam(X, y, epochs=20, seed=0)
    grid = torch.tensor([[x, -1.5] for x in np.linspace(-2, 3, 26)], dtype=torch.float32)
    h_samples = binary_entropy(predictive(method, grid, num_samples=16)).mean()
    h_mean = binary_entropy(predictive(method, grid)).mean()
    assert np.isfinite(h_samples) and h_samples > h_mean


def test_a_toys_own_checks_reach_its_page(tmp_path):
    """A toy row's page showed the figure but not the script's reading (bSAM's logistic regression: closest predictive
    to the exact posterior, yet not the closest Gaussian by KL or W2 -- only in summary.json). The script writes
    checks.md (flatbnn/toys/report.py) and the row includes it: the page carries each check's value."""
    from flatbnn.reproduce import compare, compare_markdown, spec
    from flatbnn.toys.report import fmt, write_checks

    assert [fmt(v) for v in (True, False, 0.0067990854, 3, "bsam", [0.0068, 0.02915], {"a": 1})] == \
        ["yes", "no", "0.006799", "3", "bsam", "0.0068, 0.02915", '{"a": 1}']
    for name in ("bsam_logreg", "bsam_twomoons", "vsam_fig1"):
        row = spec.load_row(name)
        out = tmp_path / name / "paper"
        out.mkdir(parents=True)
        (out / "launch.json").write_text(json.dumps({"row": name, "scale": "paper", "command": "x", "returncode": 0,
                                                     "seconds": 1.0, "git": {"commit": "0" * 40, "dirty": False}}))
        write_checks(out / "checks.md", "Our checks", "budget line", {"bsam_closest_predictive": True, "largest |z|": 1.2},
                     tables=[("caption", ["method", "W2"], [["bsam", 0.23863753]])])
        md = compare_markdown.to_markdown(compare.build(row, "paper", out))
        assert "## The analysis (`checks.md`)\n\n" in md and "(`checks.md`)\n\n\n" not in md, name  # one blank line
        assert "| bsam_closest_predictive | yes |" in md and "| bsam | 0.2386 |" in md, name
        assert "| largest \\|z\\| | 1.2 |" in md, name  # a bar inside a cell is escaped: one row, two cells


def test_a_toys_numbers_are_committed_beside_its_page(tmp_path):
    """A toy's summary.json (what its tests read) is copied beside its page as paper_summary.json, with its figure:
    the one committed copy (results/<toy>/ from `make reproduce-<toy>` once duplicated the page's folder)."""
    from flatbnn.reproduce import compare_markdown, spec

    row = spec.load_row("bsam_twomoons")
    assert compare_markdown.kept_files(row) == ["summary.json"]
    out = tmp_path / "runs" / "bsam_twomoons" / "paper"
    out.mkdir(parents=True)
    (out / "launch.json").write_text(json.dumps({"row": row.row, "scale": "paper", "command": "x", "returncode": 0,
                                                 "seconds": 1.0, "git": {"commit": "0" * 40, "dirty": False}}))
    (out / "summary.json").write_text('{"claims": {"x": true}}')
    (out / "fig6_twomoons.png").write_bytes(b"png")
    (out / "scratch.json").write_text("{}")
    dest = tmp_path / "results" / "bsam_twomoons"
    compare_markdown.write_comparison(row, "paper", out=out, dest=dest)
    assert sorted(p.name for p in dest.iterdir() if p.is_file()) == [
        "paper.json", "paper.md", "paper_fig6_twomoons.png", "paper_summary.json"]
    assert json.loads((dest / "paper_summary.json").read_text()) == {"claims": {"x": True}}
