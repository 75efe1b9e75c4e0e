"""The optimizer-and-schedule section: Adam, its LR / weight-decay schedule, fp16 loss scaling,
DDP and the distributed optimizer."""

from dataclasses import dataclass
from typing import ClassVar, Optional

from .checks import Context, check_range, ignore_without, require
from .fields import add_flags, flag


_SCHEDULER = "on --load, take the LR / weight-decay schedule from "


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam, its LR / weight-decay schedule, fp16 loss scaling, DDP and the distributed
    optimizer (`bf16`/`fp16` come from `ModelConfig`)."""

    optimizer: str = flag("adam", choices=("adam",))
    lr: float = flag(None, "required unless --skip-train")
    min_lr: float = flag(0.0)
    # the LR schedule: decay style, warmup and decay in iterations or samples, WSD, decoupled LR
    lr_decay_style: str = flag("linear", choices=("constant", "linear", "cosine",
                                                  "inverse-square-root", "WSD"))
    lr_wsd_decay_style: str = flag(
        "exponential", "--lr-decay-style WSD: the shape of the final anneal",
        choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: ClassVar[Optional[int]] = flag(
        None, "--lr-decay-style WSD with --train-iters: anneal iterations", kept=False)
    lr_wsd_decay_samples: ClassVar[Optional[int]] = flag(
        None, "--lr-decay-style WSD with --train-samples: anneal samples", kept=False)
    lr_warmup_iters: int = flag(0)
    lr_warmup_samples: ClassVar[int] = flag(0, "warmup in samples (with --train-samples)",
                                            kept=False)
    lr_warmup_fraction: ClassVar[Optional[float]] = flag(
        None, "warmup as a fraction of the decay length", kept=False)
    lr_warmup_init: float = flag(0.0, "the LR warmup starts from")
    lr_decay_iters: int = flag(None, "default --train-iters")
    lr_decay_samples: ClassVar[Optional[int]] = flag(
        None, "with --train-samples; default --train-samples", kept=False)
    decoupled_lr: Optional[float] = flag(
        None, "max LR of the input embedding and output layer (the others: --lr)")
    decoupled_min_lr: Optional[float] = flag(
        None, "min LR of the --decoupled-lr group; default --min-lr")
    weight_decay: float = flag(0.01)
    start_weight_decay: float = flag(None, "with --weight-decay-incr-style linear/cosine")
    end_weight_decay: float = flag(None, "with --weight-decay-incr-style linear/cosine")
    weight_decay_incr_style: str = flag(
        "constant", "weight decay from --start-weight-decay to --end-weight-decay",
        choices=("constant", "linear", "cosine"))
    apply_wd_to_qk_layernorm: bool = flag(
        False, "weight decay on the q/k layernorm weights too")
    no_weight_decay_cond_type: ClassVar[Optional[str]] = flag(
        None, "Megatron-LM's deprecated spelling of --apply-wd-to-qk-layernorm",
        choices=("apply_wd_to_qk_layernorm",), kept=False)
    calculate_per_token_loss: bool = flag(
        False, "accepted: the loss is always per token over the global batch")
    adam_beta1: float = flag(0.9)
    adam_beta2: float = flag(0.999)
    adam_eps: float = flag(1e-8)
    clip_grad: float = flag(1.0, "0 disables clipping")
    override_opt_param_scheduler: bool = flag(
        False, _SCHEDULER + "these flags, not from the checkpoint",
        names=("--override-opt_param-scheduler", "--override-opt-param-scheduler"))
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, _SCHEDULER + "the checkpoint",
        names=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"))
    loss_scale: Optional[float] = flag(None, "static fp16 loss scale; default dynamic")
    initial_loss_scale: Optional[float] = flag(
        None, "dynamic fp16 loss scale to start from; default 2^20 / a rank's micro batch "
        "tokens")
    min_loss_scale: float = flag(1.0)
    loss_scale_window: float = flag(1000)
    hysteresis: int = flag(2)
    use_distributed_optimizer: bool = flag(False)
    overlap_grad_reduce: bool = flag(
        False, "gradient reductions over DP x SP overlap the last micro batch's backward")
    # with overlap_grad_reduce: the schedule launches each reduction (Megatron-LM's
    # DistributedInitConfig field: both spellings its argument factory makes)
    align_grad_reduce: bool = flag(
        True, "with --overlap-grad-reduce and PP > 1: each stage starts its reductions as "
        "ready",
        names=("--no-align-grad-reduce", "--disable-align-grad-reduce"))
    # The scheduler's lengths in samples (Megatron-LM's get_optimizer_param_scheduler).
    lr_warmup_steps: float  # a fraction of the decay need not be whole (Megatron-LM's)
    lr_decay_steps: int
    wd_incr_steps: int
    wsd_decay_steps: Optional[int]


def add_arguments(parser) -> None:
    add_flags(parser, OptimizerConfig, "optimizer and schedule")


def check_values(args) -> None:
    """After `rules.check_run_length` (it fills in --lr with --skip-train)."""
    check_range(args, "lr_decay_iters", low=0, low_open=True, optional=True)
    check_range(args, "hysteresis", low=1)
    for name in ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init"):
        check_range(args, name, low=0)
    for name in ("lr_decay_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples"):
        check_range(args, name, low=0, low_open=True, optional=True)
    for name in ("decoupled_lr", "decoupled_min_lr", "start_weight_decay", "end_weight_decay"):
        check_range(args, name, low=0, optional=True)
    for name in ("adam_eps", "min_loss_scale", "loss_scale_window"):
        check_range(args, name, low=0, low_open=True)
    for name in ("loss_scale", "initial_loss_scale"):
        check_range(args, name, low=0, low_open=True, optional=True)
    for name in ("lr", "min_lr", "weight_decay", "clip_grad"):
        check_range(args, name, low=0)
    for name in ("adam_beta1", "adam_beta2"):
        check_range(args, name, low=0, high=1, high_open=True)
    check_range(args, "lr_warmup_fraction", low=0, high=1, high_open=True, optional=True)


def validate(args, ctx: Context) -> None:
    """The LR and weight-decay schedule (after the training section: its lengths follow the
    run's), decoupled LR, the schedule flags' exclusivity."""
    require(0 <= args.min_lr <= args.lr,
            f"--min-lr ({args.min_lr}) must be in [0, --lr ({args.lr})]")
    require(args.lr_warmup_init <= args.lr,
            f"--lr-warmup-init ({args.lr_warmup_init}) must be <= --lr ({args.lr})")
    _check_decoupled_lr(args, ctx)
    if args.no_weight_decay_cond_type is not None:  # as Megatron-LM: said, then mapped
        ctx.warnings.append("--no-weight-decay-cond-type is deprecated (as in Megatron-LM); "
                            "use --apply-wd-to-qk-layernorm")
        args.apply_wd_to_qk_layernorm = True
    _check_weight_decay(args)
    _schedule_lengths(args, ctx)
    _check_wsd(args)
    require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
            "exclusive; give one")
    require(ctx.cuda or not args.use_distributed_optimizer,
            "--use-distributed-optimizer needs CUDA (megatron-core's distributed "
            "optimizer); drop it on CPU")


def _check_decoupled_lr(args, ctx: Context) -> None:
    if args.decoupled_lr is None:
        if args.decoupled_min_lr is not None:  # Megatron-LM ignores it then
            ctx.warnings.append(f"--decoupled-min-lr {args.decoupled_min_lr} is ignored "
                                "without --decoupled-lr")
        return
    low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
    flag = "--min-lr" if args.decoupled_min_lr is None else "--decoupled-min-lr"
    require(low <= args.decoupled_lr, f"{flag} ({low}) must be <= --decoupled-lr "
            f"({args.decoupled_lr}): the embedding and output layer decay from one to the other")


def _check_weight_decay(args) -> None:
    """Megatron-LM's rules: constant takes --weight-decay, linear/cosine need the two ends."""
    style = args.weight_decay_incr_style
    given = [f"--{end}-weight-decay" for end in ("start", "end")
             if getattr(args, f"{end}_weight_decay") is not None]
    if style == "constant":
        require(not given, f"{' and '.join(given)} need --weight-decay-incr-style linear or "
                "cosine (constant uses --weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
        return
    require(len(given) == 2, f"--weight-decay-incr-style {style} needs --start-weight-decay "
            "and --end-weight-decay")
    require(args.start_weight_decay <= args.end_weight_decay,
            f"--start-weight-decay ({args.start_weight_decay}) must be <= --end-weight-decay "
            f"({args.end_weight_decay}): the weight decay increases")


def _schedule_lengths(args, ctx: Context) -> None:
    """Megatron-LM's get_optimizer_param_scheduler: with --train-iters the lengths in iterations
    x --global-batch-size, with --train-samples in samples (the other unit's decay and warmup
    refused, as its validate_args does; its WSD length ignored); the scheduler counts
    samples."""
    by_samples = args.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    scale = 1 if by_samples else args.global_batch_size
    for what in ("lr_decay", "lr_warmup"):
        given = getattr(args, f"{what}_{other}")
        require(given in (None, 0), f"--{what.replace('_', '-')}-{other} goes with --train-"
                f"{other}; with --train-{unit} give --{what.replace('_', '-')}-{unit} (as in "
                "Megatron-LM)")
    # Megatron-LM's scheduler reads only this unit's WSD length (validate_args has no rule)
    ignore_without(args, ctx, f"--train-{other}", ((f"--lr-wsd-decay-{other}",
                                                     f"lr_wsd_decay_{other}", None),))
    warmup = getattr(args, f"lr_warmup_{unit}")
    require(args.lr_warmup_fraction is None or warmup == 0,
            f"give --lr-warmup-fraction or --lr-warmup-{unit}, not both")
    run_length = args.train_samples if by_samples else args.train_iters
    decay_defaulted = getattr(args, f"lr_decay_{unit}") is None
    if decay_defaulted:
        setattr(args, f"lr_decay_{unit}", run_length)
    decay = getattr(args, f"lr_decay_{unit}")
    wsd = getattr(args, f"lr_wsd_decay_{unit}")
    args.lr_decay_steps, args.wd_incr_steps = decay * scale, run_length * scale
    args.wsd_decay_steps = None if wsd is None else wsd * scale
    if args.lr_warmup_fraction is None:
        args.lr_warmup_steps = warmup * scale
        warmup_flag = f"--lr-warmup-{unit}"
    else:  # a float, as Megatron-LM passes it
        args.lr_warmup_steps = args.lr_warmup_fraction * args.lr_decay_steps
        warmup = args.lr_warmup_steps / scale
        warmup_flag = f"--lr-warmup-fraction {args.lr_warmup_fraction} x --lr-decay-{unit}"
    # megatron-core's OptimizerParamScheduler asserts warmup < decay (whatever the decay style).
    noun = "samples" if by_samples else "iterations"
    require(args.lr_warmup_steps < args.lr_decay_steps or args.skip_train,
            f"{warmup_flag} ({warmup:g} {noun}) must be < --lr-decay-{unit}"
            f"{f' (default --train-{unit})' if decay_defaulted else ''} ({decay}); shorten the "
            "warmup or lengthen the decay")


def _check_wsd(args) -> None:
    """WSD needs its anneal length (megatron-core asserts it), within the decay."""
    unit = "samples" if args.train_samples is not None else "iters"
    if args.lr_decay_style != "WSD" or args.skip_train:
        return
    require(args.wsd_decay_steps is not None,
            f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the anneal length)")
    require(args.wsd_decay_steps <= args.lr_decay_steps,
            f"--lr-wsd-decay-{unit} must be <= --lr-decay-{unit}: the anneal is the end of "
            "the decay")
