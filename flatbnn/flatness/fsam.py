"""Fisher SAM (Kim et al., ICML 2022): eps = rho F^-1 g / sqrt(g^T F^-1 g).

F is the diagonal empirical Fisher of the current minibatch, f = g^2 (no running average: the
paper's section 5; no official code is public), and its inverse is taken as 1 / (1 + eta f) --
so eta = 0 is SAM exactly (same floating-point operations give the same bits). ``rho`` is the
paper's gamma. The normaliser sqrt(g^T F^-1 g) is the norm of g / sqrt(1 + eta g^2).
"""

from __future__ import annotations

from flatbnn.flatness.sam import SAM


class FisherSAM(SAM):
    name = "fsam"

    def __init__(self, rho: float = 0.1, eta: float = 1.0, **kw):
        super().__init__(rho=rho, **kw)
        if eta < 0:
            raise ValueError(f"flatness.eta must be >= 0, got {eta}")
        self.eta = float(eta)

    def direction(self, params, grads, scaling, names):
        numer, norm_terms = [], []
        for g in grads:
            inv_fisher = 1.0 / (1.0 + self.eta * g * g)
            numer.append(g * inv_fisher)
            norm_terms.append(g * inv_fisher.sqrt())
        return numer, norm_terms

    def describe(self) -> dict:
        return {**super().describe(), "eta": self.eta}
