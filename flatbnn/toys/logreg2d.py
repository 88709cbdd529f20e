"""2-D Bayesian logistic regression without bias (bSAM paper, Fig. 3 / App. F.1): the exact posterior
by numerical integration on a grid, and Gaussian approximations to compare with it.

Model: p(y = 1 | x, w) = sigmoid(w^T x), w in R^2 (no bias: the classes are separable by a line
through the origin, as in the paper), prior w ~ N(0, prior_var I). The data follow Murphy (2012,
§8.4, Fig. 8.5; the PMTK demo ``logregLaplaceGirolamiDemo``): two Gaussian clouds, class 1 around
(1, 5) with std 1, class 0 around (-5, 1) with std 1.1, ``n_per_class`` points each, drawn with
``numpy.random.default_rng(seed)`` (class 1 first, then class 0). With the defaults (30 per class,
seed 0) the set is separable through the origin with margin 1.44.

Everything here is float64 and deterministic. Gaussian predictives integrate the logit
a = w^T x ~ N(mu^T x, x^T S x) exactly up to 64-point Gauss-Hermite quadrature error (no probit
approximation, no Monte Carlo); the exact Bayes predictive sums sigmoid(w^T x) over the grid posterior.
The training of SAM and bSAM uses flatbnn's own ``flatness.SAM`` and ``methods.bsam.BSAM``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------- data
def make_data(n_per_class: int = 30, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Murphy (2012) §8.4-style two-class data in 2-D: ``(X [2n, 2], y [2n] in {0, 1})``."""
    rng = np.random.default_rng(seed)
    x1 = rng.normal((1.0, 5.0), 1.0, (n_per_class, 2))
    x0 = rng.normal((-5.0, 1.0), 1.1, (n_per_class, 2))
    return np.vstack([x1, x0]), np.r_[np.ones(n_per_class), np.zeros(n_per_class)]


def separation_margin(X: np.ndarray, y: np.ndarray, n_angles: int = 20000) -> float:
    """max over unit w of min_i (2 y_i - 1) w^T x_i (> 0: separable through the origin)."""
    ang = np.linspace(0.0, 2 * np.pi, n_angles, endpoint=False)
    W = np.stack([np.cos(ang), np.sin(ang)], 1)
    return float((((2 * y - 1)[None, :]) * (W @ X.T)).min(1).max())


# ----------------------------------------------------------------------------------- grid integration
@dataclass
class GridPosterior:
    axis: np.ndarray          # [n] grid coordinates (same for both weights)
    points: np.ndarray        # [n*n, 2]
    weights: np.ndarray       # [n*n] normalised posterior mass of each cell
    mean: np.ndarray          # [2]
    cov: np.ndarray           # [2, 2]
    mode: np.ndarray          # [2] grid argmax (the MAP up to the grid spacing)
    edge_mass: float          # posterior mass in the outermost grid ring (should be ~0)


def grid_moments(log_density, lim: float, n: int = 601) -> GridPosterior:
    """Normalise ``log_density(points [m, 2]) -> [m]`` on [-lim, lim]^2 (midpoint rule on an
    n x n grid) and return its mean and covariance."""
    axis = np.linspace(-lim, lim, n)
    W1, W2 = np.meshgrid(axis, axis, indexing="ij")
    pts = np.stack([W1.ravel(), W2.ravel()], 1)
    lp = np.asarray(log_density(pts), dtype=np.float64)
    w = np.exp(lp - lp.max())
    w /= w.sum()
    mean = w @ pts
    d = pts - mean
    cov = d.T @ (d * w[:, None])
    grid = w.reshape(n, n)
    edge = grid[[0, -1], :].sum() + grid[1:-1, [0, -1]].sum()
    return GridPosterior(axis, pts, w, mean, cov, pts[lp.argmax()], float(edge))


def log_joint(W: np.ndarray, X: np.ndarray, y: np.ndarray, prior_var: float) -> np.ndarray:
    """log p(y | X, w) + log N(w; 0, prior_var I) (up to a constant) for each row of W."""
    t = 2 * y - 1
    z = t[None, :] * (W @ X.T)
    return -np.logaddexp(0.0, -z).sum(1) - 0.5 * (W ** 2).sum(1) / prior_var


def exact_posterior(X, y, prior_var: float, lim: float | None = None, n: int = 601) -> GridPosterior:
    lim = lim if lim is not None else 8.0 * math.sqrt(prior_var) + 4.0
    return grid_moments(lambda W: log_joint(W, X, y, prior_var), lim, n)


# ----------------------------------------------------------------------------------- predictives
def sigmoid(a):
    return 0.5 * (1.0 + np.tanh(0.5 * a))


def predictive_grid(Xq: np.ndarray, post: GridPosterior, chunk: int = 2048) -> np.ndarray:
    """Exact Bayes predictive p(y=1|x) = sum_cells sigmoid(w^T x) q(cell) (cells with mass > 1e-14)."""
    keep = post.weights > 1e-14
    pts, w = post.points[keep], post.weights[keep] / post.weights[keep].sum()
    out = np.empty(len(Xq))
    for i in range(0, len(Xq), chunk):
        out[i:i + chunk] = sigmoid(Xq[i:i + chunk] @ pts.T) @ w
    return out


_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(64)  # probabilists' Hermite: weight exp(-x^2/2)


def predictive_gaussian(Xq: np.ndarray, mean: np.ndarray, cov: np.ndarray | None) -> np.ndarray:
    """p(y=1|x) = E_{w ~ N(mean, cov)} sigmoid(w^T x) = E_{a ~ N(m, v)} sigmoid(a), m = mean^T x,
    v = x^T cov x, by 64-point Gauss-Hermite quadrature; ``cov=None`` is the plug-in sigmoid(m)."""
    m = Xq @ mean
    if cov is None:
        return sigmoid(m)
    v = np.einsum("ni,ij,nj->n", Xq, cov, Xq)
    a = m[:, None] + np.sqrt(np.maximum(v, 0.0))[:, None] * _GH_X[None, :]
    return sigmoid(a) @ (_GH_W / _GH_W.sum())


# ----------------------------------------------------------------------------------- Gaussian distances
def gaussian_kl(m0, S0, m1, S1) -> float:
    """KL(N(m0, S0) || N(m1, S1))."""
    m0, m1, S0, S1 = map(np.asarray, (m0, m1, S0, S1))
    k = len(m0)
    S1inv = np.linalg.inv(S1)
    d = m1 - m0
    return float(0.5 * (np.trace(S1inv @ S0) + d @ S1inv @ d - k
                        + np.linalg.slogdet(S1)[1] - np.linalg.slogdet(S0)[1]))


def _sqrtm_psd(S):
    vals, vecs = np.linalg.eigh(S)
    return (vecs * np.sqrt(np.clip(vals, 0, None))) @ vecs.T


def gaussian_w2(m0, S0, m1, S1) -> float:
    """2-Wasserstein distance between N(m0, S0) and N(m1, S1); S0 = 0 is a point mass."""
    m0, m1, S0, S1 = map(np.asarray, (m0, m1, S0, S1))
    r1 = _sqrtm_psd(S1)
    cross = _sqrtm_psd(r1 @ S0 @ r1)
    val = float(((m0 - m1) ** 2).sum() + np.trace(S0 + S1 - 2 * cross))
    return math.sqrt(max(val, 0.0))


# ----------------------------------------------------------------------------------- Laplace
def hessian_neg_log_joint(w: np.ndarray, X: np.ndarray, prior_var: float) -> np.ndarray:
    """sum_i sigmoid(w^T x_i)(1 - sigmoid(w^T x_i)) x_i x_i^T + I / prior_var (independent of y)."""
    p = sigmoid(X @ w)
    return (X * (p * (1 - p))[:, None]).T @ X + np.eye(2) / prior_var


def laplace(w: np.ndarray, X: np.ndarray, prior_var: float, diagonal: bool = True) -> np.ndarray:
    """Covariance of the Laplace approximation at ``w``: diag(H)^-1 (diagonal) or H^-1 (full)."""
    H = hessian_neg_log_joint(w, X, prior_var)
    return np.diag(1.0 / np.diag(H)) if diagonal else np.linalg.inv(H)


# ----------------------------------------------------------------------------------- training (flatbnn code)
def _bce(logits, y):
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), y)


def _context(module, n_train, steps, generator=None, optimizer_factory=None, cosine=True):
    from flatbnn.methods import RunContext
    from flatbnn.optim.schedulers import constant, cosine as cosine_schedule
    return RunContext(model=module, module=module, device=CPU, n_train=n_train, steps_per_epoch=steps, epochs=1,
                      optimizer_factory=optimizer_factory, generator=generator, criterion=_bce,
                      scheduler_factory=cosine_schedule if cosine else constant)


def _tensors(X, y):
    return torch.as_tensor(X, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)


def fit_sam(X, y, prior_var: float, rho: float, steps: int = 2500, lr: float = 2.0, momentum: float = 0.9,
            init=(0.0, 0.0)) -> np.ndarray:
    """Full-batch SAM on mean NLL + (delta/2)||w||^2, delta = 1/(prior_var N): flatbnn's MAP method
    (heavy-ball SGD, weight decay delta) x flatbnn's SAM flatness, cosine lr to 0.
    ``rho = 0`` gives the MAP estimate."""
    from flatbnn.engine.backprop import Backprop
    from flatbnn.flatness import SAM
    from flatbnn.methods import MAP
    x, t = _tensors(X, y)
    lin = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([init], dtype=torch.float64))
    delta = 1.0 / (prior_var * len(y))
    method = MAP()
    method.setup(_context(lin, len(y), steps, optimizer_factory=lambda p: torch.optim.SGD(
        p, lr=lr, momentum=momentum, weight_decay=delta)))
    flat, bp = SAM(rho=rho), Backprop(lin, CPU)
    for _ in range(steps):
        method.train_step((x, t), flat, bp)
    return lin.weight.detach().numpy().ravel().copy()


def fit_bsam(X, y, prior_var: float, rho: float = 0.05, m: int | None = None, steps: int = 600,
             lr: float = 0.5, beta1: float = 0.9, beta2: float = 0.99, damping: float = 0.1,
             s_init: float = 1.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict]:
    """bSAM (flatbnn.methods.bsam.BSAM) on the whole data set every step, split into ``m`` parts
    (default: one example per part), N = len(data), prior precision = 1/prior_var, cosine lr to 0.
    Returns (mean w, diagonal covariance 1/(N s), info)."""
    from flatbnn.engine.backprop import Backprop
    from flatbnn.flatness import NoFlatness
    from flatbnn.methods.bsam import BSAM
    x, t = _tensors(X, y)
    n = len(y)
    lin = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        lin.weight.zero_()
    method = BSAM(lr=lr, beta1=beta1, beta2=beta2, rho=rho, m=m or n, prior_precision=1.0 / prior_var,
                  damping=damping, s_init=s_init, num_samples=0)
    method.setup(_context(lin, n, steps, generator=torch.Generator().manual_seed(seed)))
    bp, flat = Backprop(lin, CPU), NoFlatness()
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        perm = torch.randperm(n, generator=g)  # parts see different examples each step
        method.train_step((x[perm], t[perm]), flat, bp)
    opt = method.optimizer
    (p,) = opt.params()
    s = opt.state[p]["precision"].detach().numpy().ravel().copy()
    w = p.detach().numpy().ravel().copy()
    return w, np.diag(1.0 / (n * s)), {"s": s.tolist(), "N": n, "m": m or n}
