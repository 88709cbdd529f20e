"""VOGN: variational online Gauss-Newton with Adam-like momentum (Osawa et al., "Practical deep
learning with Bayesian principles", NeurIPS 2019; Khan et al. 2018) -- the bSAM paper's baseline.

Posterior q(w) = N(mu, diag(sigma^2)), sigma^2 = 1 / (N (s + delta)), with N = len(train) *
``n_data_factor`` (Osawa et al.'s data-augmentation factor rho: N <- rho N, i.e. a tempered
posterior, as bSAM's ``dafactor``) and delta = ``prior_precision`` / N (their delta~ = delta / N
with tau = 1). Per step, the batch is cut into ``m`` parts; for each part, with its own noise,

    w~     = mu + sigma * eps,  eps ~ N(0, I)
    g_i    = grad_w l(y_i, f_w~(x_i))                        per-example gradients (torch.func:
                                                             functional_call + vmap + grad)
    g_hat  = mean_i g_i,   h_hat = mean_i g_i^2              h_hat: the diagonal Gauss-Newton
                                                             estimate of the per-example Hessian

g_hat and h_hat are averaged over parts (by part size) and, under DDP, all-reduced over ranks; then
(``flatbnn/optim/vogn.py``)

    m  <- beta1 m + (1 - beta1)(g_hat + delta mu)
    s  <- beta2 s + (1 - beta2) h_hat
    mu <- mu - alpha lr_factor m / (s + delta + damping)     (the NEW s, as in Osawa et al.'s
                                                             VOGN update where s_{t+1} divides)

so N (s + delta) tracks sum_i g_i^2 + prior precision, the mean-field GGN posterior precision.
Choices stated (the exact Alg. 1 of Osawa et al. could not be re-checked offline): momentum and
precision use EMA weights (1 - beta1), (1 - beta2) as in bSAM's code; no bias correction; the
damping gamma enters only the mean's step, not sigma; the tempering tau of their Alg. 1 is not
offered (tau = 1); K = 1 MC sample per part (use ``m`` for more independent samples per step).
The predictive averages softmax over ``num_samples`` samples mu + sigma * eps (0 = the mean).

BatchNorm: per-example gradients are undefined when the forward couples the examples through
batch statistics (Osawa et al. approximate them layer-wise); this implementation refuses models
with BatchNorm at setup -- use a BatchNorm-free backbone (mlp, lenet5, resnet20_frn, ...).
fp16 is refused too (squared per-example gradients underflow); fp32 and bf16 work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from flatbnn.flatness.base import split_batch
from flatbnn.methods.diag_gaussian import DiagonalGaussianMethod, batch_size
from flatbnn.optim.vogn import VOGNOptimizer


class VOGN(DiagonalGaussianMethod):
    name = "vogn"

    def __init__(self, lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.999, m: int = 1,
                 prior_precision: float = 1.0, n_data_factor: float = 1.0, damping: float = 1e-3,
                 s_init: float = 0.01, num_samples: int = 32, per_example_chunk: int | None = None,
                 eval_seed: int = 1):
        if int(m) < 1:
            raise ValueError(f"method.m must be >= 1, got {m}")
        super().__init__(num_samples=num_samples, n_data_factor=n_data_factor, eval_seed=eval_seed)
        self.lr_init, self.betas, self.m = float(lr), (float(beta1), float(beta2)), int(m)
        self.prior_precision, self.damping, self.s_init = float(prior_precision), float(damping), float(s_init)
        self.per_example_chunk = per_example_chunk

    def build_optimizer(self, params, n_data):
        return VOGNOptimizer(params, lr=self.lr_init, betas=self.betas, prior_precision=self.prior_precision,
                             n_data=n_data, damping=self.damping, s_init=self.s_init)

    def setup(self, ctx) -> None:
        bn = [type(m).__name__ for m in ctx.module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if bn:
            raise ValueError(f"method=vogn needs per-example gradients, which BatchNorm ({bn[0]}) in training "
                             f"mode couples across the batch; use a BatchNorm-free model (mlp, lenet5, resnet20_frn)")
        super().setup(ctx)

    # ---------------------------------------------------------------- per-example gradients
    def _criterion(self, logits, y):
        if self.ctx.criterion is not None:
            return self.ctx.criterion(logits, y)
        return F.cross_entropy(logits.float(), y, label_smoothing=self.ctx.label_smoothing)

    def per_example_gradients(self, weights: dict, chunk):
        """(per-example loss [B], per-example logits [B, ...], {name: per-example grads [B, ...]})."""
        x, y = chunk
        buffers = dict(self.module.named_buffers())

        def one(w, xi, yi):
            out = functional_call(self.module, (w, buffers), (xi.unsqueeze(0),))
            loss = self._criterion(out, yi.unsqueeze(0))
            return loss, (loss.detach(), out.detach().squeeze(0))

        fn = vmap(grad(one, has_aux=True), in_dims=(None, 0, 0), randomness="different",
                  chunk_size=self.per_example_chunk)
        grads, (losses, logits) = fn(weights, x, y)
        return losses, logits, grads

    def train_step(self, batch, flatness, backprop) -> dict:
        self.check_flatness(flatness)
        if backprop.scaler is not None:
            raise ValueError("method=vogn does not support trainer.precision=fp16 (squared per-example "
                             "gradients underflow); use fp32 or bf16")
        opt = self.optimizer
        named = self.named_parameters()
        names, params = [n for n, _ in named], [p for _, p in named]
        if [id(p) for p in params] != [id(p) for p in opt.params()]:
            raise RuntimeError("method=vogn: the optimiser's parameters do not match the model's")
        chunks = split_batch(batch, min(self.m, batch_size(batch)))
        g_hat = [torch.zeros_like(p) for p in params]
        h_hat = [torch.zeros_like(p) for p in params]
        loss_sum = torch.zeros((), device=params[0].device)
        autocast = (torch.autocast(backprop.device.type, dtype=backprop.dtype) if backprop.dtype is not None
                    else torch.autocast(backprop.device.type, enabled=False))
        for chunk, share in chunks:
            noise = opt.sample_noise(self.generator)
            with torch.no_grad():
                weights = {n: (p.detach() + e) for n, p, e in zip(names, params, noise)}
            with autocast:
                losses, logits, grads = self.per_example_gradients(weights, chunk)
            with torch.no_grad():
                for i, n in enumerate(names):
                    gi = grads[n].to(params[i].dtype)
                    g_hat[i].add_(gi.mean(0), alpha=share)
                    h_hat[i].add_((gi * gi).mean(0), alpha=share)
                loss_sum = loss_sum + losses.float().mean() * share
                y = chunk[1]
                self.count_correct(logits, y)
                self._seen += y.numel()
        g_hat = self._all_reduce(g_hat)
        h_hat = self._all_reduce(h_hat)
        self.apply_update(params, g_hat, h_hat, backprop)
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": loss_sum}

    def describe(self) -> dict:
        return {**super().describe(), "lr": self.lr_init, "beta1": self.betas[0], "beta2": self.betas[1],
                "m": self.m, "prior_precision": self.prior_precision, "damping": self.damping,
                "s_init": self.s_init}
