"""HWA Fig. 1 (rows/hwa_fig1.yaml) and the row figures of the comparison (flatbnn/reproduce/figures.py): per-epoch
curves are the mean +- std over seeds of the runs' metrics.jsonl, a sweep is a final metric against the number in
an axis label, the comparison draws both into the row's output folder, and the HWA row uses the paper's literal
Alg. 1 choices where the paper states them."""

import json
import math
import statistics

import pytest

from flatbnn.reproduce.compare_markdown import write_comparison
from flatbnn.reproduce.figures import axis_number, curve_data, draw_figures, seeds_label, sweep_data
from flatbnn.reproduce.spec import SpecError, load_row

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _hwa_row(seeds):
    row = load_row("hwa_fig1")
    row.scales["smoke"] = {**row.scales["smoke"], "seeds": list(seeds)}
    return row


def _write_curves(out, row):
    """metrics.jsonl for every smoke cell x seed: 3 epochs, values that encode (cell, seed, epoch)."""
    expected = {}
    for i, cell in enumerate(row.cells_for("smoke")):
        dataset, method = cell.id.split("/")
        split = "val" if dataset == "mnist" else "test"  # MNIST holds out a validation split
        for seed in cell.seeds:
            rd = out / cell.id / f"seed{seed}"
            rd.mkdir(parents=True)
            lines = []
            for epoch in (1, 2, 3):
                acc = 0.1 * i + 0.01 * epoch + 0.003 * seed
                lines.append(json.dumps({"epoch": epoch, "train/loss": 2.0 / epoch + seed, "train/accuracy": acc,
                                         f"{split}/nll": 1.5 - 0.1 * epoch, f"{split}/accuracy": acc + 0.05}))
                expected.setdefault((dataset, method, epoch), []).append(acc)
            (rd / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"epoch": 4, "train/lo')  # a cut line
            (rd / "results.json").write_text(json.dumps({"metrics": {"accuracy": acc + 0.05}}))  # finished
    return expected


def test_curves_are_the_mean_and_std_over_seeds_per_epoch(tmp_path):
    row = _hwa_row([0, 1, 2])
    expected = _write_curves(tmp_path, row)
    spec = row.compare["figures"][0]
    data = curve_data(row, "smoke", tmp_path, spec)
    assert set(data) == {"mnist", "cifar10"}
    for (dataset, method, epoch), values in expected.items():
        d = data[dataset]["train/accuracy"][method]
        k = d["epochs"].index(epoch)
        assert d["epochs"] == [1, 2, 3] and d["seeds"] == 3
        assert d["mean"][k] == pytest.approx(statistics.fmean(values), abs=1e-12)
        assert d["std"][k] == pytest.approx(statistics.stdev(values), abs=1e-12)
    # the alternative key: MNIST's per-epoch evaluation is on its validation split
    assert data["mnist"]["test/accuracy|val/accuracy"]["hwa"]["key"] == "val/accuracy"
    assert data["cifar10"]["test/accuracy|val/accuracy"]["hwa"]["key"] == "test/accuracy"
    # train/loss = 2/epoch + seed: mean over seeds 0, 1, 2 -> 2/epoch + 1
    assert data["cifar10"]["train/loss"]["sgld"]["mean"] == pytest.approx([3.0, 2.0, 2.0 / 3 + 1])


def test_a_run_not_finished_is_not_drawn(tmp_path):
    """A running or interrupted run (a curve, no results.json) is no seed of the figure: its first epochs would
    join the mean there and the legend would count it (hwa_fig1 at paper scale drew BBB n=4 with 2 of 5 done)."""
    row = _hwa_row([0, 1, 2])
    _write_curves(tmp_path, row)
    rd = tmp_path / "mnist" / "bbb_flipout" / "seed2"
    (rd / "results.json").unlink()
    (rd / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train/accuracy": 9.0}) + "\n")
    d = curve_data(row, "smoke", tmp_path, row.compare["figures"][0])["mnist"]["train/accuracy"]
    assert d["bbb_flipout"]["seeds"] == 2 and max(d["bbb_flipout"]["mean"]) < 1
    assert d["hwa"]["seeds"] == 3


def test_the_comparison_draws_the_hwa_curves_png(tmp_path):
    row = _hwa_row([0, 1])
    out = tmp_path / "runs"
    _write_curves(out, row)
    write_comparison(row, "smoke", out=out, dest=tmp_path / "results")
    png = out / "hwa_fig1_curves.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    assert not list(out.glob(".*.tmp"))  # written atomically


def test_no_runs_no_figure(tmp_path):
    assert draw_figures(_hwa_row([0]), "smoke", tmp_path) == []


def test_sweep_is_the_final_metric_against_the_axis_number(tmp_path):
    row = load_row("bsam_fig4")
    row.scales["smoke"] = {**row.scales["smoke"], "seeds": [0, 1]}
    for cell in row.cells_for("smoke"):
        method, rho = cell.id.split("/")[2], axis_number(cell.id.split("/")[3])
        for seed in (0, 1):
            rd = tmp_path / cell.id / f"seed{seed}"
            rd.mkdir(parents=True)
            acc = (0.5 if method == "bsam" else 0.4) - 0.1 * math.log10(rho) * (method != "bsam") + 0.01 * seed
            (rd / "results.json").write_text(json.dumps({"metrics": {"accuracy": acc, "nll": 1.0,
                                                                     "auroc_misclassification": math.nan}}))
    spec = row.compare["figures"][0]
    data = sweep_data(row, "smoke", tmp_path, spec)
    bsam = data["accuracy"]["bsam"]
    assert bsam["x"] == [0.001, 0.005, 0.01, 0.05, 0.1, 0.5]  # numeric order, not label order
    assert bsam["mean"] == pytest.approx([0.505] * 6) and bsam["std"] == pytest.approx([0.01 / math.sqrt(2)] * 6)
    assert "auroc_misclassification" not in data  # undefined everywhere (e.g. at smoke): no empty log-x panel
    sam = data["accuracy"]["sam_sgd"]
    assert sam["mean"][0] == pytest.approx(0.4 + 0.3 + 0.005)
    (png,) = draw_figures(row, "smoke", tmp_path)
    assert png.name == "bsam_fig4_rho.png" and png.read_bytes()[:8] == PNG_MAGIC


def test_axis_number_and_unknown_figure_kind():
    assert axis_number("rho0.005") == 0.005 and axis_number("m8") == 8 and axis_number("rho5e-5") == 5e-5
    with pytest.raises(SpecError):
        axis_number("mean")
    row = _hwa_row([0])
    row.compare = {**row.compare, "figures": [{"kind": "pie"}]}
    with pytest.raises(SpecError, match="kind"):
        draw_figures(row, "smoke", "/nonexistent")


# ------------------------------------------------------------------------------------------ the row
def test_hwa_row_uses_the_papers_literal_alg1_choices():
    row = load_row("hwa_fig1")
    assert row.seeds == [0, 1, 2, 3, 4] and row.scale("paper")["seeds"] == [0, 1, 2, 3, 4]  # 5 repetitions
    epochs = {"mnist": 50, "cifar10": 100}
    for cell in row.cells_for("paper"):
        dataset, method = cell.id.split("/")
        if method == "hwa":
            last = {o.split("=")[0]: o.split("=", 1)[1] for o in cell.overrides}
            assert last["method.variance"] == "eq4" and last["method.start"] == "0"
            assert int(last["method.lr_cycles"]) == int(last["trainer.epochs"]) == epochs[dataset]
    cpu = row.scale("cpu")
    assert cpu["seeds"] == [0, 1, 2, 3, 4] and "2 CPU cores" in cpu["budget"]  # the "curves over 5 seeds"
    for cell in row.cells_for("cpu"):
        last = {o.split("=")[0]: o.split("=", 1)[1] for o in cell.overrides}
        assert last["trainer.eval_every"] == "1"  # the curves need a per-epoch evaluation
        if cell.id.endswith("/hwa"):
            assert last["method.lr_cycles"] == last["trainer.epochs"]


def test_a_sweep_legend_says_when_its_points_have_different_seed_counts():
    # A partly finished sweep (some rho with 2 seeds, some with 1) must not be labelled n=2 throughout.
    assert seeds_label("bsam", [1, 1, 1]) == "bsam (n=1)"
    assert seeds_label("sam_adam", [2, 2, 1, 1]) == "sam_adam (n=1-2 per point)"
