"""What pretrain_gpt.py and the tools that run under torchrun share at their edges: one message
per configuration error, said by rank 0, and a prompt exit after an error with several ranks."""

import os
import signal
import sys
import time

RANK_0_GRACE_S = 30  # how long the other ranks give rank 0 to report an error and exit


def is_rank_0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def say_warnings(prog: str, warnings) -> None:
    """The run config's warnings, once, by rank 0."""
    if is_rank_0():
        for warning in warnings:
            print(f"{prog}: warning: {warning}", file=sys.stderr)


def report_error(prog: str, error: Exception) -> int:
    """Every rank finds the same configuration error; rank 0 says it. The others wait before
    they exit: torchrun stops every rank as soon as one exits, which could otherwise be before
    rank 0 has written the message; rank 0's exit ends the wait. A rank still alive after it
    (rank 0 did not find the error) says it itself. Returns the exit status, 2."""
    if not is_rank_0():
        # The run is over: torchrun's SIGTERM, once rank 0 has said it, ends the wait (an
        # --exit-signal-handler would only note it, and torchrun would wait 30 s to SIGKILL).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(RANK_0_GRACE_S)
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    return 2


def alone() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_world_size() == 1


def leave(code: int) -> int:
    """After an error with several ranks, exit at once: the others may be inside a collective
    this rank will never join, and tearing the process groups down can wait for them until the
    timeout; torchrun stops them when this rank exits. Alone, return the code."""
    if not alone():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def stop_children() -> None:
    """End this rank's multiprocessing children (megatron-core's checkpoint saves start a
    `multiprocessing.Manager` server) before an error exit: `os._exit`, or the SIGTERM torchrun
    sends the other ranks, skips their finalizers, and an orphan would keep the job's stdout
    open (and its launcher waiting) after every rank is gone."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()


def run_distributed(prog: str, body, reporters=None) -> int:
    """Run `body()` (it starts the process groups) and tear the groups down after it. A
    `ConfigError` (a file or a --load found bad) is one message by rank 0, exit 2; `reporters`
    maps other exception types to a function that reports one and returns the exit status.
    With several ranks any error exits at once (`leave`)."""
    import traceback

    import torch.distributed as dist

    from ..sp import parallel_state as ps
    from .arguments import ConfigError

    reporters = {ConfigError: lambda error: report_error(prog, error), **(reporters or {})}
    try:
        body()
    except tuple(reporters) as error:
        stop_children()
        return leave(next(report for kind, report in reporters.items()
                          if isinstance(error, kind))(error))
    except BaseException:
        stop_children()
        if not alone():
            traceback.print_exc()
            leave(1)
        raise
    finally:  # reached on success, or alone (with several ranks an error left above)
        if ps.is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
