"""SGVB / Bayes by Backprop: mean-field Gaussian variational inference, composable with flatness.

Objective (per training example; flat_seeking_bnn Eq. 6 with lambda = N, T = 1; Blundell et al. 2015):

    L(mu, sigma) = E_{eps ~ N(0, I)} [ mean_batch NLL(mu + sigma * eps) ]  +  kl_weight * KL(q || p) / N

q = N(mu, diag(sigma^2)) per weight, sigma = softplus(rho); prior p = N(0, prior_variance * I)
(``method.prior_variance`` is a *variance*, not a precision); N = the training-set size
(``method.n_train`` overrides it, e.g. times an augmentation factor); ``kl_weight`` < 1 tempers
(cold posterior), 1 is the ELBO. The expectation uses ``train_samples`` Monte-Carlo samples per
step with the estimator ``method.estimator``: ``reparam`` (SGVB), ``lrt`` (SGVB-LRT, Kingma et al.
2015) or ``flipout`` (Wen et al. 2018); see :mod:`flatbnn.nn.bayesian`.

Composition with flatness (flat_seeking_bnn section 3.3, Eq. 7): the method hands the flatness
variant (mu, rho and any deterministic parameters) with ``perturb`` = True for mu and deterministic
parameters, False for rho, and the noise is held fixed for the step (the layers replay the same eps
in both passes, keyed by the batch). So ``method=sgvb flatness=sam`` is F-SGVB: mu' = mu + rho g/||g||
with g = grad_mu NLL(mu + sigma eps), then the gradient of NLL(mu' + sigma eps) updates mu AND sigma;
``flatness=geometry`` uses D = |mu| / sigma from :meth:`flatness_scaling` (1 for deterministic
parameters, which are perturbed as in plain SAM).

The KL term does not depend on eps or on the perturbation, and Eq. 7 applies the max to the data
term only: it is therefore NOT part of ``loss_fn`` (which would put it in the ascent direction and
evaluate it at mu' instead of mu); its exact gradient at (mu, sigma) is added once, after the
flatness call, with the same loss scale as the data term (fp16).

``optimizer.weight_decay`` applies to deterministic parameters only (normalisation layers); the
Gaussian prior of the Bayesian weights is the KL term (mu and rho get no weight decay).
``rho_lr`` optionally sets a separate learning rate for the rho parameters.

Prediction: ``num_samples`` weight samples (weight-space reparameterisation whatever the training
estimator, so each sample is one network applied to every evaluation set), from a fixed evaluation
seed. The per-epoch monitor uses the mean weights mu.
"""

from __future__ import annotations

import torch

from flatbnn.methods.base import Method
from flatbnn.nn.bayesian import ESTIMATORS, bayesian_layers, bayesianize, find_bank


def batch_key(batch):
    """Identity of a (chunk of a) batch within one step: the noise is replayed per key."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return (x.data_ptr(), tuple(x.shape)) if torch.is_tensor(x) else id(batch)


class SGVB(Method):
    name = "sgvb"
    samples_weights = False  # the predictive's noise is drawn inside the layers' forward (LRT / flipout / reparam)
    predict_keys = Method.predict_keys + ("eval_seed",)  # the seed of the predictive's weight samples

    def __init__(self, estimator: str = "reparam", prior_variance: float = 1.0, kl_weight: float = 1.0,
                 num_samples: int = 30, train_samples: int = 1, sigma_init: float = 1e-3,
                 bayesian_bias: bool = True, n_train: int | None = None, rho_lr: float | None = None,
                 eval_seed: int = 1, name: str | None = None):
        if estimator not in ESTIMATORS:
            raise ValueError(f"method.estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if prior_variance <= 0:
            raise ValueError(f"method.prior_variance must be > 0 (a variance), got {prior_variance}")
        if int(train_samples) < 1:
            raise ValueError(f"method.train_samples must be >= 1, got {train_samples}")
        super().__init__(num_samples=num_samples)
        self.estimator = estimator
        self.prior_variance = float(prior_variance)
        self.kl_weight = float(kl_weight)
        self.train_samples = int(train_samples)
        self.sigma_init = float(sigma_init)
        self.bayesian_bias = bool(bayesian_bias)
        self.n_train_override = n_train
        self.rho_lr = rho_lr
        self.eval_seed = int(eval_seed)
        if name:
            self.name = name
        self.bank = None

    # ---------------------------------------------------------------- model
    def prepare_model(self, module):
        module = bayesianize(module, estimator=self.estimator, sigma_init=self.sigma_init,
                             bayesian_bias=self.bayesian_bias)
        self.bank = find_bank(module)
        return module

    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.model, self.module = ctx.model, ctx.module
        self.layers = bayesian_layers(self.module)
        if not self.layers:
            raise ValueError(f"method={self.name}: the model has no Bayesian layers (prepare_model was not applied)")
        self.bank = find_bank(self.module)
        self.bank.generator = ctx.generator
        self.pairs = [pair for layer in self.layers for pair in layer.posterior_pairs()]
        self._rho_ids = {id(r) for _, r in self.pairs}
        self._mu_ids = {id(m) for m, _ in self.pairs}
        self._sigma_of = {id(m): r for m, r in self.pairs}
        named = self.named_parameters()
        self._perturb = [id(p) not in self._rho_ids for _, p in named]
        mus = [p for _, p in named if id(p) in self._mu_ids]
        rhos = [p for _, p in named if id(p) in self._rho_ids]
        det = [p for _, p in named if id(p) not in self._mu_ids and id(p) not in self._rho_ids]
        groups = [{"params": mus, "weight_decay": 0.0}]
        rho_group = {"params": rhos, "weight_decay": 0.0}
        if self.rho_lr is not None:
            rho_group["lr"] = float(self.rho_lr)
        groups.append(rho_group)
        if det:
            groups.append({"params": det})
        self.optimizer = ctx.optimizer_factory(groups)
        self.attach_scheduler()

    @property
    def n_data(self) -> int:
        return int(self.n_train_override or self.ctx.n_train)

    # ---------------------------------------------------------------- objective
    def kl(self) -> torch.Tensor:
        """KL(q || p) summed over every Bayesian weight and bias."""
        return sum(layer.kl(self.prior_variance) for layer in self.layers)

    def kl_term(self) -> torch.Tensor:
        """kl_weight * KL / N: the per-example KL in the objective."""
        return self.kl() * (self.kl_weight / self.n_data)

    def loss_fn(self, batch) -> torch.Tensor:
        """Mean NLL with the step's noise for this batch (replayed on every pass of the step)."""
        key = batch_key(batch)
        loss = None
        for k in range(self.train_samples):
            with self.bank.fixed((key, k)):
                lk = super().loss_fn(batch)
            loss = lk if loss is None else loss + lk
        return loss if self.train_samples == 1 else loss / self.train_samples

    def flatness_scaling(self) -> list[torch.Tensor]:
        """Geometry D per trained parameter: |mu| / sigma for means, 1 elsewhere (unperturbed rho: 1)."""
        out = []
        with torch.no_grad():
            for _, p in self.named_parameters():
                if id(p) in self._mu_ids:
                    out.append(p.abs() / torch.nn.functional.softplus(self._sigma_of[id(p)]))
                else:
                    out.append(torch.ones_like(p))
        return out

    def add_kl_gradient(self, backprop) -> torch.Tensor:
        """p.grad += d(kl_weight KL / N)/dp at the current (mu, rho), scaled like the data term; returns the term
        as a device tensor (a float() here was a host read every step; the trainer reads the loss in batches)."""
        params = [p for pair in self.pairs for p in pair]
        with torch.enable_grad():
            term = self.kl_term()
            grads = list(torch.autograd.grad(term, params))
        with torch.no_grad():
            if getattr(backprop, "scaler", None) is not None:  # the scale stays on the device (power of two)
                grads = torch._foreach_mul(grads, backprop.loss_scale())
            have = [i for i, p in enumerate(params) if p.grad is not None]
            torch._foreach_add_([params[i].grad for i in have], [grads[i] for i in have])
            for i, p in enumerate(params):
                if p.grad is None:
                    p.grad = grads[i].clone()
        return term.detach()

    def data_gradient(self, batch, flatness, backprop) -> torch.Tensor:
        """p.grad = gradient of the data term (through the flatness variant); returns the mean NLL."""
        scaling = self.flatness_scaling() if getattr(flatness, "needs_scaling", False) else None
        return flatness.gradient(self.named_parameters(), self.loss_fn, batch, backprop,
                                 scaling=scaling, perturb=self._perturb)

    def train_step(self, batch, flatness, backprop) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        self.bank.clear()
        self._record = True
        nll = self.data_gradient(batch, flatness, backprop)
        kl = self.add_kl_gradient(backprop)
        backprop.step(self.optimizer)
        self.bank.clear()
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": nll + kl, "nll": nll, "kl": kl}

    # ---------------------------------------------------------------- prediction
    def sigma_stats(self) -> dict:
        with torch.no_grad():
            s = torch.cat([torch.nn.functional.softplus(r).flatten() for _, r in self.pairs])
            return {"sigma_mean": float(s.mean()), "sigma_median": float(s.median()),
                    "sigma_max": float(s.max())}

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        k = int(num_samples or self.num_samples)
        g = torch.Generator(device=self.ctx.device).manual_seed(self.eval_seed)
        self.module.eval()
        with self.bank.using(mode="sample", predict=True, generator=g):
            try:
                for i in range(k):
                    self.bank.clear()
                    with self.bank.fixed(("predict", i)):
                        out = self.log_probs_on(loaders)
                    yield out
            finally:
                self.bank.clear()

    @torch.no_grad()
    def monitor(self, loaders):
        self.module.eval()
        with self.bank.using(mode="mean"):
            out = self.log_probs_on(loaders)
        yield out

    def describe(self) -> dict:
        d = {"name": self.name, "num_samples": self.num_samples, "estimator": self.estimator,
             "prior_variance": self.prior_variance, "kl_weight": self.kl_weight,
             "train_samples": self.train_samples, "sigma_init": self.sigma_init,
             "bayesian_bias": self.bayesian_bias, "rho_lr": self.rho_lr,
             "sigma": "softplus(rho)", "kl_scaling": "kl_weight * KL / N"}
        if self.ctx is not None:
            d["n_train"] = self.n_data
            d.update(self.sigma_stats())
        return d
