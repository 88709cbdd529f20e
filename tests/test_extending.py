"""Issue 45: a new method or flatness variant is one file plus one YAML, truly. The facts the tools need are declared
by the classes (passes per step, prediction keys, validation bounds) and the lists that name methods and variants
(the step proofs, the benchmark's rows) are read from configs/: a SAM subclass dropped into a copy of the repository
as one file and one YAML is costed as two passes, proves its step and is a benchmark row, with no other edit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from flatbnn.bench import variants
from flatbnn.reproduce.cost import work_key
from flatbnn.resources import own_targets
from helpers import REPO, compose_cfg

# ------------------------------------------------------------------------------------------ the benchmark's rows


@pytest.mark.parametrize("group", ["method", "flatness"])
def test_a_benchmark_side_is_the_option_as_a_run_composes_it(group):
    """flatbnn/bench/variants.py merges an option's same-group defaults itself (no Hydra global state): it must
    give what Hydra composes, for every option a row can name."""
    for option in variants.options(group):
        composed = OmegaConf.to_container(compose_cfg([f"{group}={option}"])[group], resolve=True)
        assert variants.option_node(group, option) == composed, option


def test_a_benchmark_row_matches_the_run_configs_it_measures():
    """The cost estimates match a measured row to a run by (method class, flatness class, m) (cost.work_key). Every
    default row whose sides are plain options gives what a run of those options gives -- bsam+none included, whose
    m is the method's own 8 (the instances' attributes gave 1: no bSAM run ever matched its measured row)."""
    pairs = variants.pair_classes()
    checked = 0
    for label in variants.default_pairs():
        m, f = label.split("+")
        if m in variants.METHOD_VARIANTS or f in variants.FLATNESS_VARIANTS:
            continue
        cfg = OmegaConf.to_container(compose_cfg([f"method={m}", f"flatness={f}"]), resolve=False)
        assert pairs[label] == work_key(cfg)[1:4], label
        checked += 1
    assert checked >= 14 and pairs["bsam+none"] == ("BSAM", "NoFlatness", 8)
    sam_m8 = OmegaConf.to_container(compose_cfg(["flatness=sam", "flatness.m=8"]), resolve=False)
    assert pairs["map+sam_m8"] == work_key(sam_m8)[1:4] == ("MAP", "SAM", 8)


def test_the_default_rows_hold_every_class_the_configs_offer():
    rows = variants.default_pairs()
    assert len(rows) == len(set(rows))
    assert {r.split("+")[0] for r in rows} >= set(own_targets("method"))
    assert {r.split("+")[1] for r in rows} >= set(own_targets("flatness"))
    assert "sgvb+geometry" in rows  # geometry needs a method's per-weight scaling: the most basic class giving one


# ------------------------------------------------------------------------------------------ validation


class MeanPredictor:
    """A method class that predicts with its mean for num_samples=0 (as bsam / vogn): validation asks the class."""
    min_num_samples = 0


def test_validation_reads_the_fewest_samples_from_the_method_class():
    from flatbnn.engine.validate import ConfigError, check_values

    cfg = compose_cfg(["method=sgvb", "method.num_samples=0"])
    with pytest.raises(ConfigError, match=r"method.num_samples=0: .*>= 1"):
        check_values(cfg)
    cfg.method._target_ = f"{__name__}.MeanPredictor"
    check_values(cfg)  # the class's declaration, not a list of classes, lets 0 through
    check_values(compose_cfg(["method=bsam", "method.num_samples=0"]))
    with pytest.raises(ConfigError, match=r"method.num_samples=-1: .*>= 0"):
        check_values(compose_cfg(["method=bsam", "method.num_samples=-1"]))


# ------------------------------------------------------------------------------------------ one file + one YAML

VARIANT = '''"""SAM whose ascent moves only the conv / linear weights (tensors of two or more dimensions); the rest keep their
values in the ascent (issue 45's trial of a new flatness variant)."""

from __future__ import annotations

import torch

from flatbnn.flatness.sam import SAM


class WeightsOnlySAM(SAM):
    name = "weights_sam"

    def direction(self, params, grads, scaling, names):
        numer = [g if p.dim() >= 2 else torch.zeros_like(g) for p, g in zip(params, list(grads))]
        return numer, numer
'''
VARIANT_YAML = """defaults:
  - sam
  - _self_
_target_: flatbnn.flatness.weights_sam.WeightsOnlySAM
"""
CHECKS = """
import json, sys
sys.path.insert(0, "scripts")
from flatbnn.reproduce import cost, launch
import benchmark

out = {"passes": cost.run_cost(launch.compose_cell(["dataset=digits", "model=mlp", "flatness=weights_sam"])).passes,
       "default_rows": benchmark.DEFAULT.split(","), "pair": list(cost._bench_pairs()["map+weights_sam"])}
res = benchmark.main(["--smoke", "--configs", "map+weights_sam", "--repeats", "1", "--json", "bench.json"])
out["row"] = res["rows"]["map+weights_sam"]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_sam_subclass_dropped_in_as_one_file_and_one_yaml(tmp_path):
    """The repository copied, then flatbnn/flatness/weights_sam.py and configs/flatness/weights_sam.yaml added and
    nothing else: the cost estimate counts two passes (SAM's declaration, inherited), the step-proof tests collect
    and pass it, and it is one of the benchmark's default rows, built and timed."""
    repo = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("flatbnn", "configs", "scripts", "rows"):
        shutil.copytree(REPO / folder, repo / folder, ignore=skip)
    (repo / "tests").mkdir()
    for name in ("conftest.py", "helpers.py", "test_step_proofs.py"):
        shutil.copy(REPO / "tests" / name, repo / "tests" / name)
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    # the contributor's two files
    (repo / "flatbnn" / "flatness" / "weights_sam.py").write_text(VARIANT)
    (repo / "configs" / "flatness" / "weights_sam.yaml").write_text(VARIANT_YAML)

    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}

    def run(*args, timeout=600):
        p = subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True,
                           timeout=timeout)
        assert p.returncode == 0, f"{args}: {p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout

    got = json.loads(run("-c", CHECKS).strip().splitlines()[-1])
    assert got["passes"] == 2
    assert "map+weights_sam" in got["default_rows"]
    assert got["pair"] == ["MAP", "WeightsOnlySAM", 1]
    assert got["row"]["kind"] == "step" and got["row"]["images_per_s"] > 0

    collected = run("-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--collect-only", "-q",
                    "tests/test_step_proofs.py")
    ids = {line.split("::", 1)[1] for line in collected.splitlines() if "weights_sam" in line}
    assert ids == {"test_three_steps_read_nothing_back_to_the_host[map-weights_sam-fp32]",
                   "test_three_steps_read_nothing_back_to_the_host[map-weights_sam-bf16]",
                   "test_no_tensor_the_step_writes_is_rebound[map-weights_sam]"}, collected[-2000:]
    proved = run("-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "tests/test_step_proofs.py",
                 "-k", "weights_sam")
    assert "3 passed" in proved, proved[-2000:]
