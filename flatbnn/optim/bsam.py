"""The bSAM update (Möllenhoff & Khan, ICLR 2023, Alg. 1 with the m-sharpness split of App. E.4)
as a ``torch.optim.Optimizer``, so the engine's per-step schedulers set ``lr = alpha * lr_factor``.

State per parameter: momentum ``m`` (zeros) and precision ``s`` (``s_init``). With
``N = n_data`` (training-set size times the data-augmentation factor) and
``delta = prior_precision / N``, the method (``flatbnn/methods/bsam.py``) runs the passes and
hands this optimiser the averaged perturbed-point gradient ``g_p`` (in ``p.grad``) and the
averaged curvature ``h = sqrt(s) * |g|`` (``curvature=``); ``step`` then does

    m <- beta1 * m + (1 - beta1) * (g_p + delta * w)
    w <- w - lr * m / s                                  (lr = alpha * lr_factor; the OLD s)
    s <- beta2 * s + (1 - beta2) * (h + damping + delta)

(no bias correction). Helpers give the quantities the passes need: the posterior standard
deviation ``sqrt(1 / (N s))`` (noise and predictive samples), the ascent scale ``rho / s`` of
``rho * g / s`` (element-wise, not normalised -- the difference from SAM) and ``sqrt(s)`` of h.
"""

from __future__ import annotations

import torch

from flatbnn.optim.precision import PrecisionOptimizer


class BSAMOptimizer(PrecisionOptimizer):
    closure_error = "BSAMOptimizer.step takes no closure: the method runs the passes"
    curvature_error = "BSAMOptimizer.step needs curvature=[h per parameter] (sqrt(s) * |g|)"

    def __init__(self, params, lr: float = 0.5, betas=(0.9, 0.999), rho: float = 0.01,
                 prior_precision: float = 1.0, n_data: float = 1.0, damping: float = 0.1,
                 s_init: float = 1.0):
        if lr < 0:
            raise ValueError(f"bSAM lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"bSAM betas must be in [0, 1), got {betas}")
        if n_data <= 0:
            raise ValueError(f"bSAM n_data must be > 0, got {n_data}")
        if s_init <= 0:
            raise ValueError(f"bSAM s_init must be > 0, got {s_init}")
        if prior_precision < 0 or damping < 0 or rho < 0:
            raise ValueError("bSAM prior_precision, damping and rho must be >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), rho=rho, prior_precision=prior_precision,
                        n_data=float(n_data), damping=damping, s_init=s_init)
        super().__init__(params, defaults)

    # ---------------------------------------------------------------- quantities of the passes
    # The per-part arithmetic is as few passes over the weights as it can be (m = 8 parts a step; on the MNIST MLP the
    # element-wise work was ~20 % of the step): what depends only on s is computed once per step, and each part adds
    # its share with one multi-tensor op. The same quantities as the official code's rho * g / s and sqrt(s * g * g),
    # reassociated: they differ by float rounding (tests/test_bsam.py: the five lines to 1e-12 in float64).
    @torch.no_grad()
    def ascent_scales(self) -> list[torch.Tensor]:
        """rho / s per weight, once a step: part k's ascent point is then ``addcmul(w, g_k, rho / s)``."""
        scales, start = torch._foreach_reciprocal(self.precisions()), 0
        for group in self.param_groups:  # one multi-tensor op per group
            n = len(group["params"])
            if n:
                torch._foreach_mul_(scales[start:start + n], group["rho"])
            start += n
        return scales

    @torch.no_grad()
    def curvature_from_abs(self, abs_grads) -> list[torch.Tensor]:
        """h = sqrt(s) * |g|, given |g| (averaged over the parts: sqrt(s) is the same for every part, so
        mean_k sqrt(s g_k^2) = sqrt(s) mean_k |g_k|); in place in ``abs_grads``."""
        abs_grads = list(abs_grads)
        torch._foreach_mul_(abs_grads, torch._foreach_sqrt(self.precisions()))
        return abs_grads

    def posterior_precision(self, s, group):
        return s  # noise and predictive: N(w, 1 / (N s))

    def posterior_precisions(self, ss, group):
        return list(ss)

    # ---------------------------------------------------------------- the update (after the momentum)
    def _update(self, params, ms, ss, hs, group, delta) -> None:
        self._descend(params, ms, ss, group["lr"])  # old s
        torch._foreach_mul_(ss, group["betas"][1])
        torch._foreach_add_(ss, torch._foreach_add(hs, group["damping"] + delta), alpha=1.0 - group["betas"][1])
