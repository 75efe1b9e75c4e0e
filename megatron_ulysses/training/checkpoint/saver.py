"""What persists between the saves of one run (Megatron-LM's `checkpointing_context`): the
save strategy, kept so that --ckpt-assume-constant-structure can reuse its cached plan, and the
queue of --async-save requests (megatron-core's `AsyncCallsQueue`).

An async save returns once the tensors are staged in host memory; a writer process writes the
files; its request's finalize steps (megatron-core's metadata, then ours: fsync, commit, tracker,
--save-retain-interval) run on every rank when `finalize` finds the write done, so the tracker
still moves only after a complete checkpoint. The loop calls `finalize` every iteration
(non-blocking), before the next save and at the end (blocking).
"""

import torch
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)

from ..logging import print_rank_0
from .save_guard import save_error


class CheckpointSaver:
    """`config`: the `CheckpointConfig`."""

    def __init__(self, config):
        self.config = config
        self._strategy = None
        self.queue = None
        self._pending = None  # the scheduled save: (root, iteration, staging, needed_bytes)
        if config.async_save:
            # megatron-core's persistent worker sets a CUDA device in its spawned process; on
            # CPU each save forks its own writer (megatron-core's TemporalAsyncCaller).
            persistent = torch.cuda.is_available()
            if not persistent:
                print_rank_0(" WARNING: --use-persistent-ckpt-worker: the persistent checkpoint "
                             "worker needs CUDA; each async save forks its own writer process")
            self.queue = AsyncCallsQueue(persistent=persistent)

    def strategy(self):
        """megatron-core's torch_dist save strategy. --ckpt-fully-parallel-save: each tensor
        replicated over megatron-core's DP group (DP x SP) is written by one of its replicas,
        chosen to spread the bytes evenly, instead of all by the first (rank 0 at TP = PP = 1
        would write the whole model); the files are the same either way.
        --ckpt-assume-constant-structure: the same strategy object for every save, with its plan
        and distribution cached."""
        if self._strategy is not None and self.config.ckpt_assume_constant_structure:
            return self._strategy
        strategy = get_default_save_sharded_strategy("torch_dist")
        strategy.use_cached_ckpt_structure = self.config.ckpt_assume_constant_structure
        if self.config.ckpt_fully_parallel_save:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, mpu.get_data_parallel_group(),
                do_cache_distribution=self.config.ckpt_assume_constant_structure)
        self._strategy = strategy
        return strategy

    @property
    def validate_structure(self) -> bool:
        """Whether a save checks the sharding's integrity: always, except after the first save
        with --ckpt-assume-constant-structure (as Megatron-LM)."""
        return not (self.config.ckpt_assume_constant_structure and self._strategy is not None)

    def schedule(self, request, save) -> None:
        """Start an async save's write (every rank); the previous one is finalized first.
        `save`: (root, iteration, staging, needed_bytes), for the message if it fails."""
        self.finalize(blocking=True)
        self.queue.schedule_async_request(request)
        self._pending = save

    def finalize(self, blocking: bool = False) -> None:
        """Run the finalize steps of the async saves whose writes are done on every rank
        (blocking: wait for all). A collective: every rank calls it at the same points. A
        write that failed on I/O (in the writer process) is one `SaveError`, as in a
        synchronous save."""
        if self.queue is None:
            return
        try:
            self.queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as error:
            failure = self._pending and save_error(error, *self._pending)
            if not failure:
                raise
            raise failure from None
        if self.queue.get_num_unfinalized_calls() == 0:
            self._pending = None

    def close(self) -> None:
        """Finish every pending save (the end of the run, an exit)."""
        if self.queue is not None:
            self.finalize(blocking=True)
            self.queue.close()
