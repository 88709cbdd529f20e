"""The reproduction path: row specs and paper data load and agree, a generated cell config is the same config as
the spec's overrides on a command line, a row runs as one multirun (failed members alone, finished jobs skipped),
the comparison computes deltas / verdicts / directions, and the status board reflects the files."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from helpers import REPO

from flatbnn.reproduce import compare, compare_markdown, launch, spec, status


def test_every_spec_and_paper_file_loads_and_their_cells_agree():
    assert spec.check_all() == []
    rows = spec.list_rows()
    # the five papers' rows named by the issue are all there, each with its paper data
    for name in ("flatbnn_t1", "flatbnn_t2", "flatbnn_t3", "flatbnn_t4", "flatbnn_t5", "flatbnn_fig1",
                 "flatbnn_fig2", "bsam_t1", "bsam_t2", "vsam_t3", "vsam_t4", "hwa_fig1", "fsam_t1", "fsam_t4"):
        assert name in rows, name
        assert (spec.PAPER_DIR / f"{name}.yaml").exists(), name


def test_flatbnn_t2_paper_cells_are_the_printed_table():
    pd = spec.load_paper_data(spec.PAPER_DIR / "flatbnn_t2.yaml")
    cells = {c["cell"]: c for c in pd["cells"]}
    assert len(cells) == 20
    assert cells["preresnet164/mc_dropout"]["accuracy"] == {"mean": 96.18, "std": 0.02}
    assert cells["wrn28x10/f_swag"]["nll"] == {"mean": 0.0883, "std": 0.0004}
    assert cells["wrn28x10/f_deep_ens"]["ece"] == {"mean": 0.0059, "std": 0.0012}


@pytest.mark.parametrize("row,cell", [("flatbnn_t2", "wrn28x10/f_mc_dropout"), ("flatbnn_t3", "cifar100/resnet18/f_sgvb_geometry"),
                                      ("flatbnn_t4", "densenet161/f_swag")])
def test_generated_cell_config_equals_the_overrides_on_a_command_line(row, cell, tmp_path):
    """The runner turns a cell's override list into a config file; composing ``+cell=<it>`` must give exactly the
    config the same overrides give on a command line (group choices and values, in order)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    r = spec.load_row(row)
    c = next(x for x in r.cells_for("paper") if x.id == cell)
    direct = launch.compose_cell(launch.run_overrides(c, "paper"))  # the spec's + the paper scale's additions
    search, _ = launch.write_cells(r, [c], "paper", tmp_path, [])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(launch.CONFIGS), version_base="1.3"):
        name = launch.cell_config_name(c.id, c.seeds[0])
        via_file = compose(config_name="config", overrides=[f"hydra.searchpath=[file://{search}]", f"+cell={name}"])
    a = OmegaConf.to_container(direct, resolve=False)
    b = OmegaConf.to_container(via_file, resolve=False)
    assert b.pop("reproduce") == {"row": row, "cell": cell, "scale": "paper"}
    a.pop("reproduce")
    a["seed"] = c.seeds[0]
    assert a == b


def test_flat_bnn_presets_work_with_every_table_method():
    """The bug of the old preset: SWAG keys under ``method`` broke every other method, and the preset forced SAM
    on the base methods. Now each method keeps its flatness and its own paper settings; rho reaches F-presets."""
    for ds, rho in (("cifar10", 0.05), ("cifar100", 0.1)):
        for m in ("mc_dropout", "deep_ens", "sgld", "swag_diag", "swag"):
            base = launch.compose_cell([f"experiment=flat_bnn_{ds}", f"method={m}"])
            flat = launch.compose_cell([f"experiment=flat_bnn_{ds}", f"method=f_{m}"])
            assert base.flatness._target_.endswith("NoFlatness"), (ds, m)
            assert flat.flatness._target_.endswith(".SAM") and flat.flatness.rho == rho, (ds, m)
            assert base.method._target_ == flat.method._target_
            from hydra.utils import instantiate
            instantiate(flat.method)  # no foreign keys
        swag = launch.compose_cell([f"experiment=flat_bnn_{ds}", "method=f_swag"]).method
        diag = launch.compose_cell([f"experiment=flat_bnn_{ds}", "method=swag_diag"]).method
        assert (swag.swa_start, swag.scale, diag.scale) == (161, 0.1, 0.2)
        assert launch.compose_cell([f"experiment=flat_bnn_{ds}", "method=f_deep_ens"]).method.num_members == 3


def _tiny_row(tmp_path: Path, cells: dict, seeds=(0, 1)) -> spec.Row:
    data = {"row": "tiny", "paper": "none", "title": "tiny", "axes": ["method"],
            "base": ["dataset=digits", "model=mlp", "trainer.epochs=1", "trainer.limit_train_batches=3",
                     "trainer.progress=false", "trainer.reliability_diagram=false", "dataset.test_subset=100"],
            "values": {"method": cells}, "seeds": list(seeds),
            "scales": {"smoke": {"overrides": []}, "cpu": {"overrides": [], "seeds": list(seeds)}}}
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(data))
    return spec.load_row(p)


@pytest.mark.slow
def test_a_row_is_one_multirun_failed_cells_fail_alone_and_finished_jobs_are_skipped(tmp_path):
    row = _tiny_row(tmp_path, {"sgd": ["flatness=none"], "sam": ["flatness=sam"],
                               "bad": ["flatness=sam", "flatness.rho=-1"]})
    out = tmp_path / "out"
    s = launch.launch(row, "cpu", out=out)
    states = {k: v["state"] for k, v in s["jobs"].items()}
    assert states == {"sgd/seed0": "done", "sgd/seed1": "done", "sam/seed0": "done", "sam/seed1": "done",
                      "bad/seed0": "failed", "bad/seed1": "failed"}
    assert s["returncode"] == 1  # the sweep went on past the failed member and still says it failed
    assert "rho" in s["jobs"]["bad/seed0"]["detail"]
    r = json.loads((out / "sam" / "seed1" / "results.json").read_text())
    assert r["meta"]["seed"] == 1 and r["meta"]["flatness"]["name"] == "sam"
    cfg = yaml.safe_load((out / "sam" / "seed1" / ".hydra" / "config.yaml").read_text())
    assert cfg["reproduce"] == {"row": "tiny", "cell": "sam", "scale": "cpu"}
    before = (out / "sgd" / "seed0" / "results.json").stat().st_mtime_ns
    again = launch.launch(row, "cpu", out=out, dry_run=True)
    assert again["command"][-len(["+cell"]):] != [] and "+cell=bad__s0,bad__s1" in again["command"]
    assert (out / "sgd" / "seed0" / "results.json").stat().st_mtime_ns == before


def _fake_run(out: Path, cell: str, seed: int, acc: float, nll: float, ece: float = 0.01, shift=None,
              num_classes: int | None = None):
    d = out / cell / f"seed{seed}"
    d.mkdir(parents=True)
    if num_classes:  # as train.py writes it; the at-chance check reads model.num_classes from here
        (d / "config_resolved.yaml").write_text(f"model:\n  num_classes: {num_classes}\n")
    metrics = {"accuracy": acc, "nll": nll, "ece": ece}
    if shift:
        metrics["shift"] = shift
    meta = {"dataset": "cifar10", "model": "wrn", "seed": seed, "budget": {"epochs": 8, "train_size": 2000,
            "test_size": 1000, "global_batch": 128, "precision": "fp32"}, "hardware": {"cpu": "x", "torch": "2"},
            "git": {"commit": "abcdef123", "dirty": False}, "train_seconds": 36.0,
            "metric_conventions": {"ece_bins": 20}}
    (d / "results.json").write_text(json.dumps({"metrics": metrics, "meta": meta}))


def test_comparison_units_deltas_directions_and_verdicts(tmp_path):
    row = spec.load_row("flatbnn_t2")
    out = tmp_path / "out"
    # ours: F-SWAG better than SWAG on accuracy and NLL, worse on ECE
    for s, (a, n) in enumerate([(0.90, 0.30), (0.92, 0.32), (0.94, 0.34)]):
        _fake_run(out, "wrn28x10/f_swag", s, a, n, ece=0.05)
        _fake_run(out, "wrn28x10/swag", s, a - 0.01, n + 0.01, ece=0.04)
    c = compare.build(row, "cpu", out)
    rec = {(r["cell"], r["metric"]): r for r in c["table"]}
    acc = rec[("wrn28x10/f_swag", "accuracy")]
    assert acc["ours_mean"] == pytest.approx(92.0) and acc["ours_std"] == pytest.approx(2.0)  # percent, ddof=1
    assert acc["ours_n"] == 3 and acc["delta"] == pytest.approx(92.0 - 97.09)
    d = {(x["cell"], x["metric"]): x for x in c["direction"]}
    assert d[("wrn28x10/f_swag", "accuracy")]["paper_better"] == "yes"
    assert d[("wrn28x10/f_swag", "accuracy")]["agree"] is True
    assert d[("wrn28x10/f_swag", "nll")]["agree"] is True          # lower is better
    assert d[("wrn28x10/f_swag", "ece")]["paper_better"] == "yes"  # 0.0036 < 0.0088
    assert d[("wrn28x10/f_swag", "ece")]["agree"] is False          # ours got worse
    assert d[("wrn28x10/f_mc_dropout", "accuracy")]["agree"] is None  # not run: pending, not "agrees"
    assert "verdict" not in acc  # below paper scale, no verdicts
    md = compare_markdown.to_markdown(c)
    assert "NOT a paper reproduction" in md and "abcdef12" in md
    # at paper scale: within the printed spread or not
    p = compare.build(row, "paper", out)
    # paper cells are the same ids; our fake runs sit under the "paper" scale's seeds too
    assert all("verdict" not in r for r in p["table"] if r["ours_n"] == 0)


def test_paper_scale_verdict_uses_both_spreads():
    rec = {"paper_std": 0.1, "ours_std": 0.2, "delta": 0.44}
    assert compare._verdict(rec) == "within"       # 2 * sqrt(0.01 + 0.04) = 0.447
    assert compare._verdict({**rec, "delta": 0.46}) == "outside"
    assert compare._verdict({**rec, "paper_std": None}) == "no spread printed"


def test_flatbnn_t5_joins_paper_groups_to_our_shift_metrics(tmp_path):
    row = spec.load_row("flatbnn_t5")
    out = tmp_path / "out"
    groups = {g: {"accuracy": 0.5, "ece": 0.1} for g in ("noise", "blur", "weather", "digital")}
    _fake_run(out, "wrn28x10/swag", 0, 0.9, 0.3, shift={"per_group": groups, "mean": {"accuracy": 0.6, "ece": 0.2},
                                                       "group_mean": {"accuracy": 0.5, "ece": 0.1}})
    c = compare.build(row, "cpu", out)
    rec = {(r["cell"], r["metric"]): r for r in c["table"]}
    assert rec[("noise/swag", "accuracy")]["ours_mean"] == pytest.approx(50.0)
    # the paper's Average is the plain mean of its four group rows: ours is shift.group_mean, not shift.mean
    assert rec[("average/swag", "ece")]["ours_mean"] == pytest.approx(0.1)


def test_status_board_lists_every_row_with_its_state(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "RESULTS_ROOT", tmp_path)
    monkeypatch.setattr(status, "RESULTS_ROOT", tmp_path)
    (tmp_path / "flatbnn_t2").mkdir()
    (tmp_path / "flatbnn_t2" / "smoke.json").write_text(json.dumps(
        {"jobs": {"a": {"0": "done"}, "b": {"0": "failed"}}, "failed": {"b/seed0": "boom"}, "blocked": {},
         "budget": {"commits": ["abc"]}}))
    text = status.render()
    for name in spec.list_rows():
        assert f"`{name}`" in text
    line = next(x for x in text.splitlines() if x.startswith("| `flatbnn_t2`"))
    assert "**failed**" in line and "1/2 jobs" in line and "1 failed" in line
    line1 = next(x for x in text.splitlines() if x.startswith("| `flatbnn_t1`"))
    assert "not run" in line1 and "no CIFAR-100" in line1
    # a cpu comparison with a stale run and undecided pairs says both on the board
    (tmp_path / "fsam_t4").mkdir()
    (tmp_path / "fsam_t4" / "cpu.json").write_text(json.dumps(
        {"jobs": {"n20/sgd": {"0": "stale"}, "n20/sam": {"0": "done"}}, "failed": {}, "blocked": {},
         "stale": {"n20/sgd/seed0": "trained with another config"}, "budget": {"commits": ["abc"]},
         "direction": [{"agree": True, "beyond_noise": "no"}, {"agree": None, "undecided": "at chance: n60/sam",
                                                               "beyond_noise": "yes"}, {"agree": None}]}))
    line4 = next(x for x in status.render().splitlines() if x.startswith("| `fsam_t4`"))
    assert "**1 stale**" in line4 and "direction agrees 1/1 (1 undecided: a tie or a cell at chance)" in line4
    assert "1/2 pairs beyond seed noise" in line4
    # a paper page with nothing run yet is a priced queue, not a comparison missing its records
    (tmp_path / "hwa_fig1").mkdir()
    (tmp_path / "hwa_fig1" / "paper.json").write_text(json.dumps(
        {"jobs": {"mnist/hwa": {"0": "pending", "1": "pending"}}, "failed": {}, "blocked": {}, "budget": {}}))
    line5 = next(x for x in status.render().splitlines() if x.startswith("| `hwa_fig1`"))
    assert line5.endswith("| paper: not run (0/2 jobs; each run's cost under 'Still to run') |")


def test_cli_check_and_missing_row_are_one_line():
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "reproduce.py"), "run", "no_such_row"],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "no row spec" in p.stderr


def test_all_with_jobs_runs_train_then_eval_then_script_rows_each_stage_in_parallel(monkeypatch):
    """``reproduce.py all --jobs N`` (CI's smoke stage) keeps the stage order -- eval rows read the trained
    rows' runs, analysis scripts read both -- and runs every row exactly once; a failed row's code is returned."""
    from flatbnn.reproduce import cli

    stages = []

    def fake_parallel(names, args, extra):
        stages.append(list(names))
        assert args.jobs == 3 and extra == ["trainer.progress=false"]
        return [1 if n == "bsam_t3" else 0 for n in names]
    monkeypatch.setattr(cli, "_run_rows_in_parallel", fake_parallel)
    monkeypatch.setattr(status, "write_status", lambda: "STATUS.md")
    rc = cli.main(["all", "--scale", "smoke", "--jobs", "3", "--", "trainer.progress=false"])
    kinds = [{spec.load_row(n).kind for n in stage} for stage in stages]
    assert kinds == [{"train"}, {"eval"}, {"script"}]
    assert sorted(n for stage in stages for n in stage) == sorted(spec.list_rows())
    assert rc == 1


def test_a_script_row_runs_into_the_out_its_comparison_reads(tmp_path, monkeypatch):
    """``run vsam_fig1 --scale paper --out X`` ran the script into outputs/reproduce/vsam_fig1/paper while the comparison
    read X: its page said 'no finished runs yet' beside a finished run (2026-11-30). The script writes into X, {runs}
    is X's root where X is <root>/<row>/<scale>, and launch.json lies beside it."""
    from flatbnn.reproduce import cli
    from flatbnn.reproduce import scripts as row_scripts

    row = spec.load_row("vsam_fig1")
    script = {"paper": "{python} -c \"import pathlib, sys; o = pathlib.Path(sys.argv[1]); o.mkdir(parents=True, "
                       "exist_ok=True); (o / 'runs.txt').write_text(sys.argv[2])\" {out} {runs}"}
    monkeypatch.setattr(row, "script", script)
    monkeypatch.setattr(cli, "load_row", lambda name: row)
    monkeypatch.setattr(row_scripts.resources, "CHECKOUT", Path("."))
    default = tmp_path / "default"
    monkeypatch.setattr(row_scripts, "OUTPUT_ROOT", default)
    out = tmp_path / "root" / "vsam_fig1" / "paper"
    assert cli.main(["run", "vsam_fig1", "--scale", "paper", "--out", str(out), "--no-compare"]) == 0
    assert (out / "runs.txt").read_text() == str(tmp_path / "root")
    assert json.loads((out / "launch.json").read_text())["returncode"] == 0
    assert not default.exists()  # nothing went to the default output root
    elsewhere = tmp_path / "scratch"  # not <root>/<row>/<scale>: the other rows' runs stay at the default root
    assert row_scripts.run_script_row(row, "paper", out=elsewhere) == 0
    assert (elsewhere / "runs.txt").read_text() == str(default)


def test_out_sweeps_elsewhere_and_keeps_its_comparison_out_of_the_committed_tables(tmp_path, monkeypatch):
    """``run ROW --out DIR`` used to write its comparison over the committed results/reproduce/<row>/; and ``all
    --out DIR`` swept every row into the one DIR, where cells of the same id (bSAM T1 / T5) collide."""
    from flatbnn.reproduce import cli
    from flatbnn.reproduce import launch, scripts as row_scripts

    seen = []
    fake = lambda row, scale, out=None, **kw: seen.append(("sweep", row.row, out)) or {"jobs": {}, "returncode": 0}
    monkeypatch.setattr(launch, "launch", fake)
    monkeypatch.setattr(launch, "launch_eval", fake)
    monkeypatch.setattr(row_scripts, "run_script_row", lambda row, scale, dry_run=False, out=None: 0)
    monkeypatch.setattr(compare_markdown, "write_comparison",
                        lambda row, scale, out=None, dest=None, **kw: seen.append(("table", row.row, dest)) or tmp_path)
    monkeypatch.setattr(status, "write_status", lambda: seen.append(("board",)) or "STATUS.md")

    assert cli.main(["run", "bsam_t5", "--scale", "smoke"]) == 0
    # a smoke run of one row: its sweep in outputs/ (None) and its table too, not over the committed smoke.json
    assert seen == [("sweep", "bsam_t5", None), ("table", "bsam_t5", launch.OUTPUT_ROOT / "comparison" / "bsam_t5")]
    seen.clear()
    assert cli.main(["run", "bsam_t5", "--scale", "smoke", "--out", str(tmp_path / "s")]) == 0
    assert seen == [("sweep", "bsam_t5", tmp_path / "s"), ("table", "bsam_t5", tmp_path / "s" / "comparison" / "bsam_t5")]
    seen.clear()
    assert cli.main(["run", "bsam_t5", "--scale", "smoke", "--out", str(tmp_path / "s"), "--results", "R"]) == 0
    assert seen[-1] == ("table", "bsam_t5", Path("R") / "bsam_t5")  # a cluster's scratch sweep, tables into the repo
    seen.clear()
    assert cli.main(["all", "--scale", "smoke", "--out", str(tmp_path / "root")]) == 0
    sweeps = {s[1]: s[2] for s in seen if s[0] == "sweep"}
    assert len(sweeps) == len({n for n in spec.list_rows() if spec.load_row(n).kind != "script"})
    assert all(out == tmp_path / "root" / name / "smoke" for name, out in sweeps.items())
    assert all(s[2] == tmp_path / "root" / "comparison" / s[1] for s in seen if s[0] == "table")
    assert ("board",) not in seen  # the board reads the committed tables only


def test_no_spec_pins_a_data_path_of_one_machine():
    """Data roots come from the user (``-- dataset.root=PATH``, checked by the preflight with a one-line
    error); a spec that names an absolute path works on one machine only."""
    bad = []
    for name in spec.list_rows():
        row = spec.load_row(name)
        for scale in spec.SCALES:
            for cell in (row.cells_for(scale) if row.kind != "script" and row.scale(scale) else []):
                bad += [f"{name}/{scale}/{cell.id}: {o}" for o in cell.overrides
                        if o.split("=", 1)[0].endswith("root") and "=/" in o]
    assert not bad, bad[:5]


def test_data_preflight_checks_only_the_cells_selected(tmp_path):
    """HWA Fig 1 mixes MNIST and CIFAR-10 cells, each run with its own ``dataset.root``: ``--cells 'mnist/*'``
    must not fail on the CIFAR-10 cells' data (it did: the preflight built every cell's data set)."""
    from flatbnn.reproduce.preflight import check_data

    row = spec.load_row("hwa_fig1")
    assert {c.id.split("/")[0] for c in row.cells_for("cpu")} == {"cifar10", "mnist"}
    for glob, wanted, other in (("mnist/*", "MNIST", "CIFAR"), ("cifar10/*", "CIFAR", "MNIST")):
        with pytest.raises(FileNotFoundError) as e:
            check_data(row, "cpu", [f"dataset.root={tmp_path}"], cells_glob=glob)
        assert wanted in str(e.value) and other not in str(e.value), str(e.value)


def test_smoke_drops_checkpoints_only_of_finished_jobs_of_rows_nothing_reads(tmp_path):
    """A smoke pass of every row wrote ~16 GB (ImageNet SWAG checkpoints): rows no eval row or analysis script
    reads lose their finished jobs' checkpoints; an interrupted job keeps its checkpoint to resume."""
    assert {"flatbnn_t5", "flatbnn_fig1", "flatbnn_fig2", "flatbnn_sharpness"} <= set(spec.rows_reading("flatbnn_t2", "smoke"))
    assert spec.rows_reading("bsam_t1", "smoke") == ["bsam_t4"] and spec.rows_reading("flatbnn_t4", "smoke") == []
    cell = spec.Cell(id="m/swag", overrides=[], seeds=[0, 1])
    for seed, done in ((0, True), (1, False)):
        d = launch.run_dir(tmp_path, cell.id, seed)
        (d / "checkpoints").mkdir(parents=True)
        (d / "checkpoints" / "last.pt").write_bytes(b"x" * 1000)
        if done:
            (d / "results.json").write_text("{}")
    freed = launch.drop_finished_checkpoints(tmp_path, [(cell, 0), (cell, 1)])
    assert freed == 1000
    assert not (launch.run_dir(tmp_path, cell.id, 0) / "checkpoints").exists()
    assert (launch.run_dir(tmp_path, cell.id, 0) / "results.json").exists()
    assert launch.job_state(tmp_path, cell.id, 0)[0] == "done"
    assert launch.job_state(tmp_path, cell.id, 1)[0] == "interrupted"


def test_a_comparison_calls_a_job_a_live_process_trains_running_not_interrupted(tmp_path):
    """A comparison made while a campaign trains a cell (its run dir locked by a live process, a checkpoint on disk)
    listed the job as 'interrupted' (bsam_t6's page: 'sam_sgd: interrupted/pending' with seed 0 at epoch 73): it is
    'running'; once the lock is released, interrupted again."""
    from flatbnn.engine.lock import RunDirLock

    row = spec.load_row("bsam_t6")
    cell = next(c for c in row.cells_for("paper") if c.id == "fashion_mnist/lenet5/sam_sgd")
    d = launch.run_dir(tmp_path, cell.id, 0)
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "last.pt").write_bytes(b"x")
    lock = RunDirLock(d)
    lock.acquire()
    try:
        state, detail = compare.collect(row, "paper", tmp_path)["cells"][cell.id]["states"][0]
        assert state == "running" and f"pid {os.getpid()}" in detail, (state, detail)
    finally:
        lock.release()
    assert compare.collect(row, "paper", tmp_path)["cells"][cell.id]["states"][0][0] == "interrupted"


def test_smoke_runs_the_imagenet_convnets_at_64_px_and_fixed_size_nets_at_their_own():
    """The 224-px ImageNet ResNet-152 / DenseNet-161 smoke cells were half the CI smoke stage: they step at 64 px
    (their global pooling takes any size; data served resized, input_shape follows). A ViT's patch grid is fixed
    at 224, so its cells keep their size."""
    import torch
    from hydra.utils import instantiate

    cell = next(c for c in spec.load_row("flatbnn_t4").cells_for("smoke") if c.id == "resnet152/swag")
    ov = launch.smoke_overrides(launch.compose_cell(list(cell.overrides)), {})
    assert "dataset.image_size=64" in ov and "dataset.input_shape=[3,64,64]" in ov
    model = instantiate(launch.compose_cell(list(cell.overrides) + ov).model)
    assert model(torch.zeros(2, 3, 64, 64)).shape == (2, 1000)
    # ... at one block per stage: torchvision's ResNet with ResNet-152's widths (its 2048-wide last stage)
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [1, 1, 1, 1]
    assert model.fc.in_features == 2048 and sum(p.numel() for p in model.parameters()) < 11_000_000  # full: 60.2M
    for c in spec.load_row("fsam_t3").cells_for("smoke"):
        assert not any(o.startswith("dataset.image_size") for o in launch.smoke_overrides(
            launch.compose_cell(list(c.overrides)), {})), c.id


@pytest.mark.parametrize("row,cell_id,full,smoke", [
    ("fsam_t1", "cifar10/densenet121/sgd", 6_956_298, 1_000_000),   # DenseNet-121 -> one dense layer per block
    ("fsam_t1", "cifar10/vgg19_bn/sam", 20_000_000, 10_000_000),    # VGG-19-BN -> VGG-11-BN
    ("flatbnn_t3", "cifar10/resnet18/sgvb", 11_000_000, 5_000_000),  # ResNet-18 -> 10 (SGVB: mu and rho each)
])
def test_smoke_steps_the_big_cifar_nets_at_their_familys_smallest_size(row, cell_id, full, smoke):
    """The deep CIFAR nets of fsam_t1 / flatbnn_t3 were ~2-5 s a smoke job on the CI machine: their smoke cells
    build the same builder at its smallest depth; the row's own config still composes the full net."""
    from hydra.utils import instantiate

    cell = next(c for c in spec.load_row(row).cells_for("smoke") if c.id == cell_id)
    base = launch.compose_cell(list(cell.overrides))
    n_full = sum(p.numel() for p in instantiate(base.model).parameters())
    ov = launch.smoke_overrides(base, {})
    n_smoke = sum(p.numel() for p in instantiate(launch.compose_cell(list(cell.overrides) + ov).model).parameters())
    assert n_full >= full and n_smoke < smoke, (n_full, n_smoke, [o for o in ov if o.startswith("model.")])


def test_densenet_cifar_stage_blocks_keeps_growth_and_transitions():
    import torch

    from flatbnn.models import create_model

    full = create_model("densenet_cifar", num_classes=10, input_shape=[3, 32, 32])
    small = create_model("densenet_cifar", num_classes=10, input_shape=[3, 32, 32], stage_blocks=[1, 1, 1, 1])
    assert [len(full.features[i]) for i in (0, 2, 4, 6)] == [6, 12, 24, 16]
    assert [len(small.features[i]) for i in (0, 2, 4, 6)] == [1, 1, 1, 1]
    # stem 2k = 64 channels, each dense layer adds k = 32, transitions halve: 64+32 -> 48 -> 80 -> 40 -> 72 -> 36 -> 68
    assert small.stem.out_channels == 64 and small.head.in_features == 68
    assert small(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="stage_blocks"):
        create_model("densenet_cifar", num_classes=10, stage_blocks=[1, 1, 0, 1])


def test_stage_blocks_is_refused_with_pretrained_weights_and_keeps_the_named_nets_widths(tmp_path):
    """``stage_blocks`` (smoke runs) changes only the block counts: DenseNet-161's growth 48 / 96 stem features
    stay; weights of the full-depth net would not fit, so the two together are an error, not a partial load."""
    from flatbnn.models import create_model

    net = create_model("densenet161", num_classes=10, input_shape=[3, 64, 64], stage_blocks=[1, 1, 1, 1])
    assert net.features.conv0.out_channels == 96 and net.features.denseblock1.denselayer1.conv2.out_channels == 48
    assert len(net.features.denseblock3) == 1
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"x")
    with pytest.raises(ValueError, match="stage_blocks"):
        create_model("resnet152", num_classes=10, pretrained_path=str(weights), stage_blocks=[1, 1, 1, 1])
    assert len(create_model("resnet152", num_classes=10).layer3) == 36  # unset: the named net


def _finished_like(out_root: Path, row: spec.Row, cell_id: str, seed: int, extra=()) -> Path:
    """A finished run of ``row``'s cell as train.py leaves it: config_resolved.yaml (the composed cell config,
    resolved) + results.json -- without training it."""
    cell = next(c for c in row.cells_for("cpu") if c.id == cell_id)
    cfg = launch.compose_cell(list(cell.overrides) + list(extra) + [f"seed={seed}"])
    d = launch.run_dir(out_root / row.row / "cpu", cell_id, seed)
    d.mkdir(parents=True)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["reproduce"] = {"row": row.row, "cell": cell_id, "scale": "cpu"}
    (d / "config_resolved.yaml").write_text(yaml.safe_dump(resolved))
    (d / "results.json").write_text(json.dumps({"metrics": {"accuracy": 0.5 + seed / 10}, "meta": {"seed": seed}}))
    return d


def test_a_job_another_row_already_ran_is_linked_not_retrained(tmp_path, monkeypatch):
    out_root = tmp_path / "out"
    rows_dir = _tmp_rows(tmp_path, monkeypatch, out_root)
    base = ["dataset=digits", "model=mlp", "trainer.epochs=2", "trainer.progress=false"]
    for name, cells in [("src", {"sgd": ["flatness=none"], "sam": ["flatness=sam"]}),
                        ("dst", {"plain": ["flatness=none"], "sam": ["flatness=sam", "flatness.rho=0.1"],
                                 "sam05": ["flatness=sam", "flatness.rho=0.05"]})]:
        _write_row(rows_dir, name, {"method": cells}, base=base, seeds=[0, 1])
    src, dst = spec.load_row("src"), spec.load_row("dst")
    _finished_like(out_root, src, "sgd", 0)
    _finished_like(out_root, src, "sam", 0)                 # configs/flatness/sam.yaml's rho is 0.05
    _finished_like(out_root, src, "sam", 1, extra=["optimizer.lr=0.2"])  # seed 1 ran with another lr
    out = out_root / "dst" / "cpu"
    todo = [(c, s) for c in dst.cells_for("cpu") for s in c.seeds]
    found = launch.reusable_runs(todo, "cpu", out, ["dataset.root=/elsewhere"])  # data paths do not split
    # same config and seed only: not sgd/seed1 (never ran), not sam rho 0.1, not sam05/seed1 (other lr)
    assert set(found) == {("plain", 0), ("sam05", 0)}
    assert found[("sam05", 0)] == out_root / "src" / "cpu" / "sam" / "seed0"
    assert launch.reusable_runs(todo, "smoke", out, []) == {}   # smoke runs every cell itself
    s = launch.launch(dst, "cpu", out=out, dry_run=True)
    assert "plain__s0" not in " ".join(s["command"]) and "plain__s1" in " ".join(s["command"])
    for (cid, seed), source in found.items():
        launch.link_reused(out, cid, seed, source)
    state, detail = launch.job_state(out, "sam05", 0)
    assert state == "done" and detail.startswith("reused: ") and detail.endswith("src/cpu/sam/seed0")
    assert json.loads((out / "sam05" / "seed0" / "results.json").read_text())["metrics"]["accuracy"] == 0.5
    # a run dir that exists (a partial run of our own) is never replaced by a link
    (out / "sam05" / "seed1").mkdir(parents=True)
    _finished_like(out_root, src, "sam", 2)
    assert ("sam05", 1) not in launch.reusable_runs([(c, 1) for c in dst.cells_for("cpu")], "cpu", out, [])


def test_a_committed_record_of_another_row_is_linked_when_its_run_dir_is_gone(tmp_path, monkeypatch):
    """A fresh clone has no outputs/: the other rows' committed records still say which runs exist (bSAM Fig 4's
    default-rho cells are T1's). Not the row's own records (rerunning a row reproduces it), not a record that was
    itself a link (its source is indexed), and a live run dir wins over a record."""
    from flatbnn.reproduce import archive

    out_root, results = tmp_path / "out", tmp_path / "results"
    rows_dir = _tmp_rows(tmp_path, monkeypatch, out_root)
    monkeypatch.setattr(archive, "ARCHIVE_ROOT", results)
    base = ["dataset=digits", "model=mlp", "trainer.epochs=2", "trainer.progress=false"]
    for name, cells in [("src", {"sam": ["flatness=sam"]}), ("dst", {"sam05": ["flatness=sam", "flatness.rho=0.05"]})]:
        _write_row(rows_dir, name, {"method": cells}, base=base, seeds=[0, 1, 2])
    src, dst = spec.load_row("src"), spec.load_row("dst")
    for seed in (0, 1):
        run = _finished_like(out_root, src, "sam", seed)
        archive.archive_run(run, archive.record_dir(results, "src", "cpu", "sam", seed))
    own = _finished_like(tmp_path / "elsewhere", dst, "sam05", 2)   # dst's own record of seed 2
    archive.archive_run(own, archive.record_dir(results, "dst", "cpu", "sam05", 2))
    rec1 = archive.record_dir(results, "src", "cpu", "sam", 1)
    shutil.rmtree(out_root / "src" / "cpu" / "sam" / "seed1")       # seed 1: only its record is left
    out = out_root / "dst" / "cpu"
    todo = [(c, s) for c in dst.cells_for("cpu") for s in c.seeds]
    found = launch.reusable_runs(todo, "cpu", out, [], "dst")
    assert found == {("sam05", 0): out_root / "src" / "cpu" / "sam" / "seed0", ("sam05", 1): rec1}
    s = launch.launch(dst, "cpu", out=out, dry_run=True)
    assert [c for c in s["command"] if c.startswith("+cell=")] == ["+cell=sam05__s2"]   # its own record: retrained
    launch.link_reused(out, "sam05", 1, rec1)
    assert launch.job_state(out, "sam05", 1)[0] == "done"
    compare.archive_row(dst, "cpu", out, results)                  # dst's record of seed 1 is now a link ...
    assert json.loads((archive.record_dir(results, "dst", "cpu", "sam05", 1) / "record.json").read_text())[
        "reused_from"]
    # ... which a third row never reuses
    (rows_dir / "third.yaml").write_text((rows_dir / "dst.yaml").read_text().replace("dst", "third"))
    shutil.rmtree(results / "src")
    third = spec.load_row("third")
    found = launch.reusable_runs([(c, 1) for c in third.cells_for("cpu")], "cpu", out_root / "third" / "cpu", [],
                                 "third")
    assert found == {}


def _tmp_rows(tmp_path: Path, monkeypatch, out_root: Path) -> Path:
    """A row-spec folder of the test's own (spec.ROWS_DIR) and its sweeps under ``out_root`` (launch.OUTPUT_ROOT)."""
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    monkeypatch.setattr(launch, "OUTPUT_ROOT", out_root)
    return rows_dir


def _write_row(rows_dir: Path, name: str, values: dict, *, seeds: list[int], base=(), kind="train", **more) -> None:
    """A one-axis row spec (axis: ``values``' key) with a cpu and a smoke scale and no overrides of their own."""
    (rows_dir / f"{name}.yaml").write_text(yaml.safe_dump(
        {"row": name, "paper": "none", "title": name, "kind": kind, "axes": list(values), "base": list(base),
         "values": values, "seeds": seeds, "scales": {"cpu": {"overrides": []}, "smoke": {"overrides": []}}, **more}))


def test_missing_trains_only_what_no_fresh_record_of_the_row_holds(tmp_path, monkeypatch, capsys):
    """A row begun on one machine and finished on another (a fresh clone: the records, not the run dirs):
    ``run --missing`` skips the jobs the row's own committed records hold -- not a stale record (trained with
    another config than the spec's now), and not the jobs of another records root -- and says so; without it
    the recorded jobs are retrained (rerunning a row reproduces it) and the launcher points at --missing."""
    from flatbnn.reproduce import archive, cli

    out_root, results = tmp_path / "out", tmp_path / "results"
    rows_dir = _tmp_rows(tmp_path, monkeypatch, out_root)
    _write_row(rows_dir, "r", {"method": {"sam": ["flatness=sam", "flatness.rho=0.05"], "sgd": ["flatness=none"]}},
               base=["dataset=digits", "model=mlp", "trainer.epochs=2", "trainer.progress=false"], seeds=[0, 1, 2])
    row = spec.load_row("r")
    for seed, extra in [(0, []), (1, ["flatness.rho=0.1"])]:   # seed 1's record: trained at another rho
        run = _finished_like(tmp_path / "elsewhere", row, "sam", seed, extra)
        archive.archive_run(run, archive.record_dir(results, "r", "cpu", "sam", seed))
    out = out_root / "r" / "cpu"
    cells = lambda s: [c for c in s["command"] if c.startswith("+cell=")][0].split("=", 1)[1].split(",")
    s = launch.launch(row, "cpu", out=out, dry_run=True, missing=True, records=results)
    assert cells(s) == ["sgd__s0", "sam__s1", "sgd__s1", "sam__s2", "sgd__s2"]   # seed-major
    assert s["jobs"]["sam/seed0"]["state"] == "done" and s["jobs"]["sam/seed0"]["detail"].startswith("archived:")
    assert s["jobs"]["sam/seed1"]["state"] == "pending"
    err = capsys.readouterr().err
    assert "1 on record (--missing)" in err and "e.g. sam/seed1: retrained" in err
    everything = launch.launch(row, "cpu", out=out, dry_run=True, records=results)
    assert "sam__s0" in cells(everything) and len(cells(everything)) == 6
    assert "pass --missing to train only the others" in capsys.readouterr().err
    assert len(cells(launch.launch(row, "cpu", out=out, dry_run=True, missing=True))) == 6  # not the repo's records
    with pytest.raises(spec.SpecError, match="contradict"):
        launch.launch(row, "cpu", out=out, dry_run=True, missing=True, force=True)
    seen = {}
    monkeypatch.setattr(launch, "launch", lambda row, scale, **kw: seen.update(kw) or {"jobs": {}, "returncode": 0})
    assert cli.main(["run", "r", "--scale", "cpu", "--missing", "--dry-run", "--out", str(out),
                     "--results", str(results)]) == 0
    assert seen["missing"] is True and seen["records"] == results
    with pytest.raises(SystemExit):   # argparse refuses the pair before anything runs
        cli.main(["run", "r", "--scale", "cpu", "--missing", "--force"])


def test_an_eval_row_is_one_hydra_multirun_of_evaluations_that_a_launcher_can_take(tmp_path, monkeypatch):
    """bSAM T4 / FlatBNN T5 used to run evaluate.py one process after another on the machine calling reproduce.py
    (at paper scale: a login node), ignoring --launcher. Now each (cell, seed) is a member of one multirun of
    flatbnn.reproduce.eval_job: the job's result is evaluate.py's, a refused member fails alone, the data extras
    reach every evaluation and the hydra.* ones the sweep, and the aggregate reads the evaluated config."""
    from flatbnn.reproduce import aggregate

    out_root = tmp_path / "out"
    rows_dir = _tmp_rows(tmp_path, monkeypatch, out_root)
    _write_row(rows_dir, "trn", {"method": {"map": ["method=map"]}},
               base=["dataset=digits", "model=mlp", "trainer.epochs=1", "trainer.progress=false"], seeds=[0])
    _write_row(rows_dir, "ev", {"bins": {"b20": ["metrics.ece_bins=20"], "lr": ["optimizer.lr=0.5"]}}, seeds=[0],
               kind="eval", eval_from={"row": "trn", "cell": "map"})
    assert launch.launch(spec.load_row("trn"), "cpu")["returncode"] == 0
    src = out_root / "trn" / "cpu" / "map" / "seed0"
    row = spec.load_row("ev")
    dry = launch.launch_eval(row, "cpu", launcher="cpu_parallel", extra=["hydra.launcher.n_jobs=2"], dry_run=True)
    assert dry["command"][1:3] == ["-m", "flatbnn.reproduce.eval_job"] and "+cell=b20__s0,lr__s0" in dry["command"]
    assert dry["command"][-2:] == ["hydra/launcher=cpu_parallel", "hydra.launcher.n_jobs=2"]
    assert not (out_root / "ev").exists()                      # a dry run writes nothing

    s = launch.launch_eval(row, "cpu", extra=["trainer.eval_batch_size=7"])
    assert s["returncode"] == 1 and s["jobs"]["b20/seed0"]["state"] == "done"
    assert s["jobs"]["lr/seed0"]["state"] == "failed" and "optimizer.lr" in s["jobs"]["lr/seed0"]["detail"]
    out = out_root / "ev" / "cpu"
    got = json.loads((out / "b20" / "seed0" / "results.json").read_text())
    assert got == json.loads((src / "eval" / "ev" / "results.json").read_text())   # evaluate.py's own result
    assert got["meta"]["evaluated_from"]["overrides"] == ["metrics.ece_bins=20", "trainer.eval_batch_size=7"]
    trained = json.loads((src / "results.json").read_text())
    assert got["metrics"]["accuracy"] == trained["metrics"]["accuracy"]            # the same weights, re-evaluated
    assert got["meta"]["metric_conventions"]["ece_bins"] == 20 != trained["meta"]["metric_conventions"]["ece_bins"]
    runs, failed = aggregate.load_runs([out])
    assert [r.config["metrics"]["ece_bins"] for r in runs] == [20] and runs[0].config["dataset"]["name"] == "digits"
    assert [f.path.name for f in failed] == ["seed0"] and "optimizer.lr" in failed[0].message
    again = launch.launch_eval(row, "cpu", cells_glob="b20")   # a finished job is not evaluated again
    assert again["command"] == [] and again["jobs"]["b20/seed0"]["state"] == "done"
    compare.archive_row(row, "cpu", out, tmp_path / "results")    # a fresh clone: the record, no run dir
    shutil.rmtree(out / "b20")
    kept = launch.launch_eval(row, "cpu", cells_glob="b20", dry_run=True, missing=True, records=tmp_path / "results")
    assert kept["command"] == [] and kept["jobs"]["b20/seed0"]["detail"].startswith("archived:")
    assert "+cell=b20__s0" in launch.launch_eval(row, "cpu", cells_glob="b20", dry_run=True)["command"]


def test_bsam_rows_share_their_common_cells_with_table_1():
    """The cells the reuse saves (bSAM T3's bsam = T1's bsam; T5's M = 8 cells = T1's bsam and sam_sgd; VSAM T4's
    sgd / sam / vsam / rsam = T3's): a spec edit that makes them differ silently doubles their cost -- this fails."""
    def key(row, cell, scale="cpu"):
        c = next(c for c in spec.load_row(row).cells_for(scale) if c.id == cell)
        return launch.training_key(launch.compose_cell(list(c.overrides)), 0)

    t1 = "cifar10/resnet20_frn/"
    assert key("bsam_t3", t1 + "bsam") == key("bsam_t1", t1 + "bsam")
    assert key("bsam_t3", t1 + "bsam_no_noise") != key("bsam_t1", t1 + "bsam")
    assert key("bsam_t5", t1 + "bsam/m8") == key("bsam_t1", t1 + "bsam")
    assert key("bsam_t5", t1 + "sam_sgd/m8") == key("bsam_t1", t1 + "sam_sgd")
    assert key("bsam_fig4", t1 + "bsam/rho0.01") == key("bsam_t1", t1 + "bsam")
    assert key("bsam_fig4", t1 + "sam_sgd/rho0.05") == key("bsam_t1", t1 + "sam_sgd")
    assert key("bsam_fig4", t1 + "sam_adam/rho0.05") == key("bsam_t1", t1 + "sam_adam")
    for m in ("sgd", "sam", "vsam", "rsam"):
        assert key("vsam_t4", f"cifar10/wrn28x2/{m}") == key("vsam_t3", f"cifar10/wrn28x2/{m}"), m


def test_a_table_whose_paper_numbers_are_lost_lists_our_cells_and_ranks_its_pairs(tmp_path):
    row = spec.load_row("bsam_t1")   # results/paper/bsam_t1.yaml: available false, no cells
    out = tmp_path / "out"
    for s in range(3):
        _fake_run(out, "cifar10/resnet20_frn/bsam", s, 0.60 + s / 100, 1.1, ece=0.02)
        _fake_run(out, "cifar10/resnet20_frn/sam_sgd", s, 0.58, 1.2, ece=0.01)
    c = compare.build(row, "cpu", out)
    assert c["ours_only"]
    rec = {(r["cell"], r["metric"]): r for r in c["table"]}
    acc = rec[("cifar10/resnet20_frn/bsam", "accuracy")]
    assert acc["ours_mean"] == pytest.approx(61.0) and acc["ours_n"] == 3 and acc["paper_mean"] is None
    assert rec[("cifar10/resnet20_frn/sgd", "accuracy")]["state"] == "pending"
    d = {(x["cell"], x["metric"]): x for x in c["direction"]}
    assert d[("cifar10/resnet20_frn/bsam", "accuracy")]["ours_better"] == "yes"
    assert d[("cifar10/resnet20_frn/bsam", "nll")]["ours_better"] == "yes"     # lower is better
    assert d[("cifar10/resnet20_frn/bsam", "ece")]["ours_better"] == "no"
    assert all(x["agree"] is None for x in c["direction"])    # nothing to agree with: never counted as agreement
    md = compare_markdown.to_markdown(c)
    assert "## Our cells" in md and "| `cifar10/resnet20_frn/bsam` | 61.00 ± 1.00 (n=3) | 1.1000 ± 0.0000 (n=3)" in md
    assert "agrees with the paper" not in md


def test_a_pair_is_beyond_seed_noise_only_by_a_t_test_at_its_seed_count(tmp_path):
    def cell(m, sd, n):
        return {"ours_mean": m, "ours_std": sd, "ours_n": n}
    # Welch, 3 + 3 seeds of sd 0.3: se = sqrt(0.06) = 0.245, 4 dof, t = 2.776 -> 0.68. A difference of 0.6 is
    # INSIDE (a fixed 2 se = 0.49 would call it beyond), 0.8 outside
    W = False  # Welch: the default (cells trained separately)
    assert compare._separated(cell(1.0, 0.3, 3), cell(0.6, 0.3, 3), W) == ("no", pytest.approx(math.sqrt(0.06)))
    assert compare._separated(cell(1.2, 0.3, 3), cell(0.6, 0.3, 3), W)[0] == "no"
    assert compare._separated(cell(1.4, 0.3, 3), cell(0.6, 0.3, 3), W)[0] == "yes"
    assert compare._separated(cell(0.6, 0.3, 3), cell(1.4, 0.3, 3), W)[0] == "yes"     # either sign
    assert compare._separated(cell(1.2, None, 1), cell(0.6, 0.3, 3), W) == (None, None)  # one seed: no spread
    # a row whose cells share one trained run per seed (declared: paired) pairs them: a seed's shift shared by both
    # cells cancels. Welch, (60, 62, 64) vs (59.1, 60.9, 63.0) is inside the noise; paired, d = (0.9, 1.1, 1.0):
    # se 0.058, t(2 dof) 4.30 -> 0.25 < 1.0
    a = {**cell(62.0, 2.0, 3), "ours_by_seed": {"0": 60.0, "1": 62.0, "2": 64.0}}
    b = {**cell(61.0, 1.9, 3), "ours_by_seed": {"0": 59.1, "1": 60.9, "2": 63.0}}
    assert compare._separated(a, b, True) == ("yes", pytest.approx(0.1 / math.sqrt(3)))
    assert compare._separated(a, b, W)[0] == "no"           # shared seed numbers alone pair nothing
    assert compare._separated({**a, "ours_by_seed": {}}, b, True) == (None, None)   # no per-seed values: no test
    b_flip = {**b, "ours_by_seed": {"0": 61.0, "1": 60.9, "2": 61.1}}   # d = (-1, 1.1, 2.9): sd 1.95 -> inside
    assert compare._separated(a, b_flip, True)[0] == "no"
    # two seeds: d = (0.9, 1.1), se 0.1, 1 dof: t = 12.7 -> 1.27 > 1.0 is inside (2 se = 0.2 would say beyond)
    a2 = {"ours_by_seed": {"0": 60.0, "1": 62.0}}
    b2 = {"ours_by_seed": {"0": 59.1, "1": 60.9}}
    assert compare._separated(a2, b2, True) == ("no", pytest.approx(0.1))
    assert compare._separated(a2, {"ours_by_seed": {"0": 58.0, "1": 59.9}}, True)[0] == "yes"  # 2.05 > 0.64
    # through a comparison: seeds (61, 60, 59) vs (60.5, 60.5, 60.5) % -> inside; NLL 1.1 vs 1.2 flat -> beyond
    row = spec.load_row("bsam_t1")
    out = tmp_path / "out"
    for s in range(3):
        _fake_run(out, "cifar10/resnet20_frn/bsam", s, 0.61 - s / 100, 1.1, ece=0.02)
        _fake_run(out, "cifar10/resnet20_frn/sam_sgd", s, 0.605, 1.2, ece=0.01)
    _fake_run(out, "cifar10/resnet20_frn/sgd", 0, 0.50, 1.5)
    c = compare.build(row, "cpu", out)
    d = {(x["cell"], x["vs"].rsplit("/", 1)[1], x["metric"]): x for x in c["direction"]}
    assert d[("cifar10/resnet20_frn/bsam", "sam_sgd", "accuracy")]["ours_better"] == "no"
    assert d[("cifar10/resnet20_frn/bsam", "sam_sgd", "accuracy")]["beyond_noise"] == "no"
    assert d[("cifar10/resnet20_frn/bsam", "sam_sgd", "nll")]["beyond_noise"] == "yes"
    assert d[("cifar10/resnet20_frn/sam_sgd", "sgd", "accuracy")]["beyond_noise"] is None   # sgd: one seed
    md = compare_markdown.to_markdown(c)
    assert "Beyond seed noise" in md and "| 60.00 vs 60.50 | no |" in md
    judged = [x for x in c["direction"] if x["beyond_noise"]]
    assert f"{sum(x['beyond_noise'] == 'yes' for x in judged)} of {len(judged)} pairs" in md
    # the page names the test its column used: the row's declared design (a train row: Welch), never another
    line = next(x for x in md.splitlines() if x.startswith("Beyond seed noise"))
    assert c["seed_test"] == "welch" and line.startswith("Beyond seed noise (Welch t-test") and "paired" not in line
    eval_row = spec.load_row("bsam_t4")   # an eval row: its cells share one trained run per seed
    assert eval_row.seed_test()[0] == "paired"
    assert compare_markdown._noise_sentence(c["direction"], "paired").startswith(
        "Beyond seed noise (paired t-test over the seeds both cells have")


def test_seeds_option_runs_a_part_of_the_seeds_and_refuses_unknown_ones(tmp_path, monkeypatch):
    row = spec.load_row("bsam_t3")
    cells = launch.select_cells(row.cells_for("cpu"), "*/bsam", [0, 2])
    assert [(c.id, c.seeds) for c in cells] == [("cifar10/resnet20_frn/bsam", [0, 2])]
    with pytest.raises(spec.SpecError, match=r"seeds are \[0, 1, 2\]"):
        launch.select_cells(row.cells_for("cpu"), None, [3])
    s = launch.launch(row, "cpu", out=tmp_path / "t3", dry_run=True, seeds=[1])
    assert sorted(s["jobs"]) == ["cifar10/resnet20_frn/bsam/seed1", "cifar10/resnet20_frn/bsam_no_noise/seed1"]
    # an eval row's dry run over unfinished sources reports them and writes nothing
    monkeypatch.setattr(launch, "OUTPUT_ROOT", tmp_path / "runs")
    e = launch.launch_eval(spec.load_row("bsam_t4"), "cpu", out=tmp_path / "t4", dry_run=True, seeds=[0])
    assert e["returncode"] == 1 and len(e["jobs"]) == 7 and not (tmp_path / "t4").exists()


def test_hydra_overrides_after_the_separator_reach_the_multirun_not_the_job_config(tmp_path):
    # `reproduce.py run ROW -- hydra.launcher.n_jobs=1` used to die in compose() with a traceback
    row = spec.load_row("bsam_t3")
    s = launch.launch(row, "smoke", out=tmp_path / "t3", dry_run=True,
                      extra=["hydra.launcher.n_jobs=1", "trainer.progress=false"])
    assert s["command"][-2:] == ["hydra.launcher.n_jobs=1", "trainer.progress=false"]
    cfg = launch.compose_cell(["model=mlp", "hydra.launcher.n_jobs=1", "+hydra.job.env_set.X=1"])
    assert cfg.model.name == "mlp"
    with pytest.raises(Exception, match="trainer.progres"):   # a job key is still checked
        launch.compose_cell(["model=mlp", "trainer.progres=false"])


def test_cells_the_paper_does_not_print_are_listed_apart_and_never_compared(tmp_path):
    row = spec.load_row("vsam_t3")   # mfvi: our extension, no paper number
    out = tmp_path / "out"
    for s in range(2):
        _fake_run(out, "cifar10/wrn28x2/mfvi", s, 0.40 + s / 100, 1.5)
        _fake_run(out, "cifar10/wrn28x2/sgd", s, 0.38, 1.6)
    c = compare.build(row, "cpu", out)
    extra = {(r["cell"], r["metric"]): r for r in c["extra_table"]}
    assert extra[("cifar10/wrn28x2/mfvi", "accuracy")]["ours_mean"] == pytest.approx(40.5)
    assert not any(r["cell"].endswith("mfvi") for r in c["table"] + c["direction"])
    assert "| `cifar10/wrn28x2/mfvi` | 40.50 ± 0.71 (n=2) |" in compare_markdown.to_markdown(c)


def test_committed_records_stand_in_for_lost_run_dirs_and_add_up_with_new_seeds(tmp_path):
    """A row's seed 0 ran in one session, its outputs/ are gone, seeds 1-2 run in the next: the comparison must be
    the 3-seed table. write_comparison archives each finished run under <dest>/../<row>/<scale>/runs/; collect()
    reads a record only where the run dir holds no results.json (a live run wins), and a linked run keeps saying
    it was reused."""
    from flatbnn.reproduce import archive

    row = spec.load_row("bsam_t1")
    out, results = tmp_path / "out", tmp_path / "results"
    dest = results / "bsam_t1"
    cell = "cifar10/resnet20_frn/bsam"
    _fake_run(out, cell, 0, 0.60, 1.1)
    (out / cell / "seed0" / "metrics.jsonl").write_text('{"epoch": 1, "test/accuracy": 0.3}\n')
    src = tmp_path / "other_row" / "sgd"
    _fake_run(src.parent, "sgd", 0, 0.50, 1.3)
    (out / "cifar10/resnet20_frn/sgd").mkdir(parents=True)
    (out / "cifar10/resnet20_frn/sgd/seed0").symlink_to(src / "seed0", target_is_directory=True)
    compare_markdown.write_comparison(row, "cpu", out=out, dest=dest)
    rec = archive.record_dir(results, "bsam_t1", "cpu", cell, 0)
    assert json.loads((rec / "results.json").read_text())["metrics"]["accuracy"] == 0.60
    assert (rec / "metrics.jsonl").read_text() == '{"epoch": 1, "test/accuracy": 0.3}\n'
    assert not archive.archive_run(out / cell / "seed0", rec)  # unchanged: nothing rewritten

    shutil.rmtree(out)                                    # the next session: outputs/ is gone
    _fake_run(out, cell, 1, 0.62, 1.0)
    _fake_run(out, cell, 2, 0.64, 0.9)
    c = compare.build(row, "cpu", out, archive_root=results)
    acc = {(r["cell"], r["metric"]): r for r in c["table"]}[(cell, "accuracy")]
    assert acc["ours_n"] == 3 and acc["ours_mean"] == pytest.approx(62.0) and acc["state"] == "done"
    assert c["jobs"][cell] == {"0": "done", "1": "done", "2": "done"}
    assert "cifar10/resnet20_frn/sgd/seed0" in c["reused"]  # archived with the link it was
    assert compare.build(row, "cpu", out)["jobs"][cell]["0"] == "pending"  # another out reads no records
    # a live run wins over its record, and writing the comparison refreshes the record from it
    _fake_run(out, cell, 0, 0.70, 1.0)
    c = compare.build(row, "cpu", out, archive_root=results)
    assert {(r["cell"], r["metric"]): r for r in c["table"]}[(cell, "accuracy")]["ours_mean"] == pytest.approx(65.333333)
    compare_markdown.write_comparison(row, "cpu", out=out, dest=dest)
    assert json.loads((rec / "results.json").read_text())["metrics"]["accuracy"] == 0.70
    assert archive.archived(results, "bsam_t1", "smoke", cell, 0) is None  # never at smoke scale


def test_a_tie_on_one_side_is_undecided_not_a_disagreement(tmp_path):
    """FSAM T4 at cpu scale: SAM and FSAM tie (10.00 vs 10.00, as they did at 60 % noise) where the paper ranks
    FSAM first. That tie is no evidence against the paper: neither counted as agreeing nor as disagreeing."""
    row = spec.load_row("fsam_t4")
    out = tmp_path / "out"
    _fake_run(out, "n40/sam", 0, 0.10, 2.3)
    _fake_run(out, "n40/fsam", 0, 0.10, 2.3)
    _fake_run(out, "n20/sam", 0, 0.30, 2.0)
    _fake_run(out, "n20/fsam", 0, 0.20, 2.1)
    c = compare.build(row, "cpu", out)
    d = {(x["cell"], x["metric"]): x for x in c["direction"]}
    assert d[("n40/fsam", "accuracy")]["ours_better"] == "tie" and d[("n40/fsam", "accuracy")]["agree"] is None
    assert d[("n20/fsam", "accuracy")]["agree"] is True   # paper: FSAM 93.03 < SAM 93.12; ours 20 < 30
    assert "agrees with the paper on 1 of 1 comparisons (pending: 2; undecided, a tie on one side only: 1)" in \
        compare_markdown.to_markdown(c)


def test_a_cell_at_chance_ranks_nothing(tmp_path):
    """FSAM T1's first cpu budget, ResNet-56 (now the second net's cells): SAM 11.1 % and FSAM 10.0 % on 1,000 test
    images of 10 classes -- both within 3 binomial standard errors of 1/10 (10 % + 2.85 %), i.e. networks that
    learned nothing. 'FSAM worse than SAM' there is noise, so the pair is undecided; SAM (at chance) vs SGD
    (19.6 %) too. A cell where one seed trained is not at chance; ResNet-20's trained cells are still compared."""
    row = spec.load_row("fsam_t1")
    out = tmp_path / "out"
    for s in range(2):
        _fake_run(out, "cifar10/wrn28x2/sgd", s, 0.196, 2.2, num_classes=10)
        _fake_run(out, "cifar10/wrn28x2/sam", s, 0.111, 2.30, num_classes=10)
        _fake_run(out, "cifar10/wrn28x2/fsam", s, 0.100, 2.30, num_classes=10)
        _fake_run(out, "cifar10/resnet20/sam", s, [0.129, 0.30][s], 2.0, num_classes=10)  # seed 1 trained
        _fake_run(out, "cifar10/resnet20/fsam", s, 0.25, 2.1, num_classes=10)
    c = compare.build(row, "cpu", out)
    cells = {r["cell"]: r["at_chance"] for r in c["table"] if r["metric"] == "accuracy"}
    assert cells["cifar10/wrn28x2/sam"] and cells["cifar10/wrn28x2/fsam"]
    assert not cells["cifar10/wrn28x2/sgd"] and not cells["cifar10/resnet20/sam"]
    d = {(x["cell"], x["metric"]): x for x in c["direction"]}
    for pair in ("cifar10/wrn28x2/fsam", "cifar10/wrn28x2/sam"):
        assert d[(pair, "accuracy")]["agree"] is None and d[(pair, "accuracy")]["undecided"].startswith("at chance")
    assert d[("cifar10/resnet20/fsam", "accuracy")]["agree"] is True  # paper: FSAM > SAM; ours 25 > 21.45
    md = compare_markdown.to_markdown(c)
    assert "on 1 of 1 comparisons (pending: 1; undecided, a cell of ours at chance: 2)" in md
    assert md.count("| 2/3 seeds · at chance |") == 2   # the second net's SAM and FSAM; not SGD, not ResNet-20 SAM
    # the boundary: 1/10 + 3 sqrt(0.09 / 1000) = 12.85 %; 12.9 % is above it
    assert not compare._at_chance({"metrics": {"accuracy": 0.129}, "meta": {"budget": {"test_size": 1000}}},
                                  out / "cifar10/wrn28x2/sam/seed0")
    assert compare._at_chance({"metrics": {"accuracy": 0.128}, "meta": {"budget": {"test_size": 1000}}},
                              out / "cifar10/wrn28x2/sam/seed0")
    # no config (K unknown): never at chance
    assert not compare._at_chance({"metrics": {"accuracy": 0.1}, "meta": {"budget": {"test_size": 1000}}}, tmp_path)


def _run_with_config(out: Path, row, cell_id: str, seed: int, acc: float, change: list[str] = (), add: dict = None):
    """A finished run whose config_resolved.yaml is what the spec composes for the cell (+ ``change``), as train.py
    saves it, with the launcher's command line in meta.overrides."""
    from omegaconf import OmegaConf

    cell = next(c for c in row.cells_for("cpu") if c.id == cell_id)
    extra = ["dataset.root=/data/cifar10_jpeg.tar.gz"]
    cfg = launch.compose_cell(list(cell.overrides) + extra + list(change))
    OmegaConf.update(cfg, "seed", seed, force_add=True)
    config = OmegaConf.to_container(cfg, resolve=True)
    for k, v in (add or {}).items():
        config.setdefault(k.split(".")[0], {})[k.split(".")[1]] = v
    _fake_run(out, cell_id, seed, acc, 2.0)
    d = out / cell_id / f"seed{seed}"
    (d / "config_resolved.yaml").write_text(yaml.safe_dump(config))
    res = json.loads((d / "results.json").read_text())
    res["meta"]["overrides"] = [f"+cell={cell_id.replace('/', '__')}__s{seed}"] + extra
    (d / "results.json").write_text(json.dumps(res))
    return d


def test_a_run_trained_with_another_config_than_the_spec_is_stale_not_compared(tmp_path, capsys):
    """FSAM T4's cpu scale moved from ResNet-32 to ResNet-20: a finished ResNet-32 run (or its committed record)
    left under the same cell id must not stand in for the ResNet-20 cell. It is listed as stale with the command
    that reruns it, never archived, and the launcher says so; the spec's own config -- plus a key only the run has
    (a default dropped since) -- is not stale."""
    from flatbnn.reproduce import archive

    row = spec.load_row("fsam_t4")
    out, results = tmp_path / "out", tmp_path / "results"
    _run_with_config(out, row, "n20/sgd", 0, 0.36, change=["model=resnet32"])
    _run_with_config(out, row, "n20/sam", 0, 0.30, add={"trainer.dropped_key": 1})
    cells = {c.id: c for c in row.cells_for("cpu")}
    why = launch.stale_run(cells["n20/sgd"], 0, out / "n20/sgd/seed0")
    assert why is not None and "model.depth: 32 -> 20" in why
    assert launch.stale_run(cells["n20/sam"], 0, out / "n20/sam/seed0") is None
    c = compare.build(row, "cpu", out, archive_root=results)
    assert c["jobs"]["n20/sgd"]["0"] == "stale" and c["jobs"]["n20/sam"]["0"] == "done"
    acc = {(r["cell"], r["metric"]): r for r in c["table"]}
    assert acc[("n20/sgd", "accuracy")]["ours_n"] == 0 and acc[("n20/sam", "accuracy")]["ours_n"] == 1
    assert "- STALE `n20/sgd/seed0` (left out): trained with another config than the spec's (model.depth: 32 -> 20" \
        in compare_markdown.to_markdown(c)
    assert "--cells 'n20/sgd' --seeds 0 --force" in c["stale"]["n20/sgd/seed0"]
    compare_markdown.write_comparison(row, "cpu", out=out, dest=results / "fsam_t4")
    assert archive.archived(results, "fsam_t4", "cpu", "n20/sam", 0) is not None
    assert archive.archived(results, "fsam_t4", "cpu", "n20/sgd", 0) is None   # never recorded
    launch.launch(row, "cpu", out=out, dry_run=True, seeds=[0], cells_glob="n20/s*")
    assert "1 finished runs were trained with another config than the spec's now, e.g. n20/sgd/seed0" in \
        capsys.readouterr().err


# ------------------------------------------------------------------ unreadable records and paper files (issue 54)
BROKEN_QUOTE = 'row: r\npaper: none\ncells: []\nclaims:\n- id: x\n  quote: "a "quoted" word"\n'


def _row_r(tmp_path, monkeypatch, paper: str | None = None):
    """A one-axis digits row ``r`` (cpu scale) with its own rows/, results/paper/, results/reproduce/ and outputs/."""
    from flatbnn.reproduce import archive, protocol

    rows, papers, results = tmp_path / "rows", tmp_path / "paper", tmp_path / "results"
    for d in (rows, papers, results):
        d.mkdir()
    (rows / "r.yaml").write_text(yaml.safe_dump(
        {"row": "r", "paper": "none", "title": "r", "kind": "train", "axes": ["method"],
         "base": ["dataset=digits", "model=mlp"], "values": {"method": {"sgd": ["flatness=none"]}}, "seeds": [0],
         "scales": {"cpu": {"overrides": []}, "smoke": {"overrides": []}}}))
    if paper is not None:
        (papers / "r.yaml").write_text(paper)
    monkeypatch.setattr(spec, "ROWS_DIR", rows)
    for mod in (spec, status, protocol):
        monkeypatch.setattr(mod, "PAPER_DIR", papers)
    for mod in (compare, compare_markdown, status):
        monkeypatch.setattr(mod, "RESULTS_ROOT", results)
    monkeypatch.setattr(archive, "ARCHIVE_ROOT", results)
    monkeypatch.setattr(launch, "OUTPUT_ROOT", tmp_path / "outputs")
    monkeypatch.setattr(status, "STATUS_PATH", tmp_path / "STATUS.md")
    return results


def _one_reproduce_line(capsys, rc, path: Path) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, (rc, err)
    assert err[0].startswith(f"reproduce: error: {path}:"), err
    return err[0]


def test_a_truncated_record_results_json_or_comparison_is_one_line_naming_the_file_and_writes_nothing(
        tmp_path, monkeypatch, capsys):
    """Issue 54: a truncated committed record.json / results.json made ``compare`` end in a 29-line JSONDecodeError
    traceback (exit 1). Now ``file:line:column: message``, exit 2, in compare and status; no page from a partial read."""
    from flatbnn.reproduce import archive, cli

    results = _row_r(tmp_path, monkeypatch)
    rec = archive.record_dir(results, "r", "cpu", "sgd", 0)
    rec.mkdir(parents=True)
    _fake_run(tmp_path / "src", "sgd", 0, 0.9, 0.3)
    good = (tmp_path / "src" / "sgd" / "seed0" / "results.json").read_text()
    (rec / "results.json").write_text(good)
    (rec / "record.json").write_text(json.dumps({"trained_on": "cpu, torch 2, commit abc"}))
    assert cli.main(["compare", "r", "--scale", "cpu"]) == 0
    page = tmp_path / "outputs" / "comparison" / "r" / "cpu.md"
    before = page.read_bytes()
    capsys.readouterr()
    for name, text in (("results.json", good[:40]), ("record.json", "")):
        (rec / name).write_text(text)
        line = _one_reproduce_line(capsys, cli.main(["compare", "r", "--scale", "cpu"]), rec / name)
        assert "truncated or corrupt" in line, line
        assert page.read_bytes() == before  # not rewritten from what could be read
        (rec / name).write_text(good if name == "results.json" else "{}")
    (results / "r").mkdir(exist_ok=True)
    (results / "r" / "cpu.json").write_text('{"jobs": {"sgd": ')  # a committed comparison, cut
    _one_reproduce_line(capsys, cli.main(["status"]), results / "r" / "cpu.json")
    assert not (tmp_path / "STATUS.md").exists()


def test_a_yaml_error_in_a_paper_file_is_one_line_naming_it_in_check_compare_run_and_status(tmp_path, monkeypatch,
                                                                                          capsys):
    """Issue 54: an unescaped quote in a claim's ``quote:`` made check, compare, run and status end in a 60-70-line
    traceback naming ``<unicode string>``. Now each says ``<file>:6:14: YAML syntax error: ...`` once, exit 2; run
    launches nothing."""
    from flatbnn.reproduce import cli

    _row_r(tmp_path, monkeypatch, paper=BROKEN_QUOTE)
    bad = tmp_path / "paper" / "r.yaml"
    assert cli.main(["check", "--no-compose"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{bad}:6:14: YAML syntax error: while parsing a block mapping expected <block end>, but found "
                   "'<scalar>'", "1 rows checked, 1 problems"], err
    launched = []
    monkeypatch.setattr(launch, "run_sweep", lambda cmd: launched.append(cmd) or 0)
    for argv in (["compare", "r", "--scale", "cpu"], ["run", "r", "--scale", "cpu", "--out", str(tmp_path / "o")],
                 ["status"]):
        line = _one_reproduce_line(capsys, cli.main(argv), bad)
        assert line.startswith(f"reproduce: error: {bad}:6:14: YAML syntax error"), (argv, line)
    assert launched == [] and not (tmp_path / "STATUS.md").exists()


def test_a_paper_page_states_the_verdict_rule_only_where_there_are_numbers_to_apply_it_to(tmp_path):
    out = tmp_path / "out"
    for s in range(3):
        _fake_run(out, "cifar10/resnet20_frn/bsam", s, 0.60 + s / 100, 1.1, ece=0.02)
    printed = compare.build(spec.load_row("fsam_t1"), "paper", out)  # printed numbers: the rule is stated
    line = next(x for x in compare_markdown.to_markdown(printed).splitlines() if x.startswith("**Progress"))
    assert line.endswith("outside if any metric is outside the paper's ±2σ).")
    for s in range(5):
        _fake_run(out, "mnist/hwa", s, 0.98, 0.05)
    for s in range(3):
        _fake_run(out, "mnist/mlp/sgd/none", s, 0.98, 0.05)
    # no numbers, each for its own reason (compare.no_numbers): lost from our copy (bsam_t1), a figure that prints none
    # (hwa_fig1), our own row with no paper (posterior_flatness_grid) -- the page names it, and no paper spread
    for row, kind, progress in (("bsam_t1", "lost", "1/14 cells done (the paper's numbers are lost from our copy, so no "
                                                   "per-cell verdicts)"),
                                ("hwa_fig1", "figure", "1/6 cells done (a figure: the paper prints no numbers, so no "
                                                       "per-cell verdicts)"),
                                ("posterior_flatness_grid", "ours", "1/80 cells done (our own row: no paper numbers, so "
                                                                    "no per-cell verdicts)")):
        c = compare.build(spec.load_row(row), "paper", out)
        assert compare.no_numbers(c) == kind, row
        lines = compare_markdown.to_markdown(c).splitlines()
        assert next(x for x in lines if x.startswith("**Progress")) == f"**Progress: {progress}**.", row
        assert next(x for x in lines if x.startswith("**Scale")) == \
            f"**Scale: paper.** {compare_markdown.NO_NUMBERS_BANNER[kind]}", row
        assert not any("paper's spread" in x or "±2σ" in x for x in lines), row
