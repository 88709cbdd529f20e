"""The `trainer` and `metrics` schemas (flatbnn/schema.py): types, ranges, unknown keys, interpolations, and the
metrics defaults declared once. In-process compositions only (no subprocess): about a second in all."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from omegaconf import OmegaConf

from flatbnn.engine.validate import ConfigError, validate_config
from flatbnn.resources import CONFIGS_DIR
from flatbnn.schema import EvalConfig, TrainerConfig, register
from tests.helpers import compose_cfg


@pytest.mark.parametrize("overrides,line", [
    (["trainer.batch_size=0"], "trainer.batch_size=0: must be >= 1"),                              # a range
    (["trainer.label_smoothing=1.0"], "trainer.label_smoothing=1.0: must be < 1"),
    (["trainer.eval_batch_size=abc"], "trainer.eval_batch_size='abc': must be a number (a whole one)"),  # a type
    (["trainer.compile=no"], "trainer.compile='no': must be true or false"),
    (["trainer.epochs=null"], "trainer.epochs=None: must be set (not null)"),
    (["trainer.limit_train_batches=0"], "trainer.limit_train_batches=0: must be >= 1"),  # may be null, not 0
    (["+trainer.batch_sise=64"], "trainer.batch_sise: no such key in trainer; did you mean batch_size"),  # unknown
    (["+metrics.ece_binz=20"], "metrics.ece_binz: no such key in metrics; did you mean ece_bins or ece_binning?"),
    (["metrics.ece_bins=0"], "metrics.ece_bins=0: must be >= 1"),
    (["metrics.ood_score=margin"], "metrics.ood_score='margin': must be one of max_prob, entropy"),
    (["trainer.epochs=${nope}"], "trainer.epochs: Interpolation key 'nope' not found"),
])
def test_a_wrong_trainer_or_metrics_value_is_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as e:
        validate_config(compose_cfg(overrides))
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_interpolations_are_checked_by_their_value():
    validate_config(compose_cfg(["trainer.epochs=${seed}", "metrics.ece_bins=${trainer.batch_size}",
                                 "trainer.limit_train_batches=null"]))
    with pytest.raises(ConfigError, match=r"trainer.batch_size=0: must be >= 1"):
        validate_config(compose_cfg(["seed=0", "trainer.batch_size=${seed}"]))


def test_a_wrong_type_for_a_metrics_key_is_one_line_at_composition():
    """`metrics` is a typed node in the composed config (Hydra refuses the override itself): cli's line names it."""
    from hydra.errors import ConfigCompositionException

    from flatbnn.cli import hydra_error_line
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(["metrics.ece_bins=abc"])
    assert hydra_error_line(e.value) == "metrics.ece_bins: Value 'abc' of type 'str' could not be converted to Integer"


def test_metrics_defaults_are_declared_once_in_the_dataclass():
    # config.yaml does not repeat them ...
    assert "metrics" not in yaml.safe_load((CONFIGS_DIR / "config.yaml").read_text())
    # ... the composed config holds the dataclass's, in its field order (config_resolved.yaml's order) ...
    cfg = compose_cfg([])
    assert list(cfg.metrics) == [f.name for f in dataclasses.fields(EvalConfig)]
    assert OmegaConf.to_container(cfg.metrics) == dataclasses.asdict(EvalConfig())
    assert cfg.metrics.ece_bins == 15 and cfg.metrics.auroc_thresholds == 2500  # the values results were made with
    # ... and a change of the default there is what the composed config gets
    from hydra.core.config_store import ConfigStore
    moved = dataclasses.make_dataclass("MovedEval", [("ece_bins", int, dataclasses.field(default=20))], bases=(EvalConfig,))
    try:
        ConfigStore.instance().store(group="metrics", name="default", node=moved)
        assert compose_cfg([]).metrics.ece_bins == 20
    finally:
        register()
    assert compose_cfg([]).metrics.ece_bins == 15


def test_the_trainer_schema_covers_every_shipped_trainer_key_and_declares_no_value():
    """trainer/*.yaml hold the values (with why); the schema knows every key they set, and sets none itself."""
    shipped = set()
    for f in sorted((CONFIGS_DIR / "trainer").glob("*.yaml")):
        shipped |= set(yaml.safe_load(f.read_text())) - {"defaults"}
    fields = {f.name: f for f in dataclasses.fields(TrainerConfig)}
    assert shipped == set(fields)
    assert all(f.default == "???" for f in fields.values())
    # the composed trainer node is the YAML's, untouched by the schema: ints stay ints (config_resolved.yaml, resume)
    trainer = compose_cfg([]).trainer
    assert trainer.dist_timeout_s == 600 and type(trainer.dist_timeout_s) is int


def test_the_dataclass_checks_itself_where_no_composition_ran():
    """evaluate.py (a stored run's config + overrides) and one's own loop build EvalConfig directly."""
    with pytest.raises(ConfigError, match=r"^metrics.ece_edges='middle': must be one of right, left, both, strict$"):
        EvalConfig(ece_edges="middle")
    with pytest.raises(ConfigError, match=r"^metrics.ece_bins='20': must be a number \(a whole one\)$"):
        EvalConfig(ece_bins="20")
    assert EvalConfig(ece_bins=20).ece_bins == 20
