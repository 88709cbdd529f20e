"""Shared base of the methods whose diagonal Gaussian posterior lives in their own optimiser state
(``method=bsam``, ``method=vogn``, ``method=ivon``): q(w) = N(w, diag(std^2)) with std from the optimiser.

What the base does:

* builds the method's own optimiser (``build_optimizer``) instead of the ``optimizer`` group
  (which such a run ignores); the ``scheduler`` group still multiplies its lr (``lr_factor``);
* refuses any ``flatness`` other than ``none`` -- the method perturbs the weights itself
  (``own_perturbation``; one-line ValueError from ``Flatness.setup``, and from ``train_step`` for
  direct API use); IVON sets ``own_perturbation = False``: its sampled weights are where a flatness
  variant starts;
* training noise comes from the engine's per-rank generator (``ctx.generator``, checkpointed per
  rank by the engine), or an own generator when none is given; its state is also kept in
  ``state_dict`` so a state round trip alone resumes exactly;
* ``predict`` yields ``num_samples`` weight samples w + std * n from a fixed evaluation seed (the
  same weights on every DDP rank and after any resume); ``num_samples = 0`` predicts with the mean
  w alone (the papers' "mean" metrics). BatchNorm running statistics are used as trained (no
  refresh; the bSAM code does none).
"""

from __future__ import annotations

import torch

from flatbnn.methods.base import Method
from flatbnn.methods.param_vector import flatten, unflatten


def batch_size(batch) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.shape[0])


class DiagonalGaussianMethod(Method):
    name = "diag_gaussian"
    own_perturbation = True
    min_num_samples = 0  # num_samples=0 predicts with the mean
    predict_keys = Method.predict_keys + ("eval_seed",)

    def __init__(self, num_samples: int = 32, n_data_factor: float = 1.0, eval_seed: int = 1):
        if int(num_samples) < 0:
            raise ValueError(f"method.num_samples must be >= 0 (0 = predict with the mean), got {num_samples}")
        if n_data_factor <= 0:
            raise ValueError(f"method.n_data_factor must be > 0, got {n_data_factor}")
        super().__init__(num_samples=int(num_samples))
        self.n_data_factor = float(n_data_factor)
        self.eval_seed = int(eval_seed)
        self.generator: torch.Generator | None = None

    # ---------------------------------------------------------------- update
    def apply_update(self, params, grads, curvature, backprop) -> None:
        """Hand the (all-reduced) gradient and curvature to the optimiser; clipping as the engine does."""
        for p, g in zip(params, grads):
            p.grad = g
        if backprop.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, backprop.grad_clip)
        self.optimizer.step(curvature=curvature)
        for p in params:
            p.grad = None

    # ---------------------------------------------------------------- lifecycle
    def build_optimizer(self, params, n_data: float) -> torch.optim.Optimizer:
        raise NotImplementedError

    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.model = ctx.model
        self.module = ctx.module
        self.n_data = float(ctx.n_train) * self.n_data_factor
        self.optimizer = self.build_optimizer(self.parameters(), self.n_data)
        self.attach_scheduler()
        self.generator = ctx.generator
        if self.generator is None:
            self.generator = torch.Generator(device=ctx.device).manual_seed(
                ctx.seed * 1_000_003 + 4_242 + 7_919 * ctx.rank)

    @torch.no_grad()
    def _assign(self, params, values) -> None:
        torch._foreach_copy_(list(params), list(values))

    def _all_reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Mean over DDP ranks of a list of tensors (one flat all-reduce)."""
        if self.ctx.world_size <= 1 or self.ctx.all_reduce_mean is None or not tensors:
            return tensors
        flat = flatten(tensors)
        self.ctx.all_reduce_mean(flat)
        return unflatten(flat, tensors)

    # ---------------------------------------------------------------- prediction
    @torch.no_grad()
    def sample_weights(self, generator: torch.Generator, mean: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """mean + std * n; ``mean`` defaults to the current parameters (pass a copy while sampling)."""
        mean = [p.detach() for p in self.parameters()] if mean is None else mean
        stds = self.optimizer.posterior_std()
        return [w + std * torch.randn(w.shape, generator=generator, device=w.device, dtype=w.dtype)
                for w, std in zip(mean, stds)]

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        k = self.num_samples if num_samples is None else int(num_samples)
        self.module.eval()
        if k == 0:
            yield self.log_probs_on(loaders)
            return
        yield from self.predict_at_samples(loaders, k, self.sample_weights)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {**super().state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state.get("generator") is not None:
            self.generator.set_state(state["generator"])

    def describe(self) -> dict:
        out = {"name": self.name, "num_samples": self.num_samples, "n_data_factor": self.n_data_factor,
               "predictive": "mean weights" if self.num_samples == 0 else
               f"average of softmax over {self.num_samples} samples w + std * n (eval seed {self.eval_seed})",
               "optimizer_group": "ignored (the method's own optimiser)"}
        if self.optimizer is not None:
            group = self.optimizer.param_groups[0]
            out.update({"n_data": group["n_data"], "delta": group["prior_precision"] / group["n_data"],
                        **self.optimizer.summary()})
        return out
