"""Random streams under Ulysses SP: the same weights on every rank, different dropout masks on
every sequence shard and head group.

megatron-core draws from two kinds of stream, on GPU and (through `cpu_compat`) on CPU
alike:

    default generator     torch's own (CPU, and CUDA on GPU): CPU weight initialization and the
                          GPU initialization of weights that are not TP-split; hidden and
                          embedding dropout without --sequence-parallel.
    model-parallel-rng    the RNG tracker's stream (`tensor_parallel.get_cuda_rng_tracker()`):
                          GPU initialization of TP-split weights; with --sequence-parallel the
                          whole transformer block and the embedding dropout run under it; the
                          attention dropout of every backend (UlyssesAttention forks it; the
                          local backend's megatron-core attention and TE's DotProductAttention,
                          given `get_rng_state_tracker`, fork it too).

megatron-core seeds them per TP rank only (`model_parallel_cuda_manual_seed`), which is right for
its own data parallelism but not for SP ranks, which hold different tokens (hidden dropout) and,
inside attention, different heads (attention dropout). So two sets of seeds:

    weight init   `seed` on every rank: the default generator `seed`, model-parallel-rng
                  `seed + 2718 + tp_rank` (megatron-core's own), identical over DP x SP, so
                  every SP and DP rank builds the same weights as an SP = 1 run.
    dropout       `dropout_seed(seed)` = seed + 1_000_000 * (1 + sp_rank) + 100 * pp_rank,
                  through the same seeding: the default generator differs across SP ranks and
                  pipeline stages (as Megatron-LM's `seed + 100 * pp_rank`) but not TP ranks
                  (which hold replicas of the same hidden states), model-parallel-rng differs
                  across (TP, SP, PP) ranks: one stream per head group and sequence shard.
                  Never equal to a weight-init seed, so no dropout mask replays the numbers the
                  weights were drawn from (also at SP rank 0). DP ranks share it (they read
                  different samples), as in Megatron-LM.

`seed_dropout_streams` also seeds python's `random` and numpy's global generator from the dropout
seed, as Megatron-LM seeds them: nothing of ours draws from them, but a library that does gives
the same numbers run to run, and their states in a checkpoint are the same after a resume as
without one.

The dropout streams are the live ones from `seed_dropout_streams` on; `weight_init_streams` puts
the weight-init streams in place for the duration of a model build and then restores the
dropout streams exactly as they were.
"""

import contextlib
import random

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from . import parallel_state as ps
from .. import cpu_compat

# The SP stride exceeds every offset megatron-core adds within one seeding (2718 + TP rank, 1024
# + 100 x EP rank + ETP rank) plus 100 x PP rank, so no two dropout streams of different ranks,
# and no dropout and weight-init stream, share a seed.
SP_SEED_STRIDE = 1_000_000
PP_SEED_STRIDE = 100  # Megatron-LM's


def dropout_seed(seed: int, sp_rank: int = None, pp_rank: int = None) -> int:
    """The base seed of this rank's dropout streams (defaults: this rank's SP and PP rank)."""
    if sp_rank is None:
        sp_rank = ps.get_ulysses_sp_rank()
    if pp_rank is None:
        pp_rank = mpu.get_pipeline_model_parallel_rank()
    return seed + SP_SEED_STRIDE * (1 + sp_rank) + PP_SEED_STRIDE * pp_rank


def use_te_rng_tracker() -> None:
    """--te-rng-tracker: megatron-core's tracker becomes Transformer Engine's (CUDA graphs
    capture its streams); the streams are seeded as before."""
    tensor_parallel.random.initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True)


def seed_dropout_streams(seed: int) -> None:
    """Seed the default generator and the tracker's streams for dropout: per SP rank and
    pipeline stage, model-parallel-rng also per TP rank; python's `random` and numpy's global
    generator with the same seed. Needs the parallel state."""
    base = dropout_seed(seed)
    random.seed(base)
    np.random.seed(base % 2**32)
    cpu_compat.model_parallel_manual_seed(base)


def _get_states():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, tensor_parallel.get_cuda_rng_tracker().get_states()


def _set_states(states) -> None:
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


@contextlib.contextmanager
def weight_init_streams(seed: int):
    """Build the model inside: the default generator and the tracker's streams seeded from
    `seed` alone (identical on every DP and SP rank, model-parallel-rng per TP rank); on exit
    the streams in place before (the dropout streams) come back unchanged."""
    saved = _get_states()
    cpu_compat.model_parallel_manual_seed(seed)
    try:
        yield
    finally:
        _set_states(saved)
