"""The training section: the loop's batch sizes, iterations, evaluation, exits, seed and its
process group."""

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from .. import batch_schedule

from ...errors import ConfigError
from .checks import Context, check_positive, check_range, number, require
from .fields import add_flags, flag, flags_of
from .megatron_lm.refused import refuse_values


_RERUN_ENGINE = "needs megatron-core's rerun engine: refused"


@dataclass(frozen=True)
class TrainingConfig:
    """The loop: batch sizes, iterations, evaluation, exits, seeds, the process group."""

    micro_batch_size: int = flag(None, required=True)
    global_batch_size: int = flag(None, "default micro batch x data-parallel size")
    decrease_batch_size_if_needed: ClassVar[bool] = flag(
        False, "round --global-batch-size down to a multiple of micro batch x DP", kept=False)
    dataloader_type: ClassVar[Optional[str]] = flag(
        None, "only single here (Megatron-LM's default)",
        choices=("single", "cyclic", "external"), kept=False)
    train_iters: int = flag(None)
    train_samples: ClassVar[Optional[int]] = flag(
        None, "instead of --train-iters: samples / global batch size iterations", kept=False)
    eval_interval: int = flag(1000)
    eval_iters: int = flag(100)
    start_eval_at_iter: Optional[int] = flag(  # no evaluation before this iteration
        None, "evaluate every --eval-interval from this iteration on")
    skip_train: bool = flag(
        False, "no training: evaluate the weights at --load on --eval-iters batches and exit")
    seed: int = flag(1234)
    exit_interval: Optional[int] = flag(None)
    exit_duration_in_mins: Optional[float] = flag(
        None, "save (with --save) and exit after this many minutes", type=number)
    exit_signal_handler: bool = flag(
        False, "on --exit-signal: save a checkpoint (with --save) and exit")
    exit_signal: ClassVar[str] = flag(
        "SIGTERM", "the signal of --exit-signal-handler (only SIGTERM here)", kept=False)
    check_for_nan_in_loss_and_grad: bool = flag(
        True, "train on past a NaN loss or a NaN / Inf gradient",
        names=("--no-check-for-nan-in-loss-and-grad",))
    distributed_backend: str = flag(None, "default nccl with CUDA, gloo without",
                                    choices=("nccl", "gloo"))
    distributed_timeout_minutes: int = flag(10)
    # batch-size ramps, evaluation batches, GC, memory, rerun checks, profiling
    rampup_batch_size: ClassVar[Optional[Tuple[int, int, int]]] = flag(
        None, "grow the global batch from START by INCREMENT over SAMPLES samples",
        nargs=3, type=int,
        metavar=("START", "INCREMENT", "SAMPLES"), kept=False)
    step_batch_size_schedule: ClassVar[Optional[str]] = flag(
        None, "'THRESHOLD:BS ...': global batch BS from THRESHOLD tokens on (K/M/B/T)",
        nargs="+", kept=False)
    batch_size_schedule: Optional[batch_schedule.Schedule]  # --rampup / --step-batch-size-*
    eval_micro_batch_size: int = flag(None, "default --micro-batch-size")
    eval_global_batch_size: int = flag(None, "default --global-batch-size")
    data_parallel_random_init: bool = flag(
        False, "dropout streams seeded per data-parallel replica (seed + 10 x DP rank)")
    manual_gc: bool = flag(
        False, "python's GC off; collect every --manual-gc-interval iterations")
    manual_gc_interval: int = flag(0, "0: collect only around evaluations")
    manual_gc_eval: bool = flag(True, "with --manual-gc: no collection around evaluations",
                                names=("--no-manual-gc-eval", "--disable-manual-gc-eval"))
    empty_unused_memory_level: int = flag(
        0, "torch.cuda.empty_cache() after each step (1), also after evaluation (2)",
        choices=(0, 1, 2))
    rerun_mode: str = flag(
        "validate_results", "validate_results: the loss's NaN check; disabled: none",
        choices=("disabled", "validate_results", "report_stats"))
    check_for_large_grads: ClassVar[bool] = flag(False, _RERUN_ENGINE, kept=False)
    check_for_spiky_loss: ClassVar[bool] = flag(False, _RERUN_ENGINE, kept=False)
    error_injection_rate: ClassVar[int] = flag(
        0, "the rerun engine's fault injection (tests of Megatron-LM): only 0 here", kept=False)
    error_injection_type: ClassVar[str] = flag(
        "transient_error", "with --error-injection-rate", kept=False,
        choices=("correct_result", "transient_error", "persistent_error"))
    check_weight_hash_across_dp_replicas_interval: Optional[int] = flag(
        None, "every N iterations: raise unless every DP x SP replica holds the same weights")
    profile: bool = flag(
        False, "profile iterations [--profile-step-start, --profile-step-end): torch or nsys")
    use_pytorch_profiler: bool = flag(
        False, "torch.profiler (traces in <--tensorboard-dir>/../torch_profile)")
    profile_step_start: int = flag(10)
    profile_step_end: int = flag(12)
    profile_ranks: Tuple[int, ...] = flag([], "default every rank", nargs="+", type=int)
    pytorch_profiler_collect_shapes: bool = flag(
        False, "with --use-pytorch-profiler: record the tensors' shapes")
    pytorch_profiler_collect_callstack: bool = flag(
        False, "with --use-pytorch-profiler: record the Python call stacks")
    num_microbatches: int  # derived: the global batch / (micro batch x DP)
    eval_num_microbatches: int

    def evaluates_after(self, iteration: int) -> bool:
        """Whether the loop evaluates after `iteration` steps: every --eval-interval, from
        --start-eval-at-iter on."""
        return iteration % self.eval_interval == 0 and iteration >= (self.start_eval_at_iter or 0)

    def evaluations_through(self, iteration: int) -> int:
        """How many evaluations the steps 1..`iteration` are followed by."""
        first = max(1, -(-(self.start_eval_at_iter or 0) // self.eval_interval))
        return max(0, iteration // self.eval_interval - first + 1)


def add_arguments(parser) -> None:
    add_flags(parser, TrainingConfig, "training")


def check_values(args) -> None:
    """After `rules.check_run_length` (one of --train-iters and --train-samples is given)."""
    steps = [] if args.skip_train else [
        "train_iters" if args.train_iters is not None else "train_samples"]
    check_positive(args, "micro_batch_size", *steps, "eval_interval")
    check_range(args, "eval_iters", low=0)
    for name in ("exit_interval", "exit_duration_in_mins"):
        check_range(args, name, low=0, low_open=True, optional=True)
    check_range(args, "distributed_timeout_minutes", low=1)
    check_range(args, "manual_gc_interval", low=0)
    check_range(args, "check_weight_hash_across_dp_replicas_interval", low=0, low_open=True,
                optional=True)
    for name in ("eval_micro_batch_size", "eval_global_batch_size"):
        check_range(args, name, low=0, low_open=True, optional=True)
    check_range(args, "start_eval_at_iter", low=0, optional=True)
    refuse_values(args, [name for name, _ in flags_of(TrainingConfig)])
    check_range(args, "seed", low=0, high=2**32 - 1)  # numpy seeds the data sampling with it


def validate(args, ctx: Context) -> None:
    """The global batch and the micro batches per step; --train-samples in iterations; the
    process group's backend."""
    require(not args.skip_train or args.eval_iters > 0, f"--skip-train evaluates --eval-iters "
            f"batches; give a positive --eval-iters (got {args.eval_iters})")
    dims = ctx.dims
    per_step = args.micro_batch_size * dims.dp
    if args.step_batch_size_schedule is not None:
        args.step_batch_size_schedule = " ".join(args.step_batch_size_schedule)
    require(args.step_batch_size_schedule is None or not args.decrease_batch_size_if_needed,
            "give --step-batch-size-schedule or --decrease-batch-size-if-needed, not both (as "
            "in Megatron-LM)")
    require(args.step_batch_size_schedule is None or args.global_batch_size is None,
            "give --step-batch-size-schedule or --global-batch-size, not both (Megatron-LM's "
            "rule: the schedule sets every global batch)")
    require(args.step_batch_size_schedule is None or args.rampup_batch_size is None,
            "give --step-batch-size-schedule or --rampup-batch-size, not both")
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    _decrease_batch_size(args, ctx, per_step)
    require(args.global_batch_size > 0 and args.global_batch_size % per_step == 0,
            f"--global-batch-size ({args.global_batch_size}) must be a positive multiple of "
            f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x {dims.dp} = "
            f"{per_step}); data-parallel size = world {dims.world_size} / (TP {dims.tp} x PP "
            f"{dims.pp} x --ulysses-sp-size {dims.sp})")
    args.num_microbatches = args.global_batch_size // per_step
    args.batch_size_schedule = _batch_size_schedule(args, ctx)
    if args.train_samples is not None:
        require(args.train_samples >= args.global_batch_size or args.batch_size_schedule,
                f"--train-samples ({args.train_samples}) must be >= --global-batch-size "
                f"({args.global_batch_size}): training runs --train-samples // "
                "--global-batch-size iterations")
        args.train_iters = batch_schedule.iterations_for(
            args.train_samples, args.batch_size_schedule, args.global_batch_size)
    _eval_batches(args, ctx)
    _check_profile(args, ctx)
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if ctx.cuda else "gloo"
    require(not (args.distributed_backend == "nccl" and not ctx.cuda),
            "--distributed-backend nccl needs CUDA; use gloo")


def _decrease_batch_size(args, ctx: Context, per_step: int) -> None:
    """--decrease-batch-size-if-needed: the global batch rounded down to a multiple of
    `per_step` (megatron-core's calculator), said once."""
    gbs = args.global_batch_size
    if not args.decrease_batch_size_if_needed or gbs % per_step == 0:
        return
    require(gbs >= per_step, f"--decrease-batch-size-if-needed: --global-batch-size ({gbs}) is "
            f"smaller than --micro-batch-size x data-parallel size ({per_step}); raise it")
    args.global_batch_size = gbs // per_step * per_step
    ctx.warnings.append(f"--decrease-batch-size-if-needed: --global-batch-size {gbs} -> "
                        f"{args.global_batch_size}, a multiple of --micro-batch-size x "
                        f"data-parallel size ({per_step})")


def _batch_size_schedule(args, ctx: Context):
    """The parsed ramp, each of its batch sizes a multiple of micro batch x DP (megatron-core
    checks the current one as the run reaches it; here all before the run)."""
    if args.step_batch_size_schedule is not None:
        try:
            schedule = batch_schedule.parse_step_schedule(args.step_batch_size_schedule,
                                                          args.seq_length)
        except ValueError as error:
            raise ConfigError(f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: "
                              f"{error}") from None
        flag = "--step-batch-size-schedule"
    elif args.rampup_batch_size is not None:
        start, increment, samples = args.rampup_batch_size
        require(start > 0 and increment > 0 and samples >= 0, "--rampup-batch-size START "
                f"INCREMENT SAMPLES must be positive (SAMPLES >= 0), got {start} {increment} "
                f"{samples}")
        require(start <= args.global_batch_size and
                (args.global_batch_size - start) % increment == 0,
                f"--rampup-batch-size: --global-batch-size ({args.global_batch_size}) must be "
                f"START ({start}) plus a multiple of INCREMENT ({increment})")
        schedule = batch_schedule.rampup_schedule(tuple(args.rampup_batch_size),
                                                  args.global_batch_size)
        flag = "--rampup-batch-size"
    else:
        return None
    per_step = args.micro_batch_size * ctx.dims.dp
    bad = [size for size in batch_schedule.batch_sizes(schedule, 0) if size % per_step]
    require(not bad, f"{flag}: global batch sizes {bad} are not multiples of --micro-batch-size "
            f"x data-parallel size ({args.micro_batch_size} x {ctx.dims.dp} = {per_step})")
    return schedule


def _eval_batches(args, ctx: Context) -> None:
    """--eval-micro-batch-size / --eval-global-batch-size (defaults: the training ones)."""
    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    per_step = args.eval_micro_batch_size * ctx.dims.dp
    require(args.eval_global_batch_size % per_step == 0,
            f"--eval-global-batch-size ({args.eval_global_batch_size}) must be a multiple of "
            f"--eval-micro-batch-size x data-parallel size ({args.eval_micro_batch_size} x "
            f"{ctx.dims.dp} = {per_step})")
    args.eval_num_microbatches = args.eval_global_batch_size // per_step


def _check_profile(args, ctx: Context) -> None:
    args.profile_ranks = tuple(args.profile_ranks)
    if not args.profile:
        if args.use_pytorch_profiler:
            ctx.warnings.append("--use-pytorch-profiler profiles nothing without --profile")
        return
    require(0 <= args.profile_step_start < args.profile_step_end,
            f"--profile-step-start ({args.profile_step_start}) must be >= 0 and < "
            f"--profile-step-end ({args.profile_step_end})")
    bad = [rank for rank in args.profile_ranks if not 0 <= rank < ctx.dims.world_size]
    require(not bad, f"--profile-ranks {bad} are not ranks of this run (world size "
            f"{ctx.dims.world_size})")
    if not args.use_pytorch_profiler and not ctx.cuda:
        ctx.warnings.append("--profile without --use-pytorch-profiler marks an nsys range, "
                            "which needs CUDA: nothing is profiled on CPU; add "
                            "--use-pytorch-profiler for a torch.profiler trace")
