"""The IVON update (Shen et al., "Variational Learning is Effective for Large Deep Networks", ICML 2024, Alg. 1) as a
``torch.optim.Optimizer``, so the engine's per-step schedulers set ``lr``. Written for this project (MIT) from the
paper's algorithm; the authors' package ``ivon-opt`` (GPLv3+) is only a test-time reference
(tests/test_ivon.py), never imported here.

State per parameter: momentum ``g`` (zeros), Hessian estimate ``h`` (``hess_init``) and the step count ``steps``.
The posterior is q(theta) = N(m, diag(sigma^2)) with m the parameter itself and

    sigma^2 = 1 / (ess * (h + delta))           ess = lambda (the effective sample size), delta = weight_decay.

The method (``flatbnn/methods/ivon.py``) draws K samples theta_k = m + sigma * n_k (``sample_noise``), takes the
gradient g_k at each (where the flatness variant says) and hands this optimiser the averages

    g_bar = mean_k g_k  (in ``p.grad``),   nxg = mean_k (theta_k - m) * g_k   (``noise_grad=``);

``step`` then does (Alg. 1, lines 4-8; the "price" Hessian estimate h_hat = g (theta - m) / sigma^2)

    g     <- beta1 g + (1 - beta1) g_bar
    h_hat  = ess * nxg * (h + delta)                                       (= nxg / sigma^2, the OLD h)
    h     <- beta2 h + (1 - beta2) h_hat + 0.5 (1 - beta2)^2 (h - h_hat)^2 / (h + delta)
    m     <- m - alpha * clip((g / (1 - beta1^t) + delta m) / (h + delta), -r, r)   (the NEW h)

with alpha = lr * (hess_init + delta) when ``rescale_lr`` (so that lr is an SGD-like step at the start, as the
reference package does; false: alpha = lr), the bias correction 1 - beta1^t only when ``debias``, and r =
``clip_radius`` (inf: no clipping). The last term of the h update keeps h positive (the paper's Riemannian
correction). Multi-tensor (foreach) ops per group; the lr may be a device tensor (trainer.cuda_graph) and the step
count lives on the device, so a step reads nothing back to the host.
"""

from __future__ import annotations

import math

import torch

from flatbnn.optim.posterior_state import PosteriorStateOptimizer


class IVONOptimizer(PosteriorStateOptimizer):
    def __init__(self, params, lr: float = 0.1, ess: float = 1.0, hess_init: float = 1.0, beta1: float = 0.9,
                 beta2: float = 0.99999, weight_decay: float = 1e-4, clip_radius: float = math.inf,
                 rescale_lr: bool = True, debias: bool = True):
        if lr < 0:
            raise ValueError(f"IVON lr must be >= 0, got {lr}")
        if ess <= 0:
            raise ValueError(f"IVON ess (effective sample size) must be > 0, got {ess}")
        if hess_init <= 0:
            raise ValueError(f"IVON hess_init must be > 0, got {hess_init}")
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"IVON beta1 and beta2 must be in [0, 1), got {beta1}, {beta2}")
        if weight_decay < 0:
            raise ValueError(f"IVON weight_decay must be >= 0, got {weight_decay}")
        if not clip_radius > 0:
            raise ValueError(f"IVON clip_radius must be > 0 (inf: no clipping), got {clip_radius}")
        defaults = dict(lr=lr, ess=float(ess), hess_init=float(hess_init), beta1=float(beta1), beta2=float(beta2),
                        weight_decay=float(weight_decay), clip_radius=float(clip_radius),
                        rescale_lr=bool(rescale_lr), debias=bool(debias))
        super().__init__(params, defaults)  # makes the state: the first step's noise needs h

    def _init_state(self, p, group) -> dict:
        state = self.state[p]
        if "hess" not in state:
            state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["hess"] = torch.full_like(p, group["hess_init"], memory_format=torch.preserve_format)
            # a device tensor in the parameter's dtype (load_state_dict casts it so): no host counter to capture
            state["steps"] = torch.zeros((), dtype=p.dtype, device=p.device)
        return state

    # ---------------------------------------------------------------- the posterior
    @torch.no_grad()
    def posterior_std(self) -> list[torch.Tensor]:
        """sigma = 1 / sqrt(ess (h + delta)) per parameter."""
        return [torch.rsqrt((self.state[p]["hess"] + group["weight_decay"]) * group["ess"])
                for p, group in self._groups()]

    @torch.no_grad()
    def sample_noise(self, generator: torch.Generator | None) -> list[torch.Tensor]:
        """theta - m = n / sqrt(ess (h + delta)), n ~ N(0, I): ONE draw of all of a group's elements, in parameter
        order, cut per parameter (so a group's noise is the same stream however its tensors are shaped)."""
        out = []
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            p0 = params[0]
            flat = torch.randn(sum(p.numel() for p in params), generator=generator, device=p0.device, dtype=p0.dtype)
            for p, n in zip(params, flat.split([p.numel() for p in params])):
                out.append(n.view(p.shape) / ((self.state[p]["hess"] + group["weight_decay"]) * group["ess"]).sqrt())
        return out

    # ---------------------------------------------------------------- the update
    @torch.no_grad()
    def step(self, closure=None, noise_grad=None):
        """``p.grad`` = mean_k g_k; ``noise_grad`` = mean_k (theta_k - m) g_k, aligned with ``params()``."""
        if closure is not None:
            raise ValueError("IVONOptimizer.step takes no closure: the method draws the samples and their gradients")
        if noise_grad is None:
            raise ValueError("IVONOptimizer.step needs noise_grad=[mean_k (theta_k - m) * g_k per parameter]")
        noise_grad = list(noise_grad)
        if len(noise_grad) != len(self.params()):
            raise ValueError(f"IVONOptimizer.step: {len(noise_grad)} noise_grad tensors for {len(self.params())} "
                             f"parameters")
        start = 0
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            nxg = noise_grad[start:start + len(params)]
            start += len(params)
            states = [self._init_state(p, group) for p in params]
            self._update(params, [st["momentum"] for st in states], [st["hess"] for st in states],
                         [st["steps"] for st in states], nxg, group)
        return None

    @staticmethod
    def _update(params, ms, hs, steps, nxg, group) -> None:
        b1, b2, wd, ess = group["beta1"], group["beta2"], group["weight_decay"], group["ess"]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, grads, alpha=1.0 - b1)
        # h: the reparameterisation ("price") estimate at the old h, then the positivity-preserving EMA
        h_wd = torch._foreach_add(hs, wd)
        h_hat = torch._foreach_mul(list(nxg), h_wd)
        torch._foreach_mul_(h_hat, ess)
        diff = torch._foreach_sub(hs, h_hat)
        torch._foreach_mul_(diff, diff)
        torch._foreach_div_(diff, h_wd)
        torch._foreach_mul_(hs, b2)
        torch._foreach_add_(hs, h_hat, alpha=1.0 - b2)
        torch._foreach_add_(hs, diff, alpha=0.5 * (1.0 - b2) ** 2)
        # the mean, with the new h
        torch._foreach_add_(steps, 1.0)
        if group["debias"]:
            debias = 1.0 - torch.pow(b1, steps[0].double())  # float64 on the device: no host read
            num = torch._foreach_div(ms, debias.to(ms[0].dtype))
        else:
            num = [m.clone() for m in ms]
        torch._foreach_add_(num, params, alpha=wd)
        torch._foreach_div_(num, torch._foreach_add(hs, wd))
        if math.isfinite(group["clip_radius"]):
            torch._foreach_clamp_min_(num, -group["clip_radius"])
            torch._foreach_clamp_max_(num, group["clip_radius"])
        lr = group["lr"]
        scale = group["hess_init"] + wd if group["rescale_lr"] else 1.0
        if torch.is_tensor(lr):
            torch._foreach_mul_(num, lr * scale)
            torch._foreach_sub_(params, num)
        else:
            torch._foreach_add_(params, num, alpha=-lr * scale)

    def summary(self) -> dict:
        """Posterior summary for results.json: mean Hessian estimate h and mean posterior std."""
        n, h_sum, std_sum = 0, 0.0, 0.0
        for p, std in zip(self.params(), self.posterior_std()):
            n += p.numel()
            h_sum += float(self.state[p]["hess"].double().sum())
            std_sum += float(std.double().sum())
        return {"mean_hess": h_sum / max(n, 1), "mean_posterior_std": std_sum / max(n, 1)}
