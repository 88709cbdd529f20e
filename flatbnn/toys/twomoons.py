"""Two moons with a small MLP (bSAM paper, App. F.2 / Fig. 6): SAM vs bSAM predictive uncertainty.

Data: ``sklearn.datasets.make_moons(100, noise=0.1, random_state=1)`` (the authors' ``demo2d.py``
seeds numpy with 1 and draws the same set). Model: flatbnn's MLP 2-32-32-32-32-1 with ELU (the
official code's MLP non-linearity), one logit, binary cross-entropy. Both methods train on batches of
30 with the last short batch of each epoch skipped, for ``epochs + 1`` epochs with the per-epoch
cosine factor 0.5 (1 + cos(pi epoch / epochs)) -- the authors' demo loop.

* bSAM: flatbnn's ``BSAM`` method with the demo's values (alpha 0.5, beta1 0.9, beta2 0.999,
  rho 0.05, damping 0.1, M = 5, s_init 1, delta = 1e-4 i.e. prior precision 0.01 for N = 100).
* SAM: flatbnn's ``MAP`` method (SGD, momentum 0.9, weight decay delta) x flatbnn's ``SAM`` flatness
  with the same split M = 5; the paper gives no SAM settings for this figure (ours: lr 0.05, rho 0.05).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from flatbnn.models.mlp import MLP

CPU = torch.device("cpu")
N_DATA = 100
BATCH = 30
DELTA = 1e-4          # the demo's wdecay, = prior precision / N
BSAM_HP = dict(lr=0.5, beta1=0.9, beta2=0.999, rho=0.05, damping=0.1, s_init=1.0, m=5)
SAM_HP = dict(lr=0.05, momentum=0.9, rho=0.05, m=5)


def make_data(n: int = N_DATA, noise: float = 0.1, random_state: int = 1):
    from sklearn.datasets import make_moons
    X, y = make_moons(n, noise=noise, random_state=random_state)
    return torch.as_tensor(X, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)


def make_model(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(2, 1, hidden=(32, 32, 32, 32), activation="elu")


def _bce(logits, y):
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), y)


class _EpochCosine:
    """The demo's per-epoch factor 0.5 (1 + cos(pi e / E)), e = 0..E, as a per-step LambdaLR."""

    def __init__(self, epochs: int, steps_per_epoch: int):
        self.epochs, self.spe = epochs, steps_per_epoch

    def __call__(self, step: int) -> float:
        e = min(step // self.spe, self.epochs)
        return 0.5 * (1.0 + math.cos(math.pi * e / self.epochs))


def _context(module, epochs, steps_per_epoch, seed, optimizer_factory=None):
    from flatbnn.methods import RunContext
    return RunContext(
        model=module, module=module, device=CPU, n_train=N_DATA, steps_per_epoch=steps_per_epoch,
        epochs=epochs + 1, optimizer_factory=optimizer_factory, criterion=_bce, seed=seed,
        generator=torch.Generator().manual_seed(10_000 + seed),
        scheduler_factory=lambda opt, total_steps, steps_per_epoch: torch.optim.lr_scheduler.LambdaLR(
            opt, _EpochCosine(epochs, steps_per_epoch)))


def _train(method, flatness, module, X, y, epochs, seed):
    from flatbnn.engine.backprop import Backprop
    bp = Backprop(module, CPU)
    g = torch.Generator().manual_seed(20_000 + seed)
    for _ in range(epochs + 1):
        perm = torch.randperm(len(y), generator=g)
        for start in range(0, len(y), BATCH):
            idx = perm[start:start + BATCH]
            if len(idx) != BATCH:  # the demo skips the irregular last batch
                continue
            method.train()
            method.train_step((X[idx], y[idx]), flatness, bp)


def train_bsam(X, y, epochs: int = 250, seed: int = 0, **overrides):
    from flatbnn.flatness import NoFlatness
    from flatbnn.methods.bsam import BSAM
    hp = {**BSAM_HP, **overrides}
    module = make_model(seed)
    method = BSAM(prior_precision=DELTA * N_DATA, num_samples=0, **hp)
    method.setup(_context(module, epochs, len(y) // BATCH, seed))
    _train(method, NoFlatness(), module, X, y, epochs, seed)
    return method


def train_sam(X, y, epochs: int = 250, seed: int = 0, **overrides):
    from flatbnn.flatness import SAM
    from flatbnn.methods import MAP
    hp = {**SAM_HP, **overrides}
    module = make_model(seed)
    method = MAP()
    method.setup(_context(module, epochs, len(y) // BATCH, seed, optimizer_factory=lambda p: torch.optim.SGD(
        p, lr=hp["lr"], momentum=hp["momentum"], weight_decay=DELTA)))
    _train(method, SAM(rho=hp["rho"], m=hp["m"]), module, X, y, epochs, seed)
    return method


@torch.no_grad()
def predictive(method, Xq: torch.Tensor, num_samples: int = 0, seed: int = 1) -> np.ndarray:
    """p(y=1|x): plug-in at the mean weights (``num_samples=0``) or the average of sigmoid over
    samples of the method's posterior (bSAM: w + n sqrt(1/(N s)))."""
    module = method.module
    module.eval()
    if num_samples == 0:
        return torch.sigmoid(module(Xq).squeeze(-1)).double().numpy()
    params = method.parameters()
    mean = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros(len(Xq), dtype=torch.float64)
    try:
        for _ in range(num_samples):
            method._assign(params, method.sample_weights(g, mean))
            total += torch.sigmoid(module(Xq).squeeze(-1)).double()
    finally:
        method._assign(params, mean)
    return (total / num_samples).numpy()


def binary_entropy(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log(p) + (1 - p) * np.log(1 - p))
