"""scripts/estimate_cost.py: the FLOP counting, the per-run formula, a real row, and the docs rewrite."""

from __future__ import annotations

import pytest
from torch import nn

from flatbnn.tools import estimate_cost as ec

TINY = ["dataset=digits", "model=mlp", "trainer.epochs=7"]


def _compose(overrides):
    from flatbnn.reproduce import launch

    return launch.compose_cell(overrides)


def test_forward_flops_of_a_linear_stack():
    # a Linear layer is one in x out matmul per image: 2 * in * out FLOPs (bias and ReLU are not counted)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    assert ec.forward_flops(net, (5,)) == 2 * (5 * 7 + 7 * 3)


def test_run_cost_passes_members_samples():
    base = ec.run_cost(_compose(TINY + ["method=map", "flatness=none"]))
    n_train, n_test = ec.SPLIT_SIZES["digits"]
    assert (base.passes, base.members, base.samples, base.epochs) == (1, 1, 1, 7)
    assert base.train_flops == 3 * base.forward_flops * n_train * 7
    assert base.eval_flops == base.forward_flops * n_test
    sam = ec.run_cost(_compose(TINY + ["method=map", "flatness=sam"]))
    assert sam.passes == 2 and sam.train_flops == 2 * base.train_flops and sam.eval_flops == base.eval_flops
    # a preset that composes SAM (F-SWAG) is two-pass too, found from the composed config, not the override name
    assert ec.run_cost(_compose(TINY + ["method=f_swag"])).passes == 2
    # the classes declare it: every SAM subclass, and the methods with an ascent of their own
    passes = {o: ec.run_cost(_compose(TINY + [o])).passes
              for o in ("flatness=asam", "flatness=fsam", "flatness=random", "method=bsam", "method=vsam",
                        "method=vogn", "method=rsam", "method=swag")}
    assert passes == {"flatness=asam": 2, "flatness=fsam": 2, "flatness=random": 1, "method=bsam": 2,
                      "method=vsam": 2, "method=vogn": 1, "method=rsam": 1, "method=swag": 1}
    ens = ec.run_cost(_compose(TINY + ["method=deep_ens", "method.num_members=3", "flatness=none"]))
    assert ens.train_flops == 3 * base.train_flops and ens.eval_flops == 3 * base.eval_flops  # each member predicts
    sub = ec.run_cost(_compose(TINY + ["method=map", "flatness=none", "dataset.train_subset=100",
                                       "dataset.test_subset=50"]))
    assert (sub.train_images, sub.test_images) == (100, 50)


@pytest.mark.slow
def test_row_counts_runs_and_two_pass_share(monkeypatch):
    from flatbnn.reproduce import spec

    cells = [c for c in spec.load_row("bsam_t6").cells_for("paper") if not c.blocked]
    runs = sum(len(c.seeds) for c in cells)
    # independent of the composed configs: which cells name a two-pass method or flatness in their overrides
    two_pass = sum(len(c.seeds) for c in cells
                   if any(o in ("method=bsam", "method=vsam", "method=sam_adam", "flatness=sam") for o in c.overrides))
    cost = ec.row_cost("bsam_t6")
    assert (cost.runs, cost.two_pass_runs) == (runs, two_pass) and 0 < two_pass < runs
    # every cell of the row trains one network per dataset for the same epochs, so doubling the two-pass cells'
    # training is (1 + share) x the one-pass count (the evaluation is never doubled)
    # the passes each class declares (SAM's subclasses inherit them)
    from flatbnn.flatness.sam import SAM
    from flatbnn.methods.bsam import BSAM
    from flatbnn.methods.vsam import VariationalSAM
    for cls in (SAM, BSAM, VariationalSAM):
        monkeypatch.setattr(cls, "passes", 1)
    one_pass = ec.row_cost("bsam_t6")
    assert one_pass.two_pass_runs == 0
    by_net = {}
    for c in cells:
        by_net.setdefault(ec.run_cost(_compose(list(c.overrides))).network, []).append(c)
    # per network the share is the same here (the methods are crossed with the data sets)
    shares = {n: sum(any(o in ("method=bsam", "method=vsam", "method=sam_adam", "flatness=sam")
                         for o in c.overrides) for c in cs) / len(cs) for n, cs in by_net.items()}
    assert len(set(shares.values())) == 1
    share = two_pass / runs
    eval_flops = sum(len(c.seeds) * ec.run_cost(_compose(list(c.overrides))).eval_flops for c in cells)
    assert cost.flops - eval_flops == pytest.approx((1 + share) * (one_pass.flops - eval_flops), rel=1e-9)


def test_replace_table_keeps_the_rest(tmp_path):
    text = f"intro\n{ec.START}\n| old |\n{ec.END}\noutro\n"
    assert ec.replace_table(text, "| new |\n") == f"intro\n{ec.START}\n| new |\n{ec.END}\noutro\n"
    with pytest.raises(ec.CostError):
        ec.replace_table("no markers here\n", "| new |\n")


def test_bad_input_exits_2_and_leaves_docs_untouched(tmp_path, capsys):
    docs = tmp_path / "cluster.md"
    docs.write_text("no markers\n")
    assert ec.main(["--rows", "bsam_t6", "--write-docs", "--docs", str(docs)]) == 2
    assert docs.read_text() == "no markers\n"
    assert ec.main(["--rows", "no_such_row"]) == 2
    assert ec.main(["--tflops", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)


@pytest.mark.slow
def test_write_docs_replaces_the_table(tmp_path, capsys):
    docs = tmp_path / "cluster.md"
    docs.write_text(f"before\n{ec.START}\n| stale |\n{ec.END}\nafter\n")
    assert ec.main(["--rows", "bsam_t6", "--tflops", "25", "--write-docs", "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert text.startswith(f"before\n{ec.START}\n| row |") and text.endswith(f"{ec.END}\nafter\n")
    assert "| `bsam_t6` | 42 |" in text and "| **all** | **42** |" in text and "stale" not in text
    assert list(tmp_path.iterdir()) == [docs]  # no temporary file left behind


def test_a_gpu_estimate_is_never_below_its_launch_overhead():
    """The H100 window of 2026-11-27 queued bSAM m=8 MNIST MLP runs as '~2 s' from FLOPs (each takes tens of
    minutes: 16 small passes per step). An assumed GPU estimate is at least steps x passes x sub-batches x
    GPU_PASS_FLOOR_S; a CPU estimate never takes it (its assumed rate was measured with the overhead in it)."""
    from flatbnn.reproduce import cost

    mnist = ["dataset=mnist", "model=mlp", "trainer.epochs=2", "trainer.batch_size=200"]
    for method, passes_x_chunks in (("method=map", 1), ("method=bsam", 2 * 8)):
        cfg = _compose(mnist + [method])
        steps = 60_000 // 200 * 2
        est = cost.estimate(cfg, "some-unmeasured-gpu")
        assert est.seconds >= steps * passes_x_chunks * cost.GPU_PASS_FLOOR_S * 0.999, (method, est.describe())
        assert "launch-bound" in est.rate.basis
        assert "launch-bound" not in cost.estimate(cfg, "cpu").rate.basis
    # a captured bSAM step still pays per pass and sub-batch, less than eager: the H100 window of c942193 replayed
    # bSAM m = 8 MLP steps at a median 8,029 images/s; priced at 0.5 ms per whole step it had queued them as '~18 s'
    graphed = cost.estimate(_compose(mnist + ["method=bsam", "trainer.cuda_graph=true"]), "some-unmeasured-gpu")
    assert graphed.seconds == pytest.approx(steps * 16 * cost.GPU_GRAPH_PASS_FLOOR_S, rel=0.01)
    assert 60_000 * 2 / graphed.seconds == pytest.approx(8029, rel=0.05)   # the window's measured rate
    assert graphed.seconds < cost.estimate(_compose(mnist + ["method=bsam"]), "some-unmeasured-gpu").seconds / 1.5


def test_a_paper_page_prices_a_gpu_run_with_the_step_path_the_newest_self_check_passed(tmp_path):
    """The 'Still to run' GPU column priced every cell eagerly, though a window's campaign runs bSAM through the graph
    where its self-check passed (~15 min a 120-epoch MNIST run, not ~26). The newest non-dry self-check of that
    device decides (by the date it records), its file is named in the basis; none, or a dry one: eager."""
    import json

    from flatbnn.reproduce import cost

    cell = ["dataset=mnist", "model=mlp", "trainer.epochs=2", "trainer.batch_size=200", "method=bsam"]
    eager = cost.estimate(_compose(cell), "some-gpu")
    graphed = cost.estimate(_compose(cell + ["trainer.cuda_graph=true"]), "some-gpu")
    assert cost.window_estimate(cell, "some-gpu", bench_dir=tmp_path).seconds == eager.seconds  # no self-check

    def report(date, usable, dry=False):
        return {"versions": {"device": "Some GPU", "date": date, "dry_run": dry}, "usable": usable,
                "paths": {"eager": {"img_s": 1.0}, "cuda_graph": {"img_s": 2.0}}}
    (tmp_path / "some-gpu-2026-11-27-selfcheck-aaa.json").write_text(json.dumps(report("2026-11-27 10:00", [])))
    (tmp_path / "some-gpu-2026-11-26-selfcheck-bbb.json").write_text(json.dumps(report("2026-11-26 10:00",
                                                                                       ["bsam_m8"])))
    (tmp_path / "some-gpu-2026-11-28-selfcheck-ccc.json").write_text(json.dumps(report("2026-11-28 10:00",
                                                                                       ["bsam_m8"], dry=True)))
    assert cost.latest_selfcheck("some-gpu", tmp_path)[0].name == "some-gpu-2026-11-27-selfcheck-aaa.json"
    assert cost.window_estimate(cell, "some-gpu", bench_dir=tmp_path).seconds == eager.seconds  # bsam_m8 failed there
    (tmp_path / "some-gpu-2026-11-29-selfcheck-ddd.json").write_text(json.dumps(report("2026-11-29 10:00",
                                                                                       ["bsam_m8"])))
    est = cost.window_estimate(cell, "some-gpu", bench_dir=tmp_path)
    assert est.seconds == graphed.seconds < eager.seconds
    assert "trainer.cuda_graph=true, which some-gpu-2026-11-29-selfcheck-ddd.json passed" in est.rate.basis
