"""Tiled logits + cross entropy (ALST): the ``[s, b, V]`` logits never exist whole.

Glossary: ``s`` sequence, ``b`` micro batch, ``h`` hidden, ``V`` vocab (``V/tp``
per tensor-parallel rank).
"""

import math
from typing import Optional

import torch
from megatron.core import tensor_parallel

from megatron_ulysses.memory.tiling import NumTiles, check_num_tiles, sequence_tiled_recompute

# "auto" keeps each tile's float32 logits at or under this many bytes.
AUTO_TILE_LOGITS_BYTES = 1 << 30


def resolve_loss_tiles(num_tiles: NumTiles, seq_len: int, batch: int, vocab_local: int) -> int:
    """Number of sequence tiles: ``num_tiles``, or for "auto" the fewest tiles whose float32
    logits ``[s/n, b, V/tp]`` fit in ``AUTO_TILE_LOGITS_BYTES``."""
    check_num_tiles(num_tiles, "--tiled-loss-shards")
    if num_tiles == "auto":
        return max(1, math.ceil(seq_len * batch * vocab_local * 4 / AUTO_TILE_LOGITS_BYTES))
    return num_tiles


def tiled_cross_entropy(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: Optional[torch.Tensor],
    labels: torch.Tensor,
    num_tiles: NumTiles,
) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (float32) of ``hidden`` ``[s, b, h]`` vs ``labels`` ``[b, s]``.

    Equals ``GPTModel.compute_language_model_loss(labels, output_layer(hidden))``
    (unfused ``vocab_parallel_cross_entropy``) in value and gradients.
    ``output_layer`` is megatron-core's ``ColumnParallelLinear``;
    ``output_weight`` is the tied embedding weight or None for its own weight.
    """
    if output_layer.sequence_parallel:
        raise ValueError(
            "--tiled-loss-shards does not support --sequence-parallel with tensor parallel "
            "size > 1 (the output layer all-gathers the sequence)"
        )
    vocab_local = (output_weight if output_weight is not None else output_layer.weight).shape[0]
    n = resolve_loss_tiles(num_tiles, hidden.shape[0], hidden.shape[1], vocab_local)

    def tile_loss(hidden_tile: torch.Tensor, tile: slice) -> torch.Tensor:
        logits, _ = output_layer(hidden_tile, weight=output_weight)
        labels_tile = labels[:, tile].transpose(0, 1).contiguous()  # [b, t] -> [t, b]
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels_tile)
        return loss.transpose(0, 1)  # [t, b] -> [b, t]

    params = [p for p in output_layer.parameters() if p.requires_grad]
    if output_weight is not None and output_weight.requires_grad:
        params.append(output_weight)
    return sequence_tiled_recompute(tile_loss, hidden, n, params=params, out_dim=1)


class TiledLossGPTModelMixin:
    """Mix in before ``GPTModel``: ``class M(TiledLossGPTModelMixin, GPTModel)``.

    ``tiled_loss_shards`` (constructor kwarg; None = off) turns on tiled loss.
    Overrides ``GPTModel._postprocess``, which ``GPTModel.forward`` calls with
    keyword arguments only (0.16 and 0.19 alike; 0.19 adds ``padding_mask``,
    ``output_processor``, ``output_processor_context``), so ``**kwargs`` matches
    both. When labels are given on the last pipeline stage outside inference,
    returns the tiled per-token loss ``[b, s]`` without full logits; otherwise
    defers to ``GPTModel._postprocess``.
    """

    def __init__(self, *args, tiled_loss_shards: Optional[NumTiles] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if tiled_loss_shards is not None:
            resolve_loss_tiles(tiled_loss_shards, 1, 1, 1)  # fail at build time on a bad value
            if self.config.mtp_num_layers:
                raise ValueError("--tiled-loss-shards does not support multi-token prediction")
            if getattr(self.config, "use_mup", False):  # 0.19 MuP rescales logits
                raise ValueError("--tiled-loss-shards does not support MuP logit scaling")
        self.tiled_loss_shards = tiled_loss_shards

    def _postprocess(self, hidden_states, labels=None, **kwargs):
        """``[s, b, h]`` -> per-token loss ``[b, s]`` (tiled) or ``GPTModel``'s result."""
        if (
            self.tiled_loss_shards is None
            or labels is None
            or not self.post_process
            or kwargs.get("inference_context") is not None
            or kwargs.get("output_processor") is not None
        ):
            return super()._postprocess(hidden_states=hidden_states, labels=labels, **kwargs)
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()
        return tiled_cross_entropy(
            hidden_states, self.output_layer, output_weight, labels, self.tiled_loss_shards
        )
