"""What a checkpoint holds besides tensors: the tracker, the format, the saved model args and
the sharded state dict that save and load share (megatron-core's keys)."""

import contextlib
import dataclasses
import json
import os
import warnings

from ...data.tokenizer_flags import tokenizer_files
from ...errors import ConfigError
from ..chunks import model_chunks, state_keys
from ..fsdp import (
    model_sharded_state_dict,
)
from ...sp.rope import YARN_CONFIG
from .rng_state import rng_sharded

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 2  # 2: RNG states as per-rank tensors, no pickled objects
# The distributed optimizer's canonical, per-parameter layout: it loads at any DP x SP size (SP
# lives inside megatron-core's DP, so a new --ulysses-sp-size changes DP), TP and PP size (as
# Megatron-LM requires of a load at another TP x PP: its checkpoint_fully_reshardable_formats).
# megatron-core 0.19's default, fully_sharded_model_space, is deprecated there and fails to
# save; dp_reshardable reshards over DP only with the same bucket layout. `CpuAdamW` takes and
# ignores it.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# Args that change parameter shapes or their meaning: they must match between the checkpoint
# and the run that loads it (max_position_embeddings only with learned absolute positions).
MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "kv_channels", "padded_vocab_size",
               "position_embedding_type", "rotary_percent", "swiglu", "normalization",
               "qk_layernorm", "untie_embeddings_and_output_weights", "disable_bias_linear",
               "add_qkv_bias", "apply_layernorm_1p", "squared_relu", "rotary_interleaved")
# What a checkpoint saved before an arg existed means by its absence (it still loads).
MISSING_MEANS = {"add_qkv_bias": False, "apply_layernorm_1p": False, "squared_relu": False,
                  "rotary_interleaved": False}
# The model-parallel layout: saved, not checked. megatron-core's keys number the layers over
# the whole model and the tied output layer is saved as the embedding, so the model loads at any
# PP and virtual pipeline; its ShardedTensors hold global shapes with each TP rank's offsets
# (SwiGLU's fc1 as its gate and up halves), so dist_checkpointing reshards them at any TP. The
# Adam moments are sharded as their parameters (`CpuAdamW`, megatron-core's optimizers, the
# distributed one in `OPTIMIZER_METADATA`'s layout) and load too, as Megatron-LM loads
# torch_dist checkpoints. Only the per-rank RNG states need the same layout
# (`rng_states_to_load`), and the padded vocabulary, which depends on TP, the same rows.
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size")
# Args that change the optimizer state's keys (megatron-core's distributed optimizer, its
# mixed-precision optimizer and the fp32 one each name them differently).
OPTIMIZER_ARGS = ("use_distributed_optimizer", "bf16", "fp16")
# Also saved (not checked; --use-checkpoint-args takes them): RoPE and norm numerics, the vocab
# padding, the sequence length and dropout, --vocab-size (None with a tokenizer file) and the
# tokenizer (`_saved_tokenizer`).
TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "tiktoken_pattern")
SAVED_ARGS = MODEL_ARGS + LAYOUT_ARGS + OPTIMIZER_ARGS + (
    "max_position_embeddings", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", *YARN_CONFIG, "norm_epsilon",
    "make_vocab_size_divisible_by",
    "vocab_size", "seq_length", "attention_dropout", "hidden_dropout") + TOKENIZER_ARGS


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str):
    """The iteration in `root`'s "latest" marker, or None when there is no marker."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isascii() or not text.isdigit():
        raise ConfigError(f"--load {root}: {path} holds {raw[:32]!r}, not an iteration number; "
                          "fix or delete it (without it the run trains from scratch)")
    return int(text)


def plain(value, what: str):
    """`value`, checked to be JSON-able: what is stored besides tensors needs no pickled
    objects to load."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"the checkpoint's {what} must hold only plain values: {error}") from None
    return value


def sharded_state_dict(model, optimizer, scheduler, is_loading, with_optimizer=True,
                        rng_states=None, common=None):
    model_sd = {key: model_sharded_state_dict(chunk)  # Megatron-LM's keys, `training.chunks`
                for key, chunk in zip(state_keys(model), model_chunks(model))}
    state = {**model_sd, **(common or {})}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd.get("model", model_sd), is_loading=is_loading, metadata=OPTIMIZER_METADATA)
        if not is_loading:
            state["opt_param_scheduler"] = plain(scheduler.state_dict(), "scheduler")
    if rng_states is not None:
        state["rng_state"] = rng_sharded(rng_states)
    return state


@contextlib.contextmanager
def quiet_torch_checkpoint():
    """torch's checkpoint internals warn about the APIs megatron-core's dist_checkpointing uses."""
    with warnings.catch_warnings():
        for message in ("Please use DTensor instead", "`load_state_dict` is deprecated"):
            warnings.filterwarnings("ignore", message=message)
        yield


def args_of(config) -> dict:
    """The `SAVED_ARGS` values of a `RunConfig`, by Megatron-LM argument name."""
    values = {**dataclasses.asdict(config.model), "tensor_model_parallel_size": config.dims.tp,
              "pipeline_model_parallel_size": config.dims.pp,
              "use_distributed_optimizer": config.optimizer.use_distributed_optimizer,
              "vocab_size": config.data.vocab_size, **_saved_tokenizer(config.data)}
    return {key: values[key] for key in SAVED_ARGS}


def _saved_tokenizer(data) -> dict:
    """The tokenizer that --use-checkpoint-args takes back, as Megatron-LM's args hold it: one
    read from a --tokenizer-model file (its absolute path: a later run may start elsewhere).
    None for the others: Megatron-LM takes no --vocab-file / --merge-file from a checkpoint,
    so GPT2BPETokenizer's files come from the command line anyway, and NullTokenizer stands
    for no tokenizer here (mock data; --vocab-size is saved), e.g. in tools/convert_hf.py's
    checkpoints, whose tokenizer the run that loads them names."""
    model = tokenizer_files(data).get("--tokenizer-model")
    if model is None:
        return dict.fromkeys(TOKENIZER_ARGS)
    return {"tokenizer_type": data.tokenizer_type, "tokenizer_model": os.path.abspath(model),
            "tiktoken_pattern": data.tiktoken_pattern if data.tokenizer_type == "TikTokenizer"
            else None}
