"""Issue 53's posterior x flatness grid (rows/posterior_flatness_grid.yaml): its cells are every posterior with a class
of its own x the flatness variants that compose with it, and its heat map (flatbnn/reproduce/figures.py delta_grid)
shows the change against flatness=none (Welch: the cells are trained separately) with the cells beyond seed noise marked."""

from __future__ import annotations

import json

import pytest

from flatbnn.keyroles import method_class
from flatbnn.reproduce import figures
from flatbnn.reproduce.spec import load_row
from flatbnn.reproduce.stats import seed_stats, welch_ttest
from flatbnn.resources import group_options, own_targets

ROW = "posterior_flatness_grid"


def test_the_grid_holds_every_posterior_class_with_each_flatness_it_composes_with():
    row = load_row(ROW)
    cells = set(row.cell_ids())
    options = group_options("method")

    def target(option):  # an option without a _target_ of its own takes its defaults' (sgvb_lrt: sgvb's)
        node = options[option]
        return node["_target_"] if node.get("_target_") else target(node["defaults"][0])

    classes = {}
    for label, overrides in row.values["method"].items():
        classes[label] = method_class(target(next(o.split("=", 1)[1] for o in overrides if o.startswith("method="))))
    # every method option with a class of its own is a posterior of the grid (presets and key-only options aside)
    shipped = {method_class(t) for t in own_targets("method").values()}
    assert shipped <= set(classes.values()), shipped - set(classes.values())
    for dataset in ("mnist", "fashion_mnist"):
        for label, cls in classes.items():
            got = {c.split("/")[3] for c in cells if c.startswith(f"{dataset}/mlp/{label}/")}
            assert got == ({"none"} if cls.own_perturbation else {"none", "sam", "fsam"}), (dataset, label, got)


def _write(out, cell, seed, nll, ece=0.02):
    d = out / cell / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"metrics": {"nll": nll, "ece": ece, "auroc_ood": 0.9}}))


def test_delta_grid_is_the_welch_difference_and_marks_only_what_the_t_test_rejects(tmp_path):
    """Separately trained cells (SAM vs none are two runs): Welch, as the claims test them; never paired."""
    row = load_row(ROW)
    base = {0: 0.100, 1: 0.120, 2: 0.090}
    sam = {0: 0.040, 1: 0.041, 2: 0.039}     # 0.063 below the base's mean, sd 0.001: beyond noise
    fsam = {0: 0.130, 1: 0.080, 2: 0.120}    # +0.030, -0.040, +0.030: mean +0.0067, within noise
    for seed in (0, 1, 2):
        _write(tmp_path, "mnist/mlp/sgd/none", seed, base[seed])
        _write(tmp_path, "mnist/mlp/sgd/sam", seed, sam[seed])
        _write(tmp_path, "mnist/mlp/sgd/fsam", seed, fsam[seed], ece=0.05)
    _write(tmp_path, "mnist/mlp/vogn/none", 0, 0.2)  # own perturbation: a base with no variant, no cell
    for seed in (0, 1, 2):                             # adam: SAM half-way (2 of 3 seeds), FSAM's base half-way
        _write(tmp_path, "mnist/mlp/adam/fsam", seed, 0.01)
        if seed < 2:
            _write(tmp_path, "mnist/mlp/adam/none", seed, 0.1)
            _write(tmp_path, "mnist/mlp/adam/sam", seed, 0.01)
    spec = {"kind": "delta_grid", "facets": "dataset", "rows": "method", "cols": "flatness", "base": "none",
            "metrics": ["nll", "ece", "auroc_ood"]}
    data = figures.delta_grid_data(row, "paper", tmp_path, spec)
    nll = data["mnist"]["nll"]["sgd"]
    assert set(data["mnist"]["nll"]) == {"sgd"} and set(nll) == {"sam", "fsam"}  # a cell half-way is no result
    for cv, values in (("sam", sam), ("fsam", fsam)):
        ref = welch_ttest(seed_stats(list(values.values())), seed_stats(list(base.values())))
        assert nll[cv]["delta"] == pytest.approx(ref.diff, abs=1e-12)
        assert nll[cv]["p"] == pytest.approx(ref.p, rel=1e-9) and nll[cv]["test"] == "Welch t"
        assert nll[cv]["beyond"] == (ref.p < 0.05)
    assert nll["sam"]["beyond"] and nll["sam"]["better"] is True  # lower NLL is better
    assert not nll["fsam"]["beyond"] and nll["fsam"]["better"] is False
    ece = data["mnist"]["ece"]["sgd"]["fsam"]
    assert ece["delta"] == pytest.approx(0.03) and ece["better"] is False and ece["beyond"]  # zero spread: floored, 300 units
    assert data["mnist"]["auroc_ood"]["sgd"]["sam"]["delta"] == 0.0 and not data["mnist"]["auroc_ood"]["sgd"]["sam"]["beyond"]
    png = figures.draw_delta_grid(row, "paper", tmp_path, {**spec, "name": "grid"})
    assert png.exists() and png.stat().st_size > 5000
    saved = json.loads(png.with_suffix(".json").read_text())
    assert saved["grid"]["mnist"]["nll"]["sgd"]["sam"]["beyond"] is True


def test_the_row_draws_its_heat_map_from_its_own_spec():
    specs = [f for f in load_row(ROW).compare["figures"] if f["kind"] == "delta_grid"]
    assert specs and specs[0]["base"] == "none" and set(specs[0]["metrics"]) == {"nll", "ece", "auroc_ood"}
