"""Laplace: a post-hoc Gaussian around the trained weights (Daxberger et al., "Laplace Redux -- Effortless Bayesian
Deep Learning", NeurIPS 2021), through ``laplace-torch`` (MIT; the ``[laplace]`` extra: BackPACK, curvlinops, asdl).

Training is MAP's, step for step (``trains_like``): the ``optimizer`` group's optimiser on the mean NLL, through
whatever flatness variant the run composes -- ``method=laplace flatness=sam`` is F-Laplace, a Laplace around a SAM
solution. At the first prediction after training (the final evaluation; ``evaluate.py`` on a finished run), the
Laplace is fitted on the trained weights theta*:

    p(theta | D) ~ N(theta*, (H + P0)^-1),   H = sum_i GGN of the NLL of example i at theta*   (curvlinops' GGN)

over the training set (in its order, as the data set serves it at the last epoch: with its augmentation where it
has one), for the weights ``subset_of_weights`` names (``last_layer``: the last Linear layer, found by
laplace-torch; ``all``) with the structure ``hessian_structure`` (``diag`` or ``kron``: KFAC). The prior precision
P0 = ``prior_init`` * I is then tuned by maximising the log marginal likelihood (``prior_fit=marglik``: Adam on
log P0, ``marglik_steps`` steps at ``marglik_lr``, laplace-torch's ``optimize_prior_precision``; ``gridsearch``:
the scalar P0 of ``grid_size`` values log-spaced over 10^``grid_min`` .. 10^``grid_max`` whose predictive has the
lowest NLL on the held-out split ``dataset.val_split`` -- laplace-torch's validation grid search, for when marglik's
prior leaves the predictive under-confident; ``none`` keeps ``prior_init``), as ``prior_structure`` (``scalar``:
one P0; ``layerwise``; ``diag``; the grid search is scalar only).

Predictive (``pred_type``): ``glm`` -- the linearised network, f(x) ~ N(f*(x), J P^-1 J^T), turned into class
probabilities by ``link_approx`` (``probit``: the closed form, one predictive, ``num_samples`` unused; ``mc``:
``num_samples`` samples of f); ``nn`` -- ``num_samples`` weight samples from the posterior, each a forward pass
of the network (one weight sample serves every evaluation set). Samples come from a generator seeded with
``eval_seed``. Every key of this method but ``num_samples``' meaning is a prediction key: ``evaluate.py`` may
change them on a finished run, and may turn a finished MAP run (SGD, Adam, SAM, FSAM, ...) into a Laplace one
with ``method=laplace`` -- the same training, nothing retrained.

A missing laplace-torch stops the run when the method is built, in one line naming the extra.
"""

from __future__ import annotations

import time
import warnings

import torch

from flatbnn.methods.map import MAP
from flatbnn.methods.base import Method
from flatbnn.methods.param_vector import copy_flat_, flatten

SUBSETS = ("last_layer", "all")
STRUCTURES = ("diag", "kron")
PRIOR_FITS = ("marglik", "gridsearch", "none")
PRIOR_STRUCTURES = ("scalar", "layerwise", "diag")
PRED_TYPES = ("glm", "nn")
LINKS = ("probit", "mc", "bridge", "bridge_norm")
MISSING = ("method=laplace needs laplace-torch (MIT): pip install 'flatbnn[laplace]' (or pip install "
           "'laplace-torch>=0.3,<0.4')")


def import_laplace():
    """The ``laplace`` package, or an ImportError of one line naming the extra (train.py / evaluate.py: exit 2)."""
    import logging

    root = logging.getLogger()
    level = root.level
    try:
        # its import logs an INFO line on the root logger about an optional backend it does not find, and BackPACK
        # warns about torch.jit.script: neither concerns the curvlinops backend used here
        root.setLevel(max(level, logging.WARNING))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            import laplace
    except ImportError:
        raise ImportError(MISSING) from None
    finally:
        root.setLevel(level)
    return laplace


def validation_nll(probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean NLL of one prior's predictive on the whole held-out split. Passed to laplace-torch's grid search as a
    callable (scored afresh at each prior): its default, a running torchmetrics NLL, is never reset between the
    priors in laplace-torch 0.3, so each prior is scored by the mean over it and every prior before it and the
    search returns the argmin of that running mean (tests/test_laplace.py shows the two apart)."""
    return torch.nn.functional.nll_loss(probs.clamp_min(torch.finfo(probs.dtype).tiny).log(), targets)


class Laplace(Method):
    name = "laplace"
    #: trained as MAP, step for step: evaluate.py may fit a Laplace on a finished run of this class
    trains_like = MAP
    min_num_samples = 1
    samples_weights = False  # laplace-torch holds the posterior (a last-layer or GLM predictive is no weight set)
    predict_keys = Method.predict_keys + ("subset_of_weights", "hessian_structure", "prior_fit", "prior_init",
                                          "prior_structure", "marglik_steps", "marglik_lr", "pred_type",
                                          "link_approx", "eval_seed", "grid_min", "grid_max", "grid_size")

    def __init__(self, subset_of_weights: str = "last_layer", hessian_structure: str = "kron",
                 prior_fit: str = "marglik", prior_init: float = 1.0, prior_structure: str = "scalar",
                 marglik_steps: int = 100, marglik_lr: float = 0.1, pred_type: str = "glm",
                 link_approx: str = "probit", num_samples: int = 1, eval_seed: int = 1,
                 grid_min: float = -4.0, grid_max: float = 4.0, grid_size: int = 100):
        for key, value, allowed in (("subset_of_weights", subset_of_weights, SUBSETS),
                                    ("hessian_structure", hessian_structure, STRUCTURES),
                                    ("prior_fit", prior_fit, PRIOR_FITS),
                                    ("prior_structure", prior_structure, PRIOR_STRUCTURES),
                                    ("pred_type", pred_type, PRED_TYPES), ("link_approx", link_approx, LINKS)):
            if value not in allowed:
                raise ValueError(f"method.{key} must be one of {allowed}, got {value!r}")
        if pred_type == "nn" and link_approx != "mc":
            raise ValueError("method.pred_type=nn samples weights: it takes method.link_approx=mc only")
        if subset_of_weights == "last_layer" and prior_structure == "layerwise":
            raise ValueError("method.prior_structure=layerwise needs method.subset_of_weights=all (a last-layer "
                             "Laplace takes a scalar or diag prior)")
        if not prior_init > 0:
            raise ValueError(f"method.prior_init must be > 0 (a precision), got {prior_init}")
        if int(marglik_steps) < 1 and prior_fit == "marglik":
            raise ValueError(f"method.marglik_steps must be >= 1, got {marglik_steps}")
        if prior_fit == "gridsearch" and prior_structure != "scalar":
            raise ValueError("method.prior_fit=gridsearch searches one scalar prior precision: it takes "
                             f"method.prior_structure=scalar, got {prior_structure!r}")
        if prior_fit == "gridsearch" and not (int(grid_size) >= 2 and float(grid_min) < float(grid_max)):
            raise ValueError(f"method.grid_size must be >= 2 and method.grid_min < method.grid_max (log10 bounds), "
                             f"got {grid_size}, {grid_min}, {grid_max}")
        super().__init__(num_samples=num_samples)
        import_laplace()  # before any data is read: one line if the extra is missing
        self.subset_of_weights, self.hessian_structure = subset_of_weights, hessian_structure
        self.prior_fit, self.prior_init, self.prior_structure = prior_fit, float(prior_init), prior_structure
        self.marglik_steps, self.marglik_lr = int(marglik_steps), float(marglik_lr)
        self.pred_type, self.link_approx, self.eval_seed = pred_type, link_approx, int(eval_seed)
        self.grid_min, self.grid_max, self.grid_size = float(grid_min), float(grid_max), int(grid_size)
        self.la = None  # the fitted laplace-torch object (after training; refitted after any further step)
        self.fit_seconds: float | None = None

    def setup(self, ctx) -> None:
        if self.prior_fit == "gridsearch" and ctx.val_loader is None:
            raise ValueError("method.prior_fit=gridsearch picks the prior on a held-out split: train with "
                             "dataset.val_split=<examples held out>, e.g. dataset.val_split=5000")
        super().setup(ctx)

    @property
    def closed_form(self) -> str | None:
        """The name of a closed-form predictive (one predictive, no sample), else None."""
        return f"closed form, {self.link_approx}" if self.pred_type == "glm" and self.link_approx != "mc" else None

    # ---------------------------------------------------------------- training: MAP's
    def train_step(self, batch, flatness, backprop) -> dict:
        self.la = None
        return super().train_step(batch, flatness, backprop)

    def load_state_dict(self, state: dict) -> None:
        self.la = None
        super().load_state_dict(state)

    # ---------------------------------------------------------------- the fit
    @staticmethod
    def _whole(loader, what: str):
        """``loader``'s whole data set in order, in its batch size (every DDP rank sees all of it: one fit)."""
        from torch.utils.data import DataLoader

        dataset = getattr(loader, "dataset", None)
        if dataset is None:
            raise ValueError(f"method=laplace: the {what} loader has no dataset to read in order (the Laplace fit "
                             f"and the prior's grid search each need the whole set)")
        return DataLoader(dataset, batch_size=getattr(loader, "batch_size", None) or 256, shuffle=False)

    def fit_loader(self):
        """The training set in order, batched as in training (the GGN sums over it; N = its length)."""
        return self._whole(self.ctx.train_loader, "training")

    def fit(self, loader=None):
        """Fit laplace-torch's Laplace on the current weights and tune its prior; returns it."""
        laplace = import_laplace()
        self.module.eval()
        t0 = time.perf_counter()
        la = laplace.Laplace(self.module, "classification", subset_of_weights=self.subset_of_weights,
                             hessian_structure=self.hessian_structure, prior_precision=self.prior_init)
        la.fit(loader if loader is not None else self.fit_loader())
        if self.prior_fit == "marglik":
            with warnings.catch_warnings():  # its reminder to predict with the link_approx named here
                warnings.simplefilter("ignore", UserWarning)
                la.optimize_prior_precision(pred_type=self.pred_type, method="marglik", n_steps=self.marglik_steps,
                                            lr=self.marglik_lr, init_prior_prec=self.prior_init,
                                            prior_structure=self.prior_structure, link_approx=self.link_approx)
        elif self.prior_fit == "gridsearch":  # the lowest validation NLL of the predictive this run predicts with
            # link_approx=mc samples from the global generator inside laplace-torch: seeded here, so that a rerun
            # (evaluate.py, a resumed run) picks the same prior, and the caller's random stream is left as it was
            cuda = [self.ctx.device] if self.ctx.device.type == "cuda" else []
            with warnings.catch_warnings(), torch.random.fork_rng(devices=cuda):
                warnings.simplefilter("ignore", UserWarning)
                torch.manual_seed(self.eval_seed)
                la.optimize_prior_precision(pred_type=self.pred_type, method="gridsearch",
                                            val_loader=self._whole(self.ctx.val_loader, "validation"),
                                            log_prior_prec_min=self.grid_min, log_prior_prec_max=self.grid_max,
                                            grid_size=self.grid_size, link_approx=self.link_approx,
                                            n_samples=max(self.num_samples, 1), loss=validation_nll)
        self.la = la
        self.fit_seconds = time.perf_counter() - t0
        return la

    # ---------------------------------------------------------------- prediction
    def _inputs(self, loader):
        for x, _ in loader:
            x = x.to(self.ctx.device, non_blocking=True)
            if self.ctx.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x

    @staticmethod
    def _log(p: torch.Tensor) -> torch.Tensor:
        return torch.log(p.float().clamp_min(torch.finfo(torch.float32).tiny)).cpu()

    def predict(self, loaders, num_samples=None):
        k = self.num_samples if num_samples is None else int(num_samples)
        la = self.la if self.la is not None else self.fit()
        self.module.eval()
        g = torch.Generator(device=self.ctx.device).manual_seed(self.eval_seed)
        if self.pred_type == "nn":
            yield from self._predict_nn(la, loaders, k, g)
            return
        if self.closed_form:  # probit / bridge: one predictive
            yield {name: torch.cat([self._log(la(x, pred_type="glm", link_approx=self.link_approx))
                                    for x in self._inputs(loader)]) for name, loader in loaders.items()}
            return
        per_set = {name: torch.cat([la.predictive_samples(x, pred_type="glm", n_samples=k, generator=g).cpu()
                                    for x in self._inputs(loader)], dim=1) for name, loader in loaders.items()}
        for i in range(k):
            yield {name: self._log(s[i]) for name, s in per_set.items()}

    @torch.no_grad()
    def _predict_nn(self, la, loaders, k, g):
        """k weight samples (laplace-torch's ``sample``), each written into the Laplace's weights (the last layer
        of its copy of the network, or all of ours) and run over every set; the MAP weights are put back."""
        params = list(la.model.last_layer.parameters()) if self.subset_of_weights == "last_layer" else list(la.params)
        mean = flatten(params)
        try:
            for sample in la.sample(k, generator=g):
                copy_flat_(params, sample)
                yield {name: self.forward_log_probs(la.model, loader) for name, loader in loaders.items()}
        finally:
            copy_flat_(params, mean)

    # ---------------------------------------------------------------- record
    def describe(self) -> dict:
        out = {"name": self.name, "num_samples": self.num_samples, "subset_of_weights": self.subset_of_weights,
               "hessian_structure": self.hessian_structure, "prior_fit": self.prior_fit, "prior_init": self.prior_init,
               "prior_structure": self.prior_structure, "marglik_steps": self.marglik_steps,
               "marglik_lr": self.marglik_lr, "pred_type": self.pred_type, "link_approx": self.link_approx,
               "eval_seed": self.eval_seed, "trained_as": "map", "library": "laplace-torch (MIT)",
               **({"grid_min": self.grid_min, "grid_max": self.grid_max, "grid_size": self.grid_size}
                  if self.prior_fit == "gridsearch" else {})}
        if self.la is not None:
            prior = self.la.prior_precision.detach().flatten().double().cpu()
            with torch.no_grad():
                lml = float(self.la.log_marginal_likelihood())
            from importlib.metadata import version
            out.update({"prior_precision": prior.tolist() if prior.numel() <= 64 else
                        {"mean": float(prior.mean()), "min": float(prior.min()), "max": float(prior.max())},
                        "log_marginal_likelihood": lml, "n_params": int(self.la.n_params),
                        "fit_seconds": self.fit_seconds,
                        "laplace_torch": version("laplace-torch")})
        return out
