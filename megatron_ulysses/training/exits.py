"""When a run stops early: --exit-signal-handler (SIGTERM) and --exit-duration-in-mins, agreed on
by every rank after each iteration; and, for the one line a failed or interrupted (Ctrl-C) run
ends with, where the run is (`at`) and which checkpoint is the last complete one."""

import importlib.util
import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from .. import cpu_compat


class ExitRequest:
    """Whether to save and exit after this iteration, the same answer on every rank: SIGTERM
    received on any rank (--exit-signal-handler) or --exit-duration-in-mins passed on any rank
    since `start` (one collective per iteration, only with either flag)."""

    def __init__(self, signal_handler: bool, duration_in_mins: Optional[float], start: float):
        self.received = False
        self.signal_handler, self.duration_in_mins, self.start = (
            signal_handler, duration_in_mins, start)
        if signal_handler:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def reason(self) -> Optional[str]:
        """None, or why the run stops now."""
        if not self.signal_handler and self.duration_in_mins is None:
            return None
        late = (self.duration_in_mins is not None
                and time.time() - self.start >= 60 * self.duration_in_mins)
        flag = torch.tensor([2 if self.received else int(late)], device=cpu_compat.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return {0: None, 1: f"--exit-duration-in-mins {self.duration_in_mins} passed",
                2: "SIGTERM received"}[int(flag.item())]


# Tests only: a Python file whose `at(phase, iteration)` runs at each point `at` marks (to plant
# a fault there).
HOOK_ENV = "MEGATRON_ULYSSES_FAULT_HOOK"
_PHASES = {"setup": "before the first step", "step": "in iteration {}",
           "evaluate": "evaluating after iteration {}", "save": "saving iteration {}",
           "end": "after the last iteration ({})"}
_position = {"phase": "setup", "iteration": 0, "hook": None}
_interrupted = []


def at(phase: str, iteration: int) -> None:
    """The run is now in `phase` (a key of _PHASES) of `iteration`."""
    _position.update(phase=phase, iteration=iteration)
    if os.environ.get(HOOK_ENV):
        if _position["hook"] is None:
            spec = importlib.util.spec_from_file_location("fault_hook", os.environ[HOOK_ENV])
            _position["hook"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(_position["hook"])
        _position["hook"].at(phase, iteration)


def where() -> str:
    return _PHASES[_position["phase"]].format(_position["iteration"])


def last_checkpoint(save: Optional[str]) -> str:
    """Which checkpoint a resume starts from, as a clause."""
    if not save:
        return "nothing was saved (no --save)"
    from .checkpoint.state import read_tracker

    try:
        iteration = read_tracker(save)
    except (OSError, ValueError):
        iteration = None
    if iteration is None:
        return f"--save {save} holds no complete checkpoint"
    return (f"the last complete checkpoint is iteration {iteration} in --save {save} (resume "
            f"with --load {save})")


def watch_interrupt() -> None:
    """Ctrl-C: SIGINT raises KeyboardInterrupt, as by default, and is remembered, so that a rank
    whose collective failed because another rank stopped on it still ends as interrupted."""
    def handle(signum, frame):
        _interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handle)


def interrupted() -> bool:
    return bool(_interrupted)
