"""Mean-field Gaussian layers: q(w) = N(mu, sigma^2) independently per weight (and per bias).

Parameterisation: ``sigma = softplus(rho)`` (``weight_rho`` / ``bias_rho``), so sigma > 0 without
constraints; ``mu`` starts from the backbone's own initialisation (He, truncated He, ...), ``sigma``
from ``sigma_init`` (absolute, default 1e-3: rho = log(expm1(sigma_init))).

Estimators of the expected log-likelihood gradient (the layer output for one input batch x):

* ``reparam`` (Blundell et al. 2015): one weight sample per forward, w = mu + sigma * eps,
  eps ~ N(0, I) of the weight's shape, shared by the whole batch.
* ``lrt`` -- local reparameterisation (Kingma, Salimans & Welling 2015): the pre-activation is
  Gaussian, mean = op(x, mu_w) + mu_b, var = op(x^2, sigma_w^2) + sigma_b^2 (op = linear / conv2d),
  sampled directly: out = mean + sqrt(var) * xi, xi ~ N(0, I) of the *output's* shape. Exact in
  distribution for fully connected layers; for convolutions it ignores the correlation of the
  output positions that share a weight (the usual approximation).
* ``flipout`` (Wen et al. 2018): one weight perturbation dW = sigma * eps for the batch, decorrelated
  per example by random signs: out = op(x, mu) + op(x * s_in, dW) * s_out (+ bias: mu_b + s_out * dB),
  s_in, s_out in {-1, +1} per example and channel.

Biases are Bayesian too (flat_seeking_bnn "absorbs the biases into the weight matrices"); with
``bayesian_bias=False`` they stay point estimates (plain ``bias`` parameters).

Noise: every draw goes through a :class:`NoiseBank` shared by the layers of one network. Inside a
``bank.fixed(key)`` block, the draw of a layer for a given key is stored and returned again on
every later draw with the same key -- this is how F-SGVB evaluates both SAM passes with the SAME
eps (flat_seeking_bnn Eq. 7), and how one posterior sample serves every evaluation batch. Fresh
draws come from ``bank.generator`` (the engine's per-rank, checkpointed generator once the method
is set up; the global torch RNG before that).

``bayesianize(module)`` swaps every ``nn.Linear`` and ``nn.Conv2d`` (zeros padding, any stride,
dilation, groups) for these layers in place. Not converted (stay deterministic point estimates,
trained by the optimiser with its weight decay): normalisation layers (BatchNorm, FRN, LayerNorm),
embeddings / class tokens, the projections inside ``nn.MultiheadAttention`` (it reads their weights
directly), and any other layer type (Conv1d/3d, ConvTranspose).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

ESTIMATORS = ("reparam", "lrt", "flipout")
MODES = ("sample", "mean")


class NoiseBank:
    """Standard-normal / Rademacher draws for the Bayesian layers of one network.

    ``mode``: ``"sample"`` (stochastic forward with each layer's estimator) or ``"mean"`` (weights =
    mu, no noise). ``predict``: force the weight-space ``reparam`` estimator (one weight sample for
    every batch inside one ``fixed`` block), whatever the training estimator.
    """

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator
        self.mode = "sample"
        self.predict = False
        self._key = None
        self._store: dict = {}

    # ------------------------------------------------------------ keys
    def clear(self) -> None:
        self._store.clear()

    @contextmanager
    def fixed(self, key):
        """Inside: draws are stored under ``key`` and replayed for the same key (until ``clear``)."""
        old, self._key = self._key, key
        try:
            yield
        finally:
            self._key = old

    @contextmanager
    def using(self, mode: str | None = None, predict: bool | None = None,
              generator: torch.Generator | None = None):
        """Temporarily change mode / predict flag / generator (restored on exit)."""
        saved = (self.mode, self.predict, self.generator)
        if mode is not None:
            if mode not in MODES:
                raise ValueError(f"noise bank mode must be one of {MODES}, got {mode!r}")
            self.mode = mode
        if predict is not None:
            self.predict = predict
        if generator is not None:
            self.generator = generator
        try:
            yield self
        finally:
            self.mode, self.predict, self.generator = saved

    # ------------------------------------------------------------ draws
    def _fresh(self, kind: str, shape, like: torch.Tensor) -> torch.Tensor:
        g = self.generator
        dev = g.device if g is not None else like.device
        if kind == "normal":
            t = torch.randn(shape, generator=g, device=dev, dtype=like.dtype)
        else:  # rademacher
            t = torch.randint(0, 2, shape, generator=g, device=dev).to(like.dtype).mul_(2).sub_(1)
        return t.to(like.device)

    def draw(self, slot, kind: str, shape, like: torch.Tensor) -> torch.Tensor:
        shape = tuple(shape)
        if self._key is None:
            return self._fresh(kind, shape, like)
        k = (self._key, slot, kind)
        t = self._store.get(k)
        if t is None or tuple(t.shape) != shape or t.dtype != like.dtype:
            t = self._fresh(kind, shape, like)
            self._store[k] = t
        return t

    def stored(self) -> dict:
        """The draws kept for the current step (tests inspect them)."""
        return dict(self._store)

    def __getstate__(self):  # deepcopy / pickle: no stored noise, no generator
        return {"generator": None, "mode": self.mode, "predict": self.predict, "_key": None, "_store": {}}


def _rho_from_sigma(sigma: float) -> float:
    if sigma <= 0:
        raise ValueError(f"sigma_init must be > 0, got {sigma}")
    return float(sigma + math.log(-math.expm1(-sigma)))  # log(expm1(sigma)), stable for small/large


class _BayesianLayer(nn.Module):
    """Shared parameters and estimators; subclasses supply ``_op(x, weight, bias)``."""

    def _init_posterior(self, weight: torch.Tensor, bias: torch.Tensor | None, sigma_init: float,
                        estimator: str, bank: NoiseBank, bayesian_bias: bool, slot: int) -> None:
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        rho0 = _rho_from_sigma(float(sigma_init))
        self.weight_mu = nn.Parameter(weight.detach().clone())
        self.weight_rho = nn.Parameter(torch.full_like(weight.detach(), rho0))
        self.bayesian_bias = bool(bayesian_bias) and bias is not None
        if bias is None:
            self.register_parameter("bias_mu", None)
            self.register_parameter("bias_rho", None)
            self.register_parameter("bias", None)
        elif self.bayesian_bias:
            self.bias_mu = nn.Parameter(bias.detach().clone())
            self.bias_rho = nn.Parameter(torch.full_like(bias.detach(), rho0))
            self.register_parameter("bias", None)
        else:
            self.register_parameter("bias_mu", None)
            self.register_parameter("bias_rho", None)
            self.bias = nn.Parameter(bias.detach().clone())
        self.estimator = estimator
        self.slot = slot
        object.__setattr__(self, "bank", bank)  # a plain attribute, not a submodule

    # ------------------------------------------------------------ posterior
    @property
    def weight_sigma(self) -> torch.Tensor:
        return F.softplus(self.weight_rho)

    @property
    def bias_sigma(self) -> torch.Tensor | None:
        return F.softplus(self.bias_rho) if self.bias_rho is not None else None

    def posterior_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(mu, rho) parameter pairs of this layer."""
        pairs = [(self.weight_mu, self.weight_rho)]
        if self.bias_mu is not None:
            pairs.append((self.bias_mu, self.bias_rho))
        return pairs

    def kl(self, prior_variance: float) -> torch.Tensor:
        """KL(q || N(0, prior_variance I)) summed over this layer's Bayesian weights (closed form)."""
        return sum(gaussian_kl(mu, F.softplus(rho), prior_variance) for mu, rho in self.posterior_pairs())

    def _mean_bias(self):
        return self.bias_mu if self.bias_mu is not None else self.bias

    # ------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bank = self.bank
        if bank.mode == "mean":
            return self._op(x, self.weight_mu, self._mean_bias())
        estimator = "reparam" if bank.predict else self.estimator
        w_sigma = self.weight_sigma
        if estimator == "reparam":
            w = self.weight_mu + w_sigma * bank.draw(self.slot, "normal", w_sigma.shape, w_sigma)
            b = self._mean_bias()
            if self.bias_mu is not None:
                b_sigma = self.bias_sigma
                b = self.bias_mu + b_sigma * bank.draw((self.slot, "b"), "normal", b_sigma.shape, b_sigma)
            return self._op(x, w, b)
        mean = self._op(x, self.weight_mu, self._mean_bias())
        if estimator == "lrt":
            b_var = self.bias_sigma ** 2 if self.bias_mu is not None else None
            var = self._op(x * x, w_sigma ** 2, b_var)
            std = var.float().clamp_min(1e-16).sqrt().to(mean.dtype)
            return mean + std * bank.draw(self.slot, "normal", mean.shape, mean)
        # flipout
        dw = w_sigma * bank.draw(self.slot, "normal", w_sigma.shape, w_sigma)
        s_in = bank.draw((self.slot, "in"), "rademacher", self._sign_shape(x, x.shape[self._channel_dim(x)]), x)
        s_out = bank.draw((self.slot, "out"), "rademacher", self._sign_shape(mean, mean.shape[self._channel_dim(mean)]),
                          mean)
        out = mean + self._op(x * s_in, dw, None) * s_out
        if self.bias_mu is not None:
            b_sigma = self.bias_sigma
            db = b_sigma * bank.draw((self.slot, "b"), "normal", b_sigma.shape, b_sigma)
            out = out + s_out * db.view(self._bias_view(mean))
        return out


class BayesLinear(_BayesianLayer):
    """``nn.Linear`` with a mean-field Gaussian posterior (``weight_mu``/``weight_rho``, ``bias_*``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, sigma_init: float = 1e-3,
                 estimator: str = "reparam", bank: NoiseBank | None = None, bayesian_bias: bool = True,
                 slot: int = 0, weight: torch.Tensor | None = None, bias_init: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if weight is None:
            ref = nn.Linear(in_features, out_features, bias=bias)
            weight, bias_init = ref.weight, ref.bias
        self._init_posterior(weight, bias_init if bias else None, sigma_init, estimator, bank or NoiseBank(),
                             bayesian_bias, slot)

    @classmethod
    def from_module(cls, m: nn.Linear, **kw) -> "BayesLinear":
        return cls(m.in_features, m.out_features, m.bias is not None, weight=m.weight, bias_init=m.bias, **kw)

    def _op(self, x, weight, bias):
        return F.linear(x, weight, bias)

    @staticmethod
    def _channel_dim(t):
        return -1

    @staticmethod
    def _sign_shape(t, channels):
        return (t.shape[0],) + (1,) * (t.dim() - 2) + (channels,) if t.dim() > 1 else (channels,)

    @staticmethod
    def _bias_view(t):
        return (-1,)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias_mu is not None or self.bias is not None}, estimator={self.estimator}")


class BayesConv2d(_BayesianLayer):
    """``nn.Conv2d`` (zeros padding) with a mean-field Gaussian posterior."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, *, sigma_init: float = 1e-3, estimator: str = "reparam",
                 bank: NoiseBank | None = None, bayesian_bias: bool = True, slot: int = 0,
                 weight: torch.Tensor | None = None, bias_init: torch.Tensor | None = None):
        super().__init__()
        ref = None
        if weight is None:
            ref = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias)
            weight, bias_init = ref.weight, ref.bias
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = tuple(weight.shape[-2:])
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self._init_posterior(weight, bias_init if bias else None, sigma_init, estimator, bank or NoiseBank(),
                             bayesian_bias, slot)

    @classmethod
    def from_module(cls, m: nn.Conv2d, **kw) -> "BayesConv2d":
        if m.padding_mode != "zeros":
            raise ValueError(f"bayesianize: Conv2d with padding_mode={m.padding_mode!r} is not supported")
        return cls(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation, m.groups,
                   m.bias is not None, weight=m.weight, bias_init=m.bias, **kw)

    def _op(self, x, weight, bias):
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    @staticmethod
    def _channel_dim(t):
        return 1

    @staticmethod
    def _sign_shape(t, channels):
        return (t.shape[0], channels) + (1,) * (t.dim() - 2)

    @staticmethod
    def _bias_view(t):
        return (1, -1) + (1,) * (t.dim() - 2)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, groups={self.groups}, estimator={self.estimator}")


def gaussian_kl(mu: torch.Tensor, sigma: torch.Tensor, prior_variance: float) -> torch.Tensor:
    """sum_i KL(N(mu_i, sigma_i^2) || N(0, s^2)) = 1/2 sum [(sigma^2 + mu^2)/s^2 - 1 - log sigma^2 + log s^2]."""
    s2 = float(prior_variance)
    var = sigma * sigma
    return 0.5 * ((var + mu * mu) / s2 - 1.0 - torch.log(var) + math.log(s2)).sum()


def bayesian_layers(module: nn.Module) -> list[_BayesianLayer]:
    return [m for m in module.modules() if isinstance(m, _BayesianLayer)]


def find_bank(module: nn.Module) -> NoiseBank | None:
    layers = bayesian_layers(module)
    return layers[0].bank if layers else None


def bayesianize(module: nn.Module, estimator: str = "reparam", sigma_init: float = 1e-3,
                bayesian_bias: bool = True, bank: NoiseBank | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` / ``nn.Conv2d`` of ``module`` (in place) by its Bayesian version.

    mu is copied from the layer's initialised weight; the layers share one :class:`NoiseBank`
    (returned by :func:`find_bank`). Raises if nothing was converted.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"method.estimator must be one of {ESTIMATORS}, got {estimator!r}")
    bank = bank or find_bank(module) or NoiseBank()
    kw = dict(sigma_init=sigma_init, estimator=estimator, bank=bank, bayesian_bias=bayesian_bias)
    slot = len(bayesian_layers(module))
    converted = 0
    for parent in list(module.modules()):
        if isinstance(parent, (nn.MultiheadAttention, _BayesianLayer)):
            continue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = BayesLinear.from_module(child, slot=slot, **kw)
            elif type(child) is nn.Conv2d:
                new = BayesConv2d.from_module(child, slot=slot, **kw)
            else:
                continue
            new.to(device=child.weight.device)
            setattr(parent, name, new)
            slot += 1
            converted += 1
    if type(module) in (nn.Linear, nn.Conv2d):
        raise ValueError("bayesianize: pass a container module (e.g. nn.Sequential(layer)), not a bare layer")
    if converted == 0 and not bayesian_layers(module):
        raise ValueError(f"bayesianize: {type(module).__name__} has no nn.Linear / nn.Conv2d to convert")
    return module


__all__ = ["BayesConv2d", "BayesLinear", "ESTIMATORS", "NoiseBank", "bayesian_layers", "bayesianize",
           "find_bank", "gaussian_kl"]
