"""``trainer.cuda_graph=true``: the whole training step replayed from one CUDA graph (issue 33 item 1).

On the GPUs we have (H100 / H200) every step of the small CIFAR nets is bound by the host issuing kernels (SAM m = 8:
~17,500 launches per step); a graph replays them with one launch. One graph per (method, flatness, batch shape)
holds zero-grad, ``flatness.gradient`` (every chunk, both passes, the BatchNorm policy), clipping and the optimiser
step. Outside it, in Python, stay: copying the batch into the static input buffers, the lr scheduler (it fills the
optimiser's device lr tensors), the rho schedule (``Flatness.set_lr_ratio`` refills its device scalars), the
example counter, posterior collection, stop checks and checkpoints.

Capture protocol (``GraphedStep._capture``): snapshot every tensor the step writes (and the RNG states and the
method's host counters); warm up on a side stream (lazy state -- optimiser moments, the SAM weight copy, the
BatchNorm snapshot -- is allocated there, outside the graph's pool), and capture on that same stream; restore the
snapshot IN PLACE (optimiser and method state made by the warm-up is zeroed: the "state exists" path of SGD
momentum / Adam then gives the fresh step's values); register the noise generator with the graph; capture one
step; replay. A resume loads the checkpoint in place, but the graph is recaptured anyway (``invalidate``) since
the loaded optimiser may have created new state tensors (an eager Adam checkpoint's CPU step counts are moved to
the device for capturable Adam: ``capturable_steps``).

Eager fallback, with a one-line reason printed once per reason: a capture that raised (for the rest of the run:
the backend undoes its stream and memory-pool state, the step's tensors go back to the snapshot), a batch of
another shape (the short last batch), DDP, fp16 (GradScaler.step reads found-inf on the host), a method whose
step keeps host-side state (``Method.capturable = False``), an optimiser without device lr (torch.optim.SGD / Adam
/ AdamW are switched to ``fused`` with a device lr, bSAM's and VOGN's take one as they are (``device_lr``); other
optimisers are not), and steps that replay the dropout
RNG (SAM's ``same_noise`` with active dropout: torch.cuda.get_rng_state cannot run inside a capture).

Only the capture itself needs a GPU: ``capture=`` takes any backend with ``capture(fn) -> replay``; the tests run
the whole protocol on the CPU with a backend that calls ``fn`` on every replay (tests/test_graphed.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

FUSED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def refusal(device: torch.device, ddp: bool = False) -> str | None:
    """Why ``trainer.cuda_graph=true`` cannot run at all here (one line), or None."""
    if device.type != "cuda":
        return (f"trainer.cuda_graph=true captures CUDA graphs and needs a CUDA device (trainer.device resolved to "
                f"{device.type}); set trainer.cuda_graph=false")
    return None


def step_tensors(method, flatness, backprop) -> dict[str, torch.Tensor]:
    """Every tensor a training step may write, by a stable name (weights, buffers, optimiser state, the method's,
    the flatness' and the Backprop's own tensors); gradients excluded."""
    out = {f"module.{k}": v for k, v in method.module.state_dict(keep_vars=True).items() if torch.is_tensor(v)}
    for owner, obj in (("method", method), ("flatness", flatness), ("backprop", backprop)):
        for k, v in vars(obj).items():
            if torch.is_tensor(v):
                out[f"{owner}.{k}"] = v
            elif isinstance(v, (list, tuple)) and v and all(torch.is_tensor(t) for t in v):
                out.update({f"{owner}.{k}[{i}]": t for i, t in enumerate(v)})
    for k, entry in getattr(flatness, "_scalars", {}).items():
        out[f"flatness.scalar.{k}"] = entry[0]
    opt = method.optimizer
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for p, state in opt.state.items():
        for k, v in state.items():
            if torch.is_tensor(v):
                out[f"opt.{index.get(id(p), id(p))}.{k}"] = v
    for i, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if torch.is_tensor(v):
                out[f"opt.group{i}.{k}"] = v
    if backprop.scaler is not None and backprop.scaler._scale is not None:
        out["scaler.scale"] = backprop.scaler._scale
    return out


def _host_counters(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if isinstance(v, (bool, int, float)) and not k.startswith("__")}


class CudaGraphCapture:
    """The real backend: warm-up, then ``torch.cuda.graph`` capture, both on ONE side stream (``stream``: the
    capture then sees the warm-up's allocations in the same stream's pool); ``replay()`` per step. A capture that
    raises is undone here before the error goes on (``_abandon``): caller's stream current again, the stream out of
    capture mode, the allocator no longer routing into the graph's pool, the graph reset and its memory freed."""

    def __init__(self, device: torch.device, generators: list[torch.Generator]):
        self.device, self.generators = device, generators
        self._stream = None
        self.graph = None

    @property
    def stream(self):
        if self._stream is None:  # made on first use: constructing a CUDA stream needs CUDA
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def warm_up(self, fn: Callable[[], object], steps: int = 3) -> None:
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(steps):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, fn: Callable[[], object]):
        self.release()
        caller = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            for g in self.generators:  # the default CUDA generator is registered by torch itself
                graph.register_generator_state(g)
            # thread_local: the loader's pin-memory thread may call CUDA while this thread captures
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                out = fn()
        except BaseException:
            self._abandon(graph, caller)
            raise
        self.graph = graph
        return graph.replay, out

    def release(self) -> None:
        """Drop the graph (a recapture, a fallback): its private memory pool goes back to the allocator."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None

    def _abandon(self, graph, caller) -> None:
        """Undo what a failed capture left (``torch.cuda.graph.__exit__`` skips restoring the stream when
        ``capture_end`` raises). Each step is tried on its own: the first error is the one already on its way."""
        def attempt(fn, *args):
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 -- best effort after the failure being reported
                pass
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        torch.cuda.set_stream(self.stream)
        if torch.cuda.is_current_stream_capturing():  # the error came before capture_end: end the capture here
            attempt(graph.capture_end)
        attempt(lambda: torch._C._cuda_endAllocateToPool(index, graph.pool()))
        torch.cuda.set_stream(caller)
        attempt(graph.reset)
        attempt(torch.cuda.synchronize, self.device)
        torch.cuda.empty_cache()


class EagerReplay:
    """A stand-in backend without CUDA: ``replay()`` runs the step again in Python and copies its outputs into the
    static ones, as a graph rewrites its output tensors. The whole protocol around the capture runs as on a GPU
    (tests/test_graphed.py; ``scripts/gpu_probe.py --dry-run``); it is not faster than eager."""

    replays_python = True  # the step's host counters advance on each replay (a CUDA graph's do not)

    def __init__(self):
        self.warm_ups = 0

    def warm_up(self, fn: Callable[[], object], steps: int = 3) -> None:
        for _ in range(steps):
            fn()
            self.warm_ups += 1

    def capture(self, fn: Callable[[], dict]):
        static = fn()

        def replay():
            new = fn()
            with torch.no_grad():
                for k, v in static.items():
                    if torch.is_tensor(v):
                        v.copy_(new[k])
        return replay, static


class GraphedStep:
    """Callable in place of ``method.train_step(batch, flatness, backprop)``; see the module docstring."""

    def __init__(self, method, flatness, backprop, capture=None, log: Callable[[str], None] = print,
                 warm_up_steps: int = 3):
        self.method, self.flatness, self.backprop = method, flatness, backprop
        self.warm_up_steps = warm_up_steps
        self.log = log
        self._told: set[str] = set()
        gens = [g for g in {id(g): g for g in (getattr(method, "generator", None), flatness.generator,
                                               getattr(getattr(method, "ctx", None), "generator", None))
                            if g is not None}.values()]
        self.generators = gens
        self.backend = capture if capture is not None else CudaGraphCapture(backprop.device, [
            g for g in gens if g.device.type == "cuda"])
        self.capture_failed: str | None = None  # set once a capture raised: every later step is eager
        # what ran, for results.json (``summary``): a window's record must say whether its step was the graph
        self.replayed_steps = self.eager_steps = self.captures = 0
        self.invalidate()

    def summary(self) -> dict:
        """This process's steps: replayed from the graph, run eagerly (and why), captures made."""
        return {"replayed_steps": self.replayed_steps, "eager_steps": self.eager_steps, "captures": self.captures,
                "eager_reasons": sorted(self._told)}

    # ---------------------------------------------------------------- decisions
    def fallback_reason(self, batch) -> str | None:
        """Why this step runs eagerly (one line), or None to replay the graph."""
        m, bp = self.method, self.backprop
        if self.capture_failed is not None:
            return self.capture_failed
        if bp.ddp is not None:
            return "DDP (the all-reduce hooks are not captured yet)"
        if bp.scaler is not None:
            return "fp16 (GradScaler.step reads found-inf on the host; use bf16)"
        if not getattr(m, "capturable", True):
            return f"method={m.name} keeps host-side state in its step"
        if any(not isinstance(g["lr"], torch.Tensor) for g in m.optimizer.param_groups) and \
                not isinstance(m.optimizer, FUSED_OPTIMIZERS) and not getattr(m.optimizer, "device_lr", False):
            return f"{type(m.optimizer).__name__} reads its lr as a host float (no device lr)"
        replays = getattr(self.flatness, "passes", 1) > 1 or getattr(m, "own_perturbation", False)
        if replays and any(isinstance(x, nn.modules.dropout._DropoutNd) and x.p > 0 for x in m.module.modules()):
            return "the second pass's dropout-mask replay (torch.cuda.get_rng_state) is not graph-safe yet"
        if self.shapes is not None and self._shapes(batch) != self.shapes:
            return (f"a batch of shape {tuple(batch[0].shape)}, the graph holds {self.shapes[0][0]} "
                    f"(the short last batch; each other shape would need its own graph)")
        return None

    @staticmethod
    def _shapes(batch):
        return tuple((tuple(t.shape), t.dtype) for t in batch)

    def invalidate(self) -> None:
        """Forget the graph (a resume, a new ensemble member): the next step captures again."""
        self.replay = None
        self.shapes = None
        self.static_batch = None
        self.static_out = None
        self.seen_per_step = 0
        release = getattr(self.backend, "release", None)
        if release is not None:
            release()

    # ---------------------------------------------------------------- the step
    def __call__(self, batch, flatness=None, backprop=None) -> dict:
        reason = self.fallback_reason(batch)
        if reason is not None:
            if reason not in self._told:
                self._told.add(reason)
                self.log(f"trainer.cuda_graph: eager step: {reason}")
            self.eager_steps += 1
            return self.method.train_step(batch, self.flatness, self.backprop)
        if self.replay is None:
            if not self._capture(batch):
                return self(batch)  # the capture failed: said once, and this step runs eagerly
            self.captures += 1
            if self.captures == 1:
                self.log(f"trainer.cuda_graph: step captured (batch {tuple(batch[0].shape)}); replaying it")
        with torch.no_grad():
            torch._foreach_copy_(list(self.static_batch), list(batch))
        self.replay()
        self.replayed_steps += 1
        m = self.method
        if not getattr(self.backend, "replays_python", False):
            m._seen += self.seen_per_step  # the host-side example count the graph cannot advance
        if m.scheduler is not None:
            m.scheduler.step()
        # a copy: the trainer keeps several steps' losses before reading them, and the graph rewrites its output
        return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in self.static_out.items()}

    def _core(self) -> dict:
        """One step without the scheduler (it runs outside the graph, after each replay)."""
        m = self.method
        scheduler, m.scheduler = m.scheduler, None
        try:
            return m.train_step(self.static_batch, self.flatness, self.backprop)
        finally:
            m.scheduler = scheduler

    def _capture(self, batch) -> bool:
        """Capture the step for ``batch``'s shapes; False when the capture raised (``capture_failed`` says why)."""
        m = self.method
        self._device_lr()
        self.static_batch = tuple(t.detach().clone() for t in batch)
        self.shapes = self._shapes(batch)
        # snapshot, warm up, restore in place
        before = {k: v.detach().clone() for k, v in step_tensors(m, self.flatness, self.backprop).items()}
        rng = self._rng_state()
        counters = (_host_counters(m), _host_counters(self.flatness))
        warm = getattr(self.backend, "warm_up", None)
        if warm is not None:
            warm(self._core, self.warm_up_steps)
        self._restore(before, rng, counters)
        seen = m._seen
        try:
            self.replay, self.static_out = self.backend.capture(self._core)
        except Exception as e:  # noqa: BLE001 -- any capture error: the run goes on eagerly, never on a half graph
            self._capture_failure(e, before, rng, counters)
            return False
        self.seen_per_step = m._seen - seen
        # the capture did not step (CUDA records the kernels without running them) but its Python did count; a
        # backend that does run the step (the CPU tests) also moved the tensors: either way back to the snapshot,
        # so that the first replay is the first step
        if getattr(self.backend, "replays_python", False):
            self._restore(before, rng, counters)
        else:
            self._restore_counters(counters)
        return True

    def _capture_failure(self, error: BaseException, before: dict, rng: dict, counters) -> None:
        """A capture raised (the backend has already undone its stream / pool state): forget the graph, drop the
        gradients the capture may have allocated in its pool, put every written tensor, RNG and counter back to
        the snapshot, and run eagerly from now on."""
        first = " ".join(str(error).split())[:200] or type(error).__name__
        self.capture_failed = f"the CUDA-graph capture failed ({type(error).__name__}: {first}); eager from here on"
        self.invalidate()
        for p in self.method.module.parameters():
            p.grad = None
        self._restore(before, rng, counters)

    def _restore(self, before: dict, rng: dict, counters) -> None:
        with torch.no_grad():
            for k, v in step_tensors(self.method, self.flatness, self.backprop).items():
                if k in before:
                    v.copy_(before[k])
                elif k.startswith(("opt.", "method.")):  # made by the warm-up (optimiser moments, step counts, the
                    v.zero_()  # accuracy count moved to the device): the fresh state is zeros
                # else: a work buffer or device copy of a host value (SAM's weight copy, the BatchNorm snapshot, the
                # radius): rewritten or still right, and zeroing the radius would silently turn SAM off
        self._set_rng_state(rng)
        self._restore_counters(counters)

    def _restore_counters(self, counters) -> None:
        for obj, saved in zip((self.method, self.flatness), counters):
            for k, v in saved.items():
                setattr(obj, k, v)

    def _rng_state(self) -> dict:
        state = {"torch": torch.get_rng_state(), "gens": [g.get_state() for g in self.generators]}
        if self.backprop.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.backprop.device)
        return state

    def _set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        for g, s in zip(self.generators, state["gens"]):
            g.set_state(s)
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.backprop.device)

    def _device_lr(self) -> None:
        """lr as a device tensor (the scheduler then fills it in place): torch.optim.SGD / Adam / AdamW with the
        fused kernels, which read it on the device; optimisers that declare ``device_lr`` (bSAM, VOGN) as they are.
        On the CPU test backend nothing changes."""
        opt, device = self.method.optimizer, self.backprop.device
        fused = isinstance(opt, FUSED_OPTIMIZERS)
        if device.type != "cuda" or not (fused or getattr(opt, "device_lr", False)):
            return
        for group in opt.param_groups:
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
            if not fused:
                continue
            group["fused"], group["foreach"] = True, False
            if "capturable" in group:
                group["capturable"] = True
        capturable_steps(opt)


def capturable_steps(opt: torch.optim.Optimizer) -> None:
    """Adam / AdamW with ``capturable`` or ``fused`` want ``state['step']`` as a float32 tensor on the parameter's
    device; an eager run keeps it as a CPU scalar, and loading an eager checkpoint keeps it there too (torch moves
    it only when the LOADED param group says capturable / fused). Moved here, after the flags are set, before the
    snapshot and the capture (issue 41: an eager Adam checkpoint resumed under trainer.cuda_graph=true)."""
    for group in opt.param_groups:
        if not (group.get("capturable") or group.get("fused")):
            continue
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                opt.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
