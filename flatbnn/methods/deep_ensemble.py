"""Deep ensembles (Lakshminarayanan et al. 2017): M members trained independently, predictions averaged.

In one run the members are trained one after another, each from its own initialisation seed
(``seed + i``, as the flat_seeking_bnn code's "member i uses seed i" for seed 0) with a fresh
optimiser and the full schedule; the engine runs ``trainer.epochs * num_members`` epochs and every
member sees its own data order. Members are never trained jointly on the same batches.
For a cluster, train members as separate runs (``--multirun seed=0,1,2,3,4 method=map``) and
combine them with ``scripts/ensemble.py RUN_DIR...``, which uses the same evaluation routine.
The predictive is the mean of the members' probabilities (NLL = -log of that mean).
"""

from __future__ import annotations

import torch

from flatbnn.methods.base import Method


class DeepEnsemble(Method):
    name = "deep_ens"
    capturable = False  # swaps members (new weights and optimiser) between steps
    predict_keys = ()  # it predicts with each member once: every key of it shapes what is trained

    def __init__(self, num_members: int = 5):
        if num_members < 1:
            raise ValueError(f"method.num_members must be >= 1, got {num_members}")
        super().__init__(num_samples=num_members)
        self.num_members = int(num_members)
        self.epoch_multiplier = self.num_members
        self.members: list[dict] = []

    def setup(self, ctx) -> None:
        super().setup(ctx)
        if ctx.model_factory is None and self.num_members > 1:
            raise ValueError("method=deep_ens needs the engine's model factory to re-initialise members")

    @property
    def member(self) -> int:
        return len(self.members)

    def on_epoch_end(self, epoch: int) -> None:
        if (epoch + 1) % self.ctx.epochs:
            return
        self.members.append({k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()})
        if self.member < self.num_members:
            self._start_member(self.member)

    def _start_member(self, i: int) -> None:
        fresh = self.ctx.model_factory(seed=self.ctx.seed + i)
        self.module.load_state_dict(fresh.state_dict())
        del fresh
        self.optimizer = self.ctx.optimizer_factory(self.parameters())
        self.attach_scheduler()

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        members = self.members if self.members else [self.module.state_dict()]
        current = {k: v.clone() for k, v in self.module.state_dict().items()}
        try:
            for state in members[: int(num_samples or len(members))]:
                self.module.load_state_dict(state)
                self.module.eval()
                yield self.log_probs_on(loaders)
        finally:
            self.module.load_state_dict(current)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "members": self.members}

    def load_state_dict(self, state: dict) -> None:
        self.members = state["members"]
        super().load_state_dict(state)  # the current member's weights, optimiser and schedule

    def describe(self) -> dict:
        return {"name": self.name, "num_members": self.num_members, "trained_members": self.member}
