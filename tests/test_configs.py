"""Every YAML under configs/ composes; every experiment preset runs one optimisation step at tiny size."""

from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import real_cifar10_path
from helpers import CONFIGS, compose_cfg, run_cfg

GROUPS = ["dataset", "model", "method", "flatness", "optimizer", "scheduler", "trainer", "logger"]


def _options(group):
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_every_config_file_is_covered():
    covered = set(GROUPS) | {"experiment", "dataset_model"}
    groups = {p.parent.name for p in CONFIGS.rglob("*.yaml") if p.parent != CONFIGS}
    assert groups <= covered, groups - covered


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_group_option_composes_and_resolves(group, option):
    cfg = compose_cfg([f"{group}={option}"])
    OmegaConf.resolve(cfg)  # every interpolation resolves
    node = cfg[group]
    if group in ("method", "flatness"):
        obj = instantiate(node)
        assert type(obj).__name__ and hasattr(obj, "describe")
    if group in ("optimizer", "scheduler"):
        assert callable(instantiate(node))


@pytest.mark.parametrize("name", _options("dataset_model"))
def test_dataset_model_pair_composes_when_both_selected(name):
    dataset, model = None, None
    for d in _options("dataset"):
        if name.startswith(d + "_") and name[len(d) + 1:] in _options("model"):
            dataset, model = d, name[len(d) + 1:]
    assert dataset, f"dataset_model/{name}.yaml does not name an existing <dataset>_<model> pair"
    base = compose_cfg([f"dataset={dataset}", f"model={model}"])
    delta = OmegaConf.load(CONFIGS / "dataset_model" / f"{name}.yaml")
    for key in ("trainer", "optimizer"):
        for k, v in (delta.get(key) or {}).items():
            assert base[key][k] == v, f"{name}: {key}.{k} not applied"


@pytest.mark.parametrize("name", _options("experiment"))
def test_experiment_runs_one_step(name, tmp_path):
    cfg = compose_cfg([f"experiment={name}"])
    overrides = [f"experiment={name}", "trainer.epochs=1", "trainer.limit_train_batches=1",
                 "trainer.batch_size=8", "trainer.eval_every=0"]
    if cfg.dataset.name == "cifar10":
        path = real_cifar10_path()
        if path is None:
            pytest.skip("experiment uses CIFAR-10; real archive not found")
        overrides += [f"dataset.root={path}", "dataset.train_subset=20", "dataset.test_subset=20",
                      f"dataset.cache_dir={tmp_path / 'cache'}"]
    elif cfg.dataset.name == "cifar100":
        pytest.skip("experiment uses CIFAR-100, which is not on this machine (composition is checked above)")
    else:
        overrides += ["dataset.test_subset=50"] if "test_subset" in cfg.dataset else []
    if "model" in cfg and cfg.model.get("name") == "wrn":
        overrides += ["model.depth=10", "model.widen_factor=1"]
    if "swa_start" in cfg.method:
        overrides += ["method.swa_start=0", "method.num_samples=2"]  # collect after the one epoch
    res = run_cfg(overrides, tmp_path)
    assert res["meta"]["budget"]["steps"] == 1
    assert 0.0 <= res["metrics"]["accuracy"] <= 1.0
