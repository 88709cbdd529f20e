"""What the Fisher-SAM rows (rows/fsam_*.yaml, issue 14) need beyond train.py: top-5 accuracy (Table 2), the Stanford
Cars / Flowers-102 loaders and CIFAR at 224 px (Table 3), the weights preflight (Tables 2-3), the explicit ASAM
choices of Table 1 and the Sec. 5.7 overhead comparison."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flatbnn.data import build_dataset
from flatbnn.data.fake import class_colour, write_cifar100, write_flowers102, write_stanford_cars
from flatbnn.metrics import classification_metrics
from flatbnn.metrics.classification import top_k_accuracy

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ top-5 accuracy (Table 2)
def test_top5_accuracy_hand_computed():
    # 3 examples, 7 classes; the target's rank (0 = best) is 0, 4 and 5
    scores = torch.tensor([
        [0.9, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0],   # target 0: rank 0 -> top-1 and top-5
        [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05],  # target 4: four classes above it -> top-5 only
        [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05],  # target 5: five classes above it -> neither
    ])
    targets = torch.tensor([0, 4, 5])
    assert top_k_accuracy(scores, targets, 5) == pytest.approx(2 / 3)
    assert top_k_accuracy(scores, targets, 1) == pytest.approx(1 / 3)
    assert top_k_accuracy(scores.log(), targets, 6) == pytest.approx(1.0)  # log-probs: same ranks
    # ties: a target tied with the best counts (fewer than k classes score strictly higher)
    assert top_k_accuracy(torch.tensor([[0.5, 0.5, 0, 0, 0, 0]]), torch.tensor([1]), 1) == 1.0


def test_top5_in_classification_metrics_only_above_five_classes():
    lp = torch.log_softmax(torch.randn(40, 10, generator=torch.Generator().manual_seed(0)), 1)
    y = torch.arange(40) % 10
    m = classification_metrics(lp, y)
    ranks = (lp > lp.gather(1, y[:, None])).sum(1)
    assert m["top5_accuracy"] == pytest.approx(float((ranks < 5).double().mean()))
    assert m["top5_accuracy"] >= m["accuracy"]
    assert "top5_accuracy" not in classification_metrics(lp[:, :5].log_softmax(1), y % 5)


# ------------------------------------------------------------------ Table 3 data
def test_stanford_cars_loader_reads_the_torchvision_layout(tmp_path):
    root = write_stanford_cars(tmp_path / "cars")
    b = build_dataset("stanford_cars", root=str(root), augment="none", num_classes=196, input_shape=[3, 224, 224])
    assert (len(b.train), len(b.test), b.num_classes, b.input_shape) == (196, 196, 196, (3, 224, 224))
    assert sorted(b.train.targets.tolist()) == list(range(196))  # every 1-based class c became c - 1
    for i in (0, 77, 195):  # each fake image is coloured by its class: the label came with the right file
        raw = b.test.raw(i)
        assert np.allclose(raw[:, 112, 112].numpy(), class_colour(int(b.test.targets[i])), atol=3)
    assert b.meta["classes"][0] == "Car 000"
    with pytest.raises(FileNotFoundError, match="stanford_cars/") as e:
        build_dataset("stanford_cars", root=str(tmp_path / "nowhere"))
    assert "\n" not in str(e.value) and "dataset.root" in str(e.value)


def test_flowers102_loader_splits_and_labels(tmp_path):
    root = write_flowers102(tmp_path / "fl")
    b = build_dataset("flowers102", root=str(root), augment="imagenet", seed=0)
    assert (len(b.train), len(b.test)) == (204, 102)  # trnid + valid / tstid
    only = build_dataset("flowers102", root=str(root), augment="none", train_split="train")
    assert len(only.train) == 102
    for i in (0, 50, 101):
        raw = only.test.raw(i)
        assert np.allclose(raw[:, 112, 112].numpy(), class_colour(int(only.test.targets[i])), atol=3)
    x, _ = b.train[3]
    assert x.shape == (3, 224, 224)
    with pytest.raises(ValueError, match="train_split"):
        build_dataset("flowers102", root=str(root), train_split="all")
    with pytest.raises(FileNotFoundError, match="flowers-102/"):
        build_dataset("flowers102", root=str(tmp_path / "nowhere"))


def test_cifar100_served_at_224_is_the_bilinear_upsample(tmp_path):
    root = write_cifar100(tmp_path / "c100")
    small = build_dataset("cifar100", root=str(root), augment="none")
    big = build_dataset("cifar100", root=str(root), augment="crop_flip", image_size=224, seed=0,
                        input_shape=[3, 224, 224], num_classes=100)
    assert big.input_shape == (3, 224, 224) and big.meta["image_size"] == 224
    x, y = big.test[7]
    x0, y0 = small.test[7]
    assert y == y0 and x.shape == (3, 224, 224)
    want = F.interpolate(x0[None], size=(224, 224), mode="bilinear", align_corners=False)[0]
    assert torch.allclose(x, want, atol=1e-6)
    assert big.train[0][0].shape == (3, 224, 224)  # the augmented train items too
    with pytest.raises(ValueError, match="input_shape"):  # the config must say what the model will see
        build_dataset("cifar100", root=str(root), image_size=224, input_shape=[3, 32, 32])


# ------------------------------------------------------------------ rows: weights preflight, explicit choices
@pytest.mark.parametrize("row, key, example", [("fsam_t2", "trainer.init_from", "deit_base_patch16_224-b5f2ef4d.pth"),
                                               ("fsam_t3", "model.pretrained_path", "vit_base_patch16_224.npz")])
def test_missing_weights_are_one_line_naming_key_and_file(row, key, example, tmp_path):
    from flatbnn.reproduce.preflight import check_files
    from flatbnn.reproduce.spec import load_row

    r = load_row(row)
    with pytest.raises(FileNotFoundError) as e:
        check_files(r, "paper", [])
    msg = str(e.value)
    assert "\n" not in msg and key in msg and example in msg and "not set" in msg
    if row == "fsam_t2":
        assert "init_key=model" in msg
    weights = tmp_path / example
    weights.write_bytes(b"x")
    check_files(r, "paper", [f"{key}={weights}"])  # present: no error
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_files(r, "paper", [f"{key}={tmp_path / 'missing.pth'}"])


@pytest.mark.parametrize("row, cell, key", [("fsam_t2", "sgd", "trainer.init_from"),
                                            ("fsam_t3", "cifar100/sgd", "model.pretrained_path"),
                                            ("flatbnn_t4", "resnet152/swag", "model.pretrained_path")])
def test_a_pretrained_row_refuses_in_train_py_itself_without_its_weights(row, cell, key, tmp_path, monkeypatch):
    """Not only the reproduce runner: the cell's own config (trainer.weights_required) refuses in train.py, in one
    line, before any data or network is built -- never a fine-tuning protocol trained from random init (issue 42)."""
    from flatbnn.engine.validate import ConfigError, check_weights
    from flatbnn.reproduce.launch import compose_cell
    from flatbnn.reproduce.spec import load_row

    monkeypatch.delenv("FLATBNN_DENSENET161_WEIGHTS", raising=False)
    monkeypatch.delenv("FLATBNN_RESNET152_WEIGHTS", raising=False)
    r = load_row(row)
    overrides = next(c.overrides for c in r.cells_for("paper") if c.id == cell)
    with pytest.raises(ConfigError) as e:
        check_weights(compose_cell(overrides))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{key} must name") and "not set" in str(e.value)
    with pytest.raises(ConfigError, match="missing.pth does not exist"):
        check_weights(compose_cell(overrides + [f"{key}={tmp_path / 'missing.pth'}"]))
    (tmp_path / "w.pth").write_bytes(b"x")
    check_weights(compose_cell(overrides + [f"{key}={tmp_path / 'w.pth'}"]))  # given: accepted
    smoke = next(c.overrides for c in r.cells_for("smoke") if c.id == cell)
    check_weights(compose_cell(smoke))  # the smoke scale's random-init stand-in says so itself
    if row == "fsam_t2":  # once end to end: train.py run directly on the cell's overrides
        from helpers import train_cli
        p = train_cli(overrides + ["trainer.device=cpu"], tmp_path / "run", check=False)
        assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(
            "flatbnn: error: trainer.init_from must name this config's pretrained weights"), p.stderr[-2000:]
        assert not (tmp_path / "run").exists()


def test_a_dry_run_of_a_pretrained_row_says_the_real_run_would_be_refused(tmp_path, capsys):
    from flatbnn.reproduce import cli

    assert cli.main(["run", "fsam_t2", "--scale", "paper", "--dry-run", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "reproduce fsam_t2: dry run: the real run would be refused: fsam_t2 (paper) needs trainer.init_from" in err
    assert "deit_base_patch16_224-b5f2ef4d.pth" in err and not any(tmp_path.iterdir())


def test_fsam_t1_asam_choices_are_explicit():
    from flatbnn.reproduce.launch import compose_cell
    from flatbnn.reproduce.spec import load_row

    row = load_row("fsam_t1")
    cells = {c.id: c for c in row.cells_for("paper")}
    c10 = compose_cell(cells["cifar10/resnet20/asam"].overrides)
    c100 = compose_cell(cells["cifar100/wrn28x10/asam"].overrides)
    assert (c10.flatness.rho, c10.flatness.eta, c10.flatness.bn_stats) == (0.5, 0.01, "both")  # official ASAM
    assert compose_cell({c.id: c for c in row.cells_for("cpu")}["cifar10/resnet20/asam"].overrides).flatness.bn_stats \
        == "first"  # the cpu scale keeps its committed runs' policy
    assert (c100.flatness.rho, c100.flatness.eta) == (1.0, 0.1)
    assert "flatness.bn_stats=first" in cells["cifar10/resnet20/asam"].overrides  # stated, not inherited
    assert "both" in row.choices["bn_stats"] and "0.0" in row.choices["asam eta"]


def test_overhead_ratios_beside_the_paper(tmp_path):
    from flatbnn.tools import analyze

    rows = {"map+none": [100, 110, 90], "map+sam": [200, 220, 180], "map+asam": [210, 200, 190],
            "map+fsam": [202, 230, 170]}
    bench = {"device": {"type": "cpu", "name": "cpu, 2 threads", "threads": 2}, "torch": "x", "label": "test",
             "settings": {"model": "resnet_cifar", "batch_size": 128, "precision": "fp32"}, "git": {},
             "rows": {k: {"step_ms": v, "step_ms_median": float(np.median(v))} for k, v in rows.items()}}
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(bench))
    analyze.main(["overhead", str(f), "--out", str(tmp_path / "o.png")])
    out = json.loads((tmp_path / "o.json").read_text())
    r = out["ratios"]["FSAM/SAM"]
    assert r["ours"] == pytest.approx(202 / 200)
    assert (r["ours_min"], r["ours_max"]) == (pytest.approx(170 / 180), pytest.approx(230 / 220))
    assert r["paper"] == pytest.approx(0.2334 / 0.2322)
    assert out["ratios"]["ASAM/SAM"]["ours"] == pytest.approx(1.0) and "paper" not in out["ratios"]["ASAM/SAM"]
    md = (tmp_path / "o.md").read_text()
    assert "CPU numbers" in md and "1.0052" in md
    assert (tmp_path / "o.png").stat().st_size > 3000
    assert math.isclose(out["seconds_per_batch"]["map+sam"], 0.2)


def test_overhead_comparison_reads_the_analysis_json(tmp_path):
    """The script row's comparison takes its cells from overhead.json (seconds per batch of SAM and FSAM beside
    the paper's) and carries the analysis' ratio table; without the file the cells are listed as missing."""
    from flatbnn.tools import analyze
    from flatbnn.reproduce.compare import build
    from flatbnn.reproduce.compare_markdown import to_markdown
    from flatbnn.reproduce.spec import load_row

    row = load_row("fsam_overhead")
    empty = build(row, "cpu", out=tmp_path)
    assert {r["cell"]: r["state"] for r in empty["table"]} == {"sam": "missing", "fsam": "missing"}
    rows = {"map+none": [100], "map+sam": [300], "map+asam": [310], "map+fsam": [330]}
    bench = {"device": {"type": "cpu", "name": "cpu, 2 threads", "threads": 2}, "torch": "x", "label": "test",
             "settings": {"model": "resnet_cifar", "batch_size": 128, "precision": "fp32"}, "git": {},
             "rows": {k: {"step_ms": v, "step_ms_median": float(np.median(v))} for k, v in rows.items()}}
    (tmp_path / "benchmark.json").write_text(json.dumps(bench))
    analyze.main(["overhead", str(tmp_path / "benchmark.json"), "--out", str(tmp_path / "overhead.png")])
    c = build(row, "cpu", out=tmp_path)
    got = {r["cell"]: (r["ours_mean"], r["paper_mean"], r["state"]) for r in c["table"]}
    assert got == {"sam": (pytest.approx(0.3), 0.2322, "done"), "fsam": (pytest.approx(0.33), 0.2334, "done")}
    md = to_markdown(c)
    assert "| FSAM/SAM | 1.100" in md and "## The analysis (`overhead.md`)" in md
    assert "analyses other rows' finished runs" not in md  # a benchmark, not an analysis of other rows' runs
