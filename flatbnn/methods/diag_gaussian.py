"""Shared base of the methods whose diagonal Gaussian posterior lives in their own optimiser state
(``method=bsam``, ``method=vogn``, ``method=ivon``): q(w) = N(w, diag(std^2)) with std from the optimiser.

What the base does:

* builds the method's own optimiser (``build_optimizer``) instead of the ``optimizer`` group
  (which such a run ignores); the ``scheduler`` group still multiplies its lr (``lr_factor``);
* refuses any ``flatness`` other than ``none`` -- the method perturbs the weights itself
  (``own_perturbation``; one-line ValueError from ``Flatness.setup``, and from ``train_step`` for
  direct API use); IVON sets ``own_perturbation = False``: its sampled weights are where a flatness
  variant starts;
* training noise comes from the engine's per-rank generator (``ctx.generator``, checkpointed per
  rank by the engine), or an own generator when none is given; its state is also kept in
  ``state_dict`` so a state round trip alone resumes exactly;
* the m-sharpness parts of a step (bSAM's and VOGN's ``m``) run one after another (the loop) or all at once
  (``batched_parts``: one ``torch.func.vmap`` forward over the parts, each with its own weights, and one backward):
  the same step up to the order of float sums. ``auto`` takes the measured rule :func:`batched_by_default`;
* ``predict`` yields ``num_samples`` weight samples w + std * n from a fixed evaluation seed (the
  same weights on every DDP rank and after any resume); ``num_samples = 0`` predicts with the mean
  w alone (the papers' "mean" metrics). BatchNorm running statistics are used as trained (no
  refresh; the bSAM code does none).
"""

from __future__ import annotations

import torch
from torch import nn

from flatbnn import runlog
from flatbnn.flatness.batched import parts_forward, parts_losses
from flatbnn.methods.base import Method
from flatbnn.methods.param_vector import flatten, unflatten
from flatbnn.nn.parts_linear import row_linear_layers

BATCHED_PARTS = ("auto", True, False)


def batch_size(batch) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.shape[0])


def batched_by_default(device: torch.device, linear_only: bool = False) -> bool:
    """``batched_parts=auto``: batched on a GPU; on a CPU only where every parameter is a Linear's (``linear_only``: the
    parts-Linear path, flatbnn/nn/parts_linear.py), the loop elsewhere. Why, measured (issue 52): on a GPU the small
    nets' step is bound by kernel launches, and the batched step launches several times fewer
    (tests/test_kernel_counts.py); on one CPU thread the parts-Linear path beats the loop for bSAM and VOGN on the MNIST
    MLP (results/bench/cpu-2026-11-29-mnist-mlp-b200-partslinear.md), and on every conv net measured quiet the
    ``torch.func.vmap`` parts are slower than the loop or tie with it, for both methods (and SAM's batched chunks):
    VOGN m = 8 106 vs 128 ms on the classic LeNet-5 at 3x32x32, 2.21 vs 2.72 s on ResNet-20-FRN at batch 128, a tie
    within the noise at 1x28x28 (100 vs 97 ms, rounds spread 30 %; results/bench/cpu-2026-11-30-*-parts-paths.md),
    105 vs 144 ms on the bSAM LeNet-5 (results/bench/cpu-2026-11-29-fashion_mnist-lenet5bsam-b200-2339ebe.md)."""
    return device.type == "cuda" or linear_only


class DiagonalGaussianMethod(Method):
    name = "diag_gaussian"
    own_perturbation = True
    min_num_samples = 0  # num_samples=0 predicts with the mean
    predict_keys = Method.predict_keys + ("eval_seed",)

    def __init__(self, num_samples: int = 32, n_data_factor: float = 1.0, eval_seed: int = 1,
                 batched_parts: str | bool = "auto"):
        if isinstance(batched_parts, str) and batched_parts.lower() in ("true", "false"):
            batched_parts = batched_parts.lower() == "true"
        if batched_parts not in BATCHED_PARTS:
            raise ValueError(f"method.batched_parts must be auto, true or false, got {batched_parts!r}")
        if int(num_samples) < 0:
            raise ValueError(f"method.num_samples must be >= 0 (0 = predict with the mean), got {num_samples}")
        if n_data_factor <= 0:
            raise ValueError(f"method.n_data_factor must be > 0, got {n_data_factor}")
        super().__init__(num_samples=int(num_samples))
        self.n_data_factor = float(n_data_factor)
        self.eval_seed = int(eval_seed)
        self.generator: torch.Generator | None = None
        self.batched_parts = batched_parts
        self._noise_buffer: torch.Tensor | None = None
        self._told: set[str] = set()
        self._linear: list[nn.Linear] | None | bool = False  # parts_linear_layers(): False = not decided yet
        self.parts_taken: set[str] = set()  # the paths parts_path() chose (describe(): which made the steps)

    # ---------------------------------------------------------------- update
    def apply_update(self, params, grads, curvature, backprop) -> None:
        """Hand the (all-reduced) gradient and curvature to the optimiser; clipping as the engine does."""
        for p, g in zip(params, grads):
            p.grad = g
        if backprop.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, backprop.grad_clip)
        self.optimizer.step(curvature=curvature)
        for p in params:
            p.grad = None

    # ---------------------------------------------------------------- lifecycle
    def build_optimizer(self, params, n_data: float) -> torch.optim.Optimizer:
        raise NotImplementedError

    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.model = ctx.model
        self.module = ctx.module
        self.n_data = float(ctx.n_train) * self.n_data_factor
        self.optimizer = self.build_optimizer(self.parameters(), self.n_data)
        self.attach_scheduler()
        self.generator = ctx.generator
        if self.generator is None:
            self.generator = torch.Generator(device=ctx.device).manual_seed(
                ctx.seed * 1_000_003 + 4_242 + 7_919 * ctx.rank)
        self.check_batched()  # what the model and the processes decide: before the first step

    # ---------------------------------------------------------------- the m parts of a step
    def batched_refusal(self, precision_fp16: bool = False) -> str | None:
        """Why the parts cannot run batched here (one line), or None. Subclasses add their own reasons."""
        module = self.module
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
            return "BatchNorm (batched running statistics are not implemented)"
        if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()):
            return "active dropout (vmap would draw other masks than the loop)"
        if self.ctx.world_size > 1:
            return "DDP (the parts run per process in the loop)"
        if precision_fp16:
            return "fp16 (the loss scaling is not threaded through)"
        return None

    def check_batched(self, precision_fp16: bool = False) -> None:
        """``batched_parts=true`` where it cannot run: a one-line ValueError (setup, and the first step for fp16)."""
        if self.batched_parts is True:
            why = self.batched_refusal(precision_fp16)
            if why is not None:
                raise ValueError(f"method.batched_parts=true: {why}; use method.batched_parts=false or auto")

    def parts_path(self, batch, parts: int, backprop) -> str:
        """How this step's ``parts`` run: "loop" (one after another), "linear" (one forward and one backward, each
        Linear a batched product per part: flatbnn/nn/parts_linear.py) or "vmap" (``torch.func.vmap`` over the parts).
        ``batched_parts`` decides (auto: :func:`batched_by_default`) where possible; a batch that ``parts`` does not
        divide (the short last one) takes the loop, its exact step. Said once in train.log."""
        if parts <= 1 or batch_size(batch) % parts:
            return "loop"  # not recorded: m = 1, or an epoch's short last batch
        why = None
        if self.batched_parts is not False:
            self.check_batched(backprop.scaler is not None)  # true where it cannot run: one line
            why = self.batched_refusal(backprop.scaler is not None)  # before the probe forward: DDP, BatchNorm, ...
            if why is not None and batched_by_default(self.ctx.device):
                self.note_once(f"method={self.name}: the m parts run one after another (batched_parts=auto): {why}")
        if self.batched_parts is False or why is not None:
            self.parts_taken.add("loop")
            return "loop"
        linear = self.parts_linear_layers(self.parameters(), backprop, batch[0])
        if self.batched_parts == "auto" and not batched_by_default(self.ctx.device, linear is not None):
            self.parts_taken.add("loop")
            return "loop"
        path = "vmap" if linear is None else "linear"
        self.parts_taken.add(path)
        self.note_once(f"method={self.name}: the m parts run batched: " + (
            "torch.func.vmap over the parts" if linear is None else
            "one forward and one backward over the whole batch, each Linear a batched product per part"))
        return path

    def note_once(self, line: str) -> None:
        """``line`` in the run's train.log (and stderr), once per run."""
        if line not in self._told:
            self._told.add(line)
            runlog.note(line)

    def parts_buffer(self, parts: int, params: list[torch.Tensor]) -> torch.Tensor:
        """A [parts, P] buffer allocated once (a captured graph needs fixed addresses)."""
        shape = (parts, sum(p.numel() for p in params))
        buf, like = self._noise_buffer, params[0]
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._noise_buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    def noise_parts(self, parts: int, params: list[torch.Tensor], mean: torch.Tensor | None = None) -> torch.Tensor:
        """[parts, P] posterior noise std * n for this step's parts (``PrecisionOptimizer.sample_noise_parts``: one
        draw over all of ``params``), or with ``mean`` ([P]) each part's noisy weights mean + std * n (the same draw,
        one multiply-add instead of two passes), in :meth:`parts_buffer`."""
        return self.optimizer.sample_noise_parts(self.generator, self.parts_buffer(parts, params), mean)

    def parts_linear_layers(self, params: list[torch.Tensor], backprop, x: torch.Tensor) -> list[nn.Linear] | None:
        """The ``nn.Linear`` layers holding every one of ``params`` where the batched parts can run as one forward and
        one backward with a batched product per layer (flatbnn/nn/parts_linear.py: the MNIST MLP), else None. Decided
        at the first step: each layer must run once per forward on [rows, features] (a probe forward of two examples
        in eval mode); fp32 / fp64 only (no autocast)."""
        if backprop.dtype is not None:
            return None
        if self._linear is False:
            self._linear = row_linear_layers(self.module, params, x)
        return self._linear

    def parts_forward(self, names: list[str], weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits of every part at its own weights (flatbnn/flatness/batched.py: ``parts_forward``)."""
        return parts_forward(self.module, names, weights, x)

    def parts_losses(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[parts] mean loss of each part, as the loop's per-part loss (flatbnn/flatness/batched.py)."""
        return parts_losses(logits, y, self.ctx.criterion, self.ctx.label_smoothing)

    @torch.no_grad()
    def _assign(self, params, values) -> None:
        torch._foreach_copy_(list(params), list(values))

    def _all_reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Mean over DDP ranks of a list of tensors (one flat all-reduce)."""
        if self.ctx.world_size <= 1 or self.ctx.all_reduce_mean is None or not tensors:
            return tensors
        flat = flatten(tensors)
        self.ctx.all_reduce_mean(flat)
        return unflatten(flat, tensors)

    # ---------------------------------------------------------------- prediction
    @torch.no_grad()
    def sample_weights(self, generator: torch.Generator, mean: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """mean + std * n; ``mean`` defaults to the current parameters (pass a copy while sampling)."""
        mean = [p.detach() for p in self.parameters()] if mean is None else mean
        stds = self.optimizer.posterior_std()
        return [w + std * torch.randn(w.shape, generator=generator, device=w.device, dtype=w.dtype)
                for w, std in zip(mean, stds)]

    @torch.no_grad()
    def predict(self, loaders, num_samples=None):
        k = self.num_samples if num_samples is None else int(num_samples)
        self.module.eval()
        if k == 0:
            yield self.log_probs_on(loaders)
            return
        yield from self.predict_at_samples(loaders, k, self.sample_weights)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        # parts_taken too: a resumed run's results.json names every path its steps took, before and after the resume
        return {**super().state_dict(), "generator": self.generator.get_state(), "parts_taken": sorted(self.parts_taken)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state.get("generator") is not None:
            self.generator.set_state(state["generator"])
        self.parts_taken.update(state.get("parts_taken") or ())  # absent in checkpoints before 97d7154

    def describe(self) -> dict:
        out = {"name": self.name, "num_samples": self.num_samples, "n_data_factor": self.n_data_factor,
               "batched_parts": self.batched_parts,
               # which path made the m-part steps (loop / linear / vmap; results.json, as SAM's chunk_algorithm)
               **({"parts_path": ",".join(sorted(self.parts_taken))} if self.parts_taken else {}),
               "predictive": "mean weights" if self.num_samples == 0 else
               f"average of softmax over {self.num_samples} samples w + std * n (eval seed {self.eval_seed})",
               "optimizer_group": "ignored (the method's own optimiser)"}
        if self.optimizer is not None:
            group = self.optimizer.param_groups[0]
            out.update({"n_data": group["n_data"], "delta": group["prior_precision"] / group["n_data"],
                        **self.optimizer.summary()})
        return out
