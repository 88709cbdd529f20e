"""``method=map``: a point estimate (maximum a posteriori with weight decay as the Gaussian prior).

The optimiser (SGD, Adam, ...) comes from the ``optimizer`` group; predictions use the weights alone.
"""

from __future__ import annotations

import torch

from flatbnn.methods.base import Method


class MAP(Method):
    name = "map"

    def __init__(self, num_samples: int = 1):
        if num_samples != 1:
            raise ValueError("method=map is a point estimate: method.num_samples must be 1")
        super().__init__(num_samples=1)

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        self.module.eval()
        yield self.log_probs_on(loaders)
