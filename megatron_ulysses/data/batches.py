"""The sequence-sharded micro batches of one rank, on its device.

    sampler (pure-DP rank's samples) -> [b, s] on CPU -> this SP rank's [b, s/P] slice
    -> tokens, labels, loss_mask, position_ids (+ PackedSeqParams for packed documents) on device
"""

import functools

from megatron.core.packed_seq_params import PackedSeqParams

from .. import cpu_compat
from ..sp import parallel_state as ps
from .datasets import build_data_iterator
from .sharding import get_batch_for_sp_rank
from .tokenizers import padding_id


class Batches:
    """Reads the pure-DP rank's samples on CPU, keeps this SP rank's `[b, s/P]` slice, then
    moves only that slice to the device. `data`: a `DataConfig`."""

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int, data, tokenizer):
        self.iterator = build_data_iterator(
            dataset, consumed_samples, micro_batch_size, ps.get_pure_data_parallel_rank(),
            ps.get_pure_data_parallel_world_size(), num_workers=data.num_workers,
        )
        self.shard = functools.partial(
            get_batch_for_sp_rank, sp_rank=ps.get_ulysses_sp_rank(),
            sp_size=ps.get_ulysses_sp_world_size(), pad_id=padding_id(tokenizer),
            eod_id=tokenizer.eod, vocab_size=tokenizer.vocab_size,
            reset_attention_mask=data.reset_attention_mask,  # the dataset applied the others
        )

    def __iter__(self):
        return self

    def __next__(self):
        local = self.shard(next(self.iterator))
        device = cpu_compat.device()
        batch = {key: local[key].to(device, non_blocking=True)
                 for key in ("tokens", "labels", "loss_mask", "position_ids")}
        batch["packed_seq_params"] = None
        if "cu_seqlens" in local:
            cu = local["cu_seqlens"].to(device)
            batch["packed_seq_params"] = PackedSeqParams(
                qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                max_seqlen_q=local["max_seqlen"], max_seqlen_kv=local["max_seqlen"],
            )
        return batch
