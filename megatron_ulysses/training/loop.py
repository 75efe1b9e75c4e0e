"""The pretraining loop, as a story: check the inputs (`training.inputs`), start the process
groups, build the model, optimizer and scheduler (`training.model`), resume
(`training.checkpoint`), build the sequence-sharded batches, then step (`training.schedule`,
the global batch of `training.batch_schedule`, the run flags' `training.step_hooks` around it),
log, evaluate, save and stop on `--exit-interval`, SIGTERM or the time limit (`training.exits`).
"""

import os
import time

import torch
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

from ..sp import parallel_state as ps
from ..sp import rng
from .processes import guard_rank
from ..data.vocab import model_vocab_size
from .batch_schedule import global_batch_size_at
from .checkpoint.saver import CheckpointSaver
from .chunks import model_chunks
from .checkpoint.load import carried_common_state, load_checkpoint
from .checkpoint.save import save_checkpoint
from .config import RunConfig
from . import exits, wandb_run
from .exits import ExitRequest
from .fsdp import RankBytesLog, sharding_strategy
from .inputs import build_batches, check_inputs
from .logging import TrainingLogger, append_progress, print_rank_0, set_logging_level
from .model import build_model, build_model_and_optimizer, gather_params, transformer_config
from .checkpoint.save_guard import lock_save_dir
from .schedule import NonFiniteError, evaluate, train_step
from .step_hooks import StepHooks


def set_deterministic_mode() -> None:
    """`--deterministic-mode`: what TE and torch need for bitwise run-to-run equality on GPU.
    Set before the first kernel runs (TE reads NVTE_* when it picks an attention kernel)."""
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # TE: no atomics in attention bwd
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    # warn_only: an op without a deterministic kernel warns (once) instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)


def initialize_distributed(config: RunConfig) -> None:
    """The default process group, then the megatron-core and Ulysses groups and the seeds."""
    if config.model.deterministic_mode:
        set_deterministic_mode()
    ps.start_process_group(config.training.distributed_backend,
                           config.training.distributed_timeout_minutes)
    ps.initialize_model_parallel(
        dims=config.dims, create_gloo_process_groups=config.model.use_gloo_process_groups,
        num_distributed_optimizer_instances=config.performance.num_distributed_optimizer_instances,
        virtual_pipeline_model_parallel_size=config.model.virtual_pipeline_model_parallel_size)
    if config.model.te_rng_tracker:
        rng.use_te_rng_tracker()
    rng.seed_dropout_streams(dropout_base_seed(config.training))  # per SP rank and stage


def dropout_base_seed(training) -> int:
    """--seed, or with --data-parallel-random-init Megatron-LM's seed + 10 x DP rank (the pure
    DP rank: the SP ranks of one replica share it). Megatron-LM seeds the weights with it too but
    then broadcasts DP rank 0's, so only the dropout streams differ: the weights stay --seed's."""
    if not training.data_parallel_random_init:
        return training.seed
    return training.seed + 10 * ps.get_pure_data_parallel_rank()


def evaluate_only(config: RunConfig, tokenizer) -> None:
    """--skip-train: the model's weights from --load (no optimizer), `--eval-iters` validation
    batches, one validation line at the checkpoint's iteration."""
    model_config, training = config.model, config.training
    model = build_model(model_config, config.optimizer, training.seed,
                        transformer_config(model_config, config.dims, config.performance),
                        config.performance)
    iteration = 0
    if config.checkpoint.load:
        iteration, _ = load_checkpoint(config.checkpoint.load, model, None, None, config)
    _, valid_batches = build_batches(config, tokenizer, iteration, 0)
    logger = TrainingLogger(config, config.dims.world_size)
    local_seq = config.dims.local_seq_length(model_config.seq_length)
    logger.log_validation(iteration, evaluate(valid_batches, model, training, local_seq))
    logger.close()


def pretrain(config: RunConfig) -> None:
    """Build everything and train for `--train-iters` steps (resuming from `--load`)."""
    start = time.time()  # --exit-duration-in-mins counts from here
    set_logging_level(config.logging.logging_level)
    exits.watch_interrupt()
    guard_rank()  # its helper processes die with it, it with torchrun
    tokenizer = check_inputs(config)  # a bad input leaves nothing behind, not even --save
    if os.environ.get("RANK", "0") == "0":
        if config.logging.wandb_project:
            wandb_run.check_credentials(config.logging.wandb_project)
        if config.checkpoint.save:
            lock_save_dir(config.checkpoint.save)  # one live job per --save
    dims = config.dims
    config = config.with_padded_vocab_size(model_vocab_size(
        tokenizer.vocab_size, config.model.padded_vocab_size,
        config.model.make_vocab_size_divisible_by, dims.tp, config.model.pad_vocab_size))
    initialize_distributed(config)
    print_rank_0(f" > world {dims.world_size} = TP {dims.tp} x PP {dims.pp} x DP {dims.dp} x "
                 f"Ulysses SP {dims.sp}; {config.training.num_microbatches} micro batches per "
                 f"step; attention backend {config.model.ulysses_attention_backend} in "
                 f"{config.model.transformer_impl} layers; padded vocab "
                 f"{config.model.padded_vocab_size}")
    if config.training.skip_train:
        return evaluate_only(config, tokenizer)
    model, optimizer, scheduler = build_model_and_optimizer(config)
    print_rank_0(" > parameters on rank 0: "
                 f"{sum(p.numel() for chunk in model_chunks(model) for p in chunk.parameters()):,}")
    iteration, consumed, extra_common = 0, 0, {}
    if config.checkpoint.load:
        iteration, consumed = load_checkpoint(config.checkpoint.load, model, optimizer,
                                              scheduler, config)
        extra_common = carried_common_state(config.checkpoint.load)
    scheduler.step(increment=0)  # set lr for the first step (no-op after a load)
    batches = build_batches(config, tokenizer, iteration, consumed)
    _train(config, (model, optimizer, scheduler), batches, iteration, consumed, extra_common,
           ExitRequest(config.training.exit_signal_handler,
                       config.training.exit_duration_in_mins, start))


def _train(config: RunConfig, built, batches, iteration: int, consumed: int,
           extra_common: dict, exit_request: ExitRequest) -> None:
    """The run loop from `iteration`: step, log, evaluate every --eval-interval, save every
    --save-interval and at the end, stop early on `exit_request` or --exit-interval."""
    model, optimizer, scheduler = built
    train_batches, valid_batches = batches
    training, checkpoint = config.training, config.checkpoint
    local_seq = config.dims.local_seq_length(config.model.seq_length)
    logger = TrainingLogger(config, config.dims.world_size, model)
    hooks = StepHooks(training, config.logging.tensorboard_dir)
    progress = config.logging.log_progress and checkpoint.save
    if progress:
        append_progress(checkpoint.save, "Starting job")
    job_start, saver = consumed, CheckpointSaver(checkpoint)

    def save():
        exits.at("save", iteration)
        gather_params(model, config.performance)
        with logger.paused():
            save_checkpoint(checkpoint.save, iteration, model, optimizer, scheduler, config,
                            consumed, extra_common, saver)
        if progress:
            append_progress(checkpoint.save, _progress_line(config, logger, iteration, consumed,
                                                            job_start))

    print_rank_0(f" > training from iteration {iteration} to {training.train_iters}")
    saved = True
    shard_bytes = RankBytesLog(model, optimizer, sharding_strategy(config.performance))
    exits.at("setup", iteration)
    while iteration < training.train_iters:
        exits.at("step", iteration + 1)
        hooks.before_step(iteration)
        batch = global_batch_size_at(consumed, training.batch_size_schedule,
                                     training.global_batch_size)
        loss, grad_norm, ok, num_zeros = _step(config, iteration, train_batches, built,
                                               local_seq, batch, shard_bytes)
        iteration += 1
        consumed += batch
        saved = False
        saver.finalize()  # commits an async save whose write is done
        logger.log_iteration(iteration, consumed, loss,
                             get_canonical_lr_for_logging(optimizer.param_groups), grad_norm,
                             optimizer.get_loss_scale(), skipped=not ok, num_zeros=num_zeros,
                             global_batch_size=batch)
        hooks.after_step(iteration, model)
        shard_bytes.after_step()
        if valid_batches is not None and training.evaluates_after(iteration):
            _validate(iteration, valid_batches, model, training, local_seq, logger, hooks)
        stop, reason = _stop_after(iteration, training, exit_request)
        interval = checkpoint.save_interval and iteration % checkpoint.save_interval == 0
        if checkpoint.save and (stop or interval):
            save()
            saved = True
        if stop:
            print_rank_0(f" exiting at iteration {iteration}"
                         + (f" ({reason})" if reason else ""))
            break
    if checkpoint.save and not saved:
        save()
    exits.at("end", iteration)
    saver.close()
    hooks.close()
    logger.close()


def _stop_after(iteration: int, training, exit_request: ExitRequest):
    """(stop, reason): the run stops after `iteration` on `exit_request` (its reason) or at
    --exit-interval (no reason)."""
    reason = exit_request.reason()
    return reason is not None or bool(training.exit_interval
                                      and iteration % training.exit_interval == 0), reason


def _validate(iteration: int, valid_batches, model, training, local_seq: int, logger,
              hooks) -> None:
    """The --eval-iters validation batches, logged (the step's timers paused)."""
    exits.at("evaluate", iteration)
    with logger.paused(), hooks.around_evaluation():
        logger.log_validation(iteration, evaluate(valid_batches, model, training, local_seq))


def _progress_line(config: RunConfig, logger, iteration: int, consumed: int,
                   job_start: int) -> str:
    """progress.txt's line after a save (Megatron-LM's, without its cumulative throughput over
    earlier jobs)."""
    flops = logger.flops_per_sample * consumed
    saved = "Saving async checkpoint" if config.checkpoint.async_save else "Saved checkpoint"
    return (f"{saved}\tIteration: {iteration}\t"
            f"Job throughput: {logger.job_throughput(consumed - job_start):.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops:.2e}\t"
            f"Tokens (in billions): {consumed * config.model.seq_length / 10**9:.2f}")


def _step(config: RunConfig, iteration: int, train_batches, built, local_seq: int,
          global_batch: int, shard_bytes: RankBytesLog):
    """One optimizer step over `global_batch` samples -> (loss, grad norm, applied, zero
    gradients); a NaN / Inf stops the run with what to resume from and what to change."""
    model, optimizer, scheduler = built
    per_step = config.training.micro_batch_size * config.dims.dp
    try:
        return train_step(train_batches, model, optimizer, scheduler, config.training,
                          local_seq, num_microbatches=global_batch // per_step,
                          after_backward=shard_bytes.after_backward)
    except NonFiniteError as error:
        save = config.checkpoint.save
        last = (f"the last checkpoint (--save {save}) is the one to resume from" if save
                else "no checkpoint was saved (no --save)")
        raise NonFiniteError(
            f"iteration {iteration + 1}: {error}. The update was not applied and {last}. "
            f"Lower --lr or raise --lr-warmup-iters, check --clip-grad and the data, or "
            f"pass --no-check-for-nan-in-loss-and-grad to train on regardless") from None
