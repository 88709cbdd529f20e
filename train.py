#!/usr/bin/env python
"""flatbnn's one entry point.

    python train.py dataset=cifar10 model=resnet20_frn method=map flatness=sam flatness.rho=0.05
    python train.py --multirun flatness=sam flatness.rho=0.01,0.05,0.1 seed=0,1,2
    torchrun --nproc_per_node=2 train.py trainer.batch_size=128 ...   (DDP; batch_size is global)
"""

from __future__ import annotations

import os
import sys
import tempfile

import hydra
from omegaconf import DictConfig

from flatbnn.cli import EXIT_CONFIG, EXIT_PREEMPTED, one_line_error


def _nonzero_rank_overrides() -> None:
    """Under torchrun only rank 0 owns a Hydra run dir; the others write nothing (PITFALLS: hydra#2070).
    The engine broadcasts rank 0's directory to every rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        return
    args = sys.argv[1:]
    extra = ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        extra.append(f"hydra.run.dir={tempfile.mkdtemp(prefix='flatbnn_rank')}")
    sys.argv += extra


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from flatbnn.engine.run import run
    from flatbnn.engine.trainer import Preempted

    try:
        results = run(cfg)
    except Preempted as e:
        print(f"flatbnn: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except Exception as e:  # known, actionable errors become one line; anything else keeps its traceback
        msg = one_line_error(e)
        if msg is None:
            raise
        print(f"flatbnn: error: {msg}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    # the return value is what a Hydra sweeper (e.g. Optuna) would optimise
    return None if results is None else results["metrics"].get("nll")


if __name__ == "__main__":
    _nonzero_rank_overrides()
    main()
