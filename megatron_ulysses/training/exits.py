"""When a run stops early: --exit-signal-handler (SIGTERM) and --exit-duration-in-mins, agreed on
by every rank after each iteration."""

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
