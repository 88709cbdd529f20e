"""Bayesian SAM (Möllenhoff & Khan, "SAM as an optimal relaxation of Bayes", ICLR 2023, Alg. 1
with the m-sharpness split of App. E.4), checked against the authors' JAX code.

Posterior q(w) = N(w, diag(1 / (N s))) with mean w and precision s kept in the optimiser state
(``flatbnn/optim/bsam.py``). N = len(train) * ``n_data_factor`` (the code's ``dafactor``; 4 with
crop+flip augmentation "to account for the augmented data", i.e. a tempered posterior, 1 without);
delta = ``prior_precision`` / N. There is no KL term: the prior enters as delta * w in the momentum
and delta in the precision. Per step, the batch is cut into ``m`` parts and for each part:

    w~   = w + n * sqrt(1 / (N s)),   n ~ N(0, I)            noisy point (own noise per part; one draw
                                                             [parts, P] per step for all parts, row k part k's)
    g    = grad L_part(w~)                                   mean NLL over the part
    g_p  = grad L_part(w + rho * g / s)                      ascent from the MEAN w, no normalisation
    h    = sqrt(s) * |g|

``noise=false`` is the paper's "bSAM w/o Noise" ablation (Table 3, App. F.5: Alg. 1 line 3 off): w~ = w,
so g, the ascent rho * g / s and h are all taken at the mean; the update and the predictive are unchanged.

g_p and h are averaged over the parts (weighted by part size: the plain mean for equal parts, as
the official code's reshape requires) and, under DDP, over ranks. The parts run one after another (2m passes) or
batched (``batched_parts``; flatbnn/methods/diag_gaussian.py): on a network whose parameters are all Linear's (the MNIST
MLP) two passes over the whole batch, each Linear a per-part product (flatbnn/nn/parts_linear.py: the first pass forms
each part's gradient, the second only their sum), elsewhere two ``vmap``-ed passes over the parts -- the same step up
to the order of float sums; then (``BSAMOptimizer.step``)

    m <- beta1 m + (1 - beta1)(g_p + delta w);  w <- w - alpha lr_factor m / s (old s);
    s <- beta2 s + (1 - beta2)(h + damping + delta)

with lr_factor from the ``scheduler`` group (the paper: linear warm-up for 5 epochs then cosine to
0 -- ``scheduler=cosine scheduler.warmup_epochs=5``; the official code changes the factor per epoch
and runs epochs + 1 epochs, here it changes per step). The ``optimizer`` group is not used.

BatchNorm running statistics: the official code threads them through both passes of the first part
and drops the other parts' updates; ``bn_stats`` (both | first | second | none) says which passes of
the FIRST part update them (default both); the other parts never do. ``m`` is the split of the GLOBAL
batch on any number of processes: under DDP each of k ranks cuts its share of the batch into m / k parts
(refused unless k divides m; never a silent m * k), runs them inside ``no_sync()`` (forward and backward)
and g_p, h are all-reduced once -- the single-process algorithm with the parts spread over ranks (each
part its own noise and ascent). With fp16 the loss is
scaled by the engine's GradScaler and unscaled here; a non-finite ascent gradient gives no ascent, a
non-finite g_p or h skips the step and halves the scale (the scale is never grown again).
``trainer.grad_clip`` clips the averaged g_p. The returned (logged) loss is the mean loss at the noisy
points (the official code logs the perturbed-point loss; the noisy one stays finite when fp16 gradients
overflow, so the engine's divergence check only fires on a real divergence).

Predictive: the average of softmax over ``num_samples`` (the code's ``testmc``, 32 in the paper)
samples w + n * sqrt(1 / (N s)); ``num_samples=0`` predicts with w alone ("mean" metrics).
"""

from __future__ import annotations

import torch

from flatbnn.flatness.base import split_batch
from flatbnn.flatness.sam import all_finite
from flatbnn.methods.diag_gaussian import DiagonalGaussianMethod, batch_size
from flatbnn.methods.param_vector import flatten, unflatten
from flatbnn.nn.parts_linear import in_param_order, layer_views, pair_leaves, param_views, parts_weights, phantom_pairs
from flatbnn.optim.bsam import BSAMOptimizer

BN_POLICIES = ("both", "first", "second", "none")


class BSAM(DiagonalGaussianMethod):
    name = "bsam"
    passes = 2  # per part: the gradient at the noisy point, then the one at the ascent point

    def __init__(self, lr: float = 0.5, beta1: float = 0.9, beta2: float = 0.999, rho: float = 0.01,
                 m: int = 8, prior_precision: float = 40.0, n_data_factor: float = 1.0, damping: float = 0.1,
                 s_init: float = 1.0, num_samples: int = 32, bn_stats: str = "both", eval_seed: int = 1,
                 noise: bool = True, batched_parts: str | bool = "auto"):
        if int(m) < 1:
            raise ValueError(f"method.m must be >= 1, got {m}")
        if bn_stats not in BN_POLICIES:
            raise ValueError(f"method.bn_stats must be one of {BN_POLICIES}, got {bn_stats!r}")
        super().__init__(num_samples=num_samples, n_data_factor=n_data_factor, eval_seed=eval_seed,
                         batched_parts=batched_parts)
        self.lr_init, self.betas, self.rho, self.m = float(lr), (float(beta1), float(beta2)), float(rho), int(m)
        self.prior_precision, self.damping, self.s_init = float(prior_precision), float(damping), float(s_init)
        self.bn_stats = bn_stats
        self.noise = bool(noise)

    def setup(self, ctx) -> None:
        world = int(getattr(ctx, "world_size", 1) or 1)
        if self.m % world:  # before anything is built: k ranks must share the m parts equally
            raise ValueError(f"method.m={self.m}: bSAM splits the global batch into m parts and {world} processes "
                             f"must share them equally; use a method.m divisible by {world} or another number of "
                             f"processes")
        super().setup(ctx)

    def build_optimizer(self, params, n_data):
        return BSAMOptimizer(params, lr=self.lr_init, betas=self.betas, rho=self.rho,
                             prior_precision=self.prior_precision, n_data=n_data, damping=self.damping,
                             s_init=self.s_init)

    # ---------------------------------------------------------------- one step
    def _grad(self, params, chunk, backprop, update_bn: bool):
        """(loss, unscaled gradient list) of the mean loss on ``chunk`` at the current weights."""
        for p in params:
            p.grad = None
        with backprop.no_sync(), backprop.bn_updates(update_bn):
            loss = backprop.forward(self.loss_fn, chunk)
            backprop.backward(loss)
        # no copy: p.grad is dropped right after, so the next backward writes a fresh tensor (DDP's grads are not
        # bucket views: engine/build.py keeps gradient_as_bucket_view off) -- 2 x m copies of the weights a step
        grads = [g.detach() for g in backprop.unscaled_grads(params)]
        for p in params:
            p.grad = None
        return loss.detach(), grads

    def train_step(self, batch, flatness, backprop) -> dict:
        self.check_flatness(flatness)
        opt = self.optimizer
        params = opt.params()
        # this process's share of the m parts; a short last batch (drop_last=False) gets as many as it has examples
        chunks = split_batch(batch, min(self.m // self.world_size, batch_size(batch)))
        # Alg. 1 line 3 for every part at once: one draw [parts, P] (row k: part k's noise)
        path = self.parts_path(batch, len(chunks), backprop)
        if path == "linear":  # noise and mean in one multiply-add: the rows are each part's noisy weights
            points = (self.noise_parts(len(chunks), params, flatten(params)) if self.noise
                      else self.parts_buffer(len(chunks), params).copy_(flatten(params)))
            g_p, h, loss_sum = self._linear_parts(self._linear, params, batch, len(chunks), points)
        else:
            noise = self.noise_parts(len(chunks), params) if self.noise else None
            g_p, h, loss_sum = (self._batched_parts(params, batch, len(chunks), noise, backprop) if path == "vmap"
                                else self._loop_parts(params, chunks, noise, backprop))
        g_p = self._all_reduce(g_p)
        h = self._all_reduce(h)
        if backprop.scaler is not None:
            self._update_unless_overflow(params, g_p, h, backprop)
        else:
            self.apply_update(params, g_p, h, backprop)
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": loss_sum}

    def _loop_parts(self, params, chunks, noise, backprop):
        """(g_p, h, loss) of the parts one after another: two forward / backward passes each. Besides its passes, a
        part costs seven multi-tensor ops over the weights, eleven before 2339ebe (its points are written into the
        parameters in place; what depends on s alone is computed once a step: ``BSAMOptimizer.ascent_scales`` /
        ``curvature_from_abs``)."""
        opt = self.optimizer
        with torch.no_grad():
            mean = [p.detach().clone() for p in params]
            rho_over_s = opt.ascent_scales()
        g_p = [torch.zeros_like(p) for p in params]
        abs_g = [torch.zeros_like(p) for p in params]  # sum of share * |g| over the parts; times sqrt(s) at the end
        loss_sum = torch.zeros((), device=mean[0].device)
        try:
            for k, (chunk, share) in enumerate(chunks):
                first = k == 0
                # noise off: the first gradient at the mean (Table 3 ablation). Always reassign: the previous part
                # left the weights at its ascent point
                with torch.no_grad():
                    self._assign(params, mean)
                    if noise is not None:
                        torch._foreach_add_(params, unflatten(noise[k], params))
                self._record = True  # train accuracy at the noisy weights, every part
                loss, g = self._grad(params, chunk, backprop, first and self.bn_stats in ("first", "both"))
                with torch.no_grad():
                    if backprop.scaler is not None:  # fp16 overflow: no ascent (step skipped below); decided on device
                        finite = all_finite(g)
                        g_ascent = [torch.where(finite, x, 0.0) for x in g]
                    else:
                        g_ascent = g
                    self._assign(params, mean)
                    torch._foreach_addcmul_(params, g_ascent, rho_over_s)  # w + rho * g / s
                    torch._foreach_add_(abs_g, torch._foreach_abs(g), alpha=share)
                _, gp = self._grad(params, chunk, backprop, first and self.bn_stats in ("second", "both"))
                with torch.no_grad():
                    torch._foreach_add_(g_p, gp, alpha=share)
                loss_sum = loss_sum + loss.float() * share
        finally:
            self._assign(params, mean)
        return g_p, opt.curvature_from_abs(abs_g), loss_sum

    def _linear_parts(self, layers, params, batch, parts: int, points):
        """(g_p, h, loss) of all parts where every parameter is a Linear's (flatbnn/nn/parts_linear.py): one forward and
        one backward per pass over the whole batch, part k's rows at part k's weights (``points`` [parts, P], the
        noisy weights, overwritten with the ascent points); the first pass forms each part's gradient (the ascent and
        |g| need them), the second only their sum -- the loop's arithmetic, the sums over parts in another order."""
        opt = self.optimizer
        x, y = batch
        rows = x.shape[0]

        def losses_at(weights, sums=None):
            with torch.enable_grad(), parts_weights(layers, parts, rows, weights, sums):
                logits = self.module(x)
                return logits, self.parts_losses(logits.view(parts, -1, *logits.shape[1:]),
                                                 y.view(parts, -1, *y.shape[1:]))

        leaves = [tuple(None if t is None else t.detach().requires_grad_(True) for t in pair)
                  for pair in layer_views(points, params, layers)]
        logits, losses = losses_at(leaves)
        g = in_param_order(layers, params, torch.autograd.grad(losses.sum(), pair_leaves(leaves)))
        with torch.no_grad():
            self.count_correct(logits.detach(), y)  # train accuracy at the noisy weights, every part
            self._seen += y.numel()
            at = param_views(points, params)
            for p, gk, ros, out in zip(params, g, opt.ascent_scales(), at):
                torch.addcmul(p.detach(), gk, ros, out=out)  # w + rho * g_k / s: the second pass's weights
            abs_g = [gk.abs_().sum(0).mul_(1.0 / parts) for gk in g]  # mean |g_k| over parts; h = sqrt(s) * it
        sums = phantom_pairs(layers)
        _, losses2 = losses_at(layer_views(points, params, layers), sums)
        gp = in_param_order(layers, params, torch.autograd.grad(losses2.sum(), pair_leaves(sums)))
        with torch.no_grad():
            g_p = torch._foreach_mul(gp, 1.0 / parts)
        return g_p, opt.curvature_from_abs(abs_g), losses.detach().float().mean()

    def batched_refusal(self, precision_fp16: bool = False) -> str | None:
        if len(self.optimizer.param_groups) > 1:
            return "several parameter groups"
        return super().batched_refusal(precision_fp16)

    def _batched_parts(self, params, batch, parts: int, noise, backprop):
        """(g_p, h, loss) of all parts at once: two ``vmap``-ed forward passes over the parts (each at its own
        weights), each with one backward -- the loop's element-wise arithmetic on [parts, P] rows, sums over parts
        in another order (tests/test_bsam.py: the same weights to float rounding)."""
        opt = self.optimizer
        names = [n for n, _ in self.named_parameters()]
        x, y = batch
        xs, ys = x.reshape(parts, -1, *x.shape[1:]), y.reshape(parts, -1, *y.shape[1:])
        group = opt.param_groups[0]
        autocast = (torch.autocast(backprop.device.type, dtype=backprop.dtype) if backprop.dtype is not None
                    else torch.autocast(backprop.device.type, enabled=False))

        def grads_at(flat):  # [parts, P] weights -> ([parts, P] gradients of each part's mean loss, losses, logits)
            leaves = [t.view(parts, *p.shape).detach().requires_grad_(True)
                      for t, p in zip(flat.split([p.numel() for p in params], dim=-1), params)]
            with torch.enable_grad(), autocast:
                logits = self.parts_forward(names, leaves, xs)
                losses = self.parts_losses(logits, ys)
            grads = torch.autograd.grad(losses.sum(), leaves)  # part k's loss depends on its own weights only
            return torch.cat([g.reshape(parts, -1) for g in grads], dim=1), losses.detach(), logits.detach()

        with torch.no_grad():
            mean = flatten(params)
            s = flatten(opt.precisions())
            noisy = mean.expand(parts, -1) if noise is None else noise.add_(mean)  # the buffer becomes the weights
        g, losses, logits = grads_at(noisy)
        with torch.no_grad():
            ascent = torch.addcmul(mean, g, s.reciprocal().mul_(group["rho"]))  # w + g * (rho / s), as the loop
            abs_g = g.abs_().sum(0).mul_(1.0 / parts)  # mean |g| over the parts; h = sqrt(s) * it, as the loop
            self.count_correct(logits.flatten(0, 1), y)  # train accuracy at the noisy weights, every part
            self._seen += y.numel()
        gp, _, _ = grads_at(ascent)
        with torch.no_grad():
            g_p = unflatten(gp.sum(0).mul_(1.0 / parts), params)
            h = unflatten(abs_g.mul_(s.sqrt()), params)
        return g_p, h, losses.float().mean()

    @torch.no_grad()
    def _update_unless_overflow(self, params, g_p, h, backprop) -> None:
        """fp16: a non-finite g_p or h skips the step and halves the scale (never grown again) -- decided on the
        device (an `if` on a tensor is a host read every step): the update runs, and where it overflowed the
        weights and the optimiser state are put back from a copy."""
        finite = all_finite(g_p + h)
        state = [self.optimizer.state[p][k] for p in params for k in ("momentum", "precision")]
        before = [t.clone() for t in params + state]
        self.apply_update(params, g_p, h, backprop)
        for t, old in zip(params + state, before):
            t.copy_(torch.where(finite, t, old))
        scale = backprop.loss_scale()
        backprop.scaler.update(new_scale=torch.where(finite, scale, scale * backprop.scaler.get_backoff_factor()))

    def describe(self) -> dict:
        return {**super().describe(), "lr": self.lr_init, "beta1": self.betas[0], "beta2": self.betas[1],
                "rho": self.rho, "m": self.m, "prior_precision": self.prior_precision,
                "damping": self.damping, "s_init": self.s_init, "bn_stats": self.bn_stats, "noise": self.noise,
                # m parts of the global batch on any number of processes (m / k per process; issue 42)
                "effective_m": self.m}
