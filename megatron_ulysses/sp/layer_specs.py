"""GPT layer spec and model with Ulysses attention.

The layer is megatron-core's own GPT layer spec (TE linear layers for the `te` backend, local
ones otherwise) with one entry swapped: `self_attention.submodules.core_attention` becomes
`UlyssesAttention`. The model is megatron-core's `GPTModel`, with RoPE taking global positions.
"""

import copy

import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from . import parallel_state as ps
from .attention import UlyssesAttention
from .backends import resolve_backend
from ..memory.tiled_loss import TiledLossGPTModelMixin
from ..memory.tiled_mlp import mark_recompute_chunk_ends, tiled_mlp_layer_spec
from .rope import ShardedRotaryEmbedding


class ZeroCenteredNorm(torch.nn.Module):
    """LayerNorm / RMSNorm over the last dim `h` whose weight stores gamma - 1 (zero at init,
    applied as 1 + w): megatron-core's `layernorm_zero_centered_gamma` (--apply-layernorm-1p),
    which its torch `WrappedTorchNorm` refuses. Same parameter names as torch's norms."""

    def __init__(self, hidden_size: int, eps: float, rms: bool):
        super().__init__()
        self.eps, self.rms = eps, rms
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.bias = None if rms else torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.weight.numel(),)
        if self.rms:
            return F.rms_norm(x, shape, 1 + self.weight, self.eps)
        return F.layer_norm(x, shape, 1 + self.weight, self.bias, self.eps)


class LocalTorchNorm:
    """megatron-core's `WrappedTorchNorm`, or `ZeroCenteredNorm` under the config's
    `layernorm_zero_centered_gamma`; also under `--sequence-parallel` (a norm is per token, and
    the per-head q / k norms see whole sequences: megatron-core's `finalize_model_grads` sums
    their grads over TP by name)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.layernorm_zero_centered_gamma:
            return ZeroCenteredNorm(hidden_size, eps, rms=config.normalization == "RMSNorm")
        local_config = copy.copy(config)
        local_config.sequence_parallel = False
        return WrappedTorchNorm(local_config, hidden_size, eps, **kwargs)


class SequenceParallelTorchNorm:
    """megatron-core's `WrappedTorchNorm` (torch LayerNorm / RMSNorm), also under
    `--sequence-parallel`, which `WrappedTorchNorm` refuses only because it does not mark its
    weights: a norm is per token, so a TP-sequence-sharded input needs nothing else, and
    megatron-core's `finalize_model_grads` sums over TP the grads of params marked
    `sequence_parallel` (as for `FusedLayerNorm` and `TENorm`)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm = LocalTorchNorm(config, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


def get_gpt_layer_ulysses_spec(
    backend: str = "auto", normalization: str = "LayerNorm", qk_layernorm: bool = False,
    transformer_impl: str = "auto",
) -> ModuleSpec:
    """megatron-core's GPT layer spec with `UlyssesAttention` as core attention: Transformer
    Engine's layers (`transformer_impl` "transformer_engine"; "auto": with the te backend) or
    megatron-core's local ones, around any backend's attention."""
    backend = resolve_backend(backend)
    if transformer_impl == "auto":
        transformer_impl = "transformer_engine" if backend == "te" else "local"
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    elif backend == "te":
        raise ValueError("--ulysses-attention-backend te runs in Transformer Engine's layers "
                         "(--transformer-impl transformer_engine)")
    else:
        spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    spec = copy.deepcopy(spec)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name) is WrappedTorchNorm:
            setattr(spec.submodules, name, SequenceParallelTorchNorm)
    attention = spec.submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):  # per head: never sequence-sharded
        if getattr(attention, name) is WrappedTorchNorm:
            setattr(attention, name, LocalTorchNorm)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=UlyssesAttention, params={"backend": backend}
    )
    return spec


class UlyssesGPTModel(TiledLossGPTModelMixin, GPTModel):
    """megatron-core's GPTModel for sequence-sharded input `[b, s/P]`; RoPE uses global
    positions. Learned absolute embeddings take global `position_ids` from the data loader.
    `tiled_loss_shards` (None = off) computes logits + loss over sequence tiles."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.position_embedding_type in ("rope", "yarn"):
            self.rotary_pos_emb = ShardedRotaryEmbedding(self.rotary_pos_emb)


def build_gpt_model(config, vocab_size: int, max_sequence_length: int, backend: str = "auto",
                    pre_process: bool = True, post_process: bool = True,
                    tiled_mlp_shards=None, transformer_impl: str = "auto", **gpt_kwargs):
    """A `UlyssesGPTModel` with the Ulysses layer spec for `backend` and `transformer_impl`;
    `tiled_mlp_shards` (None = off) runs the MLP over sequence tiles, other kwargs go to
    `GPTModel`. The heads are checked against TP x SP here, once (the exchanges check the
    tensors' shapes)."""
    ps.get_parallel_dims().validate_model(config.num_attention_heads, config.num_query_groups)
    spec = get_gpt_layer_ulysses_spec(
        backend, normalization=config.normalization, qk_layernorm=config.qk_layernorm,
        transformer_impl=transformer_impl,
    )
    if tiled_mlp_shards is not None:
        spec = tiled_mlp_layer_spec(spec, tiled_mlp_shards)
    if (config.sequence_parallel or config.layernorm_zero_centered_gamma) and \
            spec.submodules.input_layernorm is SequenceParallelTorchNorm:
        # From a layer spec, megatron-core's block builds its final norm from its own default
        # (TE, Apex or WrappedTorchNorm, which refuses both); a block spec names it.
        num_layers = get_num_layers_to_build(config, vp_stage=gpt_kwargs.get("vp_stage"))
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * num_layers, layer_norm=SequenceParallelTorchNorm
        )
    model = UlyssesGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        **gpt_kwargs,
    )
    if tiled_mlp_shards is not None:
        mark_recompute_chunk_ends(model.decoder)
    return model
