"""The optimizer-and-schedule section: Adam, its LR / weight-decay schedule, fp16 loss scaling,
DDP and the distributed optimizer."""

from dataclasses import dataclass
from typing import Optional

from .checks import Context, check_range, require


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam, its LR / weight-decay schedule, fp16 loss scaling, DDP and the distributed
    optimizer (`bf16`/`fp16` come from `ModelConfig`)."""

    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    override_opt_param_scheduler: bool
    use_checkpoint_opt_param_scheduler: bool
    loss_scale: Optional[float]
    initial_loss_scale: Optional[float]
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool


def add_arguments(parser) -> None:
    g = parser.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=("adam",), default="adam")
    g.add_argument("--lr", type=float, default=None, help="required unless --skip-train")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine",
                                                "inverse-square-root"), default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, take the LR / weight-decay schedule from these flags, not "
                   "from the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, take the LR / weight-decay schedule from the checkpoint "
                   "(without either flag a schedule that differs from the flags is an error)")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static fp16 loss scale; default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=None,
                   help="dynamic fp16 loss scale to start from; default 2^20 / the tokens of "
                   "one micro batch on one rank (rounded up to a power of 2), since each rank "
                   "backpropagates the SUM of its per-token losses (Megatron-LM's 2^32 skipped "
                   "every step of a short run while it halved)")
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")


def check_values(args) -> None:
    """After `rules.check_run_length` (it fills in --lr with --skip-train)."""
    check_range(args, "lr_decay_iters", low=0, low_open=True, optional=True)
    check_range(args, "hysteresis", low=1)
    check_range(args, "lr_warmup_iters", low=0)
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
    """The schedule's defaults from the run length are `rules.check_schedule`'s."""
    require(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
            "give --lr-warmup-fraction or --lr-warmup-iters, not both")
    require(0 <= args.min_lr <= args.lr,
            f"--min-lr ({args.min_lr}) must be in [0, --lr ({args.lr})]")
    require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
            "exclusive; give one")
    require(ctx.cuda or not args.use_distributed_optimizer,
            "--use-distributed-optimizer needs CUDA (megatron-core's distributed "
            "optimizer); drop it on CPU")
