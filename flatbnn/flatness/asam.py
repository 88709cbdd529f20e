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

    def direction(self, params, grads, scaling, names):
        grads = list(grads)
        scaled_idx = [i for i in range(len(params))
                      if not (self.only_weights and names is not None and "weight" not in names[i])]
        norm_terms, numer = list(grads), list(grads)  # T = 1 where not scaled
        if scaled_idx:
            t = torch._foreach_abs([params[i].detach() for i in scaled_idx])
            torch._foreach_add_(t, self.eta)                                  # T = |w| + eta
            tg = torch._foreach_mul(t, [grads[i] for i in scaled_idx])        # T g
            t2g = torch._foreach_mul(t, tg)                                   # T^2 g
            for k, i in enumerate(scaled_idx):
                norm_terms[i], numer[i] = tg[k], t2g[k]
        return numer, norm_terms

    def describe(self) -> dict:
        return {**super().describe(), "eta": self.eta, "only_weights": self.only_weights}
