"""Test-only fault hook: the trainer loads this file when MEGATRON_ULYSSES_FAULT_HOOK names it
and calls `at(phase, iteration)` at each point `megatron_ulysses.training.exits.at` marks.

PLANT="<phase>:<iteration>:<ranks>:<fault>" (ranks comma-separated) plants, on those ranks:
- `error`: a RuntimeError; in phase `save` it is raised once the save has written its files,
  before they are recorded and committed (with --async-save: in its finalize step);
- `enospc`: in phase `save`, every checkpoint file write fails with ENOSPC (in the writer
  process too, with --async-save);
- `sigint`: SIGINT as Ctrl-C in a terminal sends it: to torchrun (the rank's parent) under
  torchrun, else to the job's process group.
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


def _fail_writes() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    filesystem_async._write_item = full


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
        _fail_writes()
    elif fault == "sigint":
        if "TORCHELASTIC_RUN_ID" in os.environ:
            os.kill(os.getppid(), signal.SIGINT)
        else:
            os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(60)  # the SIGINT arrives meanwhile
    elif phase == "save":
        _fail_mid_save(iteration)
    else:
        raise RuntimeError(f"{MESSAGE} at {phase} {iteration}")
