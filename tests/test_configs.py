"""Every YAML under configs/ composes; every experiment preset runs one optimisation step at tiny size."""


import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import real_cifar10_path
from helpers import CONFIGS, compose_cfg, run_cfg

GROUPS = ["dataset", "model", "method", "flatness", "optimizer", "scheduler", "trainer", "logger"]


def _options(group):
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_every_config_file_is_covered():
    # hydra/launcher/*.yaml are composed by tests/test_cluster.py::test_launchers_compose_and_the_default_stays_basic,
    # debug/default.yaml runs in tests/test_first_hour.py::test_debug_preset_start_and_final_lines_...
    covered = set(GROUPS) | {"experiment", "dataset_model", "paper", "paper_method", "launcher", "debug"}
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


@pytest.mark.parametrize("name", _options("paper_method"))
def test_paper_method_applies_to_its_method_only_when_its_paper_is_chosen(name):
    """paper_method/<paper>_<method>.yaml names an existing paper and method, its keys reach that method when
    both are selected, and they do not leak into the method without the paper."""
    pairs = [(p, name[len(p) + 1:]) for p in _options("paper") if name.startswith(p + "_")]
    pairs = [(p, m) for p, m in pairs if m in _options("method")]
    assert pairs, f"paper_method/{name}.yaml does not name an existing <paper>_<method> pair"
    paper, method = pairs[0]
    with_paper = compose_cfg([f"paper={paper}", f"method={method}"])
    without = compose_cfg([f"method={method}"])
    delta = OmegaConf.to_container(compose_cfg([f"paper={paper}", f"method={method}"]).method)
    instantiate(with_paper.method)  # only keys the method takes
    changed = {k for k, v in delta.items() if without.method.get(k) != v}
    own = OmegaConf.load(CONFIGS / "paper_method" / f"{name}.yaml")
    keys = {k for k in own if k != "defaults"}
    assert changed <= _paper_method_keys(name)
    assert all(with_paper.method[k] == own[k] for k in keys)


def _paper_method_keys(name):
    own = OmegaConf.load(CONFIGS / "paper_method" / f"{name}.yaml")
    keys = {k for k in own if k != "defaults"}
    for d in own.get("defaults", []):
        if isinstance(d, str) and d != "_self_":
            keys |= _paper_method_keys(d)
    return keys


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
