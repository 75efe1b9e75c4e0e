"""The checkpoint section: where to save and load, what a load restores, and
--use-checkpoint-args (the model's shape flags from the checkpoint at --load)."""

import argparse
from dataclasses import dataclass
from typing import Optional

from ...errors import ConfigError, flag_name
from .checks import Context, check_output_dir, check_range, require


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    ckpt_fully_parallel_save: bool


def add_arguments(parser) -> None:
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--ckpt-fully-parallel-save", action=argparse.BooleanOptionalAction,
                   default=True, help="spread the writing of tensors replicated over DP x SP "
                   "across their replicas (Megatron-LM's default; --no-ckpt-fully-parallel-save: "
                   "the first replica writes each)")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; iteration and consumed samples start at 0")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="with --load: take the model's shape flags (--num-layers, "
                   "--hidden-size, heads, RoPE, norms, TP/PP, the vocab padding, ...) from the "
                   "checkpoint instead of the command line")
    g.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist",
                   help="checkpoints are megatron-core dist_checkpointing (torch_dist)")


def check_values(args) -> None:
    check_range(args, "save_interval", low=0, low_open=True, optional=True)


def validate(args, ctx: Context) -> None:
    require(not (args.save_interval is not None and args.save is None),
            "--save-interval needs --save")
    require(not (args.finetune and args.load is None), "--finetune needs --load")
    require(not (args.use_checkpoint_args and args.load is None),
            "--use-checkpoint-args needs --load")
    check_output_dir(args, "save")  # fail now, not after training


# Flags --use-checkpoint-args takes from the checkpoint's saved args (those it holds).
CHECKPOINT_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "max_position_embeddings", "position_embedding_type", "rotary_base",
    "rotary_percent", "use_rope_scaling", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", "normalization", "norm_epsilon", "swiglu",
    "untie_embeddings_and_output_weights", "disable_bias_linear", "add_qkv_bias",
    "qk_layernorm", "make_vocab_size_divisible_by", "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)


def apply_checkpoint_args(args: argparse.Namespace, given: frozenset = frozenset()) -> None:
    """--use-checkpoint-args: the model-shape flags from the checkpoint at --load (checked
    for pickled code before it is read), except those in `given` (flags on the command line win,
    as Megatron-LM's: e.g. a new --rotary-base for context extension; a shape that differs from
    the checkpoint's is refused by the load)."""
    require(args.load is not None, "--use-checkpoint-args needs --load")
    from .. import checkpointing  # megatron-core's dist_checkpointing: only needed here

    saved = checkpointing.read_checkpoint_args(args.load)
    if saved is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint at --load {args.load} (its "
                          "latest_checkpointed_iteration.txt is missing)")
    missing = [flag_name(k) for k in ("num_layers", "hidden_size", "num_attention_heads")
               if saved.get(k) is None]
    require(not missing, f"--use-checkpoint-args: the checkpoint at --load {args.load} holds "
            f"no {', '.join(missing)}; give them on the command line")
    for name in CHECKPOINT_ARGS:
        if name in saved and flag_name(name) not in given:
            setattr(args, name, saved[name])
    if "num_query_groups" in saved and not given & {"--group-query-attention",
                                                    "--num-query-groups"}:
        args.group_query_attention = saved["num_query_groups"] != saved["num_attention_heads"]
        if not args.group_query_attention:
            args.num_query_groups = None
    if args.vocab_size is None and saved.get("vocab_size") is not None and \
            args.tokenizer_type in (None, "NullTokenizer"):
        args.vocab_size = saved["vocab_size"]
