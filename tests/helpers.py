"""Shared test helpers: compose configs exactly as train.py does, run train.py as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from flatbnn.resources import CONFIGS_DIR as CONFIGS  # importing it registers the `metrics` node (flatbnn/schema.py)

REPO = Path(__file__).resolve().parents[1]


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_cfg(overrides: list[str], run_dir: Path) -> dict:
    from flatbnn.engine.run import run
    cfg = compose_cfg(overrides + ["trainer.progress=false", "trainer.reliability_diagram=false"])
    return run(cfg, run_dir=Path(run_dir))


def train_cli(args: list[str], run_dir: Path, torchrun: int = 0, check=True, timeout=600, env=None):
    base = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
            if torchrun else [sys.executable])
    cmd = base + [str(REPO / "train.py"), *args, f"hydra.run.dir={run_dir}", "trainer.progress=false"]
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=REPO)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def results(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "results.json").read_text())
