"""Geometry SAM for variational posteriors (flat_seeking_bnn section 3.3, Eq. 7 and the line after).

mu' = mu + rho * diag(T) g_mu / ||diag(T) g_mu||, T = |mu| / sigma, with the posterior noise held
fixed between the passes. T comes from the method (``method.flatness_scaling()``), so only methods
with a mean and a standard deviation per weight can use it; a point-estimate method is refused at
setup. Note: the paper writes the ball's norm as sqrt(d^T diag(T)^-1 d) but its update normalises
by the plain norm of T g; we implement the update as written (Eq. after 7).
"""

from __future__ import annotations

from flatbnn.flatness.sam import SAM


class Geometry(SAM):
    name = "geometry"
    needs_scaling = True

    def setup(self, ctx, method) -> None:
        super().setup(ctx, method)
        if not callable(getattr(method, "flatness_scaling", None)):
            raise ValueError(
                f"flatness=geometry needs a variational method with mu and sigma per weight "
                f"(method=sgvb, sgvb_lrt, f_sgvb, ...); method={getattr(method, 'name', method)} has none")
