"""Test-only fault hook: the trainer loads this file when MEGATRON_ULYSSES_FAULT_HOOK names it
and calls `at(phase, iteration)` at each point `megatron_ulysses.training.exits.at` marks.

PLANT="<phase>:<iteration>:<ranks>:<fault>" (ranks comma-separated) plants, on those ranks:
- `error`: a RuntimeError; in phase `save` it is raised once the save has written its files,
  before they are recorded and committed (with --async-save: in its finalize step);
- `enospc`: in phase `save`, every checkpoint file write fails with ENOSPC (in the writer
  process too, with --async-save);
- `sigint`: SIGINT as Ctrl-C in a terminal sends it: to torchrun (the rank's parent) under
  torchrun, else to the job's process group; in phase `save`, from inside the checkpoint write
  (with --async-save: from the writer process, mid-write).
Before it, `$PLANT_DIR/rank<r>.json` gets the rank's pid, its descendants' pids and the time.
"""

import errno
import json
import os
import signal
import time

MESSAGE = "planted fault"


def _descendants(pid: int) -> list:
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _record(rank: int) -> None:
    with open(os.path.join(os.environ["PLANT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "descendants": _descendants(os.getpid()),
                   "time": time.time()}, f)


def _interrupt(launcher: int) -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        os.kill(launcher, signal.SIGINT)
    else:
        os.killpg(os.getpgrp(), signal.SIGINT)


def _patch_writes(before) -> None:
    """Every checkpoint file write (in megatron-core's writer processes too) calls `before`."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real = filesystem_async._write_item

    def write(*args, **kwargs):
        before()
        return real(*args, **kwargs)

    filesystem_async._write_item = write


def _full() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _interrupt_once(launcher: int) -> None:
    if not os.environ.get("PLANT_FIRED"):
        os.environ["PLANT_FIRED"] = "1"
        _interrupt(launcher)
        time.sleep(2)  # still writing when the signal arrives


def _fail_mid_save(iteration: int) -> None:
    from megatron_ulysses.training.checkpoint import save_guard

    real = save_guard.seal

    def seal(staging, rank):
        if os.path.basename(staging).startswith(f"iter_{iteration:07d}."):
            raise RuntimeError(f"{MESSAGE} while saving to {staging}")
        real(staging, rank)  # an earlier async save's commit

    save_guard.seal = seal


def at(phase: str, iteration: int) -> None:
    want_phase, want_iteration, ranks, fault = os.environ["PLANT"].split(":")
    rank = int(os.environ.get("RANK", "0"))
    if (phase, iteration) != (want_phase, int(want_iteration)) or \
            str(rank) not in ranks.split(","):
        return
    _record(rank)
    if fault == "enospc":
        _patch_writes(_full)
    elif fault == "sigint" and phase == "save":
        launcher = os.getppid()
        _patch_writes(lambda: _interrupt_once(launcher))
    elif fault == "sigint":
        _interrupt(os.getppid())
        time.sleep(60)  # the SIGINT arrives meanwhile
    elif phase == "save":
        _fail_mid_save(iteration)
    else:
        raise RuntimeError(f"{MESSAGE} at {phase} {iteration}")
