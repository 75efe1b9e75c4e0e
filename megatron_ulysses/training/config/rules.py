"""The rules that span config sections (each section checks its own flags next to its
dataclass). `check_run_length` runs before the sections' value checks, `validate` after the
sections' rules, once every default it reads is filled in."""

import math

from ...data.datasets import parse_split
from ...sp.rope import fused_rope_fits
from .checks import Context, require


def check_run_length(args, ctx: Context) -> None:
    """--lr and one of --train-iters / --train-samples (neither needed with --skip-train), and
    the default --initial-loss-scale, which depends on the tokens of one micro batch per rank."""
    if args.initial_loss_scale is None and args.seq_length > 0 and args.micro_batch_size > 0:
        tokens = args.micro_batch_size * ctx.dims.local_seq_length(args.seq_length)
        args.initial_loss_scale = max(1.0, 2.0**20 / 2 ** math.ceil(math.log2(tokens)))
    if args.skip_train:
        if args.train_iters is None and args.train_samples is None:
            args.train_iters = 0  # nothing trains: no optimizer or schedule is built
        if args.lr is None:
            args.lr = 0.0
    else:
        require(args.lr is not None, "--lr is required (except with --skip-train)")
    require((args.train_iters is None) != (args.train_samples is None),
            "give one of --train-iters and --train-samples")


def validate(args, ctx: Context) -> None:
    """The rules between sections, in the order their warnings are said."""
    _check_splits_against_run(args, ctx)
    require(not (args.no_position_embedding and
                 args.position_embedding_type == "learned_absolute"),
            "--no-position-embedding leaves no position information with "
            f"--position-embedding-type {args.position_embedding_type}; add "
            "--position-embedding-type rope (or --use-rotary-position-embeddings), as "
            "Megatron-LM requires")
    _check_rope_fusion(args, ctx)
    if args.fp16 and args.loss_scale is None:  # megatron-core's DynamicGradScaler asserts it
        require(args.min_loss_scale <= args.initial_loss_scale,
                f"--min-loss-scale ({args.min_loss_scale}) must be <= --initial-loss-scale "
                f"({args.initial_loss_scale})")
    if args.position_embedding_type in ("rope", "yarn") and args.reset_position_ids and \
            not args.reset_attention_mask:
        ctx.warnings.append(
            "--reset-position-ids changes nothing with --position-embedding-type "
            f"{args.position_embedding_type}: RoPE "
            "takes positions from each document only with --reset-attention-mask, which "
            "also keeps documents from attending to each other; add --reset-attention-mask "
            "or drop --reset-position-ids")
    _check_exits_and_saves(args, ctx)
    _check_microbatch_groups(args, ctx)


def _check_microbatch_groups(args, ctx: Context) -> None:
    """The interleaved schedule runs the micro batches M of a step (training's and evaluation's)
    in groups of G (--microbatch-group-size-per-virtual-pipeline-stage, default PP) per virtual
    stage: megatron-core raises at the first step unless PP <= G <= M and the last group is
    full or at least PP."""
    if args.virtual_pipeline_model_parallel_size is None:
        return
    pp = ctx.dims.pp
    group = args.microbatch_group_size_per_virtual_pipeline_stage or pp
    runs = [("--global-batch-size", args.num_microbatches)]
    if args.eval_iters:
        runs.append(("--eval-global-batch-size", args.eval_num_microbatches))
    for flag, m in runs:
        require(pp <= group <= m and (m % group == 0 or m % group >= pp),
                f"the interleaved schedule runs {flag}'s {m} micro batches per step in groups "
                f"of {group} (--microbatch-group-size-per-virtual-pipeline-stage, default "
                f"--pipeline-model-parallel-size {pp}): it needs {pp} <= group <= {m} and the "
                f"last group full or at least {pp}; change {flag} or the group size")


def _check_splits_against_run(args, ctx: Context) -> None:
    """--split's train and valid weights (or the --train/valid-data-path given) against
    --skip-train and --eval-iters."""
    if args.mock_data:
        return
    if not args.data_path:  # per-split data: --split is not used, as in Megatron-LM
        require(args.train_data_path or args.skip_train, "--valid/--test-data-path without "
                "--train-data-path leave nothing to train on; add --train-data-path")
        require(args.valid_data_path or not args.skip_train, "--skip-train evaluates the "
                "valid split: it needs --valid-data-path")
        if not args.valid_data_path and args.eval_iters > 0:
            ctx.warnings.append(f"no --valid-data-path: no evaluation runs (--eval-iters "
                                f"{args.eval_iters} is ignored)")
        return
    split = parse_split(args.split)
    require(split[0] > 0 or args.skip_train, f"--split {args.split} gives the train split weight "
            "0, so there is nothing to train on; give it a positive first weight, e.g. --split "
            "969,30,1")
    require(not (args.skip_train and split[1] == 0),
            f"--skip-train evaluates the valid split, but --split {args.split} gives it "
            "weight 0; give it a weight, e.g. --split 0,1,0")
    if split[1] == 0 and args.eval_iters > 0:
        ctx.warnings.append(
            f"--split {args.split} gives the valid split weight 0: no evaluation runs "
            f"(--eval-iters {args.eval_iters} is ignored); give it a weight to evaluate")


def _check_rope_fusion(args, ctx: Context) -> None:
    """TE's fused RoPE only where its 32-bit offsets reach (`rope.fused_rope_fits`); past
    that the unfused RoPE runs, said once."""
    if not ctx.cuda or args.no_rope_fusion or args.position_embedding_type != "rope":
        return
    tokens = args.micro_batch_size * ctx.dims.local_seq_length(args.seq_length)
    heads = args.num_attention_heads // ctx.dims.tp
    groups = max(args.num_query_groups // ctx.dims.tp, 1)
    if not fused_rope_fits(tokens, heads, groups, args.kv_channels):
        args.no_rope_fusion = True
        ctx.warnings.append(
            f"RoPE runs unfused: TE's fused RoPE kernel indexes with 32-bit offsets and its k "
            f"is a view into the qkv projection of --micro-batch-size x --seq-length / "
            f"--ulysses-sp-size = {tokens} tokens x {heads + 2 * groups} heads x "
            f"{args.kv_channels} = {tokens * (heads + 2 * groups) * args.kv_channels:,} "
            f"elements per rank, past 2^31 (the fused kernel would read out of bounds: an "
            f"illegal address or NaN gradients); a larger --ulysses-sp-size brings it back, "
            f"--no-rope-fusion silences this")


def _check_exits_and_saves(args, ctx: Context) -> None:
    """The exits save where there is a --save (without one they only stop the run, as
    Megatron-LM's); --skip-train neither loads nor saves by itself."""
    exits = [flag for flag, given in (("--exit-signal-handler", args.exit_signal_handler),
                                      ("--exit-duration-in-mins",
                                       args.exit_duration_in_mins is not None)) if given]
    if exits and args.save is None and not args.skip_train:
        ctx.warnings.append(f"{' and '.join(exits)} without --save: the run stops without "
                            "saving a checkpoint (as in Megatron-LM)")
    if args.skip_train:
        if args.load is None:
            ctx.warnings.append("--skip-train without --load evaluates the freshly initialised "
                                "model")
        if args.save is not None:
            ctx.warnings.append(f"--save {args.save} is ignored with --skip-train (nothing "
                                "trains)")
