"""IVON: Improved Variational Online Newton (Shen et al., "Variational Learning is Effective for Large Deep Networks",
ICML 2024, Alg. 1), composable with every flatness variant.

Licence: the authors' package ``ivon-opt`` is GPLv3+ and this project is MIT, so IVON is implemented here from the
paper's algorithm (``flatbnn/optim/ivon.py``); ``ivon-opt`` is a test-only reference (tests/test_ivon.py checks the
update against it to 1e-6 where it is installed, skipped elsewhere; CI installs it for that test) and is never
imported by the package.

Posterior q(theta) = N(m, diag(1 / (lambda (h + delta)))): m the network's weights, h a per-weight Hessian estimate,
lambda = ``ess`` (the effective sample size; null = the training-set size N times ``n_data_factor``, the paper's
choice lambda = N) and delta = ``weight_decay`` (the prior precision per example: the prior is N(0, 1/(lambda delta))).
Per step, for each of the ``mc_samples`` (K) samples:

    theta_k = m + sigma * n_k,   n_k ~ N(0, I)                                  (Alg. 1 line 2)
    g_k     = the gradient of the mean NLL over the batch, "at theta_k" as the flatness variant takes it:
              flatness=none: grad L(theta_k); sam: grad L(theta_k + rho g / ||g||), g = grad L(theta_k); fsam,
              asam, ...: their ascent from theta_k (the noisy point is the variant's w, as F-SGVB's mu + sigma eps)

then g_bar = mean_k g_k and the Hessian estimate h_hat = mean_k g_k (theta_k - m) / sigma^2 (line 3, the
reparameterisation-trick estimate) go to the optimiser, which updates g, h and m (lines 4-8, in
``flatbnn/optim/ivon.py``). Under flatness=sam the same ascent gradient enters both g_bar and h_hat: the variant
decides where "the gradient at the sampled weights" is taken, and IVON uses that one gradient throughout.

Every sample sees the whole batch (the reference's ``mc_samples``); the flatness variant's ``m`` splits it within a
sample, the noise held fixed across the parts. Under DDP every pass runs without gradient sync and g_bar, the
noise-times-gradient average are all-reduced once: each rank's noise is one more sample of the same estimator (so
a SAM-family ascent is per rank there: ``flatness.sync_ascent`` has no effect on IVON).
BatchNorm running statistics are updated by every sample's pass (as the reference's training loop does; the
flatness variant's ``bn_stats`` decides for its second pass). The loss is the mean of the K first-pass losses.
fp16 is refused (a GradScaler overflow would enter h through g * noise); fp32 and bf16 work.

The predictive averages softmax over ``num_samples`` samples m + sigma * n from a fixed evaluation seed
(``num_samples=0``: the mean m alone). The ``optimizer`` group is ignored (IVON is its own optimiser); the
``scheduler`` group scales ``lr``.
"""

from __future__ import annotations

import math

import torch

from flatbnn.methods.diag_gaussian import DiagonalGaussianMethod


class IVON(DiagonalGaussianMethod):
    name = "ivon"
    own_perturbation = False  # the noisy point is where any flatness variant starts (see the module docstring)

    def __init__(self, lr: float = 0.1, ess: float | None = None, hess_init: float = 1.0, beta1: float = 0.9,
                 beta2: float = 0.99999, weight_decay: float = 1e-4, clip_radius: float | None = None,
                 mc_samples: int = 1, rescale_lr: bool = True, debias: bool = True, n_data_factor: float = 1.0,
                 num_samples: int = 32, eval_seed: int = 1):
        if int(mc_samples) < 1:
            raise ValueError(f"method.mc_samples must be >= 1, got {mc_samples}")
        if ess is not None and not float(ess) > 0:
            raise ValueError(f"method.ess must be > 0 (null: the training-set size), got {ess}")
        if clip_radius is not None and not float(clip_radius) > 0:
            raise ValueError(f"method.clip_radius must be > 0 (null: no clipping), got {clip_radius}")
        super().__init__(num_samples=num_samples, n_data_factor=n_data_factor, eval_seed=eval_seed)
        self.lr_init, self.ess_config, self.hess_init = float(lr), ess, float(hess_init)
        self.betas, self.weight_decay = (float(beta1), float(beta2)), float(weight_decay)
        self.clip_radius = math.inf if clip_radius is None else float(clip_radius)
        self.mc_samples, self.rescale_lr, self.debias = int(mc_samples), bool(rescale_lr), bool(debias)
        self._mean: list[torch.Tensor] = []

    def build_optimizer(self, params, n_data):
        from flatbnn.optim.ivon import IVONOptimizer

        self.ess = float(self.ess_config) if self.ess_config is not None else float(n_data)
        return IVONOptimizer(params, lr=self.lr_init, ess=self.ess, hess_init=self.hess_init, beta1=self.betas[0],
                             beta2=self.betas[1], weight_decay=self.weight_decay, clip_radius=self.clip_radius,
                             rescale_lr=self.rescale_lr, debias=self.debias)

    def _mean_buffers(self, params) -> list[torch.Tensor]:
        """The copy of m the step restores, allocated once (a captured graph needs fixed addresses)."""
        if [(t.shape, t.dtype, t.device) for t in self._mean] != [(p.shape, p.dtype, p.device) for p in params]:
            self._mean = [torch.empty_like(p) for p in params]
        return self._mean

    def train_step(self, batch, flatness, backprop) -> dict:
        self.check_flatness(flatness)
        if backprop.scaler is not None:
            raise ValueError("method=ivon does not support trainer.precision=fp16 (an overflowing step would enter "
                             "the Hessian estimate through gradient x noise); use fp32 or bf16")
        opt = self.optimizer
        named = self.named_parameters()
        params = [p for _, p in named]
        if [id(p) for p in params] != [id(p) for p in opt.params()]:
            raise RuntimeError("method=ivon: the optimiser's parameters do not match the model's")
        mean = self._mean_buffers(params)
        with torch.no_grad():
            torch._foreach_copy_(mean, params)
        g_sum = [torch.zeros_like(p) for p in params]
        nxg_sum = [torch.zeros_like(p) for p in params]
        loss_sum = torch.zeros((), device=params[0].device)
        scaling = self.flatness_scaling() if getattr(flatness, "needs_scaling", False) else None
        try:
            for k in range(self.mc_samples):
                noise = opt.sample_noise(self.generator)
                with torch.no_grad():
                    torch._foreach_add_(params, noise)  # theta_k = m + noise (params hold m here)
                for p in params:
                    p.grad = None
                self._record = k == 0  # train accuracy at the first sample
                # no DDP sync inside: the per-rank averages are all-reduced once below
                with backprop.no_sync():
                    loss = flatness.gradient(named, self.loss_fn, batch, backprop, scaling=scaling)
                grads = backprop.unscaled_grads(params)
                with torch.no_grad():
                    torch._foreach_add_(g_sum, grads)
                    torch._foreach_add_(nxg_sum, torch._foreach_mul(noise, grads))
                    torch._foreach_copy_(params, mean)
                loss_sum = loss_sum + loss.detach().float()
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, mean)
        if self.mc_samples > 1:
            torch._foreach_div_(g_sum, float(self.mc_samples))
            torch._foreach_div_(nxg_sum, float(self.mc_samples))
            loss_sum = loss_sum / self.mc_samples
        g_bar, nxg = self._all_reduce(g_sum), self._all_reduce(nxg_sum)
        for p, g in zip(params, g_bar):
            p.grad = g
        if backprop.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, backprop.grad_clip)
        opt.step(noise_grad=nxg)
        for p in params:
            p.grad = None
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": loss_sum}

    def flatness_scaling(self) -> list[torch.Tensor]:
        """Geometry D = |m| / sigma per weight (flatness=geometry, as F-SGVB's |mu| / sigma)."""
        with torch.no_grad():
            return [p.abs() / s for p, s in zip(self.parameters(), self.optimizer.posterior_std())]

    def describe(self) -> dict:
        out = {"name": self.name, "num_samples": self.num_samples, "lr": self.lr_init, "ess": self.ess_config,
               "hess_init": self.hess_init, "beta1": self.betas[0], "beta2": self.betas[1],
               "weight_decay": self.weight_decay,
               "clip_radius": None if math.isinf(self.clip_radius) else self.clip_radius,
               "mc_samples": self.mc_samples, "rescale_lr": self.rescale_lr, "debias": self.debias,
               "n_data_factor": self.n_data_factor,
               "predictive": "mean weights" if self.num_samples == 0 else
               f"average of softmax over {self.num_samples} samples m + sigma * n (eval seed {self.eval_seed})",
               "optimizer_group": "ignored (the method's own optimiser)",
               "implementation": "flatbnn (MIT); ivon-opt (GPLv3+) only as a test reference"}
        if self.optimizer is not None:
            out.update({"ess": self.ess, **self.optimizer.summary()})
        return out
