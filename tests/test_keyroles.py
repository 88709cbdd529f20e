"""flatbnn/keyroles.py: one declaration of what each config key changes drives the resume check, the aggregation's
rows and evaluate.py's overrides. No training: the three are asked directly, with small configs."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from omegaconf import OmegaConf

from flatbnn import evaluate, keyroles
from flatbnn.engine.run_dir import RESUME_EXEMPT, config_changes
from flatbnn.reproduce.aggregate import IGNORED_KEYS, Run, config_key, group_runs
from flatbnn.utils import flatten
from helpers import CONFIGS, compose_cfg

CFG = {
    "seed": 0,
    "metrics": {"ece_bins": 15},
    "model": {"name": "mlp", "hidden": [32]},
    "optimizer": {"lr": 0.1},
    "method": {"_target_": "flatbnn.methods.SWAG", "num_samples": 4, "swa_start": 0.5, "new_samples": 1},
    "trainer": {"epochs": 4, "eval_batch_size": 500, "num_workers": 0},
    "dataset": {"name": "digits", "root": "data"},
}


def _with(key: str, value) -> dict:
    cfg = copy.deepcopy(CFG)
    *parents, last = key.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[last] = value
    return cfg


def resume_refuses(key: str, value) -> bool:
    """A rerun of a run dir started with CFG, with ``key`` changed: does the resume check report it?"""
    return key in config_changes(CFG, _with(key, value))


def splits_rows(key: str, value) -> bool:
    """Two seeds, one with ``key`` changed: two rows?"""
    runs = [Run(path=f"/runs/{s}", results={"metrics": {"accuracy": 0.9}, "meta": {"seed": s}}, config=cfg)
            for s, cfg in ((0, _with("seed", 0)), (1, {**_with(key, value), "seed": 1}))]
    return len(group_runs(runs)) == 2


def evaluate_accepts(key: str, value) -> bool:
    cfg = OmegaConf.create(CFG)
    try:
        applied = evaluate.apply_overrides(cfg, [f"{key}={value}"])
    except evaluate.EvalError as e:
        assert "refusing a change" in str(e) and f"({keyroles.role_of(key).name} key" in str(e), e
        return False
    assert applied == [f"{key}={value}"] and OmegaConf.select(cfg, key) == value
    return True


def three(key: str, value) -> tuple[bool, bool, bool]:
    """(resume refuses it, it splits rows, evaluate.py accepts it)"""
    return resume_refuses(key, value), splits_rows(key, value), evaluate_accepts(key, value)


def test_a_runtime_key_is_free_on_resume_never_splits_rows_and_is_evaluable():
    """trainer.eval_batch_size was free on resume but split aggregate rows (issue #35)."""
    assert keyroles.role_of("trainer.eval_batch_size") is keyroles.RUNTIME
    assert three("trainer.eval_batch_size", 7) == (False, False, True)


def test_a_train_key_is_refused_on_resume_splits_rows_and_is_not_evaluable():
    assert three("optimizer.lr", 0.3) == (True, True, False)
    assert three("method.swa_start", 0.25) == (True, True, False)   # a method key not declared: the group's role


def test_one_declaration_drives_all_three(monkeypatch):
    """Changing the one entry changes the resume check, the rows and evaluate.py together."""
    monkeypatch.setitem(keyroles.KEY_ROLES, "trainer.eval_batch_size", keyroles.TRAIN)
    assert three("trainer.eval_batch_size", 7) == (True, True, False)
    monkeypatch.setitem(keyroles.KEY_ROLES, "optimizer.lr", keyroles.RUNTIME)
    assert three("optimizer.lr", 0.3) == (False, False, True)


def test_a_new_method_prediction_key_declared_once_becomes_evaluable(monkeypatch):
    from flatbnn.methods import SWAG

    assert three("method.new_samples", 8) == (True, True, False)    # undeclared: a method key shapes the weights
    monkeypatch.setattr(SWAG, "predict_keys", SWAG.predict_keys + ("new_samples",))  # declared by its class
    # evaluable; still its own experiment, and a resume does not change it unasked
    assert three("method.new_samples", 8) == (True, True, True)


# ------------------------------------------------------------------------------ method keys: the class's roles

class DiagLaplace:
    """A new method as a contributor writes it (issue 45): its re-evaluable prior precision takes the natural name,
    ``method.prior_precision`` -- a TRAINING key of bSAM and VOGN (delta = prior_precision / N in their updates)."""
    predict_keys = ("num_samples", "prior_precision")

    def __init__(self, prior_precision: float = 1.0, num_samples: int = 32):
        pass


def test_every_prediction_key_is_an_argument_of_its_class():
    """A misspelt ``predict_keys`` entry would leave the real key a training key."""
    for cls in keyroles.shipped_method_classes():
        assert set(cls.predict_keys) <= keyroles.constructor_keys(cls), cls


def test_no_two_methods_give_one_key_different_roles():
    """Issue 45: the roles are declared per method class; a key path one method predicts with and another trains
    with fails here (the shipped classes), and a new class that makes one is named with the classes it collides
    with."""
    shipped = keyroles.shipped_method_classes()
    assert len(shipped) >= 11 and not keyroles.role_collisions(shipped), keyroles.role_collisions(shipped)
    assert keyroles.role_collisions(shipped + (DiagLaplace,)) == [
        "method.prior_precision: a prediction key of DiagLaplace but a training key of BSAM, VOGN"]


def test_evaluate_reads_the_roles_of_the_runs_own_method(monkeypatch):
    """With the collision in the shipped classes, a bSAM run still refuses ``method.prior_precision`` (it trained
    with it) while the new method's run takes it; and the no-method answer keeps the disputed key a training key."""
    shipped = keyroles.shipped_method_classes()
    monkeypatch.setattr(keyroles, "shipped_method_classes", lambda: (*shipped, DiagLaplace))
    bsam = OmegaConf.create({"method": {"_target_": "flatbnn.methods.bsam.BSAM", "prior_precision": 40.0,
                                        "num_samples": 32}})
    with pytest.raises(evaluate.EvalError, match=r"method.prior_precision: refusing a change \(train key of BSAM"):
        evaluate.apply_overrides(bsam, ["method.prior_precision=1000"])
    assert evaluate.apply_overrides(bsam, ["method.num_samples=8"]) == ["method.num_samples=8"]
    laplace = OmegaConf.create({"method": {"_target_": f"{__name__}.DiagLaplace", "prior_precision": 1.0}})
    assert evaluate.apply_overrides(laplace, ["method.prior_precision=1000"]) == ["method.prior_precision=1000"]
    assert keyroles.role_of("method.prior_precision") is keyroles.TRAIN
    assert keyroles.role_of("method.prior_precision", f"{__name__}.DiagLaplace") is keyroles.PREDICT
    assert "method.prior_precision" not in evaluate.eval_keys()
    gone = OmegaConf.create({"method": {"_target_": "flatbnn.methods.gone.Gone", "num_samples": 3}})
    with pytest.raises(evaluate.EvalError, match="the run's method class cannot be imported") as e:
        evaluate.apply_overrides(gone, ["method.num_samples=5"])  # its roles cannot be read: one line, exit 2
    assert "\n" not in str(e.value)


def test_seed_and_labels_keep_a_run_but_never_split_its_row():
    assert three("seed", 1)[1:] == (False, False)                    # resume: the seed is compared (below)
    assert config_changes({"seed": 0}, {"seed": 1}) == {"seed": (0, 1)}
    assert keyroles.role_of("reproduce.cell") is keyroles.IDENTITY
    assert config_changes({"reproduce": {"cell": "a"}}, {"reproduce": {"cell": "b"}})


def test_an_undeclared_key_is_a_training_key():
    assert keyroles.declaration("user.added") is None and keyroles.role_of("user.added") is keyroles.DEFAULT_ROLE
    assert keyroles.DEFAULT_ROLE is keyroles.TRAIN
    assert keyroles.role_of("dataset.ood_roots.svhn") is keyroles.RUNTIME    # the longest declared prefix decides
    assert keyroles.role_of("method.num_samples") is keyroles.PREDICT and keyroles.role_of("method.lr") is keyroles.TRAIN


# ------------------------------------------------------------------------------ every config key is declared

def _option_keys(path) -> set[str]:
    """The dotted keys one config file sets (read as YAML: composing every option takes seconds; tests/test_configs.py
    composes them all)."""
    text = path.read_text()
    data = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k != "defaults"}
    package = re.search(r"^# @package (\S+)", text, re.M)   # where Hydra puts its keys (default: its group)
    package = package.group(1) if package else path.parent.name
    prefix = "" if package == "_global_" else package + "."
    return {prefix + k for k in flatten(data)}


@pytest.fixture(scope="module")
def config_keys() -> set[str]:
    """Every key of the composed default config and of every option of every config group."""
    keys = set(flatten(OmegaConf.to_container(compose_cfg([]), resolve=False)))
    for path in CONFIGS.glob("*/*.yaml"):
        keys |= _option_keys(path)
    return keys


def test_every_config_key_has_a_declared_role(config_keys):
    """trainer.* and dataset.* mix roles: each of their keys is declared by name; a new one fails here until it is
    (other groups are declared whole, so their new keys are training keys, the safe default)."""
    undeclared = sorted(k for k in config_keys if keyroles.declaration(k) is None)
    assert not undeclared, f"declare their roles in flatbnn/keyroles.py: {undeclared}"
    assert {"trainer.eval_batch_size", "dataset.shift_root", "metrics.ece_bins", "logger.wandb.project",
            "method.bn_refresh_fraction", "model.min_input_size"} <= config_keys  # every group was read


def test_every_declared_key_exists_in_the_configs(config_keys):
    """No declaration names a key that no config has (a typo would silently leave the real key a training key)."""
    known = config_keys | {"hydra"}  # hydra.* is Hydra's own node, outside the composed job config
    missing = [d for d in keyroles.KEY_ROLES if not any(k == d or k.startswith(d + ".") for k in known)]
    assert not missing, missing


def test_the_derived_key_lists_say_what_the_roles_say(config_keys):
    """run_dir.RESUME_EXEMPT, aggregate.IGNORED_KEYS and evaluate.eval_keys() cover a key exactly when its role
    says so."""
    def covered(key, names):
        return any(key == n or key.startswith(n + ".") for n in names)

    for key in config_keys | set(keyroles.KEY_ROLES) | set(keyroles.method_predict_keys()):
        role = keyroles.role_of(key)
        assert covered(key, RESUME_EXEMPT) == role.resume_may_change, key
        assert covered(key, IGNORED_KEYS) == (not role.splits_rows), key
        assert covered(key, evaluate.eval_keys()) == role.evaluable, key
    assert config_key(_with("trainer.eval_batch_size", 7)) == config_key(CFG)


def test_the_resume_check_and_the_rows_ask_no_method_class():
    """PREDICT and TRAIN agree on resuming and on rows, so a method key's answer there imports no method class (the
    aggregation runs without torch); evaluate.py's question imports them."""
    import subprocess
    import sys

    code = ("import sys; from flatbnn import keyroles as k; "
            "a = (k.splits_rows('method.scale'), k.resume_may_change('method.scale')); "
            "print(a, 'torch' in sys.modules, k.evaluable('method.scale'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["(True,", "False)", "False", "True", "True"], out.stdout + out.stderr
