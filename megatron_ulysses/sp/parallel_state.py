"""Ulysses sequence-parallel (SP) process groups, carved out of megatron-core's data parallelism.

Glossary: `P` Ulysses SP size, `DP` pure data-parallel size, `TP`/`PP` megatron-core's tensor and
pipeline sizes. world = TP x PP x DP x P.

megatron-core is initialized with context parallel 1, so it sees a data-parallel size DP' = DP x P:
its DDP and distributed optimizer reduce and shard over DP x P unchanged. The SP groups are blocks
of P consecutive members of each megatron-core DP group (right after TP in rank order, so an SP
group sits on one node when TP x P <= GPUs per node); the pure-DP groups decide which sample a rank
reads, so every rank of one SP group reads the same sample.
"""

import datetime
import os
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.parallel_state import RankGenerator

from .. import cpu_compat

# megatron-core's default rank order, and Megatron-LM's --use-tp-pp-dp-mapping one; our SP takes
# the 'cp' slot of the generator, right after TP in both.
_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"


@dataclass(frozen=True)
class ParallelDims:
    """Every parallel degree of one run. SP is the inner part of megatron-core's DP."""

    world_size: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    order: str = _ORDER

    def __post_init__(self):
        for name, flag, value in (
            ("tp", "--tensor-model-parallel-size", self.tp),
            ("pp", "--pipeline-model-parallel-size", self.pp),
            ("sp", "--ulysses-sp-size", self.sp),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.world_size % (self.tp * self.pp * self.sp) != 0:
            raise ValueError(
                f"world size {self.world_size} is not divisible by "
                f"--tensor-model-parallel-size ({self.tp}) x --pipeline-model-parallel-size "
                f"({self.pp}) x --ulysses-sp-size ({self.sp}) = {self.tp * self.pp * self.sp}; "
                "change one of these flags or the number of processes"
            )

    @property
    def dp(self) -> int:
        """Pure data-parallel size: how many different samples one step reads per micro batch."""
        return self.world_size // (self.tp * self.pp * self.sp)

    def local_seq_length(self, seq_length: int) -> int:
        """Tokens of one sequence per SP rank, s/P, after the loader pads s to a multiple of P."""
        return -(-seq_length // self.sp)

    def rank_groups(self, axis: str) -> List[List[int]]:
        """Global ranks of every group along `axis`: "sp" (blocks of P consecutive members of
        megatron-core's DP group, right after TP in rank order) or "dp" (pure data parallel:
        the ranks that read different samples). Pure: no process group needed."""
        generator = RankGenerator(tp=self.tp, ep=1, dp=self.dp, pp=self.pp, cp=self.sp,
                                  order=self.order)
        return generator.get_ranks({"sp": "cp", "dp": "dp"}[axis])

    def validate_model(
        self,
        num_attention_heads: int,
        num_query_groups: Optional[int],
        seq_length: Optional[int] = None,
    ) -> None:
        """Check the model shape against TP x SP; raise one clear error naming the flag.

        Heads need not divide by SP: SP rank r attends over ceil(H/P) or floor(H/P) of a TP
        rank's H query heads (`head_layout`), so H/TP >= P is the one SP rule."""
        heads, groups = num_attention_heads, num_query_groups or num_attention_heads
        if heads % self.tp != 0:
            raise ValueError(
                f"--num-attention-heads ({heads}) must be divisible by "
                f"--tensor-model-parallel-size ({self.tp})"
            )
        if heads % groups != 0:
            raise ValueError(
                f"--num-attention-heads ({heads}) must be divisible by --num-query-groups ({groups})"
            )
        if groups % self.tp != 0:
            raise ValueError(
                f"--num-query-groups ({groups}) must be divisible by "
                f"--tensor-model-parallel-size ({self.tp})"
            )
        if heads // self.tp < self.sp:
            raise ValueError(
                f"--num-attention-heads ({heads}) / --tensor-model-parallel-size ({self.tp}) = "
                f"{heads // self.tp} query heads per tensor-parallel rank, fewer than "
                f"--ulysses-sp-size ({self.sp}): every SP rank needs at least one head; "
                f"{self._largest_sp_message(heads // self.tp)}"
            )
        if seq_length is not None and seq_length % (self.sp * self.tp) != 0:
            raise ValueError(
                f"--seq-length ({seq_length}) must be divisible by --ulysses-sp-size x "
                f"--tensor-model-parallel-size ({self.sp} x {self.tp}); pad the sequence or "
                "change --seq-length"
            )

    def _largest_sp_message(self, heads_per_tp_rank: int) -> str:
        """The fix for too few heads: the largest SP size with a head per rank that also
        divides this world's processes per TP x PP."""
        ranks = self.world_size // (self.tp * self.pp)
        largest = max(p for p in range(1, heads_per_tp_rank + 1) if ranks % p == 0)
        return (f"the largest --ulysses-sp-size that works is {largest} (at most "
                f"{heads_per_tp_rank} heads per tensor-parallel rank, and a divisor of world size "
                f"{self.world_size} / (--tensor-model-parallel-size {self.tp} x "
                f"--pipeline-model-parallel-size {self.pp}) = {ranks}), or lower "
                "--tensor-model-parallel-size")


def start_process_group(backend: str, timeout_minutes: int = 10) -> None:
    """The default process group from torchrun's environment (a world of one without it), on
    this process's GPU, or on CPU with the compat shim installed. One that exists already (a
    test's workers) is kept."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        # rank % GPUs as Megatron-LM: ranks sharing a GPU (gloo only) get the same one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        cpu_compat.install()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: an in-process store, no port
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


_DIMS: Optional[ParallelDims] = None
_SP_GROUP = None
_SP_RANKS = None
_DP_GROUP = None
_DP_RANKS = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    ulysses_sp_size: int = 1,
    dims: Optional[ParallelDims] = None,
    **megatron_kwargs,
) -> ParallelDims:
    """Initialize megatron-core's parallel state (CP = 1) and the Ulysses SP / pure-DP groups,
    from the sizes or from the run's `dims` (whose world size must be this world's).

    `torch.distributed` must already be initialized. Returns the run's `ParallelDims`.
    """
    global _DIMS, _SP_GROUP, _SP_RANKS, _DP_GROUP, _DP_RANKS
    if _DIMS is not None:
        raise RuntimeError("megatron_ulysses parallel state is already initialized")
    if dims is None:
        dims = ParallelDims(
            world_size=dist.get_world_size(),
            tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size,
            sp=ulysses_sp_size,
        )
    elif dims.world_size != dist.get_world_size():
        raise RuntimeError(f"the run was configured for {dims.world_size} processes, but the "
                           f"process group has {dist.get_world_size()}")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=1,
        order=dims.order,
        **megatron_kwargs,
    )
    rank = dist.get_rank()
    # new_group is collective: every rank creates every group, in the same order.
    for ranks in dims.rank_groups("sp"):
        group = dist.new_group(ranks)
        if rank in ranks:
            _SP_GROUP, _SP_RANKS = group, ranks
    for ranks in dims.rank_groups("dp"):
        group = dist.new_group(ranks)
        if rank in ranks:
            _DP_GROUP, _DP_RANKS = group, ranks
    _DIMS = dims
    return dims


def is_initialized() -> bool:
    return _DIMS is not None


def _require():
    if _DIMS is None:
        raise RuntimeError(
            "megatron_ulysses parallel state is not initialized: call "
            "megatron_ulysses.sp.parallel_state.initialize_model_parallel first"
        )


def get_parallel_dims() -> ParallelDims:
    _require()
    return _DIMS


def get_ulysses_sp_group():
    _require()
    return _SP_GROUP


def get_ulysses_sp_world_size() -> int:
    _require()
    return _DIMS.sp


def get_ulysses_sp_rank() -> int:
    _require()
    return _SP_RANKS.index(dist.get_rank())


# "pure" DP: the ranks that read different samples. megatron-core's `mpu.get_data_parallel_*`
# is DP x SP: the ranks gradients are reduced over.
def get_pure_data_parallel_group():
    """The pure-DP group (ranks holding different samples), without the SP ranks."""
    _require()
    return _DP_GROUP


def get_pure_data_parallel_world_size() -> int:
    _require()
    return _DIMS.dp


def get_pure_data_parallel_rank() -> int:
    _require()
    return _DP_RANKS.index(dist.get_rank())


def destroy_model_parallel() -> None:
    """Tear down our groups and megatron-core's parallel state (not the default group)."""
    global _DIMS, _SP_GROUP, _SP_RANKS, _DP_GROUP, _DP_RANKS
    for group in {_SP_GROUP, _DP_GROUP} - {None}:
        dist.destroy_process_group(group)
    _DIMS = _SP_GROUP = _SP_RANKS = _DP_GROUP = _DP_RANKS = None
    mpu.destroy_model_parallel()

