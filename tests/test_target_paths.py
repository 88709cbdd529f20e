"""``_target_`` paths: every config names the module that defines its object (one guess to the file), and a run
saved with an older spelling of the same object -- the package re-export ``flatbnn.methods.SWAG`` that configs used
before -- is the same config: it resumes, groups with new runs and is not stale."""

from __future__ import annotations

import importlib
import json

import yaml

from helpers import CONFIGS, REPO, run_cfg

SWAG_SMALL = ["dataset=digits", "model=mlp", "model.hidden=[16]", "method=swag", "method.num_samples=2",
              "dataset.train_subset=256", "dataset.test_subset=50", "trainer.batch_size=64", "trainer.eval_every=0"]


def test_every_flatbnn_target_in_configs_names_the_module_that_defines_it():
    targets = {}
    for path in sorted(CONFIGS.rglob("*.yaml")):
        for node in _walk(yaml.safe_load(path.read_text())):
            t = node.get("_target_")
            if isinstance(t, str) and t.startswith("flatbnn."):
                targets[f"{path.relative_to(CONFIGS)}: {t}"] = t
    assert len(targets) > 50  # every dataset / model / method / flatness / scheduler option
    wrong = []
    for where, t in targets.items():
        module, _, name = t.rpartition(".")
        obj = getattr(importlib.import_module(module), name)
        if f"{obj.__module__}.{obj.__qualname__}" != t:
            wrong.append(f"{where} (defined in {obj.__module__})")
    assert not wrong, "name the defining module:\n" + "\n".join(wrong)


def _walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_canonical_target_is_where_the_object_is_defined():
    from flatbnn.utils import canonical_target

    assert canonical_target("method._target_", "flatbnn.methods.SWAG") == "flatbnn.methods.swag.SWAG"
    assert canonical_target("method._target_", "flatbnn.methods.swag.SWAG") == "flatbnn.methods.swag.SWAG"
    assert canonical_target("flatness._target_", "flatbnn.flatness.SAM") == "flatbnn.flatness.sam.SAM"
    assert canonical_target("method._target_", "flatbnn.methods.MAP") != "flatbnn.methods.swag.SWAG"
    # not a target, or a target that no longer imports: compared as written
    assert canonical_target("method.name", "flatbnn.methods.SWAG") == "flatbnn.methods.SWAG"
    assert canonical_target("method._target_", "flatbnn.methods.Gone") == "flatbnn.methods.Gone"
    assert canonical_target("method._target_", "flatbnn.no_such_module.X") == "flatbnn.no_such_module.X"
    # another library's target keeps its public spelling (what aggregate tables show: optimizer._target_=torch.optim.SGD)
    assert canonical_target("optimizer._target_", "torch.optim.SGD") == "torch.optim.SGD"


def test_a_run_saved_with_the_package_path_resumes_under_the_module_path(tmp_path):
    run = tmp_path / "run"
    run_cfg(SWAG_SMALL + ["trainer.epochs=1", "method._target_=flatbnn.methods.SWAG"], run)
    assert yaml.safe_load((run / "config_resolved.yaml").read_text())["method"]["_target_"] == "flatbnn.methods.SWAG"
    before = (run / "results.json").read_bytes()
    # the same run again, spelled the new way: finished, left alone (not refused, not retrained)
    run_cfg(SWAG_SMALL + ["trainer.epochs=1"], run)
    assert (run / "results.json").read_bytes() == before
    # extended by one epoch: resumes from the checkpoint; trainer.epochs is the only change it records
    res = run_cfg(SWAG_SMALL + ["trainer.epochs=2", "trainer.resume_overrides=[trainer.epochs]"], run)
    assert [h["changes"] for h in res["meta"]["resume_changes"]] == [{"trainer.epochs": [1, 2]}]
    assert res["meta"]["budget"]["steps"] == 8


def test_a_record_saved_with_the_package_path_is_not_stale_and_groups_with_new_runs(tmp_path):
    from flatbnn.reproduce import launch
    from flatbnn.reproduce.aggregate import config_key
    from flatbnn.reproduce.spec import load_row

    record = REPO / "results/reproduce/bsam_t6/paper/runs/mnist/mlp/swag/seed0"  # committed, trained at 09125ee4
    old = yaml.safe_load((record / "config_resolved.yaml").read_text())
    assert (old["method"]["_target_"], old["flatness"]["_target_"]) == ("flatbnn.methods.SWAG", "flatbnn.flatness.NoFlatness")
    cell = next(c for c in load_row("bsam_t6").cells_for("paper") if c.id == "mnist/mlp/swag")
    assert launch.stale_run(cell, 0, record) is None
    # one experiment whichever way its classes are spelled; another class is another experiment
    new = json.loads(json.dumps(old))
    new["method"]["_target_"], new["flatness"]["_target_"] = "flatbnn.methods.swag.SWAG", "flatbnn.flatness.none.NoFlatness"
    assert config_key(new) == config_key(old)
    new["method"]["_target_"] = "flatbnn.methods.map.MAP"
    assert config_key(new)["method._target_"] != config_key(old)["method._target_"]

