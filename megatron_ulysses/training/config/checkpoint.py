"""The checkpoint section: where to save and load, what a save writes and a load restores, how
(async, fully parallel, strictness, integrity hashes), which old checkpoints are kept, and
--use-checkpoint-args (the model's shape flags and tokenizer from the checkpoint at --load)."""

import argparse
import inspect
import os
import pathlib
from dataclasses import dataclass
from typing import ClassVar, Optional

from ...data.tokenizer_flags import TOKENIZER_TYPES
from ...errors import ConfigError, flag_name
from ...sp.rope import YARN_CONFIG
from .checks import Context, check_output_dir, check_range, ignore_without, require
from .fields import add_flags, flag, off_without
from .megatron_lm.refused import refuse_values


CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
              "raise_all", "return_unexpected", "return_all", "ignore_all")
_FROM_CHECKPOINT = "--use-checkpoint-args"


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = flag(None, type=str)
    load: Optional[str] = flag(None, type=str)
    save_interval: Optional[int] = flag(None, names=("--save-interval",
                                                     "--persistent-save-interval"))
    no_load_optim: bool = flag(False)
    ckpt_fully_parallel_save: bool = flag(
        True, "spread the writing of replicated tensors over their DP x SP replicas",
        action=argparse.BooleanOptionalAction)
    no_load_rng: bool = flag(False)
    finetune: bool = flag(
        False, "load model weights only; iteration and consumed samples start at 0",
        needs="--load")
    # --use-checkpoint-args and what it takes from the checkpoint
    use_checkpoint_args: ClassVar[bool] = flag(
        False, "with --load: the model's shape flags not given and the tokenizer from the "
        "checkpoint", kept=False)
    use_mp_args_from_checkpoint_args: ClassVar[bool] = flag(
        False, "with --use-checkpoint-args: TP and PP from the checkpoint even where the "
        "command line gives them", needs=_FROM_CHECKPOINT, kept=False)
    use_tokenizer_model_from_checkpoint_args: ClassVar[bool] = flag(
        True, "with --use-checkpoint-args: the tokenizer from the command line",
        needs=_FROM_CHECKPOINT, kept=False,
        names=("--no-use-tokenizer-model-from-checkpoint-args",
               "--disable-use-tokenizer-model-from-checkpoint-args"))
    ckpt_format: ClassVar[str] = flag(
        "torch_dist", "torch_dist (torch and torch_dcp write it too, with a warning)",
        choices=CKPT_FORMATS, kept=False)
    ckpt_fully_parallel_load: bool = flag(
        False, "DP x SP replicas each read a slice of the replicated tensors and exchange them")
    ckpt_assume_constant_structure: bool = flag(
        False, "cache the save plan across saves")
    dist_ckpt_strictness: str = flag(
        "assume_ok_unexpected", "what a load does with the checkpoint's keys it does not load",
        choices=STRICTNESS)
    dist_ckpt_optim_fully_reshardable: ClassVar[bool] = flag(
        False, "the optimizer state is always saved in the fully_reshardable layout",
        kept=False)
    save_retain_interval: Optional[int] = flag(
        None, "keep only the checkpoints at multiples of this (and the latest)")
    non_persistent_save_interval: ClassVar[Optional[int]] = flag(
        None, "not supported: non-persistent (local / global) checkpoints", kept=False)
    no_save_optim: bool = flag(
        False, "save no optimizer state or LR schedule (resume with --no-load-optim)")
    no_save_rng: bool = flag(False, "save no RNG states (resume with --no-load-rng)")
    exit_on_missing_checkpoint: ClassVar[bool] = flag(
        False, "with --load: stop if it holds no checkpoint instead of training from scratch",
        needs="--load", kept=False)
    # --async-save and Megatron-LM's options of its writer
    async_save: bool = flag(
        False, "write checkpoints in the background (with --use-persistent-ckpt-worker)")
    use_persistent_ckpt_worker: ClassVar[bool] = flag(False, kept=False)
    async_strategy: str = flag(
        "nvrx", "async saves always use megatron-core's queue (mcore); nvrx says so",
        choices=("nvrx", "mcore"))
    async_ckpt_use_cpu_shm: bool = flag(
        False, "nvidia-resiliency-ext's CPU shared-memory staging: not used (a warning)")
    verify_integrity: bool = flag(
        False, "SHA-256 of every checkpoint file, checked on load (megatron-core >= 0.19)")
    log_progress: bool = False  # progress.txt also records deleted checkpoints


def add_arguments(parser) -> None:
    add_flags(parser, CheckpointConfig, "checkpoints")
    # what --use-checkpoint-args took over the command line, said by `validate`
    parser.set_defaults(checkpoint_args_warnings=())


def check_values(args) -> None:
    check_range(args, "save_interval", low=0, low_open=True, optional=True)
    check_range(args, "save_retain_interval", low=0, low_open=True, optional=True)


def _megatron_core_has(function, parameter: str) -> bool:
    return parameter in inspect.signature(function).parameters


def validate(args, ctx: Context) -> None:
    _validate_save(args, ctx)
    _validate_async(args, ctx)
    require(not (args.use_checkpoint_args and args.load is None),
            "--use-checkpoint-args needs --load (as in Megatron-LM)")
    if args.load is None:  # Megatron-LM loads nothing, so reads them not
        ignore_without(args, ctx, "--load", off_without(CheckpointConfig, "--load"))
    if not args.use_checkpoint_args:
        ignore_without(args, ctx, _FROM_CHECKPOINT, off_without(CheckpointConfig,
                                                                _FROM_CHECKPOINT))
    ctx.warnings.extend(args.checkpoint_args_warnings)
    if args.exit_on_missing_checkpoint:
        require(os.path.isfile(os.path.join(args.load, "latest_checkpointed_iteration.txt")),
                f"--exit-on-missing-checkpoint: no checkpoint at --load {args.load} (its "
                "latest_checkpointed_iteration.txt is missing)")
    refuse_values(args, ("non_persistent_save_interval", "ckpt_format"))
    if args.ckpt_format in ("torch", "torch_dcp"):
        ctx.warnings.append(f"--ckpt-format {args.ckpt_format}: checkpoints are written as "
                            "torch_dist (megatron-core dist_checkpointing; Megatron-LM loads it)")
        args.ckpt_format = "torch_dist"
    if args.verify_integrity:
        from megatron.core import __version__, dist_checkpointing

        require(_megatron_core_has(dist_checkpointing.save, "verify_integrity"),
                f"--verify-integrity needs megatron-core>=0.19 (installed: {__version__}): "
                "its dist_checkpointing writes the SHA-256 manifest")
    check_output_dir(args, "save")  # fail now, not after training


def _validate_save(args, ctx: Context) -> None:
    """Megatron-LM writes checkpoints only when --save is given and not empty; its
    --save-interval and --save-retain-interval then apply."""
    if args.save == "":
        ctx.warnings.append("--save is empty: no checkpoints are written (as in Megatron-LM)")
        args.save = None
    if args.save is None:
        unused = [f for f in ("save_interval", "save_retain_interval", "no_save_optim",
                              "no_save_rng", "async_save") if getattr(args, f)]
        if unused:
            ctx.warnings.append(f"{', '.join(flag_name(f) for f in unused)} without --save: "
                                "no checkpoints are written (as in Megatron-LM)")
        args.async_save = False
        return
    if args.save_retain_interval is not None:
        require(args.save_interval is not None and
                args.save_retain_interval % args.save_interval == 0,
                f"--save-retain-interval {args.save_retain_interval} must be a multiple of "
                f"--save-interval {args.save_interval}")


def _validate_async(args, ctx: Context) -> None:
    """HEAD's rules: --async-save without --use-persistent-ckpt-worker is turned off with a
    warning; --async-strategy is mcore unless saving async. The async save always goes through
    megatron-core's AsyncCallsQueue: nvrx (nvidia-resiliency-ext's queue) and its CPU
    shared-memory staging are said to be replaced, not silently."""
    if args.async_save and not args.use_persistent_ckpt_worker:
        ctx.warnings.append("--async-save is not supported without --use-persistent-ckpt-worker "
                            "(as in Megatron-LM): saving synchronously")
        args.async_save = False
    if not args.async_save:
        args.async_strategy = "mcore"
        return
    if args.async_strategy == "nvrx":
        ctx.warnings.append("--async-strategy nvrx: saving through megatron-core's async queue "
                            "(--async-strategy mcore) instead of nvidia-resiliency-ext's")
        args.async_strategy = "mcore"
    if args.async_ckpt_use_cpu_shm:
        ctx.warnings.append("--async-ckpt-use-cpu-shm: CPU shared-memory staging is "
                            "nvidia-resiliency-ext's; megatron-core's queue stages the tensors "
                            "in process memory")
        args.async_ckpt_use_cpu_shm = False


# --use-checkpoint-args, as Megatron-LM's load_args_from_checkpoint: these come from the
# checkpoint's saved args where the command line gives none (the padded vocab too: it depends on
# TP, and a checkpoint loads at any TP; the TP and pipeline sizes are taken only with
# --use-mp-args-from-checkpoint-args, as in Megatron-LM) ...
CHECKPOINT_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "kv_channels", "max_position_embeddings", "use_rope_scaling", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", "norm_epsilon", "qk_layernorm",
    "make_vocab_size_divisible_by", "padded_vocab_size", *YARN_CONFIG,
)
# ... and these over the command line's (Megatron-LM's force=True), a warning naming each
# command-line value replaced.
FORCED_CHECKPOINT_ARGS = (
    "num_query_groups", "group_query_attention", "position_embedding_type", "rotary_base",
    "rotary_percent", "rotary_interleaved", "disable_bias_linear", "add_qkv_bias",
    "squared_relu", "swiglu", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "normalization", "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout",
)
# What --use-mp-args-from-checkpoint-args takes from the checkpoint over the command line.
_PARALLEL_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


def apply_checkpoint_args(args: argparse.Namespace, given: frozenset = frozenset()) -> None:
    """--use-checkpoint-args: the model flags from the checkpoint at --load (checked for
    pickled code before it is read), as Megatron-LM's: CHECKPOINT_ARGS where the command line
    (`given`) has none, FORCED_CHECKPOINT_ARGS over it (a warning names what they replace; a
    shape that differs from the checkpoint's is refused by the load), and its tokenizer
    (`_take_tokenizer`)."""
    require(args.load is not None, "--use-checkpoint-args needs --load (as in Megatron-LM)")
    from ..checkpoint import load as checkpoint_load  # dist_checkpointing: only needed here

    saved = checkpoint_load.read_checkpoint_args(args.load)
    if saved is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint at --load {args.load} (its "
                          "latest_checkpointed_iteration.txt is missing)")
    missing = [flag_name(k) for k in ("num_layers", "hidden_size", "num_attention_heads")
               if saved.get(k) is None]
    require(not missing, f"--use-checkpoint-args: the checkpoint at --load {args.load} holds "
            f"no {', '.join(missing)}; give them on the command line")
    forced = FORCED_CHECKPOINT_ARGS + (_PARALLEL_ARGS if args.use_mp_args_from_checkpoint_args
                                       else ())
    for name in CHECKPOINT_ARGS:  # (a --no-<flag> given counts as the flag)
        flags = {flag_name(name), "--no-" + flag_name(name)[2:]}
        if saved.get(name) is not None and not flags & given and name not in forced:
            setattr(args, name, saved[name])
    if saved.get("num_query_groups") is not None and "group_query_attention" not in saved:
        saved = dict(saved, group_query_attention=
                     saved["num_query_groups"] != saved["num_attention_heads"])
    _take(args, {flag_name(name): (name, saved[name]) for name in forced
                 if saved.get(name) is not None},
          "the checkpoint's values are used instead", given)
    if not args.group_query_attention:
        args.num_query_groups = None
    _take_tokenizer(args, saved)
    if args.vocab_size is None and saved.get("vocab_size") is not None and \
            args.tokenizer_type in (None, "NullTokenizer"):
        args.vocab_size = saved["vocab_size"]


def _take_tokenizer(args: argparse.Namespace, saved: dict) -> None:
    """Megatron-LM's load_args_from_checkpoint: the checkpoint's --tokenizer-type and
    --tokenizer-model (each where it holds one) over the command line's, unless
    --no-use-tokenizer-model-from-checkpoint-args; its --tiktoken-pattern in any case (only a
    TikTokenizer reads it). The checkpoint is untrusted: the type must be one built here, the
    model a path that exists (read later as the command line's would be; nothing of it runs
    without --trust-remote-code), the pattern v1 or v2."""
    kind, model = saved.get("tokenizer_type"), saved.get("tokenizer_model")
    was = f"--use-checkpoint-args: the checkpoint at --load {args.load} was saved with"
    fix = ("; give --no-use-tokenizer-model-from-checkpoint-args with the tokenizer flags "
           "(Megatron-LM's flag for a checkpoint from another machine)")
    taken = {}
    if not args.use_tokenizer_model_from_checkpoint_args:
        require(kind is None or args.tokenizer_type is not None,
                "--no-use-tokenizer-model-from-checkpoint-args: the tokenizer comes from the "
                "command line, which gives no --tokenizer-type; give it and its files (the "
                f"checkpoint's: --tokenizer-type {kind!r:.80}"
                + ("" if model is None else f" --tokenizer-model {model!r:.300}") + ")")
    elif kind is not None:
        require(kind in TOKENIZER_TYPES, f"{was} --tokenizer-type {kind!r:.80}, which is not "
                f"one of {', '.join(TOKENIZER_TYPES)}{fix}")
        require(model is None or isinstance(model, (str, pathlib.PurePath)) and
                os.path.exists(model), f"{was} --tokenizer-model {model!r:.300}, which does "
                f"not exist here{fix}")
        taken["--tokenizer-type"] = ("tokenizer_type", kind)
        if model is not None:
            taken["--tokenizer-model"] = ("tokenizer_model", str(model))
    pattern = saved.get("tiktoken_pattern")
    if pattern is not None and taken.get("--tokenizer-type", (None, args.tokenizer_type))[1] \
            == "TikTokenizer":
        require(pattern in ("v1", "v2"), f"{was} --tiktoken-pattern {pattern!r:.80}, not v1 "
                "or v2: no TikTokenizer run of this package or Megatron-LM saved it")
        taken["--tiktoken-pattern"] = ("tiktoken_pattern", pattern)
    _take(args, taken, "the checkpoint's tokenizer is used instead")


def _take(args: argparse.Namespace, taken: dict, what: str, given=None) -> None:
    """Set `taken` ({flag: (dest, value)}), a warning naming the command-line values (those of
    the flags in `given`; any set when None) they replace."""
    replaced = {flag: value for flag, (dest, value) in taken.items()
                if getattr(args, dest) not in (None, value) and (given is None or flag in given)}
    if replaced:
        keep = ("; --no-use-tokenizer-model-from-checkpoint-args keeps the command line's"
                if "--tokenizer-type" in taken else "")
        args.checkpoint_args_warnings += (
            ", ".join(f"{flag} {getattr(args, taken[flag][0])}" for flag in replaced)
            + f": {what} (" + ", ".join(f"{flag} {value}" for flag, value in replaced.items())
            + f"), as Megatron-LM's --use-checkpoint-args does{keep}",)
    for dest, value in taken.values():
        setattr(args, dest, value)
