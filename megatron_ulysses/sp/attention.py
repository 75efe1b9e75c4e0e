"""UlyssesAttention: the core-attention module of megatron-core's GPT layer spec, wrapped in the
two Ulysses all-to-alls.

Shapes per rank (see `all_to_all` for the glossary): q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]`
in (already rotated with global positions), `[s/P, b, H*d]` out, exactly what megatron-core's
`SelfAttention` hands to and expects from `core_attention`. In between, the local backend sees
every token for this SP rank's H_r query heads (ceil(H/P) or floor(H/P), `head_layout`) and the
kv heads they use, so the plain causal mask (or the packed documents' global `cu_seqlens`) is
the whole story. Each SP rank builds its backend for its own head counts.

Attention dropout runs under the RNG tracker's model-parallel stream, which `megatron_ulysses.sp.rng`
seeds per (TP, SP, PP) rank after the model build, so each head group draws its own masks:
UlyssesAttention forks it for every backend, except under --sequence-parallel, where
megatron-core's transformer block already runs under it (as megatron-core's own attention, which
forks only without --sequence-parallel; a fork nested inside the block's would not replay the
forward's masks in activation recompute, which restores the tracker's states but not the open
fork).
"""

import contextlib

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from . import parallel_state as ps
from .all_to_all import output_to_sequence_sharded, qkv_to_head_sharded
from .backends import build_backend_attention, resolve_backend
from .head_layout import HeadLayout, expand_kv


class UlyssesAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        backend: str = "auto",
        **kwargs,
    ):
        super().__init__(config=config)
        self.sp_group = ps.get_ulysses_sp_group()
        self.sp_size = ps.get_ulysses_sp_world_size()
        self.sp_rank = ps.get_ulysses_sp_rank()
        tp = config.tensor_model_parallel_size
        ps.get_parallel_dims().validate_model(config.num_attention_heads, config.num_query_groups)
        self.layout = HeadLayout(config.num_attention_heads // tp, config.num_query_groups // tp,
                                 self.sp_size)
        self.num_heads = len(self.layout.query_heads(self.sp_rank))
        self.num_kv_heads = self.layout.attended_kv_heads(self.sp_rank)
        self.backend = resolve_backend(backend)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.fork_dropout_rng = not config.sequence_parallel  # else the block runs under it
        self.backend_attention = build_backend_attention(
            self.backend, config, layer_number, self.num_heads, self.num_kv_heads,
            softmax_scale, attention_dropout,
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        """q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]` -> `[s/P, b, H*d]`."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "UlyssesAttention takes no dense attention mask or bias (a sequence shard cannot "
                "describe the full-sequence mask); packed documents come as global cu_seqlens "
                "(--reset-attention-mask)"
            )
        cu_seqlens = max_seqlen = None
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "sbhd":
                raise ValueError(
                    "UlyssesAttention expects packed_seq_params with qkv_format='sbhd' holding "
                    f"global cu_seqlens over [b*s]; got qkv_format={packed_seq_params.qkv_format!r}"
                )
            cu_seqlens, max_seqlen = packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q
        self._check_head_counts(query, key)
        s_local, b = query.shape[:2]
        if self.sp_size == 1:
            with self._dropout_rng():
                out = self.backend_attention(query, key, value, cu_seqlens, max_seqlen)
            return out.reshape(s_local, b, -1)
        q, k, v = qkv_to_head_sharded(query, key, value, self.layout, self.sp_rank,
                                      self.sp_group)
        k, v = (expand_kv(t, self.layout, self.sp_rank) for t in (k, v))
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(q.device)
        with self._dropout_rng():
            out = self.backend_attention(q, k, v, cu_seqlens, max_seqlen)
        return output_to_sequence_sharded(out, self.layout, self.sp_rank, self.sp_group)

    def _check_head_counts(self, query, key):
        """q `[s/P, b, H, d]`, k `[s/P, b, G, d]` carry this TP rank's share of the config's heads
        (the exchange checks that the shapes split over SP ranks)."""
        tp = self.config.tensor_model_parallel_size
        for name, tensor, letter, flag, total in (
            ("query", query, "H", "--num-attention-heads", self.config.num_attention_heads),
            ("key", key, "G", "--num-query-groups", self.config.num_query_groups),
        ):
            if tensor.shape[2] != total // tp:
                raise ValueError(
                    f"{name} [s/P, b, {letter}, d] {list(tensor.shape)} has {letter} = "
                    f"{tensor.shape[2]} heads, expected {flag} / --tensor-model-parallel-size "
                    f"({total} / {tp} = {total // tp}) of the config UlyssesAttention was built "
                    "with"
                )

    def _dropout_rng(self):
        """This head group's dropout stream, the tracker's model-parallel-rng (per TP x SP x PP
        rank), whatever the backend; under --sequence-parallel the block has it in place
        already, and without dropout there is nothing to draw."""
        if self.training and self.dropout > 0 and self.fork_dropout_rng:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()
