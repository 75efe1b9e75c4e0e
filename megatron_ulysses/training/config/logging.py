"""The logging section: how often the loop logs, what it measures (timers, params norm, zero
gradients, memory), and where it goes (stdout, TensorBoard, W&B, progress.txt in --save)."""

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

from ..wandb_run import EXTRA
from .checks import Context, check_output_dir, check_positive, check_range, require


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: Optional[str]
    tensorboard_queue_size: int = 1000
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    log_timers_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_memory_interval: Optional[int] = None
    log_validation_ppl_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_world_size_to_tensorboard: bool = False
    logging_level: Optional[int] = None
    log_progress: bool = False
    save: Optional[str] = None  # progress.txt's directory (the checkpoint section's --save)
    wandb_project: Optional[str] = None
    wandb_entity: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    wandb_init_failure: str = "continue"


def add_arguments(parser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="TensorBoard gets a point every --log-interval")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="pending TensorBoard events before a write to disk")
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of all parameters ('params norm')")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log the number of zero gradient entries ('num zeros')")
    g.add_argument("--timing-log-level", type=int, default=0, choices=(0, 1, 2),
                   help="megatron-core Timers: 0 iteration time only; 1 also forward-backward "
                   "and optimizer once per step; 2 also per micro batch")
    g.add_argument("--timing-log-option", default="minmax", choices=("max", "minmax", "all"),
                   help="timers over the ranks: the max, min and max, or every rank's")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the timers (max over ranks) to TensorBoard / W&B")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write memory (CUDA allocator stats; on CPU resident host memory)")
    g.add_argument("--log-memory-interval", type=int, default=None,
                   help="print a memory report every N iterations (a multiple of "
                   "--log-interval)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write validation perplexity")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                   action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--logging-level", type=int, default=None,
                   help="Python logging level of every logger (10 DEBUG, 20 INFO, ...)")
    g.add_argument("--log-progress", action="store_true",
                   help="append job start, saves and throughput to progress.txt in --save")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="also log the TensorBoard scalars to W&B (needs the wandb extra: "
                   "pip install megatron_ulysses[wandb])")
    g.add_argument("--wandb-entity", type=str, default=None)
    g.add_argument("--wandb-exp-name", type=str, default=None)
    g.add_argument("--wandb-save-dir", type=str, default=None,
                   help="W&B's local directory (default: <--save>/wandb)")
    g.add_argument("--wandb-init-failure", choices=("continue", "exit"), default="continue",
                   help="when wandb.init fails (no network on the node): train on without W&B "
                   "(one warning), or stop the run with one message")


def check_values(args) -> None:
    check_positive(args, "log_interval", "tensorboard_queue_size")
    check_range(args, "tensorboard_log_interval", low=1)
    check_range(args, "log_memory_interval", low=0, low_open=True, optional=True)


def validate(args, ctx: Context) -> None:
    check_output_dir(args, "tensorboard_dir")
    if args.log_memory_interval is not None:
        require(args.log_memory_interval % args.log_interval == 0,
                f"--log-memory-interval {args.log_memory_interval} must be a multiple of "
                f"--log-interval {args.log_interval}")
    if args.log_progress and not args.save:
        ctx.warnings.append("--log-progress without --save: progress.txt lives in --save, so "
                            "none is written")
    _validate_wandb(args, ctx)


def _validate_wandb(args, ctx: Context) -> None:
    """Megatron-LM's `_set_wandb_writer`: a run name is required; its directory is --wandb-save-dir
    or <--save>/wandb. wandb is an optional dependency."""
    given = [f for f in ("wandb_entity", "wandb_exp_name", "wandb_save_dir") if getattr(args, f)]
    if not args.wandb_project:
        if given:
            ctx.warnings.append(f"--{given[0].replace('_', '-')} without --wandb-project: "
                                "nothing is logged to W&B (as in Megatron-LM)")
        return
    require(importlib.util.find_spec("wandb") is not None,
            f"--wandb-project {args.wandb_project} needs the wandb package: {EXTRA}")
    require(bool(args.wandb_exp_name), "--wandb-project needs --wandb-exp-name (the W&B run "
            "name; Megatron-LM requires it too)")
    if args.wandb_save_dir is None:
        require(args.save is not None, "--wandb-project needs --wandb-save-dir or --save "
                "(W&B's files go to <--save>/wandb by default)")
        args.wandb_save_dir = os.path.join(args.save, "wandb")
    check_output_dir(args, "wandb_save_dir")
