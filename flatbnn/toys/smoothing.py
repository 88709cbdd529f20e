"""Smoothed versions of a 2-D loss (VariationalSAM, Ujvary et al., Fig. 1), computed honestly.

For a loss ``L`` over theta in R^2 and a radius rho:

* :func:`sam_smoothed` -- the idealised SAM loss  L_SAM(theta) = max_{||eps|| <= rho} L(theta + eps)
  (VSAM Eq. 1 with Sigma = rho^2 / p I, p = 2: eps^T Sigma^-1 eps <= p  <=>  ||eps|| <= rho). The
  inner max is a dense polar search over the disk (centre, ``n_radii`` rings up to and including the
  boundary, ``n_angles`` angles per ring, plus the first-order maximiser rho g/||g||), then
  projected gradient ascent from the best candidate
  (step halved whenever it does not improve), so the value is a certified lower bound on the true
  max that is at least the grid max. Where the disk leaves the domain through a boundary where L
  blows up (the Gaussian toy: sigma -> 0+ gives L -> +inf), the supremum is +inf and is returned
  as such (``blowup_below``).
* :func:`sam_first_order` -- what the SAM *update* sees: L(theta + rho g / ||g||) with g = grad L
  (VSAM Fig. 1 D, the first-order approximation of the inner max).
* :func:`gaussian_smoothed` -- the RandomSAM / MFVI-mean view
  L_RSAM(theta) = E_{z ~ N(0, s^2 I)} L(theta + z) with s = rho / sqrt(p) (Sigma = rho^2 / p I),
  by a tensor-product quadrature: Gauss-Hermite along axis 0 and Gauss-Legendre along axis 1,
  split and clustered at an integrable log singularity when the Gaussian window reaches it (the
  toy's log|sigma| at sigma = 0); :func:`gaussian_smoothed_mc` is the Monte-Carlo estimate used to
  check it.

``fn`` maps a tensor of shape (..., 2) to (...,) (float64); every routine evaluates it in chunks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

DTYPE = torch.float64


def _eval(fn, pts: torch.Tensor, chunk: int = 1 << 21) -> torch.Tensor:
    flat = pts.reshape(-1, 2)
    with torch.no_grad():
        out = torch.cat([fn(flat[i:i + chunk]) for i in range(0, flat.shape[0], chunk)]) if flat.shape[0] else flat[:, 0]
    return out.reshape(pts.shape[:-1])


def _grad(fn, pts: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        x = pts.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(x).sum(), x)
    return g


def disk_offsets(rho: float, n_radii: int = 8, n_angles: int = 256) -> torch.Tensor:
    """Centre plus ``n_radii`` rings (radii rho k / n_radii, k = 1..n_radii) of ``n_angles`` points."""
    ang = torch.arange(n_angles, dtype=DTYPE) * (2 * math.pi / n_angles)
    rad = rho * torch.arange(1, n_radii + 1, dtype=DTYPE) / n_radii
    ring = torch.stack([torch.cos(ang), torch.sin(ang)], -1)                 # (A, 2)
    pts = (rad[:, None, None] * ring[None]).reshape(-1, 2)                    # (R*A, 2)
    return torch.cat([torch.zeros(1, 2, dtype=DTYPE), pts])


def sam_smoothed(fn, points, rho: float, *, n_radii: int = 8, n_angles: int = 256,
                 refine_steps: int = 30, blowup_below: dict | None = None,
                 return_argmax: bool = False, batch: int = 1024):
    """max_{||eps|| <= rho} fn(theta + eps) for each row of ``points`` (shape (N, 2)).

    ``blowup_below={axis: value}``: fn -> +inf as theta[axis] -> value from above and is not
    defined below it; points whose disk reaches that line get +inf.
    """
    pts = torch.as_tensor(np.asarray(points, float), dtype=DTYPE).reshape(-1, 2)
    offs = disk_offsets(rho, n_radii, n_angles)
    g0 = _grad(fn, pts)
    first = rho * g0 / torch.linalg.vector_norm(g0, dim=1, keepdim=True).clamp_min(1e-300)
    first = torch.nan_to_num(first)          # the first-order maximiser is a candidate too
    best_val = torch.empty(pts.shape[0], dtype=DTYPE)
    best_arg = torch.empty(pts.shape[0], 2, dtype=DTYPE)
    for i in range(0, pts.shape[0], batch):
        p = pts[i:i + batch]
        cand = torch.cat([offs[None].expand(p.shape[0], -1, -1), first[i:i + batch, None]], 1)  # (n, K+1, 2)
        vals = _eval(fn, p[:, None, :] + cand)
        vals = torch.nan_to_num(vals, nan=-math.inf, posinf=math.inf)
        j = vals.argmax(1)
        best_val[i:i + batch] = vals.gather(1, j[:, None])[:, 0]
        best_arg[i:i + batch] = cand[torch.arange(p.shape[0]), j]
    # projected gradient ascent on the disk from the best grid point (monotone: only improvements kept)
    eps, val = best_arg.clone(), best_val.clone()
    step = torch.full((pts.shape[0],), 2 * math.pi * rho / n_angles, dtype=DTYPE)
    for _ in range(refine_steps):
        g = _grad(fn, pts + eps)
        gn = torch.linalg.vector_norm(g, dim=1, keepdim=True)
        ok = torch.isfinite(gn[:, 0]) & (gn[:, 0] > 0)
        cand = eps + step[:, None] * torch.where(ok[:, None], g / gn.clamp_min(1e-300), torch.zeros_like(g))
        cn = torch.linalg.vector_norm(cand, dim=1, keepdim=True)
        cand = torch.where(cn > rho, cand * (rho / cn), cand)
        cval = torch.nan_to_num(_eval(fn, pts + cand), nan=-math.inf, posinf=math.inf)
        better = cval > val
        eps = torch.where(better[:, None], cand, eps)
        val = torch.where(better, cval, val)
        step = torch.where(better, step, step / 2)
    for axis, bound in (blowup_below or {}).items():
        val = torch.where(pts[:, axis] - rho <= bound, torch.full_like(val, math.inf), val)
    return (val, pts + eps) if return_argmax else val


def sam_first_order(fn, points, rho: float, *, blowup_below: dict | None = None) -> torch.Tensor:
    """fn(theta + rho g / ||g||), g = grad fn(theta): the SAM update's first-order inner max.

    Where the probe leaves the domain (``blowup_below``) the value is nan (undefined).
    """
    pts = torch.as_tensor(np.asarray(points, float), dtype=DTYPE).reshape(-1, 2)
    g = _grad(fn, pts)
    probe = pts + rho * g / torch.linalg.vector_norm(g, dim=1, keepdim=True).clamp_min(1e-300)
    val = _eval(fn, probe)
    for axis, bound in (blowup_below or {}).items():
        val = torch.where(probe[:, axis] <= bound, torch.full_like(val, math.nan), val)
    return val


def gauss_hermite(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights for E_{z ~ N(0, 1)} f(z) ~ sum_i w_i f(z_i) (weights sum to 1)."""
    x, w = np.polynomial.hermite_e.hermegauss(n)
    return torch.as_tensor(x, dtype=DTYPE), torch.as_tensor(w / w.sum(), dtype=DTYPE)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _axis_rule(centre: torch.Tensor, std: float, n: int, singular_at: float | None,
               width: float = 8.0, power: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes x (N, M) and weights w (N, M) with sum_j w_j f(x_j) ~ E_{z ~ N(0, std^2)} f(centre + z).

    Gauss-Hermite (n nodes) unless [centre - width std, centre + width std] contains
    ``singular_at`` (where f has an integrable log singularity); then Gauss-Legendre over that
    interval (the mass outside is < 1e-15), split at the singularity, each piece mapped by
    x = a + (b - a) t^power, which clusters nodes there and makes the integrand smooth in t; the two
    pieces get n nodes each.
    """
    t, wt = np.polynomial.legendre.leggauss(n)
    t = torch.as_tensor((t + 1) / 2, dtype=DTYPE)
    wt = torch.as_tensor(wt / 2, dtype=DTYPE)
    lo, hi = centre - width * std, centre + width * std
    c = centre[:, None]
    if singular_at is None:
        cross = torch.zeros_like(centre, dtype=torch.bool)
    else:
        cross = (lo < singular_at) & (hi > singular_at)
    # away from the singularity: Gauss-Hermite (exact for polynomials), padded to 2n nodes with
    # zero weight so that every row has the same shape
    xh, wh = gauss_hermite(n)
    xs = c + std * xh[None]
    ws = wh[None].expand_as(xs)
    xs = torch.cat([xs, xs], 1)
    ws = torch.cat([ws, torch.zeros_like(ws)], 1)
    if cross.any():
        s = torch.as_tensor(singular_at, dtype=DTYPE)
        tp = t ** power
        jac = power * t ** (power - 1)
        # right piece [s, hi]: x = s + (hi - s) t^p ; left piece [lo, s]: x = s - (s - lo) t^p
        xr = s + (hi - s)[:, None] * tp[None]
        wr = (hi - s)[:, None] * (wt * jac)[None] * _normal_pdf((xr - c) / std) / std
        xl = s - (s - lo)[:, None] * tp[None]
        wl = (s - lo)[:, None] * (wt * jac)[None] * _normal_pdf((xl - c) / std) / std
        xs = torch.where(cross[:, None], torch.cat([xl, xr], 1), xs)
        ws = torch.where(cross[:, None], torch.cat([wl, wr], 1), ws)
    return xs, ws


def gaussian_smoothed(fn, points, std: float, *, n_nodes: int = 32, singular: dict | None = None,
                      batch: int = 512) -> torch.Tensor:
    """E_{z ~ N(0, std^2 I_2)} fn(theta + z) by a tensor-product quadrature.

    Axis 0: Gauss-Hermite with ``n_nodes`` nodes. Axis 1: the same, except where the +-8 std
    window contains ``singular[1]`` (the Gaussian toy: log|sigma| singularity at sigma = 0): there
    Gauss-Legendre with 2 x ``n_nodes`` nodes, split at the singularity and clustered towards it.
    """
    pts = torch.as_tensor(np.asarray(points, float), dtype=DTYPE).reshape(-1, 2)
    x0, w0 = gauss_hermite(n_nodes)
    sing = (singular or {}).get(1)
    out = torch.empty(pts.shape[0], dtype=DTYPE)
    for i in range(0, pts.shape[0], batch):
        p = pts[i:i + batch]
        x1, w1 = _axis_rule(p[:, 1], std, n_nodes, sing)                     # (n, M)
        mu = p[:, 0, None, None] + std * x0[None, :, None]                    # (n, H, 1)
        grid = torch.stack(torch.broadcast_tensors(mu, x1[:, None, :]), -1)   # (n, H, M, 2)
        vals = _eval(fn, grid)
        vals = torch.where(w1[:, None, :] == 0, torch.zeros_like(vals), vals)
        out[i:i + batch] = torch.einsum("nhm,h,nm->n", vals, w0, w1)
    return out


def gaussian_smoothed_mc(fn, point, std: float, n: int = 200_000, seed: int = 0) -> tuple[float, float]:
    """Monte-Carlo E_{z ~ N(0, std^2 I)} fn(theta + z): (estimate, standard error)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 2, generator=gen, dtype=DTYPE) * std
    v = _eval(fn, torch.as_tensor(point, dtype=DTYPE)[None] + z)
    return float(v.mean()), float(v.std() / math.sqrt(n))
