"""scripts/campaign.py: a budget that interrupts a cell, the archive that carries it to a fresh machine, and the
resumed run that ends with the uninterrupted run's metrics and config (flatbnn/reproduce/campaign.py); the
throughput table the queue and the dry runs read (flatbnn/reproduce/cost.py)."""

from __future__ import annotations

import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from helpers import REPO, compose_cfg
from omegaconf import OmegaConf

from flatbnn.reproduce import archive, campaign, cost, launch, spec
from flatbnn.reproduce.aggregate import config_key

BASE = ["dataset=digits", "model=mlp", "trainer.progress=false", "trainer.reliability_diagram=false",
        "trainer.batch_size=64", "trainer.limit_train_batches=2", "trainer.checkpoint_every=0"]
LONG_EPOCHS = 30


def _row(rows_dir: Path, scale: str = "paper") -> None:
    """Two digits/MLP cells at ``scale``: a 1-epoch one (cheaper: queued first) and a long one."""
    (rows_dir / "tiny.yaml").write_text(yaml.safe_dump(
        {"row": "tiny", "paper": "none", "title": "tiny", "kind": "train", "axes": ["method"], "base": BASE,
         "values": {"method": {"short": ["trainer.epochs=1"], "long": [f"trainer.epochs={LONG_EPOCHS}"]}},
         "seeds": [0], "scales": {scale: {"overrides": []}, "smoke": {"overrides": []}}}))


def _train_rows(tmp_path, monkeypatch, rows: dict[str, dict[str, list[str]]], seeds=(0,),
                default_outputs: Path | None = None) -> tuple[Path, Path]:
    """Train rows ``{row: {cell: overrides}}`` (axis method, ``BASE``, a paper and a smoke scale) in a rows dir of their
    own, with runs under ``tmp_path/o`` (also the launcher's default outputs, unless ``default_outputs`` names
    another), records under ``tmp_path/r`` and no measured rates. Returns (runs root, records root)."""
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    monkeypatch.setattr(cost, "RECORDS_ROOT", tmp_path / "no_records")
    out_root, results = tmp_path / "o", tmp_path / "r"
    monkeypatch.setattr(launch, "OUTPUT_ROOT", default_outputs or out_root)
    monkeypatch.setattr(archive, "ARCHIVE_ROOT", results)
    for name, cells in rows.items():
        (rows_dir / f"{name}.yaml").write_text(yaml.safe_dump(
            {"row": name, "paper": "none", "title": name, "kind": "train", "axes": ["method"], "base": BASE,
             "values": {"method": cells}, "seeds": list(seeds), "scales": {"paper": {"overrides": []},
                                                                          "smoke": {"overrides": []}}}))
    return out_root, results


def _clock_stopping_when(cond):
    """A monotonic clock that jumps past any deadline once ``cond()`` holds: the budget runs out at a known point
    of the run (after the short cell finished and the long one trained an epoch) on a loaded 2-core machine too."""
    def clock():
        return time.monotonic() + (1e9 if cond() else 0.0)
    return clock


def test_budget_interrupts_a_cell_and_the_archive_finishes_it_elsewhere_with_the_uninterrupted_metrics(
        tmp_path, monkeypatch, capsys):
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    monkeypatch.setattr(launch, "OUTPUT_ROOT", tmp_path / "unused")
    monkeypatch.setattr(archive, "ARCHIVE_ROOT", tmp_path / "unused_records")
    monkeypatch.setattr(cost, "RECORDS_ROOT", tmp_path / "no_records")
    _row(rows_dir)
    out1, res1 = tmp_path / "m1" / "outputs", tmp_path / "m1" / "results"
    p = campaign.plan(["tiny"], device="cpu", out_root=out1, results_root=res1)
    assert [j.name for j in p.jobs] == ["tiny/short/seed0", "tiny/long/seed0"]   # cheapest first
    long_run = p.jobs[1].run
    stop = _clock_stopping_when(lambda: (p.jobs[0].run / "results.json").exists() and
                                (long_run / "metrics.jsonl").is_file() and
                                len((long_run / "metrics.jsonl").read_text().splitlines()) >= 1)
    r = campaign.run(p, budget_s=3600, procs=1, margin_s=30, results_root=res1, poll_s=0.05, clock=stop)
    assert r["finished"] == ["tiny/short/seed0"] and r["interrupted"] == ["tiny/long/seed0"] and r["stopped"]
    assert not (long_run / "results.json").exists() and (long_run / "checkpoints" / "last.pt").is_file()
    done_epochs = len((long_run / "metrics.jsonl").read_text().splitlines())
    assert 1 <= done_epochs < LONG_EPOCHS
    rec = archive.record_dir(res1, "tiny", "paper", "short", 0)
    assert "torch" in json.loads((rec / "record.json").read_text())["trained_on"]  # device, torch, commit
    tgz = tmp_path / "chain.tgz"
    a = campaign.write_archive(tgz, p.jobs, [spec.load_row("tiny")], results_root=res1)
    assert a["runs"] == ["tiny/long/seed0"] and not a["left_out"] and a["bytes"] < 16 * 2**20

    # a fresh machine: nothing but the archive; the command line restores it, trains only the long cell (the short
    # one's record counts), writes the comparison and the next archive
    out2, res2 = tmp_path / "m2" / "outputs", tmp_path / "m2" / "results"
    sys.path.insert(0, str(REPO / "scripts"))
    import campaign as campaign_cli

    tgz2 = tmp_path / "chain2.tgz"
    assert campaign_cli.main(["--rows", "tiny", "--minutes", "60", "--device", "cpu", "--procs", "1", "--restore",
                              str(tgz), "--archive-out", str(tgz2), "--out", str(out2), "--results", str(res2)]) == 0
    err = capsys.readouterr().err
    assert "restored 1 unfinished run(s)" in err and "1 jobs queued, 1 already done" in err
    assert "1 finished, 0 interrupted (resumable), 0 failed, 0 not started" in err
    assert "**Progress: 2/2 cells done" in (res2 / "tiny" / "paper.md").read_text()
    with tarfile.open(tgz2) as t:  # nothing left unfinished: only the records and the comparison travel on
        assert not [n for n in t.getnames() if n.startswith("runs/")] and "results/tiny/paper.md" in t.getnames()
    log = (out2 / "tiny" / "paper" / ".campaign" / f"long__s0.pid{os.getpid()}.log").read_text()  # this process's
    assert "resum" in log.lower(), log[-2000:]   # it continued from the checkpoint, not from scratch

    # the uninterrupted reference: what `scripts/reproduce.py run tiny --scale paper` does
    ref = tmp_path / "ref"
    s = launch.launch(spec.load_row("tiny"), "paper", out=ref)
    assert s["returncode"] == 0
    for cell, run in [("short", archive.record_dir(res2, "tiny", "paper", "short", 0)),
                      ("long", out2 / "tiny" / "paper" / "long" / "seed0")]:
        got, want = (json.loads((d / "results.json").read_text()) for d in (run, ref / cell / "seed0"))
        untimed = [{k: v for k, v in r["metrics"].items() if not k.endswith("_seconds")} for r in (got, want)]
        assert untimed[0] == untimed[1] and "accuracy" in untimed[0], cell
        # the same composed config as the launcher's (scheduling changed, no hyperparameter)
        cfg_got, cfg_want = (yaml.safe_load((d / "config_resolved.yaml").read_text()) for d in (run, ref / cell / "seed0"))
        assert config_key(cfg_got) == config_key(cfg_want), cell
        assert cfg_got["trainer"]["epochs"] == (1 if cell == "short" else LONG_EPOCHS)


def test_archive_leaves_out_what_does_not_fit_and_restore_refuses_foreign_members(tmp_path, monkeypatch):
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    _row(rows_dir)
    row = spec.load_row("tiny")
    out = tmp_path / "outputs"
    jobs = [campaign.Job(row, c, 0, None, out / "tiny" / "paper", []) for c in row.cells_for("paper")]
    for j in jobs:       # random bytes: a checkpoint does not compress either
        size = {"short": 200_000, "long": 3_000_000}[j.cell.id]
        (j.run / "checkpoints").mkdir(parents=True)
        (j.run / "checkpoints" / "last.pt").write_bytes(os.urandom(size))
    (tmp_path / "results" / "tiny").mkdir(parents=True)
    (tmp_path / "results" / "tiny" / "paper.md").write_text("# table\n")
    tgz = tmp_path / "a.tgz"
    a = campaign.write_archive(tgz, jobs, [row], limit_mb=1, results_root=tmp_path / "results")
    assert a["runs"] == ["tiny/short/seed0"] and list(a["left_out"]) == ["tiny/long/seed0"]
    assert "does not fit the 1 MB archive" in a["left_out"]["tiny/long/seed0"] and tgz.stat().st_size <= 2**20
    with tarfile.open(tgz) as t:
        assert "results/tiny/paper.md" in t.getnames()
    evil = tmp_path / "evil.tgz"
    with tarfile.open(evil, "w:gz") as t:
        t.add(tmp_path / "results" / "tiny" / "paper.md", arcname="runs/../../etc/x")
    with pytest.raises(spec.SpecError, match="not a campaign archive"):
        campaign.restore(evil, out_root=tmp_path / "o", results_root=tmp_path / "r")


def test_a_run_record_is_a_measured_rate_and_an_unmatched_config_is_assumed(tmp_path):
    run = tmp_path / "records" / "row" / "cpu" / "runs" / "a" / "seed0"
    run.mkdir(parents=True)
    cfg = {"model": {"name": "mlp"}, "method": {"_target_": "flatbnn.methods.MAP"},
           "flatness": {"_target_": "flatbnn.flatness.SAM", "m": None}, "trainer": {"precision": "fp32"}}
    (run / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
    (run / "results.json").write_text(json.dumps({"meta": {
        "budget": {"train_size": 1000, "epochs": 4}, "train_seconds": 8.0,
        "hardware": {"device": "cpu", "cpu_count": 2}}}))
    rates = cost.measured_rates(tmp_path / "no_bench", tmp_path / "records")
    [r] = rates[("cpu", cost.work_key(cfg), "")]
    assert r.measured and r.images_per_s == pytest.approx(500.0)   # 1000 images x 4 epochs / 8 s
    assert ("nvidia-h200", cost.work_key(cfg), "") not in rates      # a CPU record says nothing about a GPU


def test_a_deep_ensemble_record_prices_its_cell_at_its_own_wall_time(tmp_path, monkeypatch):
    """A deep ensemble's record counts every member's epochs in its budget (engine/results.py: trainer.epochs x
    members); counting the members again priced the grid's 3-member cells at a third of what they took (the MNIST
    deep_ens/none runs took ~7 min, the FashionMNIST cells were priced ~2 min)."""
    run = tmp_path / "records" / "row" / "cpu" / "runs" / "ens" / "seed0"
    run.mkdir(parents=True)
    cfg = compose_cfg(["method=deep_ens", "method.num_members=3", "flatness=none", "trainer.epochs=4",
                       "dataset=mnist", "dataset.train_subset=1000", "dataset.test_subset=300", "model=mlp"])
    (run / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run / "results.json").write_text(json.dumps({"meta": {
        "budget": {"train_size": 1000, "epochs": 12}, "train_seconds": 60.0,   # 3 members x 4 epochs in 60 s
        "hardware": {"device": "cpu", "cpu_count": 2}}}))
    monkeypatch.setattr(cost, "RECORDS_ROOT", tmp_path / "records")
    monkeypatch.setattr(cost, "BENCH_DIR", tmp_path / "no_bench")
    cost._measured_rates.cache_clear()
    try:
        est = cost.estimate(cfg, "cpu")
    finally:
        cost._measured_rates.cache_clear()
    assert est.rate.measured and est.rate.images_per_s == pytest.approx(200.0)   # 12,000 images / 60 s
    assert est.seconds == pytest.approx(60.0 + 300 * 3 / 3.0 / 200.0)            # training + the 3-member evaluation


def test_a_benchmark_supersedes_the_runs_that_finished_before_it_and_later_runs_join_it(tmp_path):
    """VOGN's MNIST MLP cells were priced at 7.8 h from runs of the 607 ms step after the step fell to 88 ms: a run
    measured before the newest benchmark of its step (same device) measured older code and must not price today's."""
    model = yaml.safe_load((cost.CONFIGS_DIR / "model" / "mlp.yaml").read_text())
    cfg = {"model": model, "dataset": {"input_shape": [1, 28, 28]}, "trainer": {"precision": "fp32"},
           "method": {"_target_": "flatbnn.methods.vogn.VOGN", "m": 8, "batched_parts": "auto"},
           "flatness": {"_target_": "flatbnn.flatness.NoFlatness"}}
    key = ("cpu", cost.work_key(cfg), "batched")   # VOGN's auto: batched on a CPU too
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "cpu-2026-11-28.json").write_text(json.dumps({
        "date": "2026-11-28T22:54:21+00:00", "device": {"type": "cpu", "slug": "cpu"},
        "settings": {"model": "mlp", "input_shape": [1, 28, 28], "precision": "fp32", "batch_size": 200},
        "rows": {"vogn_m8+none": {"kind": "step", "images_per_s": 2000.0}}}))

    def record(name, finished_at, seconds):
        run = tmp_path / "records" / "row" / "cpu" / "runs" / name / "seed0"
        run.mkdir(parents=True)
        (run / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
        (run / "results.json").write_text(json.dumps({"meta": {
            "budget": {"train_size": 1000, "epochs": 4}, "train_seconds": seconds, "finished_at": finished_at,
            "hardware": {"device": "cpu", "cpu_count": 2}}}))

    record("old", "2026-11-25T16:10:32+00:00", 40.0)   # 100 images/s: the old step
    cost._measured_rates.cache_clear()
    [r] = cost.measured_rates(bench, tmp_path / "records")[key]
    assert r.images_per_s == 2000.0 and "cpu-2026-11-28.json" in r.basis
    record("new", "2026-11-29T01:00:00+00:00", 2.5)    # 1600 images/s, after the benchmark: joins it
    cost._measured_rates.cache_clear()
    assert sorted(r.images_per_s for r in cost.measured_rates(bench, tmp_path / "records")[key]) == [1600.0, 2000.0]
    assert sorted(r.images_per_s for r in cost.measured_rates(tmp_path / "none", tmp_path / "records")[key]) == \
        [100.0, 1600.0]                                 # no benchmark: every run counts


def test_a_benchmark_row_prices_only_the_runs_that_take_its_path_of_the_m_parts(tmp_path):
    """The loop and batched rows of one pair differ up to 3.6x (SAM m = 8 on the MNIST MLP: 78 vs 22 ms): the
    estimate of a run that loops must not come from the batched row (it did: whichever row came last won), and
    bSAM's batched_parts=auto batches on a GPU, and on a CPU where every parameter is a Linear's (the MLP: the
    parts-Linear path), else loops there (LeNet-5) -- for the benchmarked network as for the priced run."""
    model = yaml.safe_load((cost.CONFIGS_DIR / "model" / "mlp.yaml").read_text())
    bench = tmp_path / "bench"
    bench.mkdir()
    for slug, rows in (("cpu", {"map+sam_m8": 100.0, "map+sam_m8_batched": 400.0, "bsam_loop+none": 50.0,
                                "bsam_batched+none": 30.0}),
                       ("some-gpu", {"bsam+none": 7000.0, "bsam_loop+none": 900.0})):
        (bench / f"{slug}-2026-11-28.json").write_text(json.dumps({
            "date": "2026-11-28T22:54:21+00:00", "device": {"type": "cpu" if slug == "cpu" else "cuda", "slug": slug},
            "settings": {"model": "mlp", "input_shape": [1, 28, 28], "precision": "fp32", "batch_size": 200},
            "rows": {k: {"kind": "step", "images_per_s": v} for k, v in rows.items()}}))
    cost._measured_rates.cache_clear()
    rates = cost.measured_rates(bench, tmp_path / "none")

    def rate(device, method, flatness):
        cfg = {"model": model, "dataset": {"input_shape": [1, 28, 28]}, "trainer": {"precision": "fp32"},
               "method": method, "flatness": flatness}
        [r] = rates[(device, cost.work_key(cfg), cost.parts_path(cfg, device))]
        return r.images_per_s

    lenet = {"model": {**yaml.safe_load((cost.CONFIGS_DIR / "model" / "lenet5.yaml").read_text()), "variant": "bsam"},
             "dataset": {"input_shape": [1, 28, 28]}, "trainer": {"precision": "fp32"},
             "method": {"_target_": "flatbnn.methods.MAP"}, "flatness": {"_target_": "flatbnn.flatness.NoFlatness"}}
    (bench / "cpu-2026-11-29.json").write_text(json.dumps({   # a model keyword benchmarked (--set variant=bsam)
        "date": "2026-11-29T01:27:47+00:00", "device": {"type": "cpu", "slug": "cpu"},
        "settings": {"model": "lenet5", "model_overrides": {"variant": "bsam"}, "input_shape": [1, 28, 28],
                     "precision": "fp32", "batch_size": 200},
        "rows": {"map+none": {"kind": "step", "images_per_s": 2900.0}, "bsam+none": {"kind": "step", "images_per_s": 20.0}}}))
    cost._measured_rates.cache_clear()
    rates = cost.measured_rates(bench, tmp_path / "none")
    assert [r.images_per_s for r in rates[("cpu", cost.work_key(lenet), "")]] == [2900.0]
    sam = {"_target_": "flatbnn.flatness.SAM", "m": 8}
    assert rate("cpu", {"_target_": "flatbnn.methods.MAP"}, sam) == 100.0
    assert rate("cpu", {"_target_": "flatbnn.methods.MAP"}, {**sam, "batched_chunks": True}) == 400.0
    bsam = {"_target_": "flatbnn.methods.bsam.BSAM", "m": 8, "batched_parts": "auto"}
    none = {"_target_": "flatbnn.flatness.NoFlatness"}
    assert rate("cpu", bsam, none) == 30.0 and rate("some-gpu", bsam, none) == 7000.0
    assert rate("cpu", {**bsam, "batched_parts": True}, none) == 30.0
    assert rate("cpu", {**bsam, "batched_parts": False}, none) == 50.0
    lenet_bsam = {**lenet, "method": bsam, "flatness": none}  # not Linear-only: auto loops on a CPU
    assert cost.parts_path(lenet_bsam, "cpu") == "loop"
    assert [r.images_per_s for r in rates[("cpu", cost.work_key(lenet_bsam), "loop")]] == [20.0]
    assert rate("some-gpu", {**bsam, "batched_parts": False}, none) == 900.0


def test_a_measured_step_is_priced_by_the_path_it_took_not_by_todays_rule(tmp_path):
    """A benchmark row of ``batched_parts=auto`` (or a finished run) that recorded how its m parts ran is keyed by
    that path: the rule changes (VOGN's auto took the vmap parts on a CPU conv net until 2026-11-30, the loop since),
    and today's rule applied to an older measurement would price the loop at the batched step's rate (LeNet-5:
    144 ms batched vs 105 loop). A row that recorded nothing takes today's rule."""
    assert [cost.taken_path(r) for r in ("loop", "vmap", "linear", "linear,loop", "", None)] == \
        ["loop", "batched", "batched", None, None, None]
    lenet = yaml.safe_load((cost.CONFIGS_DIR / "model" / "lenet5.yaml").read_text())
    bench = tmp_path / "bench"
    bench.mkdir()
    for day, rows in (("2026-11-29", {"vogn_m8+none": {"images_per_s": 1400.0, "parts_path": "vmap"}}),
                      ("2026-11-30", {"bsam+none": {"images_per_s": 1800.0}})):
        (bench / f"cpu-{day}.json").write_text(json.dumps({
            "date": f"{day}T08:00:00+00:00", "device": {"type": "cpu", "slug": "cpu"},
            "settings": {"model": "lenet5", "input_shape": [1, 28, 28], "precision": "fp32", "batch_size": 200},
            "rows": {k: {"kind": "step", **v} for k, v in rows.items()}}))
    cost._measured_rates.cache_clear()
    rates = cost.measured_rates(bench, tmp_path / "none")

    def cfg(target, **keys):
        return {"model": lenet, "dataset": {"input_shape": [1, 28, 28]}, "trainer": {"precision": "fp32"},
                "method": {"_target_": target, "m": 8, "batched_parts": "auto", **keys},
                "flatness": {"_target_": "flatbnn.flatness.NoFlatness"}}
    vogn, bsam = cfg("flatbnn.methods.vogn.VOGN"), cfg("flatbnn.methods.bsam.BSAM")
    assert cost.parts_path(vogn, "cpu") == "loop"  # today's rule on a conv net
    assert ("cpu", cost.work_key(vogn), "loop") not in rates  # the vmap step does not price the loop
    assert [r.images_per_s for r in rates[("cpu", cost.work_key(vogn), "batched")]] == [1400.0]
    assert [r.images_per_s for r in rates[("cpu", cost.work_key(bsam), "loop")]] == [1800.0]  # nothing recorded


def test_the_sgvb_estimators_share_a_class_but_not_a_measured_rate(tmp_path):
    """bbb_flipout (HWA's baseline), sgvb_lrt and sgvb are one class (SGVB) whose estimator changes a step's work
    (flipout: a second product per layer; 18 vs 28 ms on LeNet-5 at batch 128, one CPU thread): rows of each in one
    benchmark file price each option's runs at its own rate -- keyed by class alone, the last row read priced all
    three -- and a run config composed from the option matches the row the benchmark built from it."""
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "cpu-2026-11-30.json").write_text(json.dumps({
        "date": "2026-11-30T00:00:00+00:00", "device": {"type": "cpu", "slug": "cpu"},
        "settings": {"model": "lenet5", "input_shape": [1, 28, 28], "precision": "fp32", "batch_size": 128},
        "rows": {"sgvb+none": {"kind": "step", "images_per_s": 6900.0},
                 "bbb_flipout+none": {"kind": "step", "images_per_s": 4400.0},
                 "sgvb_lrt+none": {"kind": "step", "images_per_s": 5000.0}}}))
    cost._measured_rates.cache_clear()
    rates = cost.measured_rates(bench, tmp_path / "none")
    lenet = yaml.safe_load((cost.CONFIGS_DIR / "model" / "lenet5.yaml").read_text())
    got = {}
    for option in ("sgvb", "bbb_flipout", "sgvb_lrt"):
        cfg = OmegaConf.to_container(compose_cfg([f"method={option}", "model=lenet5", "dataset=mnist"]), resolve=False)
        cfg = {**cfg, "model": lenet, "dataset": {"input_shape": [1, 28, 28]}}
        [r] = rates[("cpu", cost.work_key(cfg), "")]
        got[option] = r.images_per_s
    assert got == {"sgvb": 6900.0, "bbb_flipout": 4400.0, "sgvb_lrt": 5000.0}


def test_a_paper_cell_gets_its_verdict_when_all_its_seeds_are_in_and_the_board_counts_it(tmp_path, monkeypatch):
    from test_reproduce import _fake_run

    from flatbnn.reproduce import compare, compare_markdown, status

    row = spec.load_row("flatbnn_t2")
    out = tmp_path / "out"
    for s in range(3):  # paper: F-SWAG WRN-28-10 acc 97.09 ± 0.14 -> ours within; SWAG all seeds far below: outside
        _fake_run(out, "wrn28x10/f_swag", s, 0.9709 + 0.0001 * s, 0.0883, ece=0.0036)
        _fake_run(out, "wrn28x10/swag", s, 0.90, 0.30, ece=0.05)
    _fake_run(out, "preresnet164/swag", 0, 0.96, 0.12)  # 1 of 3 seeds: no verdict yet
    c = compare.build(row, "paper", out)
    rec = {(r["cell"], r["metric"]): r for r in c["table"]}
    assert rec[("wrn28x10/f_swag", "accuracy")]["verdict"] == "within"
    assert rec[("wrn28x10/f_swag", "accuracy")]["verdict_seeds"] == 3
    assert "verdict" not in rec[("preresnet164/swag", "accuracy")]  # 1/3 seeds
    pr = compare.paper_progress(c)
    assert (pr["cells"], pr["done"], pr["within"], pr["outside"]) == (20, 2, 1, 1)
    assert compare_markdown.progress_sentence(pr) == "2/20 cells done: 1 within the paper's spread, 1 outside"
    md = compare_markdown.to_markdown(c)
    assert "within (3 seeds)" in md and "**Progress: 2/20 cells done" in md
    monkeypatch.setattr(status, "RESULTS_ROOT", tmp_path / "results")
    (tmp_path / "results" / "flatbnn_t2").mkdir(parents=True)
    (tmp_path / "results" / "flatbnn_t2" / "paper.json").write_text(json.dumps(c))
    (tmp_path / "results" / "bsam_t6").mkdir(parents=True)
    (tmp_path / "results" / "bsam_t6" / "cpu.json").write_text(json.dumps(
        {"jobs": {"a": {"0": "done"}}, "budget": {"commits": ["abc"], "train_hours": 1.081}}))
    text = status.render()
    assert "**Paper scale: 2 of " in text and "in 1 rows; 1 within the paper's spread, 1 outside**" in text
    line = next(x for x in text.splitlines() if x.startswith("| `flatbnn_t2`"))
    # (this synthetic comparison has no committed run records: the board adds that it cannot be rebuilt)
    assert "2/20 cells done: 1 within the paper's spread, 1 outside @ abcdef12 (**no run records" in line
    t6 = next(x for x in text.splitlines() if x.startswith("| `bsam_t6`"))
    assert "1.08 CPU-h of training" in t6 and t6.endswith("| not run (0/14 cells) |")  # its numbers are lost: ours


def test_dry_runs_estimate_each_job_measured_where_a_record_matches_else_assumed(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    import campaign as campaign_cli
    import reproduce as reproduce_cli

    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    monkeypatch.setattr(launch, "OUTPUT_ROOT", tmp_path / "outputs")
    monkeypatch.setattr(archive, "ARCHIVE_ROOT", tmp_path / "records")
    monkeypatch.setattr(cost, "RECORDS_ROOT", tmp_path / "records")
    _row(rows_dir, "cpu")
    # a finished cpu run of the long cell on this kind of machine: 2 batches x 64 images x 30 epochs in 3 s
    run = archive.record_dir(tmp_path / "records", "tiny", "cpu", "long", 1)
    run.mkdir(parents=True)
    cfg = launch.compose_cell(next(c.overrides for c in spec.load_row("tiny").cells_for("cpu") if c.id == "long"))
    from omegaconf import OmegaConf
    (run / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run / "results.json").write_text(json.dumps({"meta": {"budget": {"train_size": 128, "epochs": 30},
                                                           "train_seconds": 3.0, "hardware": {"device": "cpu"}}}))
    assert reproduce_cli.main(["run", "tiny", "--scale", "cpu", "--dry-run", "--estimate-on", "cpu"]) == 0
    err = capsys.readouterr().err
    long_line = next(x for x in err.splitlines() if x.strip().startswith("long/seed0:"))
    # 1,280 images/s measured; digits: (1,437 train images x 30 epochs + 360 test images / 3) / 1,280 = 33.8 s
    assert long_line.strip() == "long/seed0: ~34 s (measured: cpu run tiny/cpu/runs/long/seed1)"
    assert "short/seed0: ~1 s (measured: " in err  # the same network, method and flatness: the same rate
    assert "2 jobs: ~35 s of training on cpu one after another (2 at a measured rate, 0 assumed" in err
    assert reproduce_cli.main(["run", "tiny", "--scale", "cpu", "--dry-run", "--estimate-on", "nvidia-h200"]) == 0
    assert "(0 at a measured rate, 2 assumed" in capsys.readouterr().err   # a CPU run says nothing about a GPU
    # the campaign's dry run (paper scale) lists its queue the same way
    _row(rows_dir, "paper")
    assert campaign_cli.main(["--rows", "tiny", "--minutes", "10", "--dry-run", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs queued" in out and "tiny/short/seed0: ~" in out and "tiny/long/seed0: ~" in out


def test_each_cell_gets_the_data_root_of_its_own_data_set_and_a_missing_one_skips_it(tmp_path, monkeypatch):
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    monkeypatch.setattr(cost, "RECORDS_ROOT", tmp_path / "no_records")
    monkeypatch.setattr(cost, "BENCH_DIR", tmp_path / "no_bench")  # the repository's CPU benchmark would price it
    (rows_dir / "mixed.yaml").write_text(yaml.safe_dump(
        {"row": "mixed", "paper": "none", "title": "mixed", "kind": "train", "axes": ["dataset"], "base": ["model=mlp"],
         "values": {"dataset": {"digits": ["dataset=digits"], "mnist": ["dataset=mnist"]}}, "seeds": [0],
         "scales": {"paper": {"overrides": []}, "smoke": {"overrides": []}}}))
    p = campaign.plan(["mixed"], device="cpu", data={"mnist": str(tmp_path / "no_mnist_here")},
                      out_root=tmp_path / "o", results_root=tmp_path / "r")
    assert [j.name for j in p.jobs] == ["mixed/digits/seed0"] and p.jobs[0].overrides == []  # embedded: no root
    [(what, why, est)] = p.skipped
    assert what == "mixed/mnist" and "needs data set mnist" in why and "no_mnist_here" in why and "assumed" in est


def test_a_budget_spent_before_a_job_starts_leaves_the_queue_for_the_next_call(tmp_path, monkeypatch):
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    _row(rows_dir)
    row = spec.load_row("tiny")
    est = cost.Estimate(1.0, cost.Rate(1.0, "assumed: test", False))
    p = campaign.Plan("cpu", jobs=[campaign.Job(row, c, 0, est, tmp_path / "o", []) for c in row.cells_for("paper")])
    calls = []

    def late_clock():  # always past the deadline; a loop that never ends would call it for ever
        calls.append(1)
        assert len(calls) < 100, "the campaign kept polling after the budget was spent"
        return 1e12

    r = campaign.run(p, budget_s=60, margin_s=10, poll_s=0.001, clock=late_clock, started=0.0)
    assert r["stopped"] and not r["finished"] and sorted(r["not_started"]) == ["tiny/long/seed0", "tiny/short/seed0"]
    assert not (tmp_path / "o").exists()  # nothing started


def test_a_row_without_a_finished_record_gets_no_paper_page(tmp_path, monkeypatch):
    """The H100 window of 2026-11-27 queued 7 rows and finished cells of 2: the other 5 had come back as pages of
    empty cells saying 'no run records committed'. Only a row with a results.json gets its comparison."""
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    _row(rows_dir)
    out, res = tmp_path / "outputs", tmp_path / "results"
    row = spec.load_row("tiny")
    assert campaign.write_comparisons([row], out, res) == [] and not (res / "tiny").exists()
    # (a row with a record gets its page: the test above, "**Progress: 2/2 cells done")


def test_a_paper_page_prices_what_is_left(tmp_path, monkeypatch):
    """Issue 42: every MNIST-scale cell done or queued 'with its cost stated'. cost_left lists the cells with seeds
    not done (a done seed is not counted), each priced per run on the CPU and on the windows' GPU; the page says it."""
    from flatbnn.reproduce.compare_markdown import _left_markdown

    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    _row(rows_dir)
    row = spec.load_row("tiny")
    left = cost.cost_left(row, "paper", {"short": {"0": "done"}, "long": {"0": "interrupted"}})
    assert [(x["cell"], x["runs_left"]) for x in left] == [("long", 1)]
    each = left[0]["each"]
    assert set(each) == {"cpu", cost.WINDOW_GPU} and all(sec > 0 for sec, _ in each.values())
    # the long cell trains LONG_EPOCHS x the short one's work: its price says so on every device
    short = {x["cell"]: x for x in cost.cost_left(row, "paper", {})}["short"]
    assert each["cpu"][0] > short["each"]["cpu"][0] and each[cost.WINDOW_GPU][0] > short["each"][cost.WINDOW_GPU][0]
    page = "\n".join(_left_markdown({"row": "tiny", "left": left}))
    assert "1 runs in 1 cells" in page and "| `long` | 1 |" in page and "`short`" not in page
    assert "Nothing" in "\n".join(_left_markdown({"row": "tiny", "left": []}))
    # a cell that does not compose first: the columns still come from a priced cell
    broken = {"cell": "x", "runs_left": 1, "each": {"error": [None, "no such key"]}}
    head = next(ln for ln in _left_markdown({"row": "tiny", "left": [broken] + left}) if ln.startswith("| cell"))
    assert head == f"| cell | runs left | each on cpu | each on {cost.WINDOW_GPU} |"


def test_linking_composes_each_cell_with_its_own_step_overrides(tmp_path, monkeypatch):
    """A GPU window's step overrides differ per cell (flatness.batched_chunks only where the flatness has that key).
    Linking once composed every cell of a row with the FIRST job's extras: with another row's finished run on disk,
    the window's campaign died before its first job ('Could not override flatness.batched_chunks', H100, bedcb58)."""
    from omegaconf import OmegaConf

    plain = ["flatness=none", "trainer.epochs=4"]
    out_root, results = _train_rows(tmp_path, monkeypatch, {  # dst's SAM cell: cheaper, first
        "src": {"plain": plain}, "dst": {"sam": ["flatness=sam", "trainer.epochs=1"], "plain": plain}})
    src = launch.run_dir(out_root / "src" / "paper", "plain", 0)  # src's finished plain run: dst/plain is the same
    src.mkdir(parents=True)
    resolved = OmegaConf.to_container(launch.compose_cell(list(BASE) + plain + ["seed=0"]), resolve=True)
    resolved["reproduce"] = {"row": "src", "cell": "plain", "scale": "paper"}
    (src / "config_resolved.yaml").write_text(yaml.safe_dump(resolved))
    (src / "results.json").write_text(json.dumps({"metrics": {"accuracy": 0.5}, "meta": {"seed": 0}}))

    def step(cfg):  # what selfcheck.step_overrides gives a SAM cell and not a plain one
        return ["flatness.batched_chunks=true"] if "batched_chunks" in (cfg.get("flatness") or {}) else []
    p = campaign.plan(["dst"], device="cpu", out_root=out_root, results_root=results, extra_for=step)
    assert [(j.cell.id, j.overrides) for j in p.jobs] == [("sam", ["flatness.batched_chunks=true"]), ("plain", [])]
    assert campaign.link_reused(p) == ["dst/plain/seed0"]
    assert [j.name for j in p.jobs] == ["dst/sam/seed0"]
    assert launch.job_state(out_root / "dst" / "paper", "plain", 0)[0] == "done"


def test_a_dry_run_shows_what_linking_would_take_off_the_queue_and_links_nothing(tmp_path, monkeypatch):
    """The dry run once queued (and priced) jobs that the real call links to another row's identical finished run:
    bsam_t6's MNIST bSAM cell is bsam_t3's, ~89 CPU-minutes a seed that the dry run counted and the run never spent."""
    from omegaconf import OmegaConf

    plain = ["flatness=none", "trainer.epochs=4"]
    out_root, results = _train_rows(tmp_path, monkeypatch, {"src": {"plain": plain},
                                                            "dst": {"sam": ["flatness=sam"], "plain": plain}},
                                    default_outputs=tmp_path / "default_outputs")  # the runs live under --out
    src = launch.run_dir(out_root / "src" / "paper", "plain", 0)
    src.mkdir(parents=True)
    resolved = OmegaConf.to_container(launch.compose_cell(list(BASE) + plain + ["seed=0"]), resolve=True)
    (src / "config_resolved.yaml").write_text(yaml.safe_dump(resolved))
    (src / "results.json").write_text(json.dumps({"metrics": {"accuracy": 0.5}, "meta": {"seed": 0}}))

    p = campaign.plan(["dst"], device="cpu", out_root=out_root, results_root=results)
    assert [j.name for j in p.jobs] == ["dst/plain/seed0", "dst/sam/seed0"]
    # a per-job limit below a run's cost does not leave out a run that is linked, not trained (it once did: bsam_t6's
    # MNIST bSAM seeds, ~89 min each, were skipped under --max-job-minutes 60 though bsam_t3 had trained them)
    whole = p.jobs[0].estimate.seconds
    limited = campaign.plan(["dst"], device="cpu", out_root=out_root, results_root=results, max_job_s=whole / 2)
    assert [j.name for j in limited.jobs] == ["dst/plain/seed0"] and campaign.reusable(limited) == ["dst/plain/seed0"]
    assert campaign.reusable(p) == ["dst/plain/seed0"]
    text = campaign.describe(p, 3600, 1)
    assert "1 jobs queued, 0 already done, 1 to link to other rows' identical finished runs" in text
    assert f"dst/plain/seed0: linked to {src}" in text and "dst/plain/seed0: ~" not in text
    assert not launch.run_dir(out_root / "dst" / "paper", "plain", 0).exists()  # nothing linked by the dry run


def test_an_interrupted_run_is_priced_by_the_epochs_it_has_left(tmp_path, monkeypatch):
    """A run that resumes after epoch 21 of 30 costs 9/30 of a run: the schedule, the window's per-job limit and the
    CPU's 'cannot finish in what is left' all read that (they read a whole run before: a chained GPU job whose
    remainder fits a window was left out, and the dry run priced bsam_t3's seed 1, 84 of 120 epochs in, at 89 min)."""
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    monkeypatch.setattr(cost, "RECORDS_ROOT", tmp_path / "no_records")
    monkeypatch.setattr(launch, "OUTPUT_ROOT", tmp_path / "unused")
    monkeypatch.setattr(archive, "ARCHIVE_ROOT", tmp_path / "unused_records")
    (rows_dir / "tiny.yaml").write_text(yaml.safe_dump(
        {"row": "tiny", "paper": "none", "title": "tiny", "kind": "train", "axes": ["method"], "base": BASE,
         "values": {"method": {"long": [f"trainer.epochs={LONG_EPOCHS}"]}}, "seeds": [0, 1],
         "scales": {"paper": {"overrides": []}, "smoke": {"overrides": []}}}))
    out = tmp_path / "o"
    whole = campaign.plan(["tiny"], device="cpu", out_root=out).jobs[0].estimate.seconds
    run = launch.run_dir(out / "tiny" / "paper", "long", 1)
    run.mkdir(parents=True)
    lines = [json.dumps({"epoch": e, "step": 2 * e, "train/loss": 1.0}) for e in range(1, 22)]
    (run / "metrics.jsonl").write_text("\n".join(lines + ['{"epoch": 22, "st']) + "\n")  # the last line cut by a kill
    assert campaign.epochs_done(run) == 21
    p = campaign.plan(["tiny"], device="cpu", out_root=out)
    fresh, resumed = p.jobs
    assert fresh.seconds_left == whole and resumed.seconds_left == pytest.approx(whole * 9 / 30)
    assert resumed.describe().startswith(f"~{cost.fmt_duration(whole * 9 / 30)} left: resumes after epoch 21 of 30")
    # a per-job limit between the two: the fresh seed is left out, the resumed one stays (it fits what is left)
    p = campaign.plan(["tiny"], device="cpu", out_root=out, max_job_s=whole / 2)
    assert [j.name for j in p.jobs] == ["tiny/long/seed1"]
    assert [s[0] for s in p.skipped] == ["tiny/long/seed0"]


def test_a_run_two_rows_share_trains_once_and_the_other_row_links_it_when_it_finishes(tmp_path, monkeypatch):
    """Rows share training runs (bsam_t6's MNIST bSAM cell is bsam_t3's; vsam_t4's cells are vsam_t3's). Linking
    saw only FINISHED runs, so one campaign over both rows queued each shared run twice and trained it twice."""
    plain, other = ["flatness=none", "trainer.epochs=1"], ["flatness=none", "trainer.epochs=2"]
    out_root, results = _train_rows(tmp_path, monkeypatch, {"a": {"plain": plain}, "b": {"plain": plain, "other": other}})
    rows_dir = tmp_path / "rows"
    p = campaign.plan(["a", "b"], device="cpu", out_root=out_root, results_root=results)
    assert [j.name for j in p.jobs] == ["a/plain/seed0", "b/other/seed0"]
    assert {n: lead.name for n, (_, lead) in p.follow.items()} == {"b/plain/seed0": "a/plain/seed0"}
    assert "b/plain/seed0: the same training run as a/plain/seed0" in campaign.describe(p, 3600, 1)
    r = campaign.run(p, budget_s=3600, procs=1, margin_s=5, results_root=results, poll_s=0.05)
    assert r["finished"] == ["a/plain/seed0", "b/other/seed0"] and r["linked"] == ["b/plain/seed0"]
    twin = launch.run_dir(out_root / "b" / "paper", "plain", 0)
    assert twin.is_symlink() and twin.resolve() == launch.run_dir(out_root / "a" / "paper", "plain", 0).resolve()
    rec = archive.record_dir(results, "b", "paper", "plain", 0)
    assert json.loads((rec / "record.json").read_text()).get("reused_from")  # b's record says whose run it is

    # the job furthest along leads, wherever it is queued: b's twin of a's cell, 1 epoch into 3
    (rows_dir / "a.yaml").write_text((rows_dir / "a.yaml").read_text().replace("trainer.epochs=1", "trainer.epochs=3"))
    (rows_dir / "b.yaml").write_text((rows_dir / "b.yaml").read_text().replace("trainer.epochs=1", "trainer.epochs=3"))
    out2 = tmp_path / "o2"
    started = launch.run_dir(out2 / "b" / "paper", "plain", 0)
    started.mkdir(parents=True)
    (started / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train/loss": 1.0}) + "\n")
    p = campaign.plan(["a", "b"], device="cpu", out_root=out2, results_root=tmp_path / "r2")
    assert p.jobs[0].name == "b/plain/seed0" and list(p.follow) == ["a/plain/seed0"]


def test_a_run_another_process_trains_now_is_left_to_it_and_so_is_its_twin_in_another_row(tmp_path, monkeypatch):
    """Two campaigns on one machine: the second (started for more rows while the first trains) started the first's
    running job too -- its train.py was refused the locked run dir, exit 2, a 'failed' job -- and trained a run two
    rows share a second time in its own row's dir. Now both are skipped with who trains them."""
    from omegaconf import OmegaConf

    from flatbnn.engine.lock import RunDirLock

    plain, other = ["flatness=none", "trainer.epochs=3"], ["flatness=none", "trainer.epochs=2"]
    out_root, results = _train_rows(tmp_path, monkeypatch, {"a": {"plain": plain}, "b": {"plain": plain, "other": other}})
    running = launch.run_dir(out_root / "a" / "paper", "plain", 0)
    running.mkdir(parents=True)
    (running / "config_resolved.yaml").write_text(yaml.safe_dump(OmegaConf.to_container(
        launch.compose_cell(list(BASE) + plain + ["seed=0"]), resolve=True)))
    lock = RunDirLock(running).acquire()  # held by this (live) process, as train.py holds it
    try:
        p = campaign.plan(["a", "b"], device="cpu", out_root=out_root, results_root=results)
        assert [j.name for j in p.jobs] == ["b/other/seed0"] and not p.follow
        why = {s[0]: s[1] for s in p.skipped}
        assert why["a/plain/seed0"].startswith(f"left to pid {os.getpid()} on host ") and "trains it now" in why["a/plain/seed0"]
        assert why["b/plain/seed0"].startswith(f"the same training run as {running}, which pid {os.getpid()}")
    finally:
        lock.release()
    # the holder is gone: a's run (its dir exists, to resume) trains at b's twin's place in the queue; b links it
    p = campaign.plan(["a", "b"], device="cpu", out_root=out_root, results_root=results)
    assert [j.name for j in p.jobs] == ["b/other/seed0", "a/plain/seed0"] and list(p.follow) == ["b/plain/seed0"]


def test_a_shared_run_a_third_row_already_finished_is_linked_into_both_queued_rows(tmp_path, monkeypatch):
    """A queued run's twin waits for it; when a third row already holds that run, both are linked (the twin once waited
    for a lead that linking had taken off the queue, and was never linked)."""
    from omegaconf import OmegaConf

    plain = ["flatness=none", "trainer.epochs=3"]
    out_root, results = _train_rows(tmp_path, monkeypatch, {name: {"plain": plain} for name in ("a", "b", "c")})
    src = launch.run_dir(out_root / "c" / "paper", "plain", 0)
    src.mkdir(parents=True)
    (src / "config_resolved.yaml").write_text(yaml.safe_dump(OmegaConf.to_container(
        launch.compose_cell(list(BASE) + plain + ["seed=0"]), resolve=True)))
    (src / "results.json").write_text(json.dumps({"metrics": {"accuracy": 0.5}, "meta": {"seed": 0}}))
    p = campaign.plan(["a", "b"], device="cpu", out_root=out_root, results_root=results)
    assert [j.name for j in p.jobs] == ["a/plain/seed0"] and list(p.follow) == ["b/plain/seed0"]
    assert campaign.link_reused(p, results) == ["a/plain/seed0", "b/plain/seed0"]
    assert not p.jobs and not p.follow
    for row in ("a", "b"):
        assert launch.run_dir(out_root / row / "paper", "plain", 0).resolve() == src.resolve()
        rec = archive.record_dir(results, row, "paper", "plain", 0)  # recorded at once, not when a job ends
        assert json.loads((rec / "record.json").read_text()).get("reused_from")


def test_a_job_another_campaign_took_after_the_plan_is_left_to_it_not_failed(tmp_path, monkeypatch):
    """Two campaigns over the same row, started minutes apart, planned the same queue: the second started a job the
    first was training (train.py refused the locked run dir: exit 2, 'FAILED', campaign exit 1) or retrained one the
    first had finished. At start time a job whose run finished meanwhile, or whose run-dir lock a live process holds,
    is left to that process."""
    from flatbnn.engine.lock import RunDirLock

    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setattr(spec, "ROWS_DIR", rows_dir)
    monkeypatch.setattr(cost, "RECORDS_ROOT", tmp_path / "no_records")
    monkeypatch.setattr(launch, "OUTPUT_ROOT", tmp_path / "unused")
    monkeypatch.setattr(archive, "ARCHIVE_ROOT", tmp_path / "unused_records")
    (rows_dir / "tiny.yaml").write_text(yaml.safe_dump(
        {"row": "tiny", "paper": "none", "title": "tiny", "kind": "train", "axes": ["method"], "base": BASE,
         "values": {"method": {"short": ["trainer.epochs=1"]}}, "seeds": [0, 1, 2],
         "scales": {"paper": {"overrides": []}, "smoke": {"overrides": []}}}))
    out, res = tmp_path / "o", tmp_path / "r"
    p = campaign.plan(["tiny"], device="cpu", out_root=out, results_root=res)
    assert [j.name for j in p.jobs] == ["tiny/short/seed0", "tiny/short/seed1", "tiny/short/seed2"]
    busy, finished = p.jobs[1].run, p.jobs[2].run
    lock = RunDirLock(busy).acquire()   # another campaign's train.py, live (this process stands in for it)
    finished.mkdir(parents=True)
    (finished / "results.json").write_text(json.dumps({"metrics": {"accuracy": 0.5}}))  # finished by the other one
    try:
        r = campaign.run(p, budget_s=3600, procs=1, margin_s=5, results_root=res, poll_s=0.05)
    finally:
        lock.release()
    assert r["finished"] == ["tiny/short/seed0"] and not r["failed"]
    assert r["taken"] == ["tiny/short/seed1", "tiny/short/seed2"]
    assert not (busy / "metrics.jsonl").exists()  # nothing trained into the held run dir


FAKE_TRAIN = """import json, sys, time
from pathlib import Path
run = Path(sys.argv[1])
time.sleep(1.0)  # train.py's imports: the window in which a second scheduler used to start the same job
from flatbnn.engine.lock import RunDirLock, RunDirLocked
try:
    lock = RunDirLock(run).acquire()  # as engine/run_dir.py claims it (a campaign's child takes its parent's over)
except RunDirLocked as e:
    print(f"flatbnn: error: {e}", file=sys.stderr)
    sys.exit(2)
with open(sys.argv[2], "a") as f:
    f.write(f"{run}\\n")
time.sleep(1.0)
meta = {"seed": 0, "dataset": "digits", "model": "mlp", "budget": {"epochs": 1, "train_size": 8, "test_size": 8, "global_batch": 8, "precision": "fp32"},
        "hardware": {"device": "cpu", "torch": "2"}, "git": {"commit": "abc", "dirty": False}, "train_seconds": 1.0}
(run / "results.json").write_text(json.dumps({"metrics": {"accuracy": 0.5, "nll": 1.0, "ece": 0.1}, "meta": meta}))
lock.release()
"""

DRIVER = """import sys, time
from pathlib import Path
from flatbnn.reproduce import archive, campaign, cost, launch, spec
tmp, me = Path(sys.argv[1]), sys.argv[2]
spec.ROWS_DIR, cost.RECORDS_ROOT = tmp / "rows", tmp / "no_records"
launch.OUTPUT_ROOT, archive.ARCHIVE_ROOT = tmp / "o", tmp / "r"
cost.estimate = lambda cfg, device: cost.Estimate(1.0, cost.Rate(1.0, "assumed: test", False))  # no FLOP count
campaign._command = lambda job, search: [sys.executable, str(tmp / "fake_train.py"), str(job.run),
                                         str(tmp / "trainings.txt")]
run = campaign.run
def together(*args, **kwargs):  # both planned the same queue; both start it now
    (tmp / f"ready.{me}").touch()
    while len(list(tmp.glob("ready.*"))) < 2:
        time.sleep(0.02)
    return run(*args, **kwargs)
campaign.run = together
sys.path.insert(0, sys.argv[3])
import campaign as campaign_cli
sys.exit(campaign_cli.main(["--rows", "tiny", "--minutes", "30", "--device", "cpu", "--procs", "1",
                            "--out", str(tmp / "o"), "--results", str(tmp / "r")]))
"""


def test_two_campaigns_on_one_out_both_exit_0_and_every_job_trains_once(tmp_path, monkeypatch):
    """Issue 54: two campaigns on one --out both exited 1, each with jobs 'FAILED (exit 2)': both had started the same
    job before either's train.py took its run-dir lock, and both appended to one .campaign/<cell>__s<k>.log. Now a
    campaign takes the lock itself before starting a job (its train.py takes it over): of two, one starts each job,
    the other skips it 'left to pid N'; logs are per process. Tiny fake jobs (they take the lock as train.py does)."""
    import subprocess

    _train_rows(tmp_path, monkeypatch, {"tiny": {"a": ["trainer.epochs=1"], "b": ["trainer.epochs=2"]}}, seeds=(0, 1))
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(REPO / "tests")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), str(i), str(REPO / "scripts")], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in (1, 2)]
    outs = [p.communicate(timeout=600) for p in procs]
    errs = [err for _, err in outs]
    assert [p.returncode for p in procs] == [0, 0], errs
    trained = (tmp_path / "trainings.txt").read_text().splitlines()
    assert sorted(trained) == sorted({str(launch.run_dir(tmp_path / "o" / "tiny" / "paper", c, s))
                                      for c in ("a", "b") for s in (0, 1)}), trained  # each job once
    assert not any("FAILED" in e for e in errs) and any("left to pid " in e for e in errs), errs
    logs = sorted(p.name for p in (tmp_path / "o" / "tiny" / "paper" / ".campaign").iterdir())
    assert len(logs) == 4 and {n.split(".pid")[1] for n in logs} <= {f"{p.pid}.log" for p in procs}, logs


@pytest.mark.parametrize("sig, code", [("SIGTERM", 75), ("SIGINT", 130)])
def test_a_stop_signal_while_the_campaign_plans_is_one_line_and_its_code(tmp_path, sig, code):
    """Issue 54: SIGTERM to campaign.py while it planned died with 143 and no line (docs/cluster.md promises a stop,
    exit 75). Now one line, 75 (130 for Ctrl-C), nothing started."""
    import subprocess

    hooks = str(REPO / "tests" / "hooks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLATBNN_TEST_HOOK": f"signal_in:flatbnn.reproduce.campaign.plan,{sig}",
           "PYTHONPATH": os.pathsep.join([str(REPO), hooks] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "campaign.py"), "--rows", "bsam_t6", "--minutes", "5",
                        "--device", "cpu", "--out", str(tmp_path / "o"), "--results", str(tmp_path / "r")],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == code and lines == [f"campaign: stopped by {sig} while planning (no job was started); "
                                              f"rerun the same command"], p.stderr[-3000:]
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


def test_a_bad_override_value_after_the_double_dash_stops_the_campaign_before_it_plans_a_job(tmp_path, monkeypatch,
                                                                                             capsys):
    """Issue 54 item 5, for the campaign: ``-- optimizer.lr=fast`` is one line and exit 2, not a failure of every job."""
    sys.path.insert(0, str(REPO / "scripts"))
    import campaign as campaign_cli

    _train_rows(tmp_path, monkeypatch, {"tiny": {"a": ["trainer.epochs=1"]}})
    rc = campaign_cli.main(["--rows", "tiny", "--minutes", "5", "--device", "cpu", "--out", str(tmp_path / "o"),
                            "--results", str(tmp_path / "r"), "--", "optimizer.lr=fast"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "optimizer.lr='fast': must be a number" in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("slot, procs, gpus, want", [
    (0, 4, 0, {"OMP_NUM_THREADS": "4"}),                                # 4 CPU jobs on 16 cores
    (1, 2, 1, {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "8"}),   # window 6: 2 jobs on one GPU
    (3, 2, 2, {"CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "4"}),   # 2 per GPU on 2 GPUs: 4 share the host
    (0, 32, 1, {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "1"}),  # never 0 threads
])
def test_jobs_side_by_side_split_the_cores_on_a_gpu_too(monkeypatch, slot, procs, gpus, want):
    # two GPU jobs with torch's default threads (all cores each) and the host loader ran 25 ms a step each against
    # 3 ms alone (window 6's probe): a GPU job gets its share of the cores like a CPU job
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(campaign.os, "cpu_count", lambda: 16)
    assert campaign.job_env(slot, procs, gpus) == want
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's choice stands
    assert "OMP_NUM_THREADS" not in campaign.job_env(slot, procs, gpus)
