"""TiledMLP: megatron-core's dense MLP run over sequence tiles (ALST).

Glossary: ``s`` sequence, ``b`` micro batch, ``h`` hidden, ``ffn`` MLP width.

The ``[s, b, ffn]`` intermediate (4x-8x the size of ``[s, b, h]``) is never
materialised whole: forward runs tile by tile without keeping activations, and
backward recomputes one tile at a time (see ``tiling.py``). Outputs and
gradients equal plain ``MLP``'s. Under full recompute, where the MLP ends a
checkpointed chunk of layers (``mark_recompute_chunk_ends``), the recompute runs
no tile: the MLP forward runs twice per step, as without recompute, not three times.
"""

import dataclasses
import functools
import math

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ulysses.memory.tiling import NumTiles, check_num_tiles, sequence_tiled_recompute


def resolve_mlp_tiles(num_tiles: NumTiles, seq_len: int, hidden_size: int) -> int:
    """Number of sequence tiles: ``num_tiles``, or ALST's ``ceil(s / h)`` for "auto".

    ALST sizes tiles to about ``h`` tokens so each tile's ``[s/n, b, ffn]``
    intermediate is no larger than an ``h x ffn`` weight.
    """
    check_num_tiles(num_tiles, "--tiled-mlp-shards")
    if num_tiles == "auto":
        return max(1, math.ceil(seq_len / hidden_size))
    return num_tiles


class TiledMLP(MLP):
    """``MLP`` whose forward tiles ``[s, b, h]`` along ``s`` into ``num_tiles`` tiles
    ("auto": ``ceil(s / h)``, see ``resolve_mlp_tiles``).

    Build it from a layer spec with ``tiled_mlp_layer_spec`` (works on
    megatron-core 0.16 and 0.19). Supported: TP == 1, or TP > 1 without
    sequence parallelism (fc1/fc2 collectives are then per tile and exact).
    Not supported: TP > 1 with sequence parallelism (fc1 all-gathers along
    ``s``), FP8/FP4 (the backward recompute runs outside the quantization
    context), ``per_token_scale`` (MoE experts).
    """

    def __init__(
        self,
        config,
        submodules,
        num_tiles: NumTiles = "auto",
        tp_group=None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        **mlp_kwargs,
    ):
        # megatron-core only passes `tp_group` to the exact `MLP` class (0.16) and
        # passes `pg_collection`/`is_mtp_layer` to other spec modules (0.19).
        del is_mtp_layer
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        super().__init__(config=config, submodules=submodules, tp_group=tp_group, **mlp_kwargs)
        resolve_mlp_tiles(num_tiles, 1, 1)  # fail at build time on a bad flag value
        self.num_tiles = num_tiles
        # True where the layer's output ends a full-recompute chunk (set by
        # `mark_recompute_chunk_ends`): the recompute only differentiates this output.
        self.skip_in_recompute = False
        if config.fp8 or getattr(config, "fp4", None):
            raise ValueError("--tiled-mlp-shards does not support --fp8 / --fp4")
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        if config.sequence_parallel and tp_size > 1:
            raise ValueError(
                "--tiled-mlp-shards does not support --sequence-parallel with tensor "
                "parallel size > 1 (fc1 all-gathers the sequence)"
            )

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        """``[s, b, h]`` -> (output ``[s, b, h]``, output_bias ``[h]`` or None), as ``MLP``."""
        if per_token_scale is not None:
            raise ValueError("--tiled-mlp-shards does not support per_token_scale (MoE experts)")
        num_tiles = resolve_mlp_tiles(
            self.num_tiles, hidden_states.shape[0], self.config.hidden_size
        )
        # MLP builds fc2 with skip_bias_add=True, so MLP.forward returns fc2's
        # bias parameter itself; return it outside the tiled function so the
        # layer's bias-dropout-add backprops into it as usual.
        output_bias = self.linear_fc2.bias if self.config.add_bias_linear else None
        output = sequence_tiled_recompute(
            lambda tile, _: MLP.forward(self, tile)[0],
            hidden_states,
            num_tiles,
            params=[p for p in self.parameters() if p.requires_grad and p is not output_bias],
            skip_in_recompute=self.skip_in_recompute,
        )
        return output, output_bias


def mark_recompute_chunk_ends(block) -> None:
    """Let each ``TiledMLP`` of a ``TransformerBlock`` skip its tiles in the full recompute
    where its layer's output ends a checkpointed chunk, as megatron-core's block chunks its
    layers: ``--recompute-method block`` checkpoints layers one by one, ``uniform`` in chunks of
    ``--recompute-num-layers``. Inside a chunk the next layer reads the recomputed output."""
    config = block.config
    num_layers = len(block.layers)
    for index, layer in enumerate(block.layers):
        if isinstance(layer.mlp, TiledMLP):
            layer.mlp.skip_in_recompute = config.recompute_granularity == "full" and (
                config.recompute_method == "block"
                or (index + 1) % config.recompute_num_layers == 0
                or index == num_layers - 1
            )


def _dense_mlp_submodules(mlp_spec):
    """MLPSubmodules of a dense-MLP entry in a layer spec (0.16: ModuleSpec; 0.19: partial)."""
    if isinstance(mlp_spec, ModuleSpec) and mlp_spec.module is MLP:
        return mlp_spec.submodules
    if (
        isinstance(mlp_spec, functools.partial)
        and getattr(mlp_spec.func, "__self__", None) is MLP
        and not mlp_spec.args
        and set(mlp_spec.keywords) == {"submodules"}
    ):
        return mlp_spec.keywords["submodules"]
    raise ValueError(
        f"--tiled-mlp-shards needs a dense megatron-core MLP in the layer spec, got {mlp_spec!r}"
    )


def tiled_mlp_layer_spec(layer_spec: ModuleSpec, num_tiles: NumTiles) -> ModuleSpec:
    """Copy of a ``TransformerLayer`` spec whose dense ``MLP`` is a ``TiledMLP``."""
    resolve_mlp_tiles(num_tiles, 1, 1)
    mlp = ModuleSpec(
        module=TiledMLP,
        submodules=_dense_mlp_submodules(layer_spec.submodules.mlp),
        params={"num_tiles": num_tiles},
    )
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp)
    )
