"""What pretrain_gpt.py and the tools that run under torchrun share at their edges: one message
per configuration error, said by rank 0, and a prompt exit after an error with several ranks."""

import os
import signal
import sys
import time

RANK_0_GRACE_S = 30  # how long the other ranks give rank 0 to report an error and exit
# A collective that failed because another rank is gone (gloo's words; NCCL's watchdog aborts):
# that rank says why, so this one waits for torchrun to stop it before it says anything.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
PEER_GRACE_S = 5


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
    """SIGKILL this rank's multiprocessing children (DataLoader workers, megatron-core's
    `multiprocessing.Manager` and checkpoint writers) before the rank exits. They keep SIGTERM
    blocked (`processes.helpers_keep_signals_blocked`), so multiprocessing's exit handler,
    which terminates and joins them, would wait forever; an orphan would also keep the job's
    stdout open. SIGCHLD back to the default first: torch's DataLoader handler raises on a
    killed worker."""
    import multiprocessing

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)


def report_unexpected(prog: str, error: BaseException, ending=None) -> int:
    """Ctrl-C (SIGINT): one line by rank 0, exit status 130 (128 + SIGINT). Any other error:
    its traceback and one line naming it and the rank, exit status 1 (a collective failed by a
    rank that is gone first waits `PEER_GRACE_S` for torchrun). `ending()`: where the run
    stopped and what it leaves, appended to the line."""
    import traceback

    from .exits import interrupted

    tail = f"; {ending()}" if ending is not None else ""
    if isinstance(error, KeyboardInterrupt) or interrupted():
        if is_rank_0():
            print(f"{prog}: interrupted (SIGINT){tail}", file=sys.stderr, flush=True)
        return 130
    if any(words in str(error) for words in PEER_GONE):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop ends the wait
        time.sleep(PEER_GRACE_S)
    traceback.print_exc()
    first = (str(error).strip().splitlines() or [""])[0][:300]
    print(f"{prog}: error: {type(error).__name__} on rank {os.environ.get('RANK', '0')}: "
          f"{first} (traceback above){tail}", file=sys.stderr, flush=True)
    return 1


def worker_error(error: BaseException) -> BaseException:
    """`error` as a DataLoader worker raised it: torch re-raises a worker's exception in the
    main process as the same type, with "Caught ... Original Traceback ..." before its message."""
    text, marker = str(error), f"{type(error).__name__}: "
    if not (text.startswith("Caught ") and "\nOriginal Traceback" in text and marker in text):
        return error
    try:
        return type(error)(text[text.rindex(marker) + len(marker):].strip())
    except Exception:  # a type whose constructor takes more than the message
        return error


def run_distributed(prog: str, body, reporters=None, ending=None) -> int:
    """Run `body()` (it starts the process groups) and tear the groups down after it. A
    `ConfigError` (a file or a --load found bad) is one message by rank 0, exit 2; `reporters`
    maps other exception types to a function that reports one (as raised, also from a DataLoader
worker) and returns the exit status;
    anything else is `report_unexpected`'s (with `ending`). Helper processes are killed at the
    end (on an error first), and with several ranks any error exits at once (`leave`)."""
    import torch.distributed as dist

    from ..sp import parallel_state as ps
    from .arguments import ConfigError

    reporters = {ConfigError: lambda error: report_error(prog, error), **(reporters or {})}
    try:
        body()
    except SystemExit:
        raise
    except BaseException as error:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut this short
        stop_children()
        report = next((report for kind, report in reporters.items()
                       if isinstance(error, kind)), None)
        if report is None:
            return leave(report_unexpected(prog, error, ending))
        return leave(report(worker_error(error)))
    finally:  # reached on success, or alone (with several ranks an error left above)
        stop_children()  # also on success: something may still hold a DataLoader's iterator
        if ps.is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
