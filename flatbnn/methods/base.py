"""The method seam: *what is done* with the gradient a flatness variant computed.

A ``Method`` owns the parameters it trains, its optimiser and scheduler, any posterior state
(moments, samples, members, mu/sigma), its checkpoint state, and ``predict`` -- a generator of
per-posterior-sample log-probabilities that the one evaluation routine turns into metrics.
The engine calls ``setup`` once, ``train_step`` per batch and ``on_epoch_end`` per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RunContext:
    """What the engine hands a method at setup."""

    model: nn.Module                 # forward module (possibly DDP-wrapped / compiled)
    module: nn.Module                # the raw backbone (for state, sampling weights)
    device: torch.device
    n_train: int                     # training-set size N (KL/posterior scaling)
    steps_per_epoch: int
    epochs: int
    optimizer_factory: Callable      # params -> torch.optim.Optimizer
    scheduler_factory: Callable | None  # (optimizer, total_steps, steps_per_epoch) -> LRScheduler
    label_smoothing: float = 0.0
    rank: int = 0
    world_size: int = 1
    generator: torch.Generator | None = None  # per-rank noise (SGLD, VI, bSAM), seeded by the engine
    channels_last: bool = False
    criterion: Callable | None = None      # (logits, targets) -> mean loss; default cross-entropy
    model_factory: Callable | None = None  # () -> a freshly initialised backbone (ensembles)
    train_loader: object = None            # training loader (BatchNorm refresh of sampled weights)
    val_loader: object = None              # the held-out split (dataset.val_split > 0; Laplace's grid search)
    all_reduce_mean: Callable | None = None  # tensor -> mean over DDP ranks, in place (BN stats)
    seed: int = 0
    eval_sample_chunk: int = 1             # weight samples per vmapped forward in predict_at_samples (1 = one by one)
    extra: dict = field(default_factory=dict)


class Method:
    name = "base"
    #: the engine runs ``trainer.epochs * epoch_multiplier`` epochs (deep ensembles: one schedule per member)
    epoch_multiplier = 1
    #: True for methods that perturb the weights themselves (bSAM, VOGN, VSAM, RandomSAM): composing them
    #: with a flatness variant would either ignore it or perturb twice, so any flatness but ``none`` is refused
    own_perturbation = False
    #: forward/backward passes per training step (bSAM, VSAM: their ascent and their descent), as a flatness
    #: variant's ``passes``; the cost estimates read it (flatbnn/reproduce/cost.py)
    passes = 1
    #: the fewest predictive samples ``method.num_samples`` may ask for (0 where the method then predicts with its
    #: mean); engine/validate.py reads it
    min_num_samples = 1
    #: the ``method.<key>`` constructor arguments that change only the predictive, never the trained weights:
    #: ``evaluate.py`` may override them on a finished run of this method (flatbnn/keyroles.py). A subclass adds
    #: its own (``predict_keys = Method.predict_keys + ("scale",)``); every other key of the method is a training key
    predict_keys: tuple[str, ...] = ("num_samples",)
    #: True where each posterior sample is a setting of the weights (``predict({}, k)`` sets them in turn: what
    #: sharpness and loss landscapes of samples need, scripts/analyze.py); False where the predictive draws its
    #: noise inside the forward pass (SGVB's local reparameterisation / flipout, MC dropout's masks)
    samples_weights = True
    #: the name of a predictive computed in closed form, not sampled (Laplace's probit): what the final line says
    #: instead of "1 sample"; None for a sampled (or point) predictive
    closed_form: str | None = None
    #: False for methods whose step keeps host-side state (counters, sample collection, member swaps): with
    #: ``trainer.cuda_graph=true`` their steps run eagerly (flatbnn/engine/graphed.py), with a one-line reason
    capturable = True
    #: the method class whose training this one repeats step for step (Laplace: MAP, then a post-hoc fit), or None:
    #: ``evaluate.py`` may evaluate a finished run of that class as this method (``method=laplace``)
    trains_like: type | None = None

    def __init__(self, num_samples: int = 1):
        self.num_samples = int(num_samples)
        self.ctx: RunContext | None = None
        self.optimizer = None
        self.scheduler = None
        self._correct = torch.zeros(())
        self._seen = 0
        self._record = False

    # ---------------------------------------------------------------- lifecycle
    def prepare_model(self, module: nn.Module) -> nn.Module:
        """Turn the freshly built backbone into what this method trains (e.g. mu/sigma layers).

        Called by the engine's model factory, before DDP / torch.compile wrap it; identity here.
        """
        return module

    @property
    def world_size(self) -> int:
        """Processes of the run (1 before setup): a method whose ascent runs per process multiplies its m by it."""
        return self.ctx.world_size if self.ctx is not None else 1

    def setup(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.model = ctx.model
        self.module = ctx.module
        self.optimizer = ctx.optimizer_factory(self.parameters())
        self.attach_scheduler()

    def check_flatness(self, flatness) -> None:
        """Called by ``Flatness.setup`` (and by the own-perturbation methods' ``train_step``, for direct API use)."""
        name = getattr(flatness, "name", "none")
        if self.own_perturbation and name != "none":
            raise ValueError(f"method={self.name} perturbs the weights itself (its own noise/ascent); "
                             f"it cannot be composed with flatness={name}: use flatness=none")

    def attach_scheduler(self) -> None:
        """The run's lr schedule over ``self.optimizer`` (every method's optimiser gets the same one). The engine
        calls it again on a resume that changes the schedule's shape (engine/run_dir.py: rebuild_schedule)."""
        ctx = self.ctx
        if ctx.scheduler_factory is not None:
            self.scheduler = ctx.scheduler_factory(
                self.optimizer, total_steps=ctx.epochs * ctx.steps_per_epoch,
                steps_per_epoch=ctx.steps_per_epoch)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """What the method trains, named (ASAM scales only ``*weight*`` tensors, as its official code)."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def parameters(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_parameters()]

    def train(self) -> None:
        self.model.train()

    def on_epoch_end(self, epoch: int) -> None:
        """Hook for posterior collection (SWAG moments, SGLD samples, ...)."""

    # ---------------------------------------------------------------- training
    @property
    def has_plain_loss(self) -> bool:
        """Whether this method keeps the inherited :meth:`loss_fn` (flatness.batched_chunks needs it; asked by
        duck typing, so the flatness layer does not import the methods)."""
        return type(self).loss_fn is Method.loss_fn

    def loss_fn(self, batch) -> torch.Tensor:
        """Mean NLL over the batch (forward only). Records train accuracy on the first call of a step."""
        x, y = batch
        logits = self.model(x)
        if self._record:
            self.count_correct(logits, y)
            self._seen += y.numel()
            self._record = False
        if self.ctx.criterion is not None:
            return self.ctx.criterion(logits, y)
        return F.cross_entropy(logits.float(), y, label_smoothing=self.ctx.label_smoothing)

    @torch.no_grad()
    def count_correct(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        """Add this batch's correct predictions to the running count. It stays on the device (read once per
        epoch: a .cpu() here would sync every step) and is accumulated IN PLACE: a captured CUDA graph keeps
        writing the tensor it saw, so rebinding ``_correct`` would silently freeze the count."""
        if logits.dim() != 2 or logits.shape[1] <= 1:
            return
        if self._correct.device != logits.device:
            self._correct = self._correct.to(logits.device)  # once: the first step on the device
        self._correct.add_((logits.argmax(1) == y).sum())

    def train_step(self, batch, flatness, backprop) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        self._record = True
        loss = flatness.gradient(self.named_parameters(), self.loss_fn, batch, backprop)
        backprop.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": loss}

    def pop_train_accuracy(self) -> tuple[float, int]:
        """(correct, seen) since the last call; the engine all-reduces these."""
        out = (float(self._correct), self._seen)
        self._correct.zero_()
        self._seen = 0
        return out

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def lr_ratio(self) -> float:
        """Current lr / the schedule's initial lr (drives ``flatness.rho_schedule=lr``; asked before every step)."""
        group = self.optimizer.param_groups[0]
        lr = self._host_lr(group["lr"])
        return lr / float(group.get("initial_lr", lr) or 1.0)

    def _host_lr(self, lr) -> float:
        """``lr`` as a host float without a device read where the host value is known: under trainer.cuda_graph
        the lr is a device tensor the scheduler fills from host values (issue 41: ``float()`` of it was a sync per
        step), and a ``LambdaLR`` (every schedule in flatbnn/optim/schedulers.py) gives that value again, the same
        ``base_lr * factor(step)`` it filled in."""
        if not torch.is_tensor(lr):
            return float(lr)
        s = self.scheduler
        if isinstance(s, torch.optim.lr_scheduler.LambdaLR) and not torch.is_tensor(s.base_lrs[0]):
            return s.base_lrs[0] * s.lr_lambdas[0](s.last_epoch)
        return float(lr)  # another scheduler or none: a device read

    # ---------------------------------------------------------------- prediction
    @torch.no_grad()
    def forward_log_probs(self, module: nn.Module, loader) -> torch.Tensor:
        """log-softmax of ``module`` over ``loader`` (in loader order), on the CPU, float32."""
        out = []
        for x, _ in loader:
            x = x.to(self.ctx.device, non_blocking=True)
            if self.ctx.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            out.append(torch.log_softmax(module(x).float(), dim=1).cpu())
        return torch.cat(out)

    def log_probs_on(self, loaders: dict) -> dict[str, torch.Tensor]:
        """One prediction of ``self.module`` as it stands: ``{set name: log-probabilities}`` for every loader."""
        return {name: self.forward_log_probs(self.module, loader) for name, loader in loaders.items()}

    def predict(self, loaders: dict, num_samples: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Yield, per posterior sample, ``{set name: [N, C] log-probabilities}`` for every loader.

        One weight sample serves all sets (test, OOD, corruptions), so their metrics are coherent.
        """
        raise NotImplementedError

    @torch.no_grad()
    def predict_at_samples(self, loaders: dict, num_samples: int, draw: Callable) -> Iterator[dict]:
        """Predictions at ``num_samples`` weight samples ``draw(generator, mean) -> weights`` around the
        current weights (generator seeded with ``self.eval_seed``: every evaluation sees the same samples);
        the weights are restored afterwards, also if the consumer stops early."""
        params = self.parameters()
        mean = [p.detach().clone() for p in params]
        g = torch.Generator(device=self.ctx.device).manual_seed(self.eval_seed)
        chunk = max(int(self.ctx.eval_sample_chunk or 1), 1)
        if chunk > 1 and not any(m.training for m in self.module.modules()):
            yield from self._predict_stacked(loaders, num_samples, draw, g, mean, chunk)
            return
        try:
            for _ in range(num_samples):
                for p, w in zip(params, draw(g, mean)):
                    p.copy_(w)
                yield self.log_probs_on(loaders)
        finally:
            for p, w in zip(params, mean):
                p.copy_(w)

    def _predict_stacked(self, loaders: dict, num_samples: int, draw: Callable, g: torch.Generator,
                         mean: list[torch.Tensor], chunk: int) -> Iterator[dict]:
        """predict_at_samples with ``chunk`` weight samples per forward (``torch.func.vmap`` over stacked
        weights; ``trainer.eval_sample_chunk``): the same samples in the same generator order, so the same
        predictive up to float rounding. Only for an eval-mode module (BatchNorm from its running statistics:
        a BN refresh per sample, as SWAG's, is a training pass and stays one by one). Weights are never written
        into the module, so nothing needs restoring."""
        from torch.func import functional_call, vmap

        names = [n for n, _ in self.named_parameters()]

        def logits(weights, x):
            return functional_call(self.module, weights, (x,))

        done = 0
        while done < num_samples:
            c = min(chunk, num_samples - done)
            samples = [draw(g, mean) for _ in range(c)]
            stacked = {n: torch.stack([w[i] for w in samples]) for i, n in enumerate(names)}
            del samples
            per_set = {}
            for name, loader in loaders.items():
                out = []
                for x, _ in loader:
                    x = x.to(self.ctx.device, non_blocking=True)
                    if self.ctx.channels_last and x.dim() == 4:
                        x = x.contiguous(memory_format=torch.channels_last)
                    out.append(torch.log_softmax(vmap(logits, in_dims=(0, None))(stacked, x).float(), dim=-1).cpu())
                per_set[name] = torch.cat(out, dim=1)  # [c, N, C]
            for j in range(c):
                yield {name: lp[j] for name, lp in per_set.items()}
            done += c

    def monitor(self, loaders: dict) -> Iterator[dict[str, torch.Tensor]]:
        """Cheap per-epoch view for metrics.jsonl: the current weights, one pass (no sampling)."""
        self.module.eval()
        yield self.log_probs_on(loaders)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def describe(self) -> dict:
        return {"name": self.name, "num_samples": self.num_samples}
