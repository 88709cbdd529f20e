#!/usr/bin/env python
"""Combine separately trained runs into a deep ensemble and evaluate it with the one routine.

    python train.py --multirun method=map seed=0,1,2,3,4 ... hydra.sweep.dir=runs/members
    python scripts/ensemble.py runs/members/*/ --out runs/ensemble

Each member run must have its ``.hydra/config.yaml`` and ``checkpoints/last.pt`` (the final
weights). Members must share dataset and model. Writes ``<out>/results.json`` like train.py, with
method ``deep_ens (combined)`` and the member runs listed in its meta.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf


from flatbnn.engine.checkpoint import load_checkpoint, write_json  # noqa: E402
from flatbnn.engine.provenance import git_commit, hardware  # noqa: E402
from flatbnn.metrics.evaluate import EvalConfig, dataset_targets, evaluate  # noqa: E402


class CombinedRuns:
    """The ``predict`` half of a method: one posterior sample per member run."""

    name = "deep_ens (combined)"

    def __init__(self, module, states, device):
        self.module, self.states, self.device = module, states, device

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        for state in self.states:
            self.module.load_state_dict(state)
            self.module.eval()
            out = {}
            for name, loader in loaders.items():
                out[name] = torch.cat([torch.log_softmax(self.module(x.to(self.device)).float(), 1).cpu()
                                       for x, _ in loader])
            yield out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="member run directories")
    ap.add_argument("--out", required=True, help="output directory for results.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=500)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device(args.device)
    runs = [Path(r) for r in args.runs]
    cfgs = [OmegaConf.load(r / ".hydra" / "config.yaml") for r in runs]
    for r, c in zip(runs, cfgs):
        if (c.dataset.name, c.model.name) != (cfgs[0].dataset.name, cfgs[0].model.name):
            print(f"error: {r} trains {c.dataset.name}/{c.model.name}, not "
                  f"{cfgs[0].dataset.name}/{cfgs[0].model.name}", file=sys.stderr)
            return 2
    cfg = cfgs[0]
    bundle = instantiate(cfg.dataset)
    module = instantiate(cfg.model).to(device)
    states = [load_checkpoint(r / "checkpoints" / "last.pt")["method"]["model"] for r in runs]
    loaders = {"test": torch.utils.data.DataLoader(bundle.test, batch_size=args.batch_size)}
    for name, ds in (bundle.ood or {}).items():
        loaders[f"ood/{name}"] = torch.utils.data.DataLoader(ds, batch_size=args.batch_size)
    eval_cfg = EvalConfig(**OmegaConf.to_container(cfg.metrics, resolve=True))
    metrics = evaluate(CombinedRuns(module, states, device), loaders, dataset_targets(bundle.test), eval_cfg)
    members = [load_json(r) for r in runs]
    meta = {"dataset": cfg.dataset.name, "model": members[0]["meta"]["model"] if members[0] else cfg.model.name,
            "method": {"name": "deep_ens", "num_members": len(runs), "combined_from": [str(r) for r in runs]},
            "flatness": members[0]["meta"]["flatness"] if members[0] else {"name": "unknown"},
            "seed": min(c.seed for c in cfgs), "member_seeds": [c.seed for c in cfgs], "epochs": cfg.trainer.epochs,
            "budget": {**(members[0]["meta"]["budget"] if members[0] else {}), "members": len(runs)},
            "hardware": hardware(device, 1), "git": git_commit(), "wall_seconds": time.perf_counter() - t0,
            "paper_reproduction": False}
    out = Path(args.out)
    write_json(out / "results.json", {"metrics": metrics, "meta": meta})
    print({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})
    return 0


def load_json(run: Path):
    import json
    f = run / "results.json"
    return json.loads(f.read_text()) if f.exists() else None


if __name__ == "__main__":
    sys.exit(main())
