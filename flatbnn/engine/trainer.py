"""The single training loop. It knows nothing method-specific: it calls
``method.train_step(batch, flatness, backprop)`` and ``method.on_epoch_end(epoch)``.

Duties: epochs, progress bar, per-epoch metrics, atomic checkpoints (incl. sampler position and
every RNG state), resume, SIGTERM/SIGUSR1 preemption, stopping on a non-finite loss.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flatbnn.engine import distributed as D
from flatbnn.engine.backprop import global_rng_state, set_global_rng_state
from flatbnn.engine.checkpoint import save_checkpoint

CHECKPOINT_FORMAT = 1
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again" -- requeue the job, it resumes from the checkpoint


class Diverged(RuntimeError):
    pass


class Preempted(Exception):
    pass


class _StopFlag:
    """SIGTERM / SIGUSR1 (SLURM preemption) -> finish the step, checkpoint, exit."""

    def __init__(self):
        self.raised = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.raised = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Trainer:
    def __init__(self, *, epochs: int, run_dir: Path, info: D.DistInfo, device: torch.device,
                 checkpoint_every: int = 1, eval_every: int = 1, progress: bool = True,
                 limit_train_batches: int | None = None, channels_last: bool = False,
                 loggers=(), log_every: int = 1):
        self.epochs = int(epochs)
        self.run_dir = Path(run_dir)
        self.ckpt_path = self.run_dir / "checkpoints" / "last.pt"
        self.info = info
        self.device = device
        self.checkpoint_every = int(checkpoint_every)
        self.eval_every = int(eval_every)
        self.progress = progress and info.is_main
        self.limit = limit_train_batches
        self.channels_last = channels_last
        self.loggers = list(loggers)
        # position
        self.epoch = 0
        self.step_in_epoch = 0
        self.global_step = 0
        self.elapsed = 0.0
        self.history_tail: dict = {}

    # ---------------------------------------------------------------- state
    def state(self, method, backprop, generator, extra: dict) -> dict:
        rng = {"global": global_rng_state(), "generator": generator.get_state() if generator is not None else None}
        all_rng = [rng]
        if self.info.enabled:
            all_rng = [None] * self.info.world_size
            torch.distributed.all_gather_object(all_rng, rng)
        return {
            "format": CHECKPOINT_FORMAT,
            "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
            "elapsed": self.elapsed, "world_size": self.info.world_size,
            "method": method.state_dict(), "backprop": backprop.state_dict(),
            "rng": all_rng, **extra,
        }

    def restore(self, state: dict, method, backprop, generator) -> None:
        if state.get("world_size", 1) != self.info.world_size:
            raise RuntimeError(
                f"checkpoint was written by {state['world_size']} processes, this run has "
                f"{self.info.world_size}; resume with the same number (results depend on it)")
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step, self.elapsed = state["global_step"], state["elapsed"]
        method.load_state_dict(state["method"])
        backprop.load_state_dict(state["backprop"])
        rng = state["rng"][self.info.rank]
        set_global_rng_state(rng["global"])
        if generator is not None and rng["generator"] is not None:
            generator.set_state(rng["generator"])

    def save(self, method, backprop, generator, extra: dict) -> None:
        state = self.state(method, backprop, generator, extra)  # collective under DDP
        if self.info.is_main:
            save_checkpoint(self.ckpt_path, state)
        D.barrier(self.info)

    # ---------------------------------------------------------------- loop
    def to_device(self, batch):
        x, y = batch
        x = x.to(self.device, non_blocking=True)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def fit(self, method, flatness, backprop, loader, sampler, train_set, *, evaluate_epoch=None,
            generator=None, checkpoint_extra: dict | None = None) -> None:
        extra = checkpoint_extra or {}
        steps_per_epoch = len(loader) if self.limit is None else min(len(loader), self.limit)
        with _StopFlag() as stop:
            while self.epoch < self.epochs:
                epoch = self.epoch
                if hasattr(train_set, "set_epoch"):
                    train_set.set_epoch(epoch)
                sampler.set_epoch(epoch)
                sampler.skip = self.step_in_epoch * loader.batch_size
                method.train()
                t0 = time.perf_counter()
                loss_sum, n_steps, n_images = 0.0, 0, 0
                bar = tqdm(total=steps_per_epoch, initial=self.step_in_epoch, disable=not self.progress,
                           desc=f"epoch {epoch + 1}/{self.epochs}", leave=False, dynamic_ncols=True)
                for batch in loader:
                    if self.step_in_epoch >= steps_per_epoch:
                        break
                    batch = self.to_device(batch)
                    if flatness.rho_schedule == "lr":
                        flatness.set_lr_ratio(method.lr_ratio())
                    out = method.train_step(batch, flatness, backprop)
                    loss = float(out["loss"])
                    if not torch.isfinite(torch.tensor(loss)):
                        raise Diverged(
                            f"non-finite loss ({loss}) at epoch {epoch + 1}, step {self.step_in_epoch + 1} "
                            f"(global step {self.global_step + 1}); last good checkpoint: "
                            f"{self.ckpt_path if self.ckpt_path.exists() else 'none'}; "
                            f"lower optimizer.lr or flatness.rho, or use trainer.precision=fp32")
                    loss_sum += loss
                    n_steps += 1
                    n_images += batch[1].numel()
                    self.step_in_epoch += 1
                    self.global_step += 1
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{method.lr():.3g}", refresh=False)
                    if self._stop_requested(stop):
                        bar.close()
                        self.elapsed += time.perf_counter() - t0
                        self.save(method, backprop, generator, extra)
                        raise Preempted(f"stopped by signal at epoch {epoch + 1}, step {self.step_in_epoch}; "
                                        f"checkpoint {self.ckpt_path}; rerun the same command to resume")
                bar.close()
                method.on_epoch_end(epoch)
                train_time = time.perf_counter() - t0
                self.elapsed += train_time
                correct, seen = method.pop_train_accuracy()
                loss_sum, n_steps, n_images, correct, seen = D.all_reduce_sum(
                    [loss_sum, n_steps, n_images, correct, seen], self.info, self.device)
                record = {"epoch": epoch + 1, "step": self.global_step,
                          "train/loss": loss_sum / max(n_steps, 1),
                          "train/accuracy": correct / max(seen, 1),
                          "lr": method.lr(), "train/seconds": train_time,
                          "train/images_per_s": n_images / max(train_time, 1e-9)}
                self.epoch, self.step_in_epoch = epoch + 1, 0
                if evaluate_epoch is not None and self.eval_every and (
                        self.epoch % self.eval_every == 0 or self.epoch == self.epochs):
                    record.update(evaluate_epoch())
                if self.info.is_main:
                    for lg in self.loggers:
                        lg.log_epoch(record)
                    if self.progress:
                        tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in record.items() if "seconds" not in k))
                self.history_tail = record
                if self.checkpoint_every and (self.epoch % self.checkpoint_every == 0
                                              or self.epoch == self.epochs):
                    self.save(method, backprop, generator, extra)

    def _stop_requested(self, stop: _StopFlag) -> bool:
        if not self.info.enabled:
            return stop.raised
        flag = D.all_reduce_sum([float(stop.raised)], self.info, self.device)[0]
        return flag > 0
