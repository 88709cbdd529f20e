"""VOGN: variational online Gauss-Newton with Adam-like momentum (Osawa et al., "Practical deep
learning with Bayesian principles", NeurIPS 2019; Khan et al. 2018) -- the bSAM paper's baseline.

Posterior q(w) = N(mu, diag(sigma^2)), sigma^2 = 1 / (N (s + delta)), with N = len(train) *
``n_data_factor`` (Osawa et al.'s data-augmentation factor rho: N <- rho N, i.e. a tempered
posterior, as bSAM's ``dafactor``) and delta = ``prior_precision`` / N (their delta~ = delta / N
with tau = 1). Per step, the batch is cut into ``m`` parts; for each part, with its own noise,

    w~     = mu + sigma * eps,  eps ~ N(0, I)                (one draw for all parts and weights)
    g_i    = grad_w l(y_i, f_w~(x_i))                        per-example gradient
    g_hat  = mean_i g_i,   h_hat = mean_i g_i^2              h_hat: the diagonal Gauss-Newton
                                                             estimate of the per-example Hessian

How h_hat is computed (``sum_grad_squared``): ``layers`` (default) takes g_hat from the part's one backward pass and,
for Linear and Conv2d weights and biases, sum_i g_i^2 from the same pass (flatbnn/nn/sum_grad_squared.py: products
of squares, no per-example gradient of the network); every other parameter (FRN's gamma / beta / tau, ...) gets its
per-example gradients from ``torch.func`` (functional_call + vmap + grad, w.r.t. those parameters only), and the run's
train.log names them once. ``per_example`` takes every parameter's per-example gradients that way: the reference,
equal to ``layers`` up to float rounding (tests/test_vogn.py), and what a bf16 step uses (the layer rules are fp32).
The m parts run one after another or batched (``batched_parts``; flatbnn/methods/diag_gaussian.py): the same values
up to the order of float sums. Batched, a network whose parameters are all Linear's (the MNIST MLP) takes one forward
and one backward over the whole batch with a per-part product per layer, and g, h summed over all rows at once
(flatbnn/nn/parts_linear.py); other networks a vmap over the parts. The loss must be a mean of per-example terms (cross-entropy, or a ``criterion`` that
is one): the layer rules scale by the part size.

g_hat and h_hat are averaged over parts (by part size) and, under DDP, all-reduced over ranks; then
(``flatbnn/optim/vogn.py``)

    m  <- beta1 m + (1 - beta1)(g_hat + delta mu)
    s  <- beta2 s + (1 - beta2) h_hat
    mu <- mu - alpha lr_factor m / (s + delta + damping)     (the NEW s, as in Osawa et al.'s
                                                             VOGN update where s_{t+1} divides)

so N (s + delta) tracks sum_i g_i^2 + prior precision, the mean-field GGN posterior precision.
Choices stated (the exact Alg. 1 of Osawa et al. could not be re-checked offline): momentum and
precision use EMA weights (1 - beta1), (1 - beta2) as in bSAM's code; no bias correction; the
damping gamma enters only the mean's step, not sigma; the tempering tau of their Alg. 1 is not
offered (tau = 1); K = 1 MC sample per part (use ``m`` for more independent samples per step).
The predictive averages softmax over ``num_samples`` samples mu + sigma * eps (0 = the mean).

BatchNorm: per-example gradients are undefined when the forward couples the examples through
batch statistics (Osawa et al. approximate them layer-wise); this implementation refuses models
with BatchNorm at setup -- use a BatchNorm-free backbone (mlp, lenet5, resnet20_frn, ...).
fp16 is refused too (squared per-example gradients underflow); fp32 and bf16 work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from flatbnn.flatness.base import split_batch
from flatbnn.methods.diag_gaussian import DiagonalGaussianMethod, batch_size
from flatbnn.methods.param_vector import flatten
from flatbnn.nn.parts_linear import in_param_order, layer_views, pair_leaves, parts_weights, phantom_pairs
from flatbnn.nn.sum_grad_squared import count_calls, tap_plan, tapped
from flatbnn.optim.vogn import VOGNOptimizer

SUM_GRAD_SQUARED = ("layers", "per_example")


class VOGN(DiagonalGaussianMethod):
    name = "vogn"

    def __init__(self, lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.999, m: int = 1,
                 prior_precision: float = 1.0, n_data_factor: float = 1.0, damping: float = 1e-3,
                 s_init: float = 0.01, num_samples: int = 32, per_example_chunk: int | None = None,
                 eval_seed: int = 1, batched_parts: str | bool = "auto", sum_grad_squared: str = "layers"):
        if int(m) < 1:
            raise ValueError(f"method.m must be >= 1, got {m}")
        if sum_grad_squared not in SUM_GRAD_SQUARED:
            raise ValueError(f"method.sum_grad_squared must be one of {SUM_GRAD_SQUARED}, got {sum_grad_squared!r}")
        super().__init__(num_samples=num_samples, n_data_factor=n_data_factor, eval_seed=eval_seed,
                         batched_parts=batched_parts)
        self.lr_init, self.betas, self.m = float(lr), (float(beta1), float(beta2)), int(m)
        self.prior_precision, self.damping, self.s_init = float(prior_precision), float(damping), float(s_init)
        self.per_example_chunk = per_example_chunk
        self.sum_grad_squared = sum_grad_squared
        self._plan: tuple[list[str], list[str]] | None = None  # (tapped names, per-example names), at the first step

    def build_optimizer(self, params, n_data):
        return VOGNOptimizer(params, lr=self.lr_init, betas=self.betas, prior_precision=self.prior_precision,
                             n_data=n_data, damping=self.damping, s_init=self.s_init)

    def setup(self, ctx) -> None:
        bn = [type(m).__name__ for m in ctx.module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if bn:
            raise ValueError(f"method=vogn needs per-example gradients, which BatchNorm ({bn[0]}) in training "
                             f"mode couples across the batch; use a BatchNorm-free model (mlp, lenet5, resnet20_frn)")
        super().setup(ctx)

    # ---------------------------------------------------------------- per-example gradients (the reference)
    def _criterion(self, logits, y):
        if self.ctx.criterion is not None:
            return self.ctx.criterion(logits, y)
        return F.cross_entropy(logits.float(), y, label_smoothing=self.ctx.label_smoothing)

    def per_example_gradients(self, weights: dict, chunk, wrt: list[str] | None = None):
        """(per-example loss [B], per-example logits [B, ...], {name: per-example grads [B, ...]}) of the parameters
        ``wrt`` (default: all of ``weights``; the others are held at their values)."""
        x, y = chunk
        buffers = dict(self.module.named_buffers())
        wrt = list(weights) if wrt is None else wrt
        held = {n: w for n, w in weights.items() if n not in wrt}

        def one(w, xi, yi):
            out = functional_call(self.module, ({**held, **w}, buffers), (xi.unsqueeze(0),))
            loss = self._criterion(out, yi.unsqueeze(0))
            return loss, (loss.detach(), out.detach().squeeze(0))

        fn = vmap(grad(one, has_aux=True), in_dims=(None, 0, 0), randomness="different",
                  chunk_size=self.per_example_chunk)
        grads, (losses, logits) = fn({n: weights[n] for n in wrt}, x, y)
        return losses, logits, grads

    # ---------------------------------------------------------------- which parameter gets h_hat how
    def plan(self, names: list[str], x: torch.Tensor, autocast: bool) -> tuple[list[str], list[str]]:
        """(names whose sum_i g_i^2 comes from the layer rules, names whose from per-example gradients), decided at the
        first step (one forward of one example counts the module calls) and said once in train.log."""
        if self.sum_grad_squared == "per_example" or autocast:
            if autocast and self.sum_grad_squared == "layers":
                self.note_once("method=vogn: mixed precision: sum_i g_i^2 from per-example gradients for every "
                               "parameter (the layer rules are fp32 only)")
            return [], list(names)
        if self._plan is None or sorted(self._plan[0] + self._plan[1]) != sorted(names):
            with torch.no_grad(), count_calls(self.module) as calls:
                self.module(x[:1])
            tapped_names, other = tap_plan(self.module, names, calls)
            if other:
                kinds = sorted(set(other.values()))
                self.note_once(f"method=vogn: sum_i g_i^2 from per-example gradients (torch.func.vmap) for "
                               f"{len(other)} of {len(names)} parameter tensors ({', '.join(kinds)}); the other "
                               f"{len(tapped_names)} (Linear / Conv2d) from the layers' products of squares")
            self._plan = (tapped_names, [n for n in names if n in other])
        return self._plan

    # ---------------------------------------------------------------- one part, or all parts batched
    def _part_statistics(self, names, flat_weights, x, y, tapped_names, other, batched: bool):
        """(g, h, losses, logits) at weights ``flat_weights`` ([P], or [parts, P] batched): g the part's mean gradient
        and h = mean_i g_i^2, per parameter -- summed over the parts when ``batched`` -- except that h of a tapped
        parameter is sum_i (d_i a_i^T)^2, which the caller scales by the part size (mean_i g_i^2 = part^2 * that /
        part), folded into its accumulation."""
        params = [p for _, p in self.named_parameters()]
        lead = (flat_weights.shape[0],) if batched else ()
        leaves = [t.view(*lead, *p.shape).detach().requires_grad_(True)
                  for t, p in zip(flat_weights.split([p.numel() for p in params], dim=-1), params)]
        # phantoms: zeros of each tapped weight's shape (an expanded scalar: no memory); their gradients are the sums
        phantoms = {n: torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).requires_grad_(True)
                    for n, p in zip(names, params) if n in tapped_names}
        with torch.enable_grad(), tapped(self.module, phantoms):
            if batched:
                logits = self.parts_forward(names, leaves, x)
                losses = self.parts_losses(logits, y)
                total = losses.sum()  # the parts' losses depend on their own weights only
            else:
                logits = functional_call(self.module, ({n: w for n, w in zip(names, leaves)},
                                                       dict(self.module.named_buffers())), (x,))
                losses = total = self._criterion(logits, y)
            grads = torch.autograd.grad(total, leaves + list(phantoms.values()))
        g = list(grads[:len(leaves)])
        if batched:
            g = [t.sum(0) for t in g]  # the parts' mean gradients, summed (the caller weights by 1 / parts)
        h = dict(zip(phantoms, grads[len(leaves):]))  # the phantoms' gradients: unbatched, summed over the parts
        if other:
            weights = {n: w.detach() for n, w in zip(names, leaves)}
            if batched:
                def per_part(w, xk, yk):
                    _, _, pe = self.per_example_gradients(w, (xk, yk), wrt=other)
                    return {n: pe[n].square().mean(0) for n in other}
                hs = vmap(per_part, in_dims=(0, 0, 0), randomness="different")(weights, x, y)
                h.update({n: t.sum(0) for n, t in hs.items()})
            else:
                _, _, pe = self.per_example_gradients(weights, (x, y), wrt=other)
                h.update({n: pe[n].square().mean(0) for n in other})
        return g, [h[n].to(p.dtype) for n, p in zip(names, params)], losses.detach(), logits.detach()

    def parts_linear_layers(self, params, backprop, x):
        """As the base's, but none where ``sum_grad_squared=per_example`` (the reference takes every parameter's h from
        per-example gradients, so its batched parts are the vmap path): the path parts_path() records is the one run."""
        return None if self.sum_grad_squared == "per_example" else super().parts_linear_layers(params, backprop, x)

    def _linear_statistics(self, layers, params, noisy, batch, parts: int):
        """(g, h, losses, logits) of all parts in one forward and one backward where every parameter is a Linear's
        (flatbnn/nn/parts_linear.py): g summed over the parts and h = sum_i (d_i a_i^T)^2 over every part's rows -- what
        ``_part_statistics(batched=True)`` gives, with no part's gradient formed (the products over all rows at once)."""
        x, y = batch
        sums, squares = phantom_pairs(layers), phantom_pairs(layers)
        with torch.enable_grad(), parts_weights(layers, parts, x.shape[0], layer_views(noisy, params, layers), sums,
                                                squares):
            logits = self.module(x)
            losses = self.parts_losses(logits.view(parts, -1, *logits.shape[1:]), y.view(parts, -1, *y.shape[1:]))
        sum_leaves = pair_leaves(sums)
        grads = torch.autograd.grad(losses.sum(), sum_leaves + pair_leaves(squares))
        n = len(sum_leaves)
        return (in_param_order(layers, params, grads[:n]), in_param_order(layers, params, grads[n:]), losses.detach(),
                logits.detach())

    def train_step(self, batch, flatness, backprop) -> dict:
        self.check_flatness(flatness)
        if backprop.scaler is not None:
            raise ValueError("method=vogn does not support trainer.precision=fp16 (squared per-example "
                             "gradients underflow); use fp32 or bf16")
        opt = self.optimizer
        named = self.named_parameters()
        names, params = [n for n, _ in named], [p for _, p in named]
        if [id(p) for p in params] != [id(p) for p in opt.params()]:
            raise RuntimeError("method=vogn: the optimiser's parameters do not match the model's")
        parts = min(self.m, batch_size(batch))
        chunks = split_batch(batch, parts)
        autocast_on = backprop.dtype is not None
        autocast = (torch.autocast(backprop.device.type, dtype=backprop.dtype) if autocast_on
                    else torch.autocast(backprop.device.type, enabled=False))
        tapped_names, other = self.plan(names, batch[0], autocast_on)
        tap = [n in tapped_names for n in names]
        with torch.no_grad():  # [parts, P]: mu + std * n, each part's weights
            noisy = self.noise_parts(len(chunks), params, flatten(params))
        g_hat = [torch.zeros_like(p) for p in params]
        h_hat = [torch.zeros_like(p) for p in params]

        def accumulate(g, h, share, part):
            torch._foreach_add_(g_hat, g, alpha=share)
            for on, alpha in ((True, share * part), (False, share)):  # tapped: h = sum_i (d_i a_i)^2, x part
                pick = [i for i, t in enumerate(tap) if t is on]
                if pick:
                    torch._foreach_add_([h_hat[i] for i in pick], [h[i] for i in pick], alpha=alpha)

        path = self.parts_path(batch, len(chunks), backprop)
        if path == "linear":
            g, h, losses, logits = self._linear_statistics(self._linear, params, noisy, batch, parts)
            with torch.no_grad():
                accumulate(g, h, 1.0 / parts, batch_size(batch) // parts)
                loss_sum = losses.float().mean()
                self.count_correct(logits, batch[1])
                self._seen += batch[1].numel()
        elif path != "loop":
            x, y = batch
            xs, ys = x.reshape(parts, -1, *x.shape[1:]), y.reshape(parts, -1, *y.shape[1:])
            with autocast:
                g, h, losses, logits = self._part_statistics(names, noisy, xs, ys, tapped_names, other, batched=True)
            with torch.no_grad():
                accumulate(g, h, 1.0 / parts, xs.shape[1])
                loss_sum = losses.float().mean()
                self.count_correct(logits.flatten(0, 1), y)
                self._seen += y.numel()
        else:
            loss_sum = torch.zeros((), device=params[0].device)
            for k, (chunk, share) in enumerate(chunks):
                with autocast:
                    g, h, loss, logits = self._part_statistics(names, noisy[k], chunk[0], chunk[1], tapped_names,
                                                               other, batched=False)
                with torch.no_grad():
                    accumulate(g, h, share, chunk[1].shape[0])
                    loss_sum = loss_sum + loss.float() * share
                    self.count_correct(logits, chunk[1])
                    self._seen += chunk[1].numel()
        g_hat = self._all_reduce(g_hat)
        h_hat = self._all_reduce(h_hat)
        self.apply_update(params, g_hat, h_hat, backprop)
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": loss_sum}

    def describe(self) -> dict:
        return {**super().describe(), "lr": self.lr_init, "beta1": self.betas[0], "beta2": self.betas[1],
                "m": self.m, "prior_precision": self.prior_precision, "damping": self.damping,
                "s_init": self.s_init, "sum_grad_squared": self.sum_grad_squared}
