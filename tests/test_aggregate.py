"""scripts/aggregate.py + flatbnn/reproduce/aggregate.py: one row per experiment, honest statistics, failures shown.

No training: each test writes fake run directories (results.json + .hydra/config.yaml) in tmp_path."""

from __future__ import annotations

import copy
import json
import math

import pytest
import yaml

from flatbnn.reproduce.aggregate import group_runs, load_runs
from scripts.aggregate import main

BASE_CFG = {
    "seed": 0,
    "metrics": {"ece_bins": 15, "ece_binning": "width", "ece_edges": "right"},
    "dataset": {"_target_": "flatbnn.data.build_dataset", "name": "digits", "root": "${oc.env:FLATBNN_DATA_ROOT,data}",
                "seed": "${seed}", "train_subset": None, "label_noise": 0.0, "num_classes": 10},
    "model": {"_target_": "flatbnn.models.create_model", "name": "mlp", "hidden": [128],
              "num_classes": "${dataset.num_classes}"},
    "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentum": 0.9},
    "flatness": {"_target_": "flatbnn.flatness.NoFlatness"},
    "method": {"_target_": "flatbnn.methods.MAP", "num_samples": 1},
    "trainer": {"epochs": 10, "batch_size": 64, "num_workers": 0, "device": "auto", "precision": "fp32",
                "progress": True, "reliability_diagram": True, "resume": True, "eval_batch_size": 500},
    "logger": {},
}
BASE_META = {
    "dataset": "digits", "model": "mlp", "method": {"name": "map", "num_samples": 1}, "flatness": {"name": "none"},
    "epochs": 10,
    "budget": {"epochs": 10, "steps": 230, "steps_per_epoch": 23, "train_size": 1437, "test_size": 360,
               "global_batch": 64, "world_size": 1, "precision": "fp32"},
    "metric_conventions": {"ece_bins": 15, "ece_binning": "width", "ece_edges": "right"},
    "hardware": {"device": "cpu", "world_size": 1, "cpu": "x86_64", "cpu_count": 2, "torch": "2.14.1"},
    "git": {"commit": "abcdef1234567890", "dirty": False},
}


def _set(d: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d[p]
    d[last] = value


def write_run(run_dir, seed, cfg=None, meta=None, metrics=None, config=True, overrides=None):
    """A fake finished run: cfg / meta are {dotted key: value} changes to BASE_CFG / BASE_META."""
    run_dir.mkdir(parents=True)
    c, m = copy.deepcopy(BASE_CFG), copy.deepcopy(BASE_META)
    c["seed"] = seed
    for k, v in (cfg or {}).items():
        _set(c, k, v)
    for k, v in (meta or {}).items():
        _set(m, k, v)
    m.update(seed=seed, run_dir=str(run_dir), overrides=overrides if overrides is not None else [f"seed={seed}"])
    mets = {"accuracy": 0.9 + 0.01 * seed, "nll": 0.3, "ece": 0.02, "brier": 0.1}
    mets.update(metrics or {})
    (run_dir / "results.json").write_text(json.dumps({"metrics": mets, "meta": m}))  # NaN -> the NaN literal
    if config:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(c))
        (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(m["overrides"]))
    return run_dir


def aggregate_cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows_of(tmp_path, capsys, *extra):
    code, out, err = aggregate_cli(capsys, tmp_path / "runs", "--json", tmp_path / "rows.json", *extra)
    assert code == 0, err
    return json.loads((tmp_path / "rows.json").read_text()), out


# ------------------------------------------------------------------------------------------- what splits a row

# (config changes, meta changes, the key shown in the config column) -- config and meta are changed separately so
# that each source of the key is tested on its own
SPLITS = {
    "epochs (config)": ({"trainer.epochs": 20}, {}, "trainer.epochs=20"),
    "epochs (budget)": ({}, {"budget.epochs": 20, "epochs": 20}, None),
    "optimizer": ({"optimizer._target_": "torch.optim.Adam"}, {}, "optimizer._target_=torch.optim.Adam"),
    "lr": ({"optimizer.lr": 0.05}, {}, "optimizer.lr=0.05"),
    "label_noise": ({"dataset.label_noise": 0.2}, {}, "dataset.label_noise=0.2"),
    "num_samples": ({"method.num_samples": 30}, {}, "method.num_samples=30"),
    "ece_bins (config)": ({"metrics.ece_bins": 20}, {}, "metrics.ece_bins=20"),
    "ece_bins (meta conventions)": ({}, {"metric_conventions.ece_bins": 20}, None),
    "train subset": ({"dataset.train_subset": 500}, {"budget.train_size": 500}, "dataset.train_subset=500"),
    "world size": ({}, {"budget.world_size": 2, "hardware.world_size": 2}, None),
    "gpu kind": ({}, {"hardware.device": "cuda", "hardware.gpu": "NVIDIA H100"}, None),
    "precision": ({"trainer.precision": "bf16"}, {"budget.precision": "bf16"}, "trainer.precision=bf16"),
    "shift sets generated, not the release": ({}, {"shift_data": {"source": "generated"}}, None),
}


@pytest.mark.parametrize("case", list(SPLITS))
def test_runs_of_different_experiments_are_never_averaged(tmp_path, capsys, case):
    cfg, meta, shown = SPLITS[case]
    for s in (0, 1):
        write_run(tmp_path / "runs" / f"base{s}", s)
        write_run(tmp_path / "runs" / f"other{s}", s, cfg=cfg, meta=meta,
                  metrics={"accuracy": 0.5 + 0.01 * s})
    rows, out = rows_of(tmp_path, capsys)
    assert len(rows) == 2, out
    assert sorted(r["n"] for r in rows) == [2, 2] and all(r["seeds"] == [0, 1] for r in rows)
    assert sorted(r["accuracy"][0] for r in rows) == pytest.approx([0.505, 0.905])
    if shown:  # the differing key is printed in the row (and only in the row that has the other value)
        other = next(r for r in rows if r["accuracy"][0] < 0.6)
        base = next(r for r in rows if r["accuracy"][0] > 0.6)
        k, v = shown.split("=", 1)
        assert f"| {shown}" in out and other["config"][k] == v and base["config"][k] != v
    # the two rows never look alike: they differ outside the metric cells (config or budget column)
    head = next(ln for ln in out.splitlines() if ln.startswith("| dataset")).split("|")
    ident = [i for i, h in enumerate(head) if h.strip() in {"dataset", "model", "method", "flatness", "config",
                                                             "budget"}]
    lines = [ln.split("|") for ln in out.splitlines() if ln.startswith("| digits")]
    assert len(lines) == 2 and [lines[0][i] for i in ident] != [lines[1][i] for i in ident]


def test_runs_without_saved_config_split_on_their_overrides(tmp_path, capsys):
    """run(cfg, run_dir) leaves no .hydra/: meta + the recorded overrides (minus the seed) are the key."""
    for s in (0, 1):
        write_run(tmp_path / "runs" / f"a{s}", s, config=False, overrides=["optimizer.lr=0.1", f"seed={s}"])
        write_run(tmp_path / "runs" / f"b{s}", s, config=False, overrides=[f"seed={s}", "optimizer.lr=0.05"])
    rows, out = rows_of(tmp_path, capsys)
    assert sorted((r["config"]["optimizer.lr"], r["n"]) for r in rows) == [("0.05", 2), ("0.1", 2)], out


def test_a_run_with_config_never_shares_a_row_with_one_without(tmp_path, capsys):
    write_run(tmp_path / "runs" / "a", 0)
    write_run(tmp_path / "runs" / "b", 1, config=False)
    rows, _ = rows_of(tmp_path, capsys)
    assert [r["n"] for r in rows] == [1, 1]


# ------------------------------------------------------------------------------------------- statistics


def test_seeds_of_one_config_form_one_row_with_sample_std(tmp_path, capsys):
    # keys that legitimately differ between seeds: seed, dataset.seed (${seed} or its value), paths, progress, how
    # fast it was evaluated (the runtime keys of flatbnn/keyroles.py)
    write_run(tmp_path / "runs" / "s0", 0, metrics={"accuracy": 0.90})
    write_run(tmp_path / "runs" / "s1", 1, metrics={"accuracy": 0.92},
              cfg={"dataset.seed": 1, "dataset.root": "/elsewhere", "trainer.progress": False,
                   "trainer.num_workers": 4, "trainer.device": "cpu", "trainer.resume": False},
              meta={"hardware.cpu_count": 16, "git.dirty": True})
    write_run(tmp_path / "runs" / "s2", 2, metrics={"accuracy": 0.97},
              cfg={"trainer.reliability_diagram": False, "trainer.eval_batch_size": 7})
    rows, out = rows_of(tmp_path, capsys)
    assert len(rows) == 1, out
    (row,) = rows
    assert row["n"] == 3 and row["seeds"] == [0, 1, 2] and row["config"] == {}
    # hand values: mean 0.93, deviations -0.03, -0.01, 0.04 -> sum of squares 0.0026; / (3 - 1) -> std 0.036056
    assert row["accuracy"][0] == pytest.approx(0.93)
    assert row["accuracy"][1] == pytest.approx(math.sqrt(0.0026 / 2))
    assert row["accuracy"][1] != pytest.approx(math.sqrt(0.0026 / 3))  # not the population std (ddof = 0)
    assert "| 3 | 0,1,2 | 93.00 ± 3.61 |" in out
    assert "ddof = 1" in out and "n = number of seeds" in out


def test_one_seed_prints_its_value_and_n1_without_plus_minus(tmp_path, capsys):
    write_run(tmp_path / "runs" / "s0", 0, metrics={"accuracy": 0.9711, "nll": 0.1234})
    rows, out = rows_of(tmp_path, capsys)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("| digits")]
    assert "97.11 (n=1)" in line and "0.1234 (n=1)" in line and "±" not in line and "0.00" not in line
    assert rows[0]["n"] == 1 and rows[0]["accuracy"] == [pytest.approx(0.9711), None]


def test_nan_and_missing_metrics_are_left_out_and_counted(tmp_path, capsys):
    """The NaN policy (flatbnn/reproduce/stats.py): a non-finite seed is left out of mean and std and counted
    beside them -- one diverged seed no longer blanks the cell (it printed ``nan (1/3 non-finite)``)."""
    write_run(tmp_path / "runs" / "s0", 0, metrics={"nll": float("nan"), "ece": 0.01, "brier": float("nan")})
    write_run(tmp_path / "runs" / "s1", 1, metrics={"nll": None, "ece": float("inf"), "brier": float("inf")})
    write_run(tmp_path / "runs" / "s2", 2, metrics={"brier": None})
    rows, out = rows_of(tmp_path, capsys)
    (row,) = rows
    # nll: only s2's 0.3; ece: 0.01 and s2's 0.02 -> mean 0.015, std 0.01/sqrt(2); brier: nothing finite
    assert "| 0.3000 (n=1) [2/3 non-finite] | 0.0150 ± 0.0071 [1/3 non-finite] | nan [3/3 non-finite] |" in out
    assert row["nll"] == [pytest.approx(0.3), None] and row["stats"]["nll"]["n_nonfinite"] == 2
    assert row["stats"]["nll"]["n"] == 1 and row["stats"]["nll"]["values"] == ["nan", None, 0.3]
    assert row["ece"] == [pytest.approx(0.015), pytest.approx(0.01 / math.sqrt(2))]
    assert row["brier"] == [None, None] and row["n"] == 3
    assert row["accuracy"][0] == pytest.approx(0.91)  # the finite metrics of the same runs are unaffected
    assert "left out of the mean, std and tests and counted" in out  # the policy, said in the table's note


def test_a_null_metric_in_the_only_run_keeps_its_column_and_says_non_finite(tmp_path, capsys):
    """Issue 54: a null accuracy in the only run dropped the column from the table (as if never computed)."""
    write_run(tmp_path / "runs" / "s0", 0, metrics={"accuracy": None})
    rows, out = rows_of(tmp_path, capsys)
    head, _, line = [ln for ln in out.splitlines() if ln.startswith("|")][:3]
    assert "acc %" in head and "| nan [1/1 non-finite] |" in line, out
    assert rows[0]["accuracy"] == [None, None] and "auroc_ood" not in rows[0]["stats"]  # never written: no column


def test_a_results_json_without_meta_is_labelled_from_its_hydra_files(tmp_path, capsys):
    """Issue 54: a results.json without meta got a '? | ? | ?' row though its .hydra/config.yaml was there. Its
    labels come from the group options Hydra chose (hydra.yaml; train.py's meta uses them), else the config."""
    run = write_run(tmp_path / "runs" / "s0", 0, cfg={"flatness": {"_target_": "flatbnn.flatness.sam.SAM", "rho": 0.1}})
    (run / "results.json").write_text(json.dumps({"metrics": {"accuracy": 0.5, "nll": 1.0}}))
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(
        {"hydra": {"runtime": {"choices": {"dataset": "digits", "model": "mlp_small", "method": "map"}}}}))
    _, out = rows_of(tmp_path, capsys)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("| digits")]
    assert line.startswith("| digits | mlp_small | map | sam(rho=0.1) |") and "10 ep" in line and "batch 64" in line, out
    assert "?" not in line.split("|")[1:5]


# ------------------------------------------------------------------------------------------- errors and failures


def test_a_duplicated_seed_is_an_error(tmp_path, capsys):
    a = write_run(tmp_path / "runs" / "first", 0)
    b = write_run(tmp_path / "runs" / "again", 0)
    write_run(tmp_path / "runs" / "other", 1)
    code, out, err = aggregate_cli(capsys, tmp_path / "runs")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and str(a) in err and str(b) in err and "seed 0" in err
    code, out, _ = aggregate_cli(capsys, tmp_path / "runs", "--allow-duplicate-seeds")
    assert code == 0 and "| 3 | 0,0,1 |" in out


def test_same_seed_in_different_experiments_is_fine(tmp_path, capsys):
    write_run(tmp_path / "runs" / "a", 0)
    write_run(tmp_path / "runs" / "b", 0, cfg={"optimizer.lr": 0.05})
    rows, _ = rows_of(tmp_path, capsys)
    assert [r["n"] for r in rows] == [1, 1]


def test_one_run_reached_through_two_paths_counts_once(tmp_path, capsys):
    run = write_run(tmp_path / "runs" / "a", 0)
    code, out, err = aggregate_cli(capsys, tmp_path / "runs", run, run / "results.json")
    assert code == 0 and "| 1 | 0 |" in out, err


def _sweep(tmp_path, n_jobs):
    sweep = tmp_path / "runs"
    sweep.mkdir(parents=True, exist_ok=True)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({
        "hydra": {"sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"},
                  "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                              "max_batch_size": None, "params": None},
                  "overrides": {"hydra": [f"hydra.sweep.dir={sweep}"],
                                "task": ["dataset=digits", f"seed={','.join(map(str, range(n_jobs)))}"]}},
        **BASE_CFG}))
    return sweep


def test_failed_and_never_started_sweep_members_are_listed_and_not_counted(tmp_path, capsys):
    sweep = _sweep(tmp_path, 4)
    write_run(sweep / "0", 0, overrides=["dataset=digits", "seed=0"])
    write_run(sweep / "1", 1, overrides=["dataset=digits", "seed=1"])
    crashed = sweep / "2"  # started (Hydra wrote .hydra/), crashed before results.json
    (crashed / ".hydra").mkdir(parents=True)
    cfg = {**copy.deepcopy(BASE_CFG), "seed": 2}
    (crashed / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    (crashed / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["dataset=digits", "seed=2"]))
    (crashed / "failed.txt").write_text("Traceback (most recent call last):\n  ...\nRuntimeError: CUDA out of memory\n")
    # job 3 (seed=3) never started: no directory at all
    rows, out = rows_of(tmp_path, capsys)
    (row,) = rows
    assert row["n"] == 2 and row["seeds"] == [0, 1] and row["failed"] == [str(crashed.resolve())]
    assert "| 2 | 0,1 (+1 failed) |" in out
    assert "Failed / missing runs (2; not counted in n)" in out
    (crash_line,) = [ln for ln in out.splitlines() if f"`{crashed.resolve()}`" in ln]
    assert "no results.json" in crash_line and "RuntimeError: CUDA out of memory" in crash_line
    (never_line,) = [ln for ln in out.splitlines() if "never started" in ln]
    assert "job #3 of 4" in never_line and "seed=3" in never_line


def test_a_complete_sweep_lists_nothing_as_failed(tmp_path, capsys):
    sweep = _sweep(tmp_path, 2)
    for s in (0, 1):
        write_run(sweep / str(s), s, overrides=["dataset=digits", f"seed={s}"])
    runs, failed = load_runs([sweep])
    assert failed == [] and [g.seeds for g in group_runs(runs)] == [[0, 1]]
    _, out = rows_of(tmp_path, capsys)
    assert "Failed" not in out


# ------------------------------------------------------------------------------------------- the old interface


def test_cli_keeps_its_table_columns_out_and_json(tmp_path, capsys):
    for s in (0, 1):
        write_run(tmp_path / "runs" / f"none{s}", s)
        write_run(tmp_path / "runs" / f"sam{s}", s, cfg={"flatness": {"_target_": "flatbnn.flatness.SAM", "rho": 0.05}},
                  meta={"flatness": {"name": "sam", "rho": 0.05, "m": 1}})
    code, out, err = aggregate_cli(capsys, tmp_path / "runs", "--out", tmp_path / "t" / "table.md",
                                   "--json", tmp_path / "rows.json")
    assert code == 0, err
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["flatness"], r["seeds"]) for r in rows] == [("none", [0, 1]), ("sam(rho=0.05)", [0, 1])]
    assert rows[1]["accuracy"][0] == pytest.approx(0.905)
    assert "| digits | mlp | map | sam(rho=0.05) |" in out
    table = (tmp_path / "t" / "table.md").read_text()
    assert table.startswith("<!-- generated by scripts/aggregate.py from 4 runs") and "ddof = 1" in table
    assert "10 ep, n=1437, batch 64, 1xcpu" in table


def test_re_evaluations_are_their_own_rows(tmp_path, capsys):
    """evaluate.py writes RUN/eval/<name>/results.json (no .hydra/): keyed by the run's config + its overrides."""
    for s in (0, 1):
        run = write_run(tmp_path / "runs" / f"s{s}", s)
        ev = run / "eval" / "ece20"
        ev.mkdir(parents=True)
        res = json.loads((run / "results.json").read_text())
        res["meta"]["metric_conventions"]["ece_bins"] = 20
        res["meta"]["evaluated_from"] = {"run_dir": str(run), "name": "ece20", "overrides": ["metrics.ece_bins=20"]}
        res["metrics"]["ece"] = 0.05
        (ev / "results.json").write_text(json.dumps(res))
    rows, out = rows_of(tmp_path, capsys)
    assert sorted((r["config"].get("evaluation"), r["config"].get("metrics.ece_bins"), r["n"], r["ece"][0])
                  for r in rows) == [("ece20", "20", 2, 0.05), ("train.py", "15", 2, 0.02)], out
