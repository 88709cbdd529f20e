"""The single training loop. It knows nothing method-specific: it calls
``method.train_step(batch, flatness, backprop)`` and ``method.on_epoch_end(epoch)``.

Duties: epochs, progress bar, per-epoch metrics, atomic checkpoints (incl. sampler position and
every RNG state), resume, SIGTERM/SIGUSR1 preemption, stopping on a non-finite loss.

Divergence: a checkpoint can hold weights whose next step is already non-finite (the last update
before it blew up). So the newest checkpoint that a finite step has followed is kept as ``good.pt``
(a hard link, no copy); when a run diverges, ``last.pt`` is rewound to it (the newer one is kept as
``diverged.pt``), so the advised rerun -- a lower lr via ``trainer.resume_overrides`` -- resumes from
weights that were fine. A finished run keeps only ``last.pt``.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flatbnn.engine import distributed as D
from flatbnn.engine.backprop import global_rng_state, set_global_rng_state
from flatbnn.engine.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, checkpoint_problem, link_checkpoint,
                                      save_checkpoint)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again" -- requeue the job, it resumes from the checkpoint


def shows_bar(progress: bool, stream=None) -> bool:
    """Whether tqdm's bar is drawn: ``trainer.progress`` and a terminal where it goes (stderr). Into a file (SLURM
    logs, ``2> log``) a bar is only carriage returns; the epoch lines (:func:`print_epoch_line`) say what it would."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(progress) and callable(isatty) and bool(isatty())


def print_epoch_line(record: dict) -> None:
    """An epoch's line on stdout (above the progress bar where one is drawn), flushed: a redirected stdout is
    block-buffered (``> log``, SLURM), and the next epoch's bar flushed it only by chance (tqdm flushes at start) --
    the last epoch's line waited for the final predictive and the exit; without a bar, every line waited."""
    tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in record.items() if "seconds" not in k), file=sys.stdout)
    sys.stdout.flush()


class Diverged(RuntimeError):
    pass


class Preempted(Exception):
    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum  # which signal stopped the run (train.py hands SIGUSR2 on to submitit's requeue)


# SIGTERM / SIGUSR1 (SLURM preemption, `scancel --signal`), SIGUSR2 (submitit's time-limit / preemption signal),
# SIGHUP (the terminal closed: like SIGTERM, exit 75) and SIGINT (Ctrl-C: the same stop, exit 130; a second Ctrl-C
# stops at once)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT)
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for Ctrl-C
STOP_AGREE_SECONDS = 5.0  # DDP: the ranks agree on a stop at least this often (well inside torchrun's 30 s grace)


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """DataLoader ``worker_init_fn``: a job's stop signal goes to its whole process group (SLURM, docker,
    systemd, Ctrl-C); a worker that died of it would fail the main process's next batch before it could
    checkpoint. Workers ignore it; the main process stops them when it leaves the loop."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # forked with them blocked (workers_forked_deaf): ignored from here on
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def workers_forked_deaf(loader):
    """``iter(loader)`` with the stop signals blocked while it forks its workers: a signal to the process group
    that arrives between a worker's fork and its ``worker_init_fn`` would otherwise kill that worker (and fail
    the main process's next batch before it checkpoints). Pending signals reach the main process right after."""
    if not getattr(loader, "num_workers", 0) or not hasattr(signal, "pthread_sigmask"):
        return iter(loader)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _StopFlag:
    """A stop signal -> finish the step, checkpoint, exit."""

    def __init__(self):
        self.raised = False
        self.signum = None
        self._old = {}

    def __enter__(self):
        for sig in STOP_SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.raised and signum == signal.SIGINT:  # a second Ctrl-C: stop now (the last checkpoint stays)
            raise KeyboardInterrupt
        self.raised = True
        self.signum = signum

    def __exit__(self, exc_type, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self.raised and exc_type is None and callable(self._old.get(self.signum)):
            # arrived after the last step's check (final epoch end): the caller's handler (train.py) must see it
            signal.raise_signal(self.signum)


def position_problem(state: dict, epochs: int, steps_per_epoch: int | None, steps_changed: bool) -> str | None:
    """Does a checkpoint's position (epoch, step in it, global step) fit this run's schedule? A hand-edited
    ``epoch`` would otherwise finish with ``meta.epochs`` claiming the full budget while ``steps`` says not."""
    epoch, step, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
    if epoch > epochs or (epoch == epochs and step):
        return (f"its position (epoch {epoch}, step {step}) is past this run's {epochs} epochs "
                f"(more epochs: trainer.epochs=<n> trainer.resume_overrides=[trainer.epochs])")
    if steps_per_epoch is None or steps_changed:  # the steps per epoch changed on a resume: no single formula
        return None
    # step == steps_per_epoch: stopped right after the epoch's last step, before its end-of-epoch work (the resume
    # runs no step of it and goes straight to that work)
    if step > steps_per_epoch or global_step != epoch * steps_per_epoch + step:
        return (f"its position disagrees with the schedule: epoch {epoch}, step {step} at {steps_per_epoch} "
                f"steps per epoch is global step {epoch * steps_per_epoch + step}, the checkpoint says {global_step}")
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


class Trainer:
    def __init__(self, *, epochs: int, run_dir: Path, info: D.DistInfo, device: torch.device,
                 checkpoint_every: int = 1, eval_every: int = 1, progress: bool = True,
                 limit_train_batches: int | None = None, channels_last: bool = False,
                 loggers=(), log_every: int = 50):
        self.epochs = int(epochs)
        self.run_dir = Path(run_dir)
        self.ckpt_path = self.run_dir / "checkpoints" / "last.pt"
        self.good_path = self.ckpt_path.with_name("good.pt")          # newest checkpoint a finite step followed
        self.diverged_path = self.ckpt_path.with_name("diverged.pt")  # the one after it, when the run diverged
        self._unverified: Path | None = None  # the checkpoint the run stands on, until a finite step follows it
        self._last_is_good = False
        self.info = info
        self.device = device
        self.checkpoint_every = int(checkpoint_every)
        self.eval_every = int(eval_every)
        # rank 0 prints one line per epoch wherever stdout goes; the bar only where a person watches a terminal
        self.show_bar = shows_bar(progress) and info.is_main
        self.limit = limit_train_batches
        self.channels_last = channels_last
        self.loggers = list(loggers)
        # the per-step loss stays on the device and is read every log_every steps (and before any
        # checkpoint): reading it each step is a host sync that stalls the GPU queue
        self.log_every = max(int(log_every), 1)
        # position
        self.epoch = 0
        self.step_in_epoch = 0
        self.global_step = 0
        self.elapsed = 0.0
        self.history_tail: dict = {}
        # replaces method.train_step when set (trainer.cuda_graph: engine/graphed.py's GraphedStep)
        self.train_step = None
        self._epoch_sums: dict | None = None  # the resumed epoch's running sums (restore)
        self._next_agreement: int | None = None  # DDP: the global step at which the ranks next agree on a stop
        self._agreed_at: tuple[int, float] | None = None  # (global step, time) of the last agreement

    # ---------------------------------------------------------------- state
    def state(self, method, backprop, generator, extra: dict, epoch_sums: dict | None = None) -> dict:
        rng = {"global": global_rng_state(), "generator": generator.get_state() if generator is not None else None}
        per_rank = [(rng, epoch_sums)]
        if self.info.enabled:
            per_rank = [None] * self.info.world_size
            torch.distributed.all_gather_object(per_rank, (rng, epoch_sums))
        return {
            "format": CHECKPOINT_FORMAT,
            "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
            "elapsed": self.elapsed, "world_size": self.info.world_size,
            "method": method.state_dict(), "backprop": backprop.state_dict(),
            "rng": [r for r, _ in per_rank],
            # a mid-epoch checkpoint: the running sums of the epoch so far (per rank), so the resumed epoch's
            # metrics.jsonl line is the uninterrupted run's
            "epoch_sums": [e for _, e in per_rank] if epoch_sums is not None else None,
            **extra,
        }

    def restore(self, state: dict, method, backprop, generator, path: Path | None = None, *,
                steps_per_epoch: int | None = None, schedule_changed: bool = False) -> None:
        """Put the run back where ``state`` stands. Its structure and position are checked first: a
        hand-edited or foreign checkpoint is one line naming the file and what is wrong, not a traceback
        from deep inside ``load_state_dict`` (nor a run whose ``meta.epochs`` and ``steps`` disagree)."""
        where = path or "the checkpoint"
        if state.get("world_size", 1) != self.info.world_size:
            raise CheckpointError(
                f"{where} was written by {state['world_size']} processes, this run has "
                f"{self.info.world_size}; resume with the same number (results depend on it), or start afresh "
                f"with trainer.resume=false or another hydra.run.dir")
        problem = (checkpoint_problem(state, self.info.world_size)
                   or position_problem(state, self.epochs, steps_per_epoch, schedule_changed))
        if problem is not None:
            raise CheckpointError(f"{where}: {problem}; delete it to start over, or set trainer.resume=false")
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step, self.elapsed = state["global_step"], state["elapsed"]
        self._epoch_sums = (state.get("epoch_sums") or [None] * self.info.world_size)[self.info.rank]
        try:
            method.load_state_dict(state["method"])
            backprop.load_state_dict(state["backprop"])
            rng = state["rng"][self.info.rank]
            set_global_rng_state(rng["global"])
            if generator is not None and rng["generator"] is not None:
                generator.set_state(rng["generator"])
        except (RuntimeError, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            first = " ".join(str(e).split())[:240] or type(e).__name__
            raise CheckpointError(f"{where} does not fit this run ({type(e).__name__}: {first}); delete it to "
                                  f"start over, or set trainer.resume=false") from None
        self._unverified = Path(path) if path is not None else None


    def save(self, method, backprop, generator, extra: dict, epoch_sums: dict | None = None) -> None:
        state = self.state(method, backprop, generator, extra, epoch_sums)  # collective under DDP
        if self.info.is_main:
            save_checkpoint(self.ckpt_path, state)
        self._unverified, self._last_is_good = self.ckpt_path, False
        D.barrier(self.info)

    def _promote(self) -> None:
        """A finite step followed the checkpoint the run stands on: it is the newest good one."""
        src, self._unverified = self._unverified, None
        self._last_is_good = _same_file(src, self.ckpt_path)
        if self.info.is_main and src.exists() and not _same_file(src, self.good_path):
            link_checkpoint(src, self.good_path)

    def _rewind_after_divergence(self) -> str:
        """Make ``last.pt`` the newest checkpoint a finite step followed (rank 0 moves files); says where
        a rerun resumes."""
        last, good, main = self.ckpt_path, self.good_path, self.info.is_main
        on_last = self._unverified is not None and _same_file(self._unverified, last)
        if not on_last or _same_file(last, good):
            if last.exists():
                return f"a rerun resumes from {last}" + (
                    ", which a finite step followed" if self._last_is_good or _same_file(last, good) else "")
            if good.exists():  # resumed from another run's checkpoint (good.pt since a finite step followed it)
                if main:
                    link_checkpoint(good, last)
                return f"a rerun resumes from {last}, the checkpoint this run resumed from (a finite step followed it)"
            return "no checkpoint in this run dir yet: a rerun starts over"
        if main:
            os.replace(last, self.diverged_path)
        if good.exists():
            if main:
                link_checkpoint(good, last)
            return (f"{last} is rewound to the newest checkpoint a finite step followed (the newer one, whose "
                    f"next step was not finite, is kept as {self.diverged_path.name})")
        return (f"no checkpoint was followed by a finite step (the last one is kept as {self.diverged_path.name}): "
                f"a rerun starts over")

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
                sums, self._epoch_sums = self._epoch_sums or {}, None  # a resumed epoch goes on from its sums
                loss_sum, n_steps, n_images = sums.get("loss_sum", 0.0), sums.get("steps", 0), sums.get("images", 0)
                seconds_before = sums.get("seconds", 0.0)
                pending = []  # (loss, lr) of steps not read yet (the loss a device tensor)
                bar = tqdm(total=steps_per_epoch, initial=self.step_in_epoch, disable=not self.show_bar,
                           desc=f"epoch {epoch + 1}/{self.epochs}", leave=False, dynamic_ncols=True)
                for batch in workers_forked_deaf(loader):
                    if self.step_in_epoch >= steps_per_epoch:
                        break
                    batch = self.to_device(batch)
                    if flatness.rho_schedule == "lr":
                        flatness.set_lr_ratio(method.lr_ratio())
                    # the lr this step ran with, for the divergence line: a host float on the eager path (free);
                    # a graphed step keeps it on the device (reading it would sync): then the lr at the check
                    lr = method.lr() if self.train_step is None else None
                    out = (self.train_step or method.train_step)(batch, flatness, backprop)
                    pending.append((out["loss"], lr))
                    n_steps += 1
                    n_images += batch[1].numel()
                    self.step_in_epoch += 1
                    self.global_step += 1
                    bar.update(1)
                    if len(pending) >= self.log_every:
                        loss_sum += self._read_losses(pending, epoch, bar, method)
                    if self._stop_requested(stop):
                        loss_sum += self._read_losses(pending, epoch, bar, method)  # never checkpoint a NaN
                        bar.close()
                        seconds = time.perf_counter() - t0
                        self.elapsed += seconds
                        correct, seen = method.pop_train_accuracy()
                        self.save(method, backprop, generator, extra, epoch_sums={
                            "loss_sum": loss_sum, "steps": n_steps, "images": n_images,
                            "correct": sums.get("correct", 0.0) + correct, "seen": sums.get("seen", 0) + seen,
                            "seconds": seconds_before + seconds})
                        raise Preempted(f"stopped by {signal.Signals(stop.signum).name} at epoch {epoch + 1}, "
                                        f"step {self.step_in_epoch} of {steps_per_epoch}; checkpoint "
                                        f"{self.ckpt_path}", stop.signum)  # the entry point adds the command that resumes
                loss_sum += self._read_losses(pending, epoch, bar, method)
                bar.close()
                method.on_epoch_end(epoch)
                train_time = time.perf_counter() - t0
                self.elapsed += train_time
                train_time += seconds_before  # images/s over the whole epoch's steps, before and after a resume
                correct, seen = method.pop_train_accuracy()
                correct, seen = correct + sums.get("correct", 0.0), seen + sums.get("seen", 0)
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
                    print_epoch_line(record)
                self.history_tail = record
                if self.checkpoint_every and (self.epoch % self.checkpoint_every == 0
                                              or self.epoch == self.epochs):
                    self.save(method, backprop, generator, extra)
            if self.info.is_main:  # trained to the end: last.pt is the result, the fallbacks are no longer needed
                self.good_path.unlink(missing_ok=True)
                self.diverged_path.unlink(missing_ok=True)

    def _read_losses(self, pending: list, epoch: int, bar, method) -> float:
        """Sum of the ``pending`` step losses, read in one host sync, then cleared; ``Diverged`` names
        the first non-finite one (those steps ran before the check, but no checkpoint was written since)."""
        if not pending:
            return 0.0
        losses = torch.stack([torch.as_tensor(v, device=self.device).detach().double().reshape(())
                              for v, _ in pending]).cpu().tolist()
        if self._unverified is not None and math.isfinite(losses[0]):  # the first step after the checkpoint
            self._promote()
        for i, loss in enumerate(losses):
            if not math.isfinite(loss):  # host floats by now: no further device reads
                back = len(losses) - i - 1  # steps taken after the bad one
                raise Diverged(
                    f"non-finite loss ({loss}) at epoch {epoch + 1}, step {self.step_in_epoch - back} "
                    f"(global step {self.global_step - back}, lr {pending[i][1] if pending[i][1] is not None else method.lr():.3g}); "
                    f"{self._rewind_after_divergence()}; rerun with a lower optimizer.lr and "
                    f"trainer.resume_overrides=[optimizer.lr] (likewise flatness.rho, or trainer.precision=fp32)")
        pending.clear()
        bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{method.lr():.3g}", refresh=False)
        total = 0.0
        for loss in losses:  # in step order, in float64: the same sum as reading each step
            total += loss
        return total

    def _stop_requested(self, stop: _StopFlag) -> bool:
        if not self.info.enabled:
            return stop.raised
        # every rank must stop at the same step, which costs a collective and a host read: agreed at most every
        # log_every global steps, and at least every STOP_AGREE_SECONDS -- torchrun kills a worker 30 s after its
        # SIGTERM, and 50 slow steps take longer. The next agreement's step comes from the all-reduced mean step
        # time, so every rank picks the same one.
        if self._next_agreement is None:
            self._next_agreement, self._agreed_at = self.global_step, (self.global_step, time.perf_counter())
        if self.global_step < self._next_agreement:
            return False
        steps, seconds = self.global_step - self._agreed_at[0], time.perf_counter() - self._agreed_at[1]
        flag, step_seconds = D.all_reduce_sum([float(stop.raised), seconds / max(steps, 1) / self.info.world_size],
                                              self.info, self.device)
        interval = 1 if steps == 0 else min(self.log_every, max(  # the first: one step, to time it
            1, int(STOP_AGREE_SECONDS / max(step_seconds, 1e-9))))
        self._next_agreement, self._agreed_at = self.global_step + interval, (self.global_step, time.perf_counter())
        return flag > 0
