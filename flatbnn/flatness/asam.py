"""Adaptive SAM (Kwon et al., ICML 2021): eps = rho * T^2 g / ||T g||, T = |w| + eta element-wise.

As in the official ASAM code, T = |w| + eta only on parameters whose name contains ``weight``
(conv, linear and BatchNorm gamma); biases and BatchNorm beta use T = 1. When the method hands
over unnamed tensors every tensor is scaled (the paper's formula). T = 1 everywhere is SAM.
"""

from __future__ import annotations

import torch

from flatbnn.flatness.sam import SAM


class ASAM(SAM):
    name = "asam"

    def __init__(self, rho: float = 0.5, eta: float = 0.01, only_weights: bool = True, **kw):
        super().__init__(rho=rho, **kw)
        if eta < 0:
            raise ValueError(f"flatness.eta must be >= 0, got {eta}")
        self.eta = float(eta)
        self.only_weights = only_weights

    def operator(self, params, names) -> list[torch.Tensor | None]:
        """T per parameter (None = identity)."""
        out = []
        for i, p in enumerate(params):
            skip = self.only_weights and names is not None and "weight" not in names[i]
            out.append(None if skip else p.detach().abs() + self.eta)
        return out

    def direction(self, params, grads, scaling, names):
        numer, norm_terms = [], []
        for t, g in zip(self.operator(params, names), grads):
            tg = g if t is None else t * g
            norm_terms.append(tg)
            numer.append(tg if t is None else t * tg)
        return numer, norm_terms

    def describe(self) -> dict:
        return {**super().describe(), "eta": self.eta, "only_weights": self.only_weights}
