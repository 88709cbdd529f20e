"""MC-Dropout (Gal & Ghahramani 2016): train with dropout on, predict with K stochastic passes.

The dropout rate and placement belong to the backbone (``model.dropout``; each family places it
where its reference code does, see docs/models.md). Only the dropout modules are in train mode at
test time (BatchNorm stays in eval mode), as in the flat_seeking_bnn code. Masks come from a fixed
evaluation seed, so the predictive does not depend on resume; the training RNG is left untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from flatbnn.methods.base import Method

DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


class MCDropout(Method):
    name = "mc_dropout"
    samples_weights = False  # a sample is a dropout mask drawn in the forward pass
    predict_keys = Method.predict_keys + ("eval_seed",)  # the seed of the predictive's dropout masks

    def __init__(self, num_samples: int = 30, eval_seed: int = 1):
        super().__init__(num_samples=num_samples)
        self.eval_seed = eval_seed

    def setup(self, ctx) -> None:
        super().setup(ctx)
        drops = [m for m in self.module.modules() if isinstance(m, DROPOUT_TYPES) and m.p > 0]
        if not drops:
            raise ValueError("method=mc_dropout needs a backbone with dropout: set model.dropout "
                             "(e.g. 0.05 for WRN-28-10, 0.01 for PreResNet-164 as in flat_seeking_bnn)")
        self.dropout_modules = drops

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        k = int(num_samples or self.num_samples)
        devices = [self.ctx.device] if self.ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.eval_seed + 7919 * self.ctx.rank)
            for _ in range(k):
                self.module.eval()
                for m in self.dropout_modules:
                    m.train()
                yield self.log_probs_on(loaders)
        self.module.eval()

    def describe(self) -> dict:
        return {"name": self.name, "num_samples": self.num_samples,
                "dropout": sorted({float(m.p) for m in self.dropout_modules})}
