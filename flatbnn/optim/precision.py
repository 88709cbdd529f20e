"""Shared state of the Adam-like natural-gradient optimisers (bSAM, VOGN): a mean (the parameter),
a momentum and a per-weight precision s; the posterior is N(w, 1 / (N * precision))."""

from __future__ import annotations

import torch

from flatbnn.optim.posterior_state import PosteriorStateOptimizer


class PrecisionOptimizer(PosteriorStateOptimizer):
    """Subclasses give the precision/weight update (``_update``) and their two step error messages. A device ``lr``
    is read on the device by ``_descend``."""

    #: one-line ``ValueError`` messages of ``step`` (no closure: the method runs the passes itself)
    closure_error = "step takes no closure"
    curvature_error = "step needs curvature=[one tensor per parameter]"

    def _init_state(self, p, group) -> dict:
        state = self.state[p]
        if "precision" not in state:
            state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["precision"] = torch.full_like(p, group["s_init"], memory_format=torch.preserve_format)
        return state

    @staticmethod
    def delta(group) -> float:
        """Prior precision per example: prior_precision / N."""
        return group["prior_precision"] / group["n_data"]

    @torch.no_grad()
    def step(self, closure=None, curvature=None):
        """``p.grad`` = the averaged gradient g; ``curvature`` = the averaged h, aligned with ``params()``.

        m <- beta1 m + (1 - beta1) (g + delta w), then the subclass's ``_update`` (w and s, in its order). Multi-tensor
        (foreach) ops per parameter group: the per-tensor operations in the same order, so the same values, in a
        few kernel launches instead of several per weight tensor."""
        if closure is not None:
            raise ValueError(self.closure_error)
        if curvature is None:
            raise ValueError(self.curvature_error)
        curvature = list(curvature)
        if len(curvature) != len(self.params()):
            raise ValueError(f"{self.curvature_error} (got {len(curvature)} tensors for {len(self.params())})")
        start = 0
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            hs = curvature[start:start + len(params)]
            start += len(params)
            states = [self._init_state(p, group) for p in params]
            ms, ss = [st["momentum"] for st in states], [st["precision"] for st in states]
            delta = self.delta(group)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            g_prior = torch._foreach_add(grads, torch._foreach_mul(params, delta))  # g + delta * w
            torch._foreach_mul_(ms, group["betas"][0])
            torch._foreach_add_(ms, g_prior, alpha=1.0 - group["betas"][0])
            self._update(params, ms, ss, hs, group, delta)
        return None

    def _update(self, params, ms, ss, hs, group, delta) -> None:
        """One group's weight and precision update, on lists (foreach ops)."""
        raise NotImplementedError

    @staticmethod
    def _descend(params, num, den, lr) -> None:
        """w <- w - lr * num / den. A host lr: one addcdiv (the eager bits, pinned by tests/test_capturable_step.py);
        a device lr (trainer.cuda_graph): divide, scale by the tensor, subtract -- ``_foreach_addcdiv_`` takes a
        tensor value only as per-tensor scalars read on the host (issue 41)."""
        if not torch.is_tensor(lr):
            torch._foreach_addcdiv_(params, num, den, -lr)
            return
        step = torch._foreach_div(num, den)
        torch._foreach_mul_(step, lr)
        torch._foreach_sub_(params, step)

    def precisions(self) -> list[torch.Tensor]:
        return [self.state[p]["precision"] for p in self.params()]

    def posterior_precision(self, s: torch.Tensor, group) -> torch.Tensor:
        """Per-example posterior precision from the state s (bSAM: s; VOGN: s + delta)."""
        raise NotImplementedError

    def posterior_precisions(self, ss: list[torch.Tensor], group) -> list[torch.Tensor]:
        """``posterior_precision`` of a list (a subclass gives it as one multi-tensor op: the same element ops)."""
        return [self.posterior_precision(s, group) for s in ss]

    @torch.no_grad()
    def posterior_std(self) -> list[torch.Tensor]:
        """1 / sqrt(N * posterior precision) per parameter (training noise and predictive samples); per group, as
        multi-tensor ops (the per-tensor ``rsqrt(precision * N)`` element for element)."""
        out = []
        for group in self.param_groups:
            if group["params"]:
                prec = self.posterior_precisions([self.state[p]["precision"] for p in group["params"]], group)
                std = torch._foreach_mul(prec, group["n_data"])
                torch._foreach_rsqrt_(std)
                out += std
        return out

    @torch.no_grad()
    def sample_noise_parts(self, generator: torch.Generator | None, out: torch.Tensor,
                           mean: torch.Tensor | None = None) -> torch.Tensor:
        """Fill ``out`` ([parts, P], P = the parameters' total size) with std * n, n ~ N(0, I): ONE ``normal_`` over
        every part and parameter (row k: part k; columns: ``params()`` order, each tensor's elements in logical
        order), then one multiply by the flat std. One draw instead of one per tensor and part (issue 52: per-step
        kernel launches; on one CPU thread one 545k draw is 3.7 ms, m = 8 of them a third of bSAM's floor). The
        random stream is not the per-tensor draws' of before issue 52: the same distribution, other numbers.
        With ``mean`` ([P]): mean + std * n, the same draw, in one multiply-add (the batched parts' noisy weights)."""
        out.normal_(generator=generator)
        std = torch.cat([s.reshape(-1) for s in self.posterior_std()])
        if mean is None:
            return out.mul_(std)
        return torch.addcmul(mean, out, std, out=out)

    def summary(self) -> dict:
        """Posterior summary for results.json: mean precision s and mean posterior std."""
        n, s_sum, std_sum = 0, 0.0, 0.0
        for p, group in self._groups():
            s = self.state[p]["precision"].double()
            n += s.numel()
            s_sum += float(s.sum())
            std_sum += float(torch.rsqrt(self.posterior_precision(s, group) * group["n_data"]).sum())
        return {"mean_precision": s_sum / max(n, 1), "mean_posterior_std": std_sum / max(n, 1)}
