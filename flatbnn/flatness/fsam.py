"""Fisher SAM (Kim et al., ICML 2022): eps = rho F^-1 g / sqrt(g^T F^-1 g).

F is the diagonal empirical Fisher of the current minibatch, f = g^2 (no running average: the
paper's section 5; no official code is public), and its inverse is taken as 1 / (1 + eta f) --
so eta = 0 is SAM exactly (same floating-point operations give the same bits). ``rho`` is the
paper's gamma. The normaliser sqrt(g^T F^-1 g) is the norm of g / sqrt(1 + eta g^2).
"""

from __future__ import annotations

import torch

from flatbnn.flatness.sam import SAM


class FisherSAM(SAM):
    name = "fsam"

    def __init__(self, rho: float = 0.1, eta: float = 1.0, **kw):
        super().__init__(rho=rho, **kw)
        if eta < 0:
            raise ValueError(f"flatness.eta must be >= 0, got {eta}")
        self.eta = float(eta)

    def direction(self, params, grads, scaling, names):
        grads = list(grads)
        inv_fisher = torch._foreach_mul(grads, grads)          # f = g^2
        torch._foreach_mul_(inv_fisher, self.eta)
        torch._foreach_add_(inv_fisher, 1.0)
        torch._foreach_reciprocal_(inv_fisher)                 # 1 / (1 + eta f)
        numer = torch._foreach_mul(grads, inv_fisher)          # F^-1 g
        torch._foreach_sqrt_(inv_fisher)
        return numer, torch._foreach_mul(grads, inv_fisher)    # ||.||^2 = g^T F^-1 g

    def describe(self) -> dict:
        return {**super().describe(), "eta": self.eta}
