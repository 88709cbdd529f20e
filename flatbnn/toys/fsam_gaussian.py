"""The 2-D toy of Fisher SAM (Kim et al., ICML 2022, section 3.1, Figs 1-3), exactly, in float64.

The model is a univariate Gaussian p(x; theta) = N(x; mu, sigma^2), theta = (mu, sigma), and the
loss is the negative log of a mixture of two KL-driven energy models (the paper's Eq. 15)::

    l(theta) = -log( alpha_1 exp(-E_1(theta) / beta_1^2) + alpha_2 exp(-E_2(theta) / beta_2^2) )
    E_i(theta) = KL( N(mu, sigma^2) || N(m_i, s_i^2) ) + c
               = log(s_i / sigma) + (sigma^2 + (mu - m_i)^2) / (2 s_i^2) - 1/2 + c

with (m_1, s_1, alpha_1, beta_1) = (20, 30, 0.7, 1.8) and (m_2, s_2, alpha_2, beta_2) =
(-20, 10, 0.3, 1.2).

**The constant c.** Eq. 15 read literally has c = 0. The paper's reported minima, loss values and
Hessian traces -- flat (19.85, 29.95), l = 0.51, tr H = 0.001; sharp (-15.94, 13.46), l = 0.49,
tr H = 0.006 -- are reproduced to every printed digit only with c = 1/2, i.e. the energy without
the KL's "- 1/2" (equivalently the cross-entropy minus log(sqrt(2 pi e) sigma) + 1/2). With c = 0
the minima are (19.81, 29.94), l = 0.356 and (-16.80, 12.80), l = 0.275. Because the constant is
divided by different beta_i^2 it is not a harmless offset (it re-weights alpha_i by
exp(-c / beta_i^2)). ``KL_OFFSET_PAPER = 0.5`` is the default here; pass ``kl_offset=0.0`` for the
literal Eq. 15.

**sigma <= 0.** The paper's domain is sigma > 0. ``loss`` uses log|sigma| (N(mu, sigma^2) depends on
sigma^2 only), so it is defined, even in sigma and +inf at sigma = 0, for any sigma != 0; the
optimisers below keep every evaluated point at sigma >= ``sigma_min`` by clamping (projection onto
the domain), and report how often that happened.

**Optimisers (the paper's Algorithm 1, full-batch: the loss is exact, no data).** Per step
``eps = ascent(theta, grad l(theta))``, ``theta <- theta - lr * grad l(theta + eps)``. The ascent
perturbation comes from the project's own flatness classes (``SAM.perturbation`` and subclasses):

* ``sgd``: eps = 0;
* ``sam``: :class:`flatbnn.flatness.SAM`, eps = rho g / ||g|| (Eq. 2);
* ``asam``: :class:`flatbnn.flatness.ASAM` without parameter names, T = |theta| + eta on both
  coordinates, eps = rho T^2 g / ||T g|| (Eq. 5; eta = 0 is the paper's formula);
* ``fsam``: Eq. 10 with the *analytic* Fisher of the Gaussian, F = diag(1/sigma^2, 2/sigma^2), the
  metric the paper's section 3.1 uses to draw its ellipses -- :class:`AnalyticFisherSAM`, a
  :class:`flatbnn.flatness.FisherSAM` whose inverse Fisher is handed in (``scaling``) instead of
  being estimated from g^2;
* ``fsam_emp``: the project's :class:`flatbnn.flatness.FisherSAM` unchanged (the paper's practical
  Eq. 12 approximation F = diag(g^2), inverse 1 / (1 + eta g^2)), for comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import minimize

from flatbnn.flatness import ASAM, SAM, FisherSAM

DTYPE = torch.float64
#: (m_i, s_i, alpha_i, beta_i) of the two mixture components (paper, section 3.1)
PAPER_COMPONENTS = ((20.0, 30.0, 0.7, 1.8), (-20.0, 10.0, 0.3, 1.2))
#: the numerically found minima the paper reports (Fig. 1), with loss and Hessian trace
PAPER_MINIMA = {
    "flat": {"theta": (19.85, 29.95), "loss": 0.51, "hessian_trace": 0.001},
    "sharp": {"theta": (-15.94, 13.46), "loss": 0.49, "hessian_trace": 0.006},
}
#: energy offset c that reproduces the paper's reported numbers (see the module docstring)
KL_OFFSET_PAPER = 0.5
OPTIMIZERS = ("sgd", "sam", "asam", "fsam", "fsam_emp")


def gaussian_kl(mu, sigma, m, s):
    """KL( N(mu, sigma^2) || N(m, s^2) ) in closed form (log|sigma|: even in sigma)."""
    return (math.log(s) - torch.log(torch.abs(sigma))
            + (sigma * sigma + (mu - m) ** 2) / (2.0 * s * s) - 0.5)


@dataclass(frozen=True)
class GaussianMixtureLoss:
    """Eq. 15 of the Fisher-SAM paper; ``theta[..., 0] = mu``, ``theta[..., 1] = sigma``."""

    components: tuple = PAPER_COMPONENTS
    kl_offset: float = KL_OFFSET_PAPER

    def energies(self, theta: torch.Tensor) -> list[torch.Tensor]:
        mu, sigma = theta[..., 0], theta[..., 1]
        return [gaussian_kl(mu, sigma, m, s) + self.kl_offset for m, s, _, _ in self.components]

    def __call__(self, theta: torch.Tensor) -> torch.Tensor:
        terms = [math.log(a) - e / (b * b)
                 for e, (_, _, a, b) in zip(self.energies(theta), self.components)]
        return -torch.logsumexp(torch.stack(terms), dim=0)

    def grad(self, theta: torch.Tensor) -> torch.Tensor:
        """d l / d theta at one point (shape (2,)) or a batch (shape (..., 2))."""
        x = theta.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(self(x).sum(), x)
        return g

    def hessian(self, theta: torch.Tensor) -> torch.Tensor:
        return torch.autograd.functional.hessian(self, theta.detach().to(DTYPE))

    @staticmethod
    def fisher_diag(theta: torch.Tensor) -> torch.Tensor:
        """Fisher information of N(mu, sigma^2) in (mu, sigma): diag(1/sigma^2, 2/sigma^2)."""
        s2 = theta[..., 1] ** 2
        return torch.stack([1.0 / s2, 2.0 / s2], dim=-1)


# ---------------------------------------------------------------------------------- minima
def find_minima(loss: GaussianMixtureLoss, starts=None, merge_tol: float = 1e-3) -> dict:
    """Local minima by BFGS (float64, autograd gradients) from several starts, then Newton polish.

    Returns ``{"flat": {...}, "sharp": {...}}``: the minimum with the smaller largest Hessian
    eigenvalue is ``flat``. Each entry: theta, loss, gradient norm, Hessian, eigenvalues, trace.
    """
    if starts is None:  # near each component's centre and a few elsewhere in the sigma > 0 half-plane
        starts = [(m, s) for m, s, _, _ in loss.components] + [(0.0, 20.0), (10.0, 40.0), (-10.0, 15.0)]
    fun = lambda x: float(loss(torch.as_tensor(x, dtype=DTYPE)))  # noqa: E731
    jac = lambda x: loss.grad(torch.as_tensor(x, dtype=DTYPE)).numpy()  # noqa: E731
    found: list[np.ndarray] = []
    for x0 in starts:
        res = minimize(fun, np.asarray(x0, float), jac=jac, method="L-BFGS-B",
                       bounds=[(None, None), (1e-3, None)], options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 10000})
        x = torch.as_tensor(res.x, dtype=DTYPE)
        for _ in range(20):  # Newton polish: quadratic convergence at a strict minimum
            h = loss.hessian(x)
            if torch.linalg.eigvalsh(h).min() <= 0:
                break
            x = x - torch.linalg.solve(h, loss.grad(x))
        if torch.linalg.eigvalsh(loss.hessian(x)).min() <= 0 or x[1] <= 0:
            continue
        if all(np.linalg.norm(x.numpy() - y) > merge_tol for y in found):
            found.append(x.numpy())
    minima = []
    for x in found:
        t = torch.as_tensor(x, dtype=DTYPE)
        h = loss.hessian(t)
        ev = torch.linalg.eigvalsh(h)
        minima.append({
            "theta": [float(v) for v in x],
            "loss": float(loss(t)),
            "grad_norm": float(loss.grad(t).norm()),
            "hessian": h.tolist(),
            "hessian_eigenvalues": ev.tolist(),
            "hessian_max_eigenvalue": float(ev.max()),
            "hessian_trace": float(h.trace()),
        })
    if len(minima) != 2:
        raise RuntimeError(f"expected two local minima, found {len(minima)}: {[m['theta'] for m in minima]}")
    minima.sort(key=lambda m: m["hessian_max_eigenvalue"])
    return {"flat": minima[0], "sharp": minima[1]}


def find_saddle(loss: GaussianMixtureLoss, start=(-2.0, 22.0)) -> dict:
    """The saddle between the two basins (a root of the gradient with one negative eigenvalue)."""
    from scipy.optimize import root

    res = root(lambda x: loss.grad(torch.as_tensor(x, dtype=DTYPE)).numpy(), np.asarray(start, float),
               jac=lambda x: loss.hessian(torch.as_tensor(x, dtype=DTYPE)).numpy(), tol=1e-14)
    t = torch.as_tensor(res.x, dtype=DTYPE)
    h = loss.hessian(t)
    ev, vec = torch.linalg.eigh(h)
    if not (ev[0] < 0 < ev[1]):
        raise RuntimeError(f"no saddle found from {start}: eigenvalues {ev.tolist()}")
    return {"theta": [float(v) for v in res.x], "loss": float(loss(t)), "grad_norm": float(loss.grad(t).norm()),
            "hessian_eigenvalues": ev.tolist(), "unstable_direction": vec[:, 0].tolist()}


# ---------------------------------------------------------------------------------- optimisers
class AnalyticFisherSAM(FisherSAM):
    """Fisher SAM (Eq. 10) with a given inverse-Fisher diagonal, passed as ``scaling``.

    eps = rho F^-1 g / sqrt(g^T F^-1 g): numerator F^-1 g, normaliser ||F^-1/2 g||. The radius,
    the normalisation and the dtype handling are :meth:`SAM.perturbation`'s. Without ``scaling``
    it falls back to the empirical FisherSAM.
    """

    name = "fsam_analytic"

    def direction(self, params, grads, scaling, names):
        if scaling is None:
            return super().direction(params, grads, scaling, names)
        numer = [f * g for f, g in zip(scaling, grads)]
        return numer, [f.sqrt() * g for f, g in zip(scaling, grads)]


def make_flatness(name: str, rho: float, eta: float | None = None) -> SAM | None:
    """The project flatness object that supplies the ascent perturbation (None for SGD)."""
    if name == "sgd":
        return None
    if name == "sam":
        return SAM(rho=rho)
    if name == "asam":
        return ASAM(rho=rho, eta=0.01 if eta is None else eta)
    if name == "fsam":
        return AnalyticFisherSAM(rho=rho, eta=1.0)  # eta unused when F is handed in
    if name == "fsam_emp":
        return FisherSAM(rho=rho, eta=1.0 if eta is None else eta)
    raise ValueError(f"unknown optimiser {name!r}; choose from {OPTIMIZERS}")


@dataclass
class Trajectories:
    """Iterates of one optimiser from a batch of starts (row b of every array is start b)."""

    name: str
    rho: float
    lr: float
    points: np.ndarray      # (T + 1, B, 2) iterates; a start that stopped early repeats its last iterate
    probes: np.ndarray      # (T, B, 2) points theta + eps where the gradient was taken
    end: np.ndarray         # (B, 2) mean of the last ``window`` iterates (SAM jitters around a point)
    spread: np.ndarray      # (B,) largest distance of those iterates from ``end``
    steps_run: np.ndarray   # (B,) steps taken before the stopping test passed (or the budget ran out)
    clamped: np.ndarray     # (B,) evaluations moved up to sigma_min


def run_optimizer(loss: GaussianMixtureLoss, name: str, starts, *, lr: float, steps: int,
                  rho: float = 0.0, eta: float | None = None, sigma_min: float = 0.5,
                  window: int = 50, check_every: int = 50, stop_tol: float | None = 0.3,
                  settle_points=None, settle_tol: float = 3.0) -> Trajectories:
    """Full-batch gradient descent with the gradient taken at theta + eps, from each start.

    ``starts``: (B, 2) or (2,). The loss gradient is evaluated for all running starts at once;
    eps comes from ``flat.perturbation([theta_b], [g_b])`` once per start and step (one flatness
    call per problem, so SAM's global norm never mixes two problems). Every ``check_every`` steps a
    start whose mean over the last ``window`` iterates moved less than ``stop_tol`` at each of the
    last two checks -- and, if ``settle_points`` (K, 2) is given, lies within ``settle_tol`` of
    one of them -- is stopped (``stop_tol=None``: always run ``steps``).
    """
    flat = make_flatness(name, rho, eta)
    theta = torch.as_tensor(np.asarray(starts, float), dtype=DTYPE).reshape(-1, 2).clone()
    B = theta.shape[0]
    active = torch.ones(B, dtype=torch.bool)
    clamped = torch.zeros(B, dtype=torch.long)
    steps_run = torch.full((B,), steps, dtype=torch.long)
    end = torch.full((B, 2), math.nan, dtype=DTYPE)
    spread = torch.zeros(B, dtype=DTYPE)
    last_mean = torch.full((B, 2), math.inf, dtype=DTYPE)
    still = torch.zeros(B, dtype=torch.bool)
    settle = None if settle_points is None else torch.as_tensor(np.asarray(settle_points, float), dtype=DTYPE).reshape(-1, 2)
    points, probes = [theta.clone()], []

    def window_stats():
        w = torch.stack(points[-window:])                                  # (w, B, 2)
        m = w.mean(0)
        return m, torch.linalg.vector_norm(w - m, dim=-1).amax(0)

    for t in range(1, steps + 1):
        idx = active.nonzero().flatten()
        if idx.numel() == 0:
            break
        th = theta[idx]
        if flat is None:
            probe = th.clone()
        else:
            g = loss.grad(th)
            finv = 1.0 / loss.fisher_diag(th) if name == "fsam" else None
            rows = zip(th.unbind(0), g.unbind(0), finv.unbind(0) if finv is not None else [None] * th.shape[0])
            eps = torch.stack([flat.perturbation([p], [q], scaling=None if f is None else [f])[0] for p, q, f in rows])
            probe = th + eps
        low = probe[:, 1] < sigma_min
        probe[low, 1] = sigma_min
        new = th - lr * loss.grad(probe)
        low2 = new[:, 1] < sigma_min
        new[low2, 1] = sigma_min
        clamped[idx] += low.long() + low2.long()
        theta = theta.clone()
        theta[idx] = new
        full_probe = theta.clone()
        full_probe[idx] = probe
        points.append(theta.clone())
        probes.append(full_probe)
        if stop_tol is not None and t % check_every == 0 and t >= window:
            m, sp = window_stats()
            small = torch.linalg.vector_norm(m - last_mean, dim=-1) < stop_tol
            done = active & small & still
            if settle is not None:
                done &= torch.cdist(m, settle).amin(1) <= settle_tol
            still = small
            end[done], spread[done], steps_run[done] = m[done], sp[done], t
            active &= ~done
            last_mean = m
    m, sp = window_stats()
    end[active], spread[active] = m[active], sp[active]
    return Trajectories(name=name, rho=float(rho), lr=float(lr), points=torch.stack(points).numpy(),
                        probes=torch.stack(probes).numpy() if probes else np.zeros((0, B, 2)),
                        end=end.numpy(), spread=spread.numpy(), steps_run=steps_run.numpy(),
                        clamped=clamped.numpy())


def classify(point, minima: dict, tol: float) -> str:
    """``flat`` / ``sharp`` if ``point`` lies within Euclidean ``tol`` of that minimum, else ``none``."""
    p = np.asarray(point, float)
    if not np.all(np.isfinite(p)):
        return "none"
    dist = {k: float(np.linalg.norm(p - np.asarray(v["theta"]))) for k, v in minima.items()}
    best = min(dist, key=dist.get)
    return best if dist[best] <= tol else "none"
