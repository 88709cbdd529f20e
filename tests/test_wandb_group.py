"""W&B runs of one Hydra multirun are grouped by default (issue 37): the sweep dir, or the reproduction row."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO

# a stand-in for the wandb package: records what WandbLogger asks of wandb.init (no service, no network)
FAKE_WANDB = '''
import json, os
class _Run:
    summary = {}
    def log(self, *a, **k): pass
    def finish(self): pass
class Settings:
    def __init__(self, **kw): pass
def teardown(): pass
def init(**kw):
    with open(os.path.join(kw["dir"], "wandb_init.json"), "w") as f:
        json.dump({k: v for k, v in kw.items() if k not in ("config", "settings")}, f)
    return _Run()
'''


def test_default_group():
    from flatbnn.engine.loggers import default_group
    assert default_group({"reproduce": {"row": "flatbnn_t2", "scale": "cpu"}}, "multirun/x") == "flatbnn_t2/cpu"
    assert default_group({"reproduce": {"row": None}}, "multirun/2026-11-27/03-40") == "multirun/2026-11-27/03-40"
    assert default_group({"reproduce": {"row": None}}, None) is None  # a single run: no group


def test_members_of_one_multirun_share_a_wandb_group(tmp_path):
    (tmp_path / "shim" / "wandb").mkdir(parents=True)
    (tmp_path / "shim" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    sweep = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path / 'shim'}{os.pathsep}{REPO}"}
    p = subprocess.run([sys.executable, str(REPO / "train.py"), "--multirun", "model=mlp", "seed=0,1",
                        "logger=wandb", "trainer.epochs=1", "trainer.limit_train_batches=1", "trainer.eval_every=0",
                        "trainer.checkpoint_every=0", "trainer.reliability_diagram=false", "trainer.progress=false",
                        f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    inits = [json.loads((sweep / str(i) / "wandb_init.json").read_text()) for i in (0, 1)]
    assert [i["group"] for i in inits] == [str(sweep)] * 2
    assert inits[0]["id"] != inits[1]["id"]
