"""The VOGN update (Osawa et al., NeurIPS 2019, "Practical deep learning with Bayesian principles";
variational online Gauss-Newton of Khan et al. 2018 with Adam-like momentum) as a
``torch.optim.Optimizer``, so the engine's per-step schedulers set ``lr = alpha * lr_factor``.

State per parameter: mean ``mu`` (the parameter itself), momentum ``m`` (zeros) and the scaled
precision ``s`` (``s_init``). With ``N = n_data`` (training-set size times the augmentation factor)
and ``delta = prior_precision / N`` the posterior is q(w) = N(mu, 1 / (N (s + delta))). The method
(``flatbnn/methods/vogn.py``) samples w~ = mu + sigma * eps, computes per-example gradients g_i at
w~ and hands this optimiser g_hat = mean_i g_i (in ``p.grad``) and h_hat = mean_i g_i^2
(``curvature=``); ``step`` then does

    m  <- beta1 * m + (1 - beta1) * (g_hat + delta * mu)
    s  <- beta2 * s + (1 - beta2) * h_hat
    mu <- mu - lr * m / (s + delta + damping)            (lr = alpha * lr_factor; the NEW s)

(no bias correction). See ``flatbnn/methods/vogn.py`` for the relation to Osawa et al.'s algorithm.
"""

from __future__ import annotations

import torch

from flatbnn.optim.precision import PrecisionOptimizer


class VOGNOptimizer(PrecisionOptimizer):
    closure_error = "VOGNOptimizer.step takes no closure: the method computes the gradients"
    curvature_error = "VOGNOptimizer.step needs curvature=[mean_i g_i^2 per parameter]"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), prior_precision: float = 1.0,
                 n_data: float = 1.0, damping: float = 1e-3, s_init: float = 1.0):
        if lr < 0:
            raise ValueError(f"VOGN lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"VOGN betas must be in [0, 1), got {betas}")
        if n_data <= 0:
            raise ValueError(f"VOGN n_data must be > 0, got {n_data}")
        if s_init < 0 or prior_precision < 0 or damping < 0:
            raise ValueError("VOGN s_init, prior_precision and damping must be >= 0")
        if s_init == 0 and prior_precision == 0:
            raise ValueError("VOGN needs s_init > 0 or prior_precision > 0 (the initial variance is 1/(N(s+delta)))")
        defaults = dict(lr=lr, betas=tuple(betas), prior_precision=prior_precision, n_data=float(n_data),
                        damping=damping, s_init=s_init)
        super().__init__(params, defaults)

    def posterior_precision(self, s, group):
        return s + self.delta(group)  # sigma^2 = 1 / (N (s + delta))

    def posterior_precisions(self, ss, group):
        return torch._foreach_add(list(ss), self.delta(group))

    def _update(self, params, ms, ss, hs, group, delta) -> None:
        """``p.grad`` = g_hat (mean per-example gradient); ``hs`` = h_hat (mean of g_i^2)."""
        torch._foreach_mul_(ss, group["betas"][1])
        torch._foreach_add_(ss, list(hs), alpha=1.0 - group["betas"][1])
        self._descend(params, ms, torch._foreach_add(ss, delta + group["damping"]), group["lr"])  # new s
