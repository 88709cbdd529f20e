"""HWA: Hyperparameters Weight Averaging (Karimi & Li, AABI 2020; hwa.txt Alg. 1-2, Eq. 4-5).

Training is SGVB (this class subclasses :class:`flatbnn.methods.sgvb.SGVB`: same layers, estimator,
ELBO, flatness composition), run with a cyclical learning rate (Alg. 1 line 2): with ``lr_cycles`` set
the method builds ``flatbnn.optim.schedulers.cyclical`` (``lr_cycles`` cosine decays over the run)
in place of the ``scheduler`` group; ``lr_cycles=None`` keeps the configured scheduler.
From step ``start`` on, every ``cycle_length`` = c steps (Alg. 1 line 6) the variational
hyperparameters are averaged. With the n_m snapshots so far (Eq. 4):

    mu_HWA  <- (n_m mu_HWA + mu^{k+1}) / (n_m + 1)
    s_HWA   <- (n_m s_HWA + (mu^{k+1})^2) / (n_m + 1),      var_traj = s_HWA - mu_HWA^2

Eq. (4) writes sigma_HWA on both sides of its second update, which only makes sense when that
running quantity is the second moment of mu (the SWAG form it cites); we read it so. The SVI
variances are averaged too, v_HWA <- (n_m v_HWA + sigma_{k+1}^2) / (n_m + 1) ("snapshots of the
hyperparameters"), and ``variance`` chooses the averaged q's diagonal:

* ``eq4``: var_traj only (Eq. 4 literally: the spread of the mean's trajectory);
* ``svi``: v_HWA only (the averaged learned variances);
* ``mixture`` (default): v_HWA + var_traj = the variance of the equal mixture of the collected
  Gaussians N(mu_k, sigma_k^2) (law of total variance; it contains both).

``covariance=lowrank`` adds Eq. (5): Sigma = Sigma_diag / 2 + D D^T / (2 (R - 1)), D the last R
deviations mu_k - mu_HWA (mean updated first), R = ``max_rank`` (columns actually collected until the
buffer is full). With the low-rank proposal the learned sigma^2 is the diagonal *part* of the proposal,
so it enters Sigma_diag twice (Sigma_diag / 2 = v_HWA [+ var_traj / 2]); otherwise feeding the average
back (below) would halve the learned variance every cycle. With ``variance=eq4`` this is SWAG's
covariance exactly. Deterministic parameters (normalisation layers) are averaged like SWA with zero
diagonal variance (they do take part in D).

``train_from`` (Alg. 2, section 3.4): ``average`` (default, the paper) -- after each averaging the
SVI iterate restarts from the averaged q, i.e. mu <- mu_HWA and sigma^2 <- the diagonal of Sigma_HWA
(for ``lowrank``: Sigma_diag / 2), so "the neural network weights are then sampled according to the
updated variational candidate" for the next gradients; with ``lowrank`` each training sample also
carries the low-rank part, w = mu + sigma*eps + D z / sqrt(2 (R - 1)), z ~ N(0, I_R) drawn per step from
the run's generator and held fixed through the flatness passes, and the KL term is the exact KL of that
Gaussian, KL_mf + ||D_b||^2 / (4 (R-1) s^2) - 1/2 log det(I + U^T diag(sigma^2)^-1 U) with U = D_b /
sqrt(2 (R - 1)) over the Bayesian coordinates (matrix determinant lemma; D is a statistic of the
trajectory, not trained). The restart is Lookahead (Zhang et al. 2019) with a 1/(n_m + 1) step on the
slow weights; the optimiser's momentum is kept across restarts. ``svi``: the averaged q is used for
prediction only and training continues from the SVI iterate.

Prediction writes each sample into mu and runs the layers in mean mode, then refreshes BatchNorm
statistics (``bn_refresh``; skipped for BN-free nets). Before the first average it predicts from the
SVI q.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flatbnn.methods.batchnorm import refresh_batchnorm
from flatbnn.methods.param_vector import flatten
from flatbnn.methods.sgvb import SGVB

VARIANCES = ("mixture", "eq4", "svi")
COVARIANCES = ("diag", "lowrank")
TRAIN_FROM = ("average", "svi")
SIGMA_FLOOR = 1e-8  # restarting sigma at 0 (Eq. 4 with one snapshot) would make rho = -inf


def softplus_inverse(sigma: torch.Tensor) -> torch.Tensor:
    """rho with softplus(rho) = sigma, stable for small and large sigma."""
    return sigma + torch.log(-torch.expm1(-sigma))


class HWA(SGVB):
    name = "hwa"
    predict_keys = SGVB.predict_keys + ("bn_refresh",)  # the BN refresh per predictive sample
    capturable = False  # collects deviations and draws its low-rank sample on the host inside its step

    def __init__(self, cycle_length: int | None = None, start: float = 0.5, variance: str = "mixture",
                 covariance: str = "diag", max_rank: int = 20, bn_refresh: bool = True,
                 lr_cycles: int | None = 4, train_from: str = "average", **sgvb_kw):
        if variance not in VARIANCES:
            raise ValueError(f"method.variance must be one of {VARIANCES}, got {variance!r}")
        if covariance not in COVARIANCES:
            raise ValueError(f"method.covariance must be one of {COVARIANCES}, got {covariance!r}")
        if train_from not in TRAIN_FROM:
            raise ValueError(f"method.train_from must be one of {TRAIN_FROM}, got {train_from!r}")
        sgvb_kw.setdefault("name", "hwa")
        super().__init__(**sgvb_kw)
        self.cycle_length_cfg = cycle_length
        self.start = start
        self.variance_mode = variance
        self.covariance = covariance
        self.max_rank = int(max_rank)
        self.bn_refresh = bn_refresh
        self.lr_cycles = lr_cycles
        self.train_from = train_from
        self._lowrank_step = None  # this step's (D_k, c) while its sample carries the low-rank part
        self.n_models = 0
        self._steps = 0

    def setup(self, ctx) -> None:
        if self.lr_cycles:
            from dataclasses import replace
            from functools import partial

            from flatbnn.optim.schedulers import cyclical
            ctx = replace(ctx, scheduler_factory=partial(cyclical, cycles=int(self.lr_cycles)))
        super().setup(ctx)
        self.cycle_length = int(self.cycle_length_cfg or ctx.steps_per_epoch)
        if self.cycle_length < 1:
            raise ValueError(f"method.cycle_length must be >= 1, got {self.cycle_length}")
        total = ctx.epochs * ctx.steps_per_epoch
        # start < 1: fraction of the training steps; >= 1: an epoch number
        self.start_step = (int(round(self.start * total)) if self.start < 1
                           else int(self.start) * ctx.steps_per_epoch)
        # the averaged quantities: every non-rho trained parameter (Bayesian means and deterministic ones)
        self.mean_params = [p for _, p in self.named_parameters() if id(p) not in self._rho_ids]
        numel = sum(p.numel() for p in self.mean_params)
        # coordinates of the flat mean vector that carry a learned sigma (Bayesian weights)
        self._bayes_mask = torch.cat([torch.full((p.numel(),), id(p) in self._sigma_of, dtype=torch.bool)
                                      for p in self.mean_params]).to(self.mean_params[0].device)
        ref = self.mean_params[0]
        self.mu_avg = torch.zeros(numel, dtype=ref.dtype, device=ref.device)
        self.sq_avg = torch.zeros_like(self.mu_avg)
        self.var_avg = torch.zeros_like(self.mu_avg)
        rows = self.max_rank if self.covariance == "lowrank" else 0
        self._dev = torch.zeros(rows, numel, dtype=ref.dtype, device=ref.device)
        self._dev_count = 0

    # ---------------------------------------------------------------- vectors
    def mean_vector(self) -> torch.Tensor:
        return flatten(self.mean_params)

    def variance_vector(self) -> torch.Tensor:
        """sigma^2 of each mean parameter (0 for deterministic ones)."""
        out = []
        with torch.no_grad():
            for p in self.mean_params:
                rho = self._sigma_of.get(id(p))
                out.append(torch.zeros_like(p).reshape(-1) if rho is None
                           else torch.nn.functional.softplus(rho).pow(2).reshape(-1))
        return torch.cat(out)

    def _segments(self):
        """(parameter, its slice of the flat mean vector), in ``mean_params`` order."""
        i = 0
        for p in self.mean_params:
            yield p, slice(i, i + p.numel())
            i += p.numel()

    @torch.no_grad()
    def write_mean_vector(self, vec: torch.Tensor) -> None:
        for p, seg in self._segments():
            p.copy_(vec[seg].view_as(p))

    # ---------------------------------------------------------------- averaging (Alg. 1, Eq. 4)
    @torch.no_grad()
    def average(self) -> None:
        mu, var = self.mean_vector(), self.variance_vector()
        n = self.n_models
        self.mu_avg.mul_(n / (n + 1)).add_(mu / (n + 1))
        self.sq_avg.mul_(n / (n + 1)).add_(mu * mu / (n + 1))
        self.var_avg.mul_(n / (n + 1)).add_(var / (n + 1))
        if self.covariance == "lowrank":
            self._dev[self._dev_count % self.max_rank] = mu - self.mu_avg
            self._dev_count += 1
        self.n_models += 1

    @torch.no_grad()
    def restart_from_average(self) -> None:
        """Alg. 2: the SVI iterate becomes the averaged q (its mean and diagonal part)."""
        self.write_mean_vector(self.mu_avg)
        var = self.diag_variance * (0.5 if self.covariance == "lowrank" else 1.0)
        sigma = var.clamp_min(SIGMA_FLOOR ** 2).sqrt()
        for p, seg in self._segments():
            rho = self._sigma_of.get(id(p))
            if rho is not None:
                rho.copy_(softplus_inverse(sigma[seg]).view_as(rho))

    def _lowrank_rows(self) -> tuple[torch.Tensor, float] | None:
        """(D_k, c) with U = c D_k^T the low-rank factor of Eq. (5); None with fewer than two deviations."""
        k = min(self._dev_count, self._dev.shape[0])
        return (self._dev[:k], 1.0 / math.sqrt(2 * (k - 1))) if k > 1 else None

    def lowrank_factor(self) -> torch.Tensor | None:
        """U = D^T / sqrt(2 (k - 1)) (numel x k), materialised (the training path works on D's rows)."""
        rows = self._lowrank_rows()
        return None if rows is None else rows[0].T * rows[1]

    def data_gradient(self, batch, flatness, backprop) -> float:
        # only the low-rank covariance collects deviations, so this is None for diag
        rows = self._lowrank_rows() if self.train_from == "average" else None
        if rows is None:
            return super().data_gradient(batch, flatness, backprop)
        D, c = rows
        g = self.ctx.generator
        z = torch.randn(D.shape[0], generator=g, device=g.device, dtype=D.dtype).to(D.device)
        mu = self.mean_vector().clone()
        self.write_mean_vector(torch.addmv(mu, D.T, z, alpha=c))  # mu + U z: the sample's low-rank part,
        self._lowrank_step = rows                                # fixed for every pass of the step
        try:
            return super().data_gradient(batch, flatness, backprop)
        finally:
            self.write_mean_vector(mu)  # exact: the update applies to mu itself

    def kl(self) -> torch.Tensor:
        kl = super().kl()
        if self._lowrank_step is None:
            return kl
        # KL(N(mu, A + U U^T) || N(0, s^2 I)) - KL_mf(mu, A) = ||U||^2 / (2 s^2) - 1/2 log det(I + U^T A^-1 U),
        # A = diag(sigma^2), over the Bayesian coordinates (matrix determinant lemma: k x k, not P x P)
        D, c = self._lowrank_step
        Db = D[:, self._bayes_mask]
        sigma = torch.cat([F.softplus(self._sigma_of[id(p)]).reshape(-1) for p in self.mean_params
                           if id(p) in self._sigma_of])
        W = Db * (c / sigma)
        inner = torch.eye(Db.shape[0], dtype=Db.dtype, device=Db.device) + W @ W.T
        return kl + (c * c) * Db.pow(2).sum() / (2 * self.prior_variance) - 0.5 * torch.logdet(inner)

    def train_step(self, batch, flatness, backprop) -> dict:
        try:
            out = super().train_step(batch, flatness, backprop)
        finally:
            self._lowrank_step = None
        self._steps += 1
        if self._steps >= self.start_step and (self._steps - self.start_step) % self.cycle_length == 0:
            self.average()
            if self.train_from == "average":
                self.restart_from_average()
        return out

    @property
    def trajectory_variance(self) -> torch.Tensor:
        return torch.clamp(self.sq_avg - self.mu_avg ** 2, min=0.0)

    @property
    def diag_variance(self) -> torch.Tensor:
        """Sigma_diag: the diagonal of the averaged q (for ``lowrank``, the one Eq. (5) halves)."""
        if self.variance_mode == "eq4":
            return self.trajectory_variance
        svi = self.var_avg * (2.0 if self.covariance == "lowrank" else 1.0)
        if self.variance_mode == "svi":
            return svi
        return svi + self.trajectory_variance

    @torch.no_grad()
    def sample_vector(self, generator: torch.Generator) -> torch.Tensor:
        z1 = torch.randn(self.mu_avg.shape, generator=generator, device=generator.device,
                         dtype=self.mu_avg.dtype).to(self.mu_avg.device)
        std = self.diag_variance.sqrt()
        k = min(self._dev_count, self._dev.shape[0])
        if self.covariance == "lowrank":
            w = math.sqrt(0.5) * std * z1
            if k > 1:
                z2 = torch.randn(k, generator=generator, device=generator.device,
                                 dtype=self.mu_avg.dtype).to(self.mu_avg.device)
                w = w + (self._dev[:k].T @ z2) / math.sqrt(2 * (k - 1))
            return self.mu_avg + w
        return self.mu_avg + std * z1

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        if self.n_models == 0:  # nothing averaged yet: the SVI posterior
            yield from super().predict(loaders, num_samples)
            return
        k = int(num_samples or self.num_samples)
        current = self.mean_vector().clone()
        buffers = {n: b.clone() for n, b in self.module.named_buffers()}
        g = torch.Generator(device=self.ctx.device).manual_seed(self.eval_seed)
        try:
            with self.bank.using(mode="mean"):
                for _ in range(k):
                    self.write_mean_vector(self.sample_vector(g))
                    if self.bn_refresh:
                        refresh_batchnorm(self.module, self.ctx.train_loader, self.ctx.device, 1.0,
                                          self.ctx.all_reduce_mean, self.ctx.channels_last)
                    self.module.eval()
                    yield self.log_probs_on(loaders)
        finally:
            self.write_mean_vector(current)
            for n, b in self.module.named_buffers():
                b.copy_(buffers[n])

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {**super().state_dict(), "n_models": self.n_models, "mu_avg": self.mu_avg, "sq_avg": self.sq_avg,
                "var_avg": self.var_avg, "deviations": self._dev, "dev_count": self._dev_count,
                "steps": self._steps}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.n_models, self._dev_count, self._steps = state["n_models"], state["dev_count"], state["steps"]
        self.mu_avg = state["mu_avg"].to(self.mu_avg).clone()
        self.sq_avg = state["sq_avg"].to(self.sq_avg).clone()
        self.var_avg = state["var_avg"].to(self.var_avg).clone()
        self._dev = state["deviations"].to(self._dev).clone()

    def describe(self) -> dict:
        d = {**super().describe(), "variance": self.variance_mode, "covariance": self.covariance,
             "max_rank": self.max_rank, "n_models": self.n_models, "lr_cycles": self.lr_cycles}
        if self.ctx is not None:
            d.update({"cycle_length": self.cycle_length, "start_step": self.start_step})
        d["train_from"] = self.train_from
        return d
