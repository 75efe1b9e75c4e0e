"""The logging section: how often the loop logs, what it measures (timers, params norm, zero
gradients, memory), and where it goes (stdout, TensorBoard, W&B, progress.txt in --save)."""

import importlib.util
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

from ..wandb_run import EXTRA
from .checks import Context, check_output_dir, check_positive, check_range, require
from .fields import add_flags, flag


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = flag(100)
    tensorboard_dir: Optional[str] = flag(None)
    tensorboard_log_interval: ClassVar[int] = flag(
        1, "TensorBoard gets a point every --log-interval", kept=False)
    tensorboard_queue_size: int = flag(1000, "pending TensorBoard events before a write to disk")
    log_params_norm: bool = flag(False, "log the L2 norm of all parameters ('params norm')")
    log_num_zeros_in_grad: bool = flag(
        False, "log the number of zero gradient entries ('num zeros')")
    timing_log_level: int = flag(
        0, "megatron-core Timers: 0 iteration time only; 1 also forward-backward "
        "and optimizer once per step; 2 also per micro batch", choices=(0, 1, 2))
    timing_log_option: str = flag(
        "minmax", "timers over the ranks: the max, min and max, or every rank's",
        choices=("max", "minmax", "all"))
    log_timers_to_tensorboard: bool = flag(
        False, "write the timers (max over ranks) to TensorBoard / W&B")
    log_memory_to_tensorboard: bool = flag(
        False, "write memory (CUDA allocator stats; on CPU resident host memory)")
    log_memory_interval: Optional[int] = flag(
        None, "print a memory report every N iterations (a multiple of --log-interval)")
    log_validation_ppl_to_tensorboard: bool = flag(False, "also write validation perplexity")
    log_loss_scale_to_tensorboard: bool = flag(True, names=(
        "--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard"))
    log_world_size_to_tensorboard: bool = flag(False)
    logging_level: Optional[int] = flag(
        None, "Python logging level of every logger (10 DEBUG, 20 INFO, ...)")
    log_progress: bool = flag(
        False, "append job start, saves and throughput to progress.txt in --save")
    save: Optional[str]  # progress.txt's directory (the checkpoint section's --save)
    wandb_project: Optional[str] = flag(
        None, "also log the TensorBoard scalars to W&B (needs the wandb extra: "
        "pip install megatron_ulysses[wandb])")
    wandb_entity: Optional[str] = flag(None)
    wandb_exp_name: Optional[str] = flag(None)
    wandb_save_dir: Optional[str] = flag(None, "W&B's local directory (default: <--save>/wandb)")
    wandb_init_failure: str = flag(
        "continue", "when wandb.init fails (no network on the node): train on without W&B "
        "(one warning), or stop the run with one message", choices=("continue", "exit"))


def add_arguments(parser) -> None:
    add_flags(parser, LoggingConfig, "logging")


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
