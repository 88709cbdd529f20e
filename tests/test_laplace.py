"""method=laplace (flatbnn/methods/laplace.py) through laplace-torch (the [laplace] extra, installed by CI): the fitted
prior precision and the predictive equal laplace-torch called directly on the same trained network and data; it
trains exactly as MAP; evaluate.py fits one on a finished MAP run (the same numbers as a Laplace run); a missing
laplace-torch is one line and exit 2 naming the extra."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flatbnn.engine.backprop import Backprop
from flatbnn.flatness import SAM
from flatbnn.methods import RunContext

from helpers import REPO, results, train_cli

laplace = pytest.importorskip("laplace", reason="method=laplace needs the [laplace] extra (CI installs it)")

CPU = torch.device("cpu")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()  # 3 classes, learnable
    return TensorDataset(x, y)


def _trained(method_kw, flatness=None, val=None):
    """A small MLP trained 30 SAM (or plain) steps by the Laplace method itself (MAP training); ``val``: the
    held-out loader of the run (dataset.val_split)."""
    from flatbnn.methods.laplace import Laplace

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    train = DataLoader(_data(96, 0), batch_size=32, shuffle=False)
    method = Laplace(**method_kw)
    ctx = RunContext(model=module, module=module, device=CPU, n_train=96, steps_per_epoch=3, epochs=10,
                     optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduler_factory=None,
                     train_loader=train, val_loader=val)
    method.setup(ctx)
    flat = flatness or SAM(rho=0.05)
    flat.setup(ctx, method)
    bp = Backprop(module, CPU)
    method.train()
    for _ in range(10):
        for batch in train:
            method.train_step(batch, flat, bp)
    return method, module, train


CASES = {
    "last_layer-kron-probit": dict(subset_of_weights="last_layer", hessian_structure="kron"),
    "last_layer-diag-glm_mc": dict(subset_of_weights="last_layer", hessian_structure="diag", link_approx="mc",
                                   num_samples=5, prior_structure="diag"),
    "all-diag-nn": dict(subset_of_weights="all", hessian_structure="diag", pred_type="nn", link_approx="mc",
                        num_samples=4, eval_seed=7),
    "all-kron-probit": dict(subset_of_weights="all", hessian_structure="kron", marglik_steps=50, marglik_lr=0.05,
                            prior_structure="layerwise"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fitted_prior_and_predictive_equal_laplace_torch_called_directly(case):
    kw = CASES[case]
    method, module, train = _trained(kw)
    reference_net = copy.deepcopy(module)  # before our fit/predict: laplace-torch's own run sees the same weights
    test = DataLoader(_data(40, 1), batch_size=20, shuffle=False)
    ours = list(method.predict({"test": test}))
    ours = torch.stack([d["test"] for d in ours]).exp()  # [k, N, C]

    la = laplace.Laplace(reference_net, "classification", subset_of_weights=kw["subset_of_weights"],
                         hessian_structure=kw["hessian_structure"], prior_precision=1.0)
    la.fit(train)
    pred_type, link = kw.get("pred_type", "glm"), kw.get("link_approx", "probit")
    la.optimize_prior_precision(pred_type=pred_type, method="marglik", n_steps=kw.get("marglik_steps", 100),
                                lr=kw.get("marglik_lr", 0.1), init_prior_prec=1.0,
                                prior_structure=kw.get("prior_structure", "scalar"), link_approx=link)
    torch.testing.assert_close(method.la.prior_precision, la.prior_precision, rtol=1e-6, atol=0.0)
    assert not torch.allclose(la.prior_precision, torch.ones(())), "marglik left the prior where it started"
    x = torch.cat([b[0] for b in test])
    if link in ("probit", "bridge", "bridge_norm"):
        theirs = la(x, pred_type="glm", link_approx=link).unsqueeze(0)
    elif pred_type == "nn":  # k weight samples, each over the whole test set (and every other set)
        g = torch.Generator().manual_seed(kw.get("eval_seed", 1))
        theirs = la.predictive_samples(x, pred_type="nn", n_samples=kw["num_samples"], generator=g)
    else:  # the GLM's function-space samples, drawn batch by batch from one generator
        g = torch.Generator().manual_seed(kw.get("eval_seed", 1))
        theirs = torch.cat([la.predictive_samples(xb, pred_type="glm", n_samples=kw["num_samples"],
                                                  generator=g) for xb, _ in test], dim=1)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)
    # the weights are the MAP weights again after sampling, and the record names the fit
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), reference_net.parameters()))
    meta = method.describe()
    assert meta["prior_precision"] == pytest.approx(la.prior_precision.flatten().tolist(), rel=1e-6)
    assert meta["n_params"] == la.n_params


def _nll_by_prior(la, loader, grid):
    """The probit predictive's mean NLL on ``loader`` at each prior precision of ``grid``, computed here."""
    x, y = (torch.cat(t) for t in zip(*loader))
    out = []
    for prior in grid:
        la.prior_precision = float(prior)
        p = la(x, pred_type="glm", link_approx="probit")
        out.append(float(-p[torch.arange(len(y)), y].log().mean()))
    return torch.tensor(out)


def test_gridsearch_picks_the_prior_of_the_lowest_validation_nll():
    """prior_fit=gridsearch: of 10^-2 .. 10^3 (26 values), the prior precision whose probit predictive has the
    lowest NLL on the held-out split -- computed here from the fitted Laplace, not taken from laplace-torch's own
    search -- and the run's predictive is the one at that prior. The split matters: the training set's curve has
    its minimum elsewhere (so a search on the training data, or marglik, would not pass), and so has the running
    mean laplace-torch's default metric scores (methods/laplace.py validation_nll)."""
    x, y = _data(60, 2).tensors
    y = torch.where(torch.arange(60) % 3 == 0, (y + 1) % 3, y)  # a third of the labels wrong: the held-out NLL
    val = DataLoader(TensorDataset(x, y), batch_size=20, shuffle=False)  # wants a wider posterior than MAP's
    kw = dict(prior_fit="gridsearch", grid_min=-2, grid_max=3, grid_size=26)
    method, module, train = _trained(kw, val=val)
    la = method.fit()
    chosen = float(la.prior_precision)
    grid = torch.logspace(-2, 3, 26)
    on_val, on_train = _nll_by_prior(la, val, grid), _nll_by_prior(la, train, grid)
    assert chosen == pytest.approx(float(grid[on_val.argmin()]), rel=1e-6)
    assert int(on_val.argmin()) != int(on_train.argmin()), (on_val, on_train)
    # laplace-torch 0.3's default running metric, never reset, scores each prior by the mean over the grid so far
    running = on_val.cumsum(0) / torch.arange(1, len(grid) + 1)
    assert int(running.argmin()) != int(on_val.argmin())  # so this test tells its choice from the right one
    assert on_val.max() - on_val.min() > 0.01  # the grid spans priors that matter for this predictive
    la.prior_precision = chosen
    test = DataLoader(_data(40, 1), batch_size=20, shuffle=False)
    ours = next(iter(method.predict({"test": test})))["test"].exp()
    torch.testing.assert_close(ours, la(torch.cat([b[0] for b in test]), pred_type="glm", link_approx="probit"),
                               rtol=1e-5, atol=1e-6)
    meta = method.describe()
    assert meta["prior_fit"] == "gridsearch" and (meta["grid_min"], meta["grid_max"], meta["grid_size"]) == (-2, 3, 26)
    assert meta["prior_precision"] == pytest.approx([chosen])
    # no held-out split: one line naming the key that makes one
    with pytest.raises(ValueError, match="dataset.val_split") as e:
        _trained(kw)
    assert "\n" not in str(e.value)


def test_a_sampled_gridsearch_picks_the_same_prior_whatever_the_global_random_state():
    """link_approx=mc: laplace-torch draws the grid search's samples from the global generator; ours seeds it with
    eval_seed (in a forked stream), so a rerun -- evaluate.py, a resumed run -- picks the same prior."""
    x, y = _data(60, 2).tensors
    y = torch.where(torch.arange(60) % 3 == 0, (y + 1) % 3, y)
    val = DataLoader(TensorDataset(x, y), batch_size=20, shuffle=False)
    kw = dict(prior_fit="gridsearch", grid_min=-2, grid_max=3, grid_size=26, link_approx="mc", num_samples=3)
    method, _, _ = _trained(kw, val=val)
    chosen = set()
    for seed in (123, 7, 99):
        torch.manual_seed(seed)
        chosen.add(float(method.fit().prior_precision))
    assert len(chosen) == 1, chosen


def test_laplace_trains_exactly_as_map_with_the_same_flatness():
    from flatbnn.methods.map import MAP

    method, module, train = _trained(CASES["last_layer-kron-probit"])
    torch.manual_seed(0)
    twin = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    m = MAP()
    ctx = RunContext(model=twin, module=twin, device=CPU, n_train=96, steps_per_epoch=3, epochs=10,
                     optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduler_factory=None)
    m.setup(ctx)
    flat = SAM(rho=0.05)
    flat.setup(ctx, m)
    bp = Backprop(twin, CPU)
    for _ in range(10):
        for batch in train:
            m.train_step(batch, flat, bp)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), twin.parameters()))


def test_bad_settings_are_one_line():
    from flatbnn.methods.laplace import Laplace

    for kw, match in (({"subset_of_weights": "subnetwork"}, "subset_of_weights"),
                      ({"pred_type": "nn", "link_approx": "probit"}, "link_approx=mc"),
                      ({"prior_init": 0.0}, "prior_init"),
                      ({"prior_structure": "layerwise"}, "subset_of_weights=all"),
                      ({"prior_fit": "gridsearch", "prior_structure": "diag"}, "prior_structure=scalar"),
                      ({"prior_fit": "gridsearch", "grid_min": 2, "grid_max": 1}, "grid_min < method.grid_max")):
        with pytest.raises(ValueError, match=match) as e:
            Laplace(**kw)
        assert "\n" not in str(e.value)
    for what in ("training", "validation"):  # a loader without a dataset (an iterable of batches): named, one line
        with pytest.raises(ValueError, match=f"the {what} loader has no dataset to read in order") as e:
            Laplace._whole(iter([]), what)
        assert "\n" not in str(e.value)


def test_missing_laplace_torch_is_one_line_and_exit_2_naming_the_extra(tmp_path):
    """A `laplace` module that fails to import (as where the extra is not installed) shadows the real one."""
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "laplace.py").write_text("raise ImportError('No module named laplace')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(REPO / "train.py"), "method=laplace", f"hydra.run.dir={tmp_path / 'run'}",
                        "trainer.progress=false"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == ["flatbnn: error: method=laplace needs laplace-torch (MIT): pip install 'flatbnn[laplace]' "
                     "(or pip install 'laplace-torch>=0.3,<0.4')"], p.stderr
    assert not (tmp_path / "run" / "results.json").exists()


def _eval_cli(args):
    return subprocess.run([sys.executable, str(REPO / "evaluate.py"), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)


@pytest.mark.slow
def test_evaluate_fits_a_laplace_on_a_finished_map_run_as_a_laplace_run_would(tmp_path):
    """`evaluate.py run=<MAP + SAM run> method=laplace`: no retraining, and the numbers of `train.py method=laplace`
    with the same training config (the same weights, the same fit)."""
    common = ["dataset=digits", "model=mlp", "model.hidden=[32]", "flatness=sam", "trainer.epochs=2",
              "trainer.eval_every=0", "trainer.reliability_diagram=false", "seed=0"]
    train_cli(common + ["method=map"], tmp_path / "map")
    train_cli(common + ["method=laplace", "method.hessian_structure=diag"], tmp_path / "laplace")
    p = _eval_cli([f"run={tmp_path / 'map'}", "method=laplace", "method.hessian_structure=diag", "eval.name=la"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "results.json: closed form, probit {" in p.stdout, p.stdout[-2000:]  # one predictive, not "1 sample"
    out, lap = results(tmp_path / "map" / "eval" / "la"), results(tmp_path / "laplace")
    assert out["meta"]["method"]["name"] == "laplace" and out["meta"]["flatness"]["name"] == "sam"
    assert out["meta"]["evaluated_from"]["overrides"] == ["method=laplace", "method.hessian_structure=diag"]
    for k in ("accuracy", "nll", "ece", "brier", "auroc_misclassification"):
        assert out["metrics"][k] == pytest.approx(lap["metrics"][k], rel=1e-6, abs=1e-9), k
    assert out["meta"]["method"]["prior_precision"] == pytest.approx(lap["meta"]["method"]["prior_precision"])
    assert results(tmp_path / "map")["meta"]["method"]["name"] == "map"  # the run's own results untouched
    # a run whose training is not MAP's cannot be switched: one line, exit 2
    train_cli(["dataset=digits", "model=mlp", "model.hidden=[32]", "method=swag", "method.swa_start=0",
               "method.num_samples=2", "trainer.epochs=1", "trainer.eval_every=0"], tmp_path / "swag")
    p = _eval_cli([f"run={tmp_path / 'swag'}", "method=laplace"])
    assert p.returncode == 2 and "trains like MAP, the run is SWAG" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_gridsearch_run_end_to_end_names_its_closed_form_predictive(tmp_path):
    """`train.py method=laplace method.prior_fit=gridsearch dataset.val_split=300`: the prior is one of the grid's
    values, the final line names the closed-form predictive (not "1 sample"); without a held-out split the run
    stops before training in one line naming dataset.val_split, exit 2."""
    common = ["dataset=digits", "model=mlp", "model.hidden=[32]", "method=laplace", "method.prior_fit=gridsearch",
              "method.grid_min=-1", "method.grid_max=3", "method.grid_size=5", "trainer.epochs=2",
              "trainer.eval_every=0", "trainer.reliability_diagram=false", "seed=0"]
    p = train_cli(common + ["dataset.val_split=300"], tmp_path / "run")
    meta = results(tmp_path / "run")["meta"]["method"]
    assert meta["prior_fit"] == "gridsearch"
    assert meta["prior_precision"][0] == pytest.approx(10 ** round(math.log10(meta["prior_precision"][0])), rel=1e-5)
    final = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("flatbnn: done")]
    assert len(final) == 1 and "(final predictive, closed form, probit)" in final[0], final
    p = train_cli(common, tmp_path / "no_val", check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "dataset.val_split" in lines[0], p.stderr
    assert not (tmp_path / "no_val" / "results.json").exists()
