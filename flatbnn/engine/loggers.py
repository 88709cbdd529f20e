"""Loggers. ``metrics.jsonl`` is always written (rank 0); W&B is optional and never required.

``logger=wandb`` adds a ``WandbLogger``; with ``WANDB_MODE=offline`` it logs to ``<run dir>/wandb``.
"""

from __future__ import annotations

import json
import os
import sys
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


class WandbStartError(ValueError):  # a ValueError: train.py makes it one line, exit 2
    pass


class WandbLogger:
    """``logger=wandb``. Start-up is bounded by ``init_timeout_s`` (no key, an unreachable server: W&B's own
    retries run for minutes, and a stop signal waits for them); then ``on_init_failure=offline`` logs to
    ``<run dir>/wandb`` offline (one warning line; ``wandb sync`` uploads it later) and ``stop`` ends the run
    with one line, exit 2. The summary equals results.json: the final predictive is logged under ``final/*``
    and the summary's ``test/*`` are set after the last history row is committed."""

    def __init__(self, run_dir: Path, run_config: dict, project: str = "flatbnn", entity: str | None = None,
                 mode: str | None = None, name: str | None = None, group: str | None = None,
                 tags: list | None = None, init_timeout_s: float = 30.0, on_init_failure: str = "offline"):
        try:
            import wandb
        except ImportError:
            raise ImportError("logger=wandb needs wandb: pip install wandb (or use logger=console)") from None
        if on_init_failure not in ("offline", "stop"):
            raise ValueError(f"logger.wandb.on_init_failure={on_init_failure}: must be offline or stop")
        if not float(init_timeout_s) > 0:
            raise ValueError(f"logger.wandb.init_timeout_s={init_timeout_s}: must be > 0 (seconds)")
        self.wandb = wandb
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id.txt"  # a resumed run continues the same W&B run
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        mode = mode or os.environ.get("WANDB_MODE")
        group = group or default_group(run_config, _hydra_sweep_dir())
        kwargs = dict(project=project, entity=entity, name=name, group=group, tags=list(tags or []),
                      config=run_config, dir=str(run_dir), id=run_id, resume="allow")
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=float(init_timeout_s)), **kwargs)
        except Exception as e:  # wandb.errors.CommError / UsageError (no key) / a timeout
            from flatbnn.engine.trainer import Preempted
            if isinstance(e, Preempted):  # a stop signal during the start-up: honoured, not taken for a failure
                raise
            why = " ".join(str(e).split())[:200] or type(e).__name__
            if on_init_failure == "stop":
                raise WandbStartError(
                    f"W&B did not start ({why}; start-up bounded by logger.wandb.init_timeout_s={init_timeout_s:g} s); log in "
                    f"(wandb login) / check the server, or log offline: WANDB_MODE=offline or "
                    f"logger.wandb.on_init_failure=offline") from None
            print(f"warning: W&B did not start ({why}; start-up bounded by logger.wandb.init_timeout_s={init_timeout_s:g} s); "
                  f"logging offline to {run_dir / 'wandb'} (upload later: wandb sync)", file=sys.stderr)
            wandb.teardown()  # the service still holds the run id of the failed attempt
            self.run = wandb.init(mode="offline", **kwargs)

    def log_epoch(self, record: dict) -> None:
        # committed now: a row left open is flushed at finish(), after the summary, and overwrites its test/*
        self.run.log(dict(record), step=int(record.get("step", 0)), commit=True)

    def log_results(self, results: dict) -> None:
        metrics = {k: v for k, v in results.get("metrics", {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        # no step=: W&B's own next step, the row after the last epoch's (an explicit step <= the last committed one
        # -- the last epoch's, or none on a resumed run that had no epoch left -- is dropped with a warning)
        self.run.log({f"final/{k}": v for k, v in metrics.items()}, commit=True)
        for k, v in metrics.items():  # the summary is results.json's final predictive, not the last epoch's
            self.run.summary[f"test/{k}"] = v
            self.run.summary[f"final/{k}"] = v

    def finish(self) -> None:
        self.run.finish()
