"""The training section: the loop's batch sizes, iterations, evaluation, exits, seed and its
process group."""

from dataclasses import dataclass
from typing import Optional

from .checks import Context, check_positive, check_range, number, require


@dataclass(frozen=True)
class TrainingConfig:
    """The loop: batch sizes, iterations, evaluation, exits, seeds, the process group."""

    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    train_iters: int
    eval_interval: int
    eval_iters: int
    skip_train: bool
    seed: int
    exit_interval: Optional[int]
    exit_duration_in_mins: Optional[float]
    exit_signal_handler: bool
    check_for_nan_in_loss_and_grad: bool
    distributed_backend: str
    distributed_timeout_minutes: int


def add_arguments(parser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro batch x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="instead of --train-iters: samples / global batch size iterations")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train", action="store_true",
                   help="no training: load the weights at --load, evaluate --eval-iters "
                   "validation batches (from the start of the valid split), print the "
                   "validation line and exit (--train-iters, --lr and --save are not needed)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=number, default=None,
                   help="save a checkpoint (needs --save) and exit once the run has taken this "
                   "many minutes (checked after every iteration, the same on every rank)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: save a checkpoint (needs --save) and exit")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="train on past a NaN loss or a NaN / Inf gradient (without it the run "
                   "stops before that update, which would turn the weights into NaN; with "
                   "--fp16 the loss scaler skips such steps instead)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def check_values(args) -> None:
    """After `rules.check_run_length` (one of --train-iters and --train-samples is given)."""
    steps = [] if args.skip_train else [
        "train_iters" if args.train_iters is not None else "train_samples"]
    check_positive(args, "micro_batch_size", *steps, "eval_interval")
    check_range(args, "eval_iters", low=0)
    for name in ("exit_interval", "exit_duration_in_mins"):
        check_range(args, name, low=0, low_open=True, optional=True)
    check_range(args, "distributed_timeout_minutes", low=1)
    check_range(args, "seed", low=0, high=2**32 - 1)  # numpy seeds the data sampling with it


def validate(args, ctx: Context) -> None:
    """The global batch and the micro batches per step; --train-samples in iterations; the
    process group's backend."""
    require(not args.skip_train or args.eval_iters > 0, f"--skip-train evaluates --eval-iters "
            f"batches; give a positive --eval-iters (got {args.eval_iters})")
    dims = ctx.dims
    per_step = args.micro_batch_size * dims.dp
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    require(args.global_batch_size > 0 and args.global_batch_size % per_step == 0,
            f"--global-batch-size ({args.global_batch_size}) must be a positive multiple of "
            f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x {dims.dp} = "
            f"{per_step}); data-parallel size = world {dims.world_size} / (TP {dims.tp} x PP "
            f"{dims.pp} x --ulysses-sp-size {dims.sp})")
    args.num_microbatches = args.global_batch_size // per_step
    if args.train_samples is not None:
        require(args.train_samples >= args.global_batch_size,
                f"--train-samples ({args.train_samples}) must be >= --global-batch-size "
                f"({args.global_batch_size}): training runs --train-samples // "
                "--global-batch-size iterations")
        args.train_iters = args.train_samples // args.global_batch_size
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if ctx.cuda else "gloo"
    require(not (args.distributed_backend == "nccl" and not ctx.cuda),
            "--distributed-backend nccl needs CUDA; use gloo")
