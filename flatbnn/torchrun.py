"""torchrun with exit codes a requeue script can rely on.

    python -m flatbnn.torchrun --nproc_per_node=2 train.py ...      (torchrun's own arguments, unchanged)
    flatbnn-torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT train.py ...

Plain torchrun exits 1 whenever a worker fails, and on SIGTERM its agent raises, kills the workers after a
grace period and loses their exit codes -- so a job whose every worker checkpointed and exited 75 ends as 1.
This wrapper runs torchrun's own launcher (same rendezvous, same environment for the workers) and

* forwards SIGTERM / SIGUSR1 / SIGUSR2 / SIGHUP to the workers and waits: they finish the step, checkpoint, exit 75;
* exits 75 when the workers stopped that way (75, or killed by the agent after a peer exited 75), 0 when all
  finished, else the first failing worker's own code (2 = bad input, 1 = a failure);
* turns a failed rendezvous (a node that never arrives within ``--rdzv-conf join_timeout=S``, an
  unreachable endpoint) into one line and exit 1.
"""

from __future__ import annotations

import os
import signal
import sys

EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_KILLED = {-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL}


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def _forward(signum, frame) -> None:
    for pid in _children(os.getpid()):
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def job_exit_code(codes: dict[int, int], first_rank: int | None = None) -> int:
    """One exit code for the failed workers' codes ``{global rank: code}`` (negative = killed by that signal)."""
    if not codes:
        return 0
    values = set(codes.values())
    if EXIT_PREEMPTED in values and values <= {EXIT_PREEMPTED} | _KILLED:
        return EXIT_PREEMPTED
    code = codes[first_rank] if first_rank in codes else codes[min(codes)]
    stopped = {EXIT_PREEMPTED} | _KILLED
    if code in stopped and any(v not in stopped for v in values):  # the root cause, not a stop or kill it caused
        code = next(v for _, v in sorted(codes.items()) if v not in stopped)
    return 128 - code if code < 0 else (code or 1)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    # the agent must not turn SIGTERM into "kill every worker": ours forward it and the workers checkpoint
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGINT,SIGQUIT"  # older torch reads only this
    if hasattr(args, "signals_to_handle"):  # newer torch: a flag that overwrites the variable
        args.signals_to_handle = os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"]
    for sig in STOP_SIGNALS:
        signal.signal(sig, _forward)
    try:
        run(args)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        code = job_exit_code(codes, e.get_first_failure()[0])
        print(f"flatbnn-torchrun: workers exited {dict(sorted(codes.items()))} -> exit {code}", file=sys.stderr)
        return code
    except (RendezvousError, TimeoutError, ConnectionError) as e:
        text = " ".join(str(e).split())[:300]
        print(f"flatbnn-torchrun: error: rendezvous failed ({type(e).__name__}: {text}); every node must start "
              f"with the same --nnodes / --rdzv-endpoint / --rdzv-id within --rdzv-conf join_timeout", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
