"""Rotary embeddings with global positions for contiguous sequence shards.

megatron-core rotates q and k inside `SelfAttention`, before core attention, while they are still
sequence-sharded: SP rank r holds tokens `[r*s/P, (r+1)*s/P)` and must rotate them with those
positions, not `0 .. s/P-1`. (megatron-core's own CP slicing assumes zigzag order and does not
apply to contiguous shards.) The same for YaRN (megatron-core's `YarnRotaryEmbedding`, which also
returns the factor its `apply_rotary_pos_emb` scales cos and sin by). Packed documents need no
position reset for RoPE: attention never crosses a document boundary and RoPE scores depend only
on relative positions.
"""

import math

import torch

from . import parallel_state as ps


class ShardedRotaryEmbedding(torch.nn.Module):
    """Wraps megatron-core's `RotaryEmbedding` or `YarnRotaryEmbedding`; returns (as the wrapped
    one) `[s/P, 1, 1, d]` frequencies for this SP rank's positions `[r*s/P, (r+1)*s/P)`."""

    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.rotary = rotary

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input,
                           transformer_config, packed_seq_params=None, **kwargs) -> int:
        """The local length s/P (packed documents keep the sbhd layout, so it is never the
        packed maximum)."""
        if transformer is not None and transformer.input_tensor is not None:
            seq_len = transformer.input_tensor.size(0)
        else:
            seq_len = transformer_input.size(0)
        if transformer_config.sequence_parallel:
            seq_len *= transformer_config.tensor_model_parallel_size
        return seq_len

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> torch.Tensor:
        offset += ps.get_ulysses_sp_rank() * max_seq_len
        return self.rotary(max_seq_len, offset=offset, packed_seq=packed_seq, cp_group=cp_group)


TE_ROPE_MAX_ELEMENTS = 2**31 - 1  # TE's fused RoPE kernel forms int32 element offsets


def fused_rope_fits(tokens: int, heads: int, groups: int, head_dim: int) -> bool:
    """Whether TE's fused RoPE can rotate this rank's q and k: its kernel (TE 2.20) indexes
    with 32-bit offsets, and k reaches it as a view into the fused qkv projection
    `[s/P, b, g, (h/g + 2) * d]` (`tokens` = b * s/P; h, g per TP rank), so an offset into k
    spans that whole tensor. Past 2^31 elements the kernel reads out of bounds (an illegal
    address on the H200 at 700K tokens of the 1B shape, NaN gradients at 1M)."""
    return tokens * (heads + 2 * groups) * head_dim <= TE_ROPE_MAX_ELEMENTS


# Megatron-LM's YaRN flags (dest names) -> the TransformerConfig attributes megatron-core's
# GPTModel and attention read for position_embedding_type "yarn" (no dataclass fields: Megatron-LM
# sets them on the config), and the value Megatron-LM gives a flag left unset.
YARN_CONFIG = {
    "rotary_scaling_factor": ("yarn_rotary_scaling_factor", 1.0),
    "yarn_original_max_position_embeddings": ("yarn_original_max_position_embeddings", 4096),
    "yarn_beta_fast": ("yarn_beta_fast", 32.0),
    "yarn_beta_slow": ("yarn_beta_slow", 1.0),
    "mscale": ("yarn_mscale", 1.0),
    "mscale_all_dim": ("yarn_mscale_all_dim", 0.0),
    "yarn_correction_range_round_to_int": ("yarn_correction_range_round_to_int", True),
}
YARN_DEFAULTS = {name: default for name, (_, default) in YARN_CONFIG.items()}


def set_yarn_config(config, values: dict) -> None:
    """Put YaRN's parameters (`values`: Megatron-LM's names) on megatron-core's `config`."""
    for name, (attribute, default) in YARN_CONFIG.items():
        setattr(config, attribute, default if values.get(name) is None else values[name])


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1), as HF and megatron-core."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(values: dict) -> float:
    """What megatron-core scales cos and sin by (its `_yarn_get_concentration_factor`; HF's
    attention factor): mscale's over mscale_all_dim's. `values`: Megatron-LM's names, all set."""
    factor = values["rotary_scaling_factor"]
    return yarn_mscale(factor, values["mscale"]) / yarn_mscale(factor, values["mscale_all_dim"])
