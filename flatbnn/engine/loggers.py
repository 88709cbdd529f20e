"""Loggers. ``metrics.jsonl`` is always written (rank 0); W&B is optional and never required.

``logger=wandb`` adds a ``WandbLogger``; with ``WANDB_MODE=offline`` it logs to ``<run dir>/wandb``.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path


class JsonlLogger:
    """One JSON object per epoch. On resume, lines of epochs that will be re-run are dropped."""

    def __init__(self, run_dir: Path, resume_epoch: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if rec.get("epoch", 0) <= resume_epoch:  # 1-based epochs already completed
                    kept.append(line)
            self.path.write_text("".join(x + "\n" for x in kept))

    def log_epoch(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log_results(self, results: dict) -> None:
        pass

    def finish(self) -> None:
        pass


def default_group(run_config: dict, sweep_dir: str | None = None) -> str | None:
    """The W&B group of a run that names none (``logger.wandb.group=null``): the reproduction row and scale
    (``flat_bnn_t2/cpu``), else the Hydra sweep dir of a ``--multirun``, so one sweep's runs land together;
    a single run gets none."""
    rep = run_config.get("reproduce") or {}
    if rep.get("row"):
        return f"{rep['row']}/{rep['scale']}" if rep.get("scale") else str(rep["row"])
    return str(sweep_dir)[-128:] if sweep_dir else None  # W&B caps a group name at 128 characters


def _hydra_sweep_dir() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return str(HydraConfig.get().sweep.dir)
    except Exception:
        pass
    return None


class WandbLogger:
    def __init__(self, run_dir: Path, run_config: dict, project: str = "flatbnn", entity: str | None = None,
                 mode: str | None = None, name: str | None = None, group: str | None = None,
                 tags: list | None = None):
        try:
            import wandb
        except ImportError:
            raise ImportError("logger=wandb needs wandb: pip install wandb (or use logger=console)") from None
        self.wandb = wandb
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id.txt"  # a resumed run continues the same W&B run
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, entity=entity, mode=mode or os.environ.get("WANDB_MODE"),
                              name=name, group=group or default_group(run_config, _hydra_sweep_dir()),
                              tags=list(tags or []), config=run_config,
                              dir=str(run_dir), id=run_id, resume="allow")

    def log_epoch(self, record: dict) -> None:
        self.run.log(dict(record), step=int(record.get("step", 0)))

    def log_results(self, results: dict) -> None:
        for k, v in results.get("metrics", {}).items():
            if isinstance(v, (int, float)):
                self.run.summary[f"test/{k}"] = v

    def finish(self) -> None:
        self.run.finish()
