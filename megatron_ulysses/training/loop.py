"""The pretraining loop, as a story: check the inputs, start the process groups, build the
model, optimizer and scheduler (`training.model`), resume (`training.checkpointing`), build the
sequence-sharded batches (`data.batches`), then step (`training.schedule`), log, evaluate, save
and stop on `--exit-interval` or SIGTERM.
"""

import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from .. import cpu_compat
from .. import parallel_state as ps
from ..processes import guard_rank
from .. import rng
from ..data.batches import Batches
from ..data.datasets import build_train_valid_test_datasets, check_data_path
from ..data.tokenizers import build_tokenizer_from, check_for_training
from .arguments import ConfigError, padded_vocab_size
from .checkpointing import carried_common_state, load_checkpoint, save_checkpoint
from .config import RunConfig
from .logging import TrainingLogger, print_rank_0
from .save_guard import lock_save_dir
from .model import build_model, build_model_and_optimizer, transformer_config
from .schedule import NonFiniteError, evaluate, train_step


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
    ps.initialize_model_parallel(dims=config.dims)
    rng.seed_dropout_streams(config.training.seed)  # per SP rank and stage


class ExitRequest:
    """Whether to save and exit after this iteration, the same answer on every rank: SIGTERM
    received on any rank (--exit-signal-handler) or --exit-duration-in-mins passed on any rank
    since `start` (one collective per iteration, only with either flag)."""

    def __init__(self, signal_handler: bool, duration_in_mins: Optional[float], start: float):
        self.received = False
        self.signal_handler, self.duration_in_mins, self.start = (
            signal_handler, duration_in_mins, start)
        if signal_handler:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def reason(self) -> Optional[str]:
        """None, or why the run stops now."""
        if not self.signal_handler and self.duration_in_mins is None:
            return None
        late = (self.duration_in_mins is not None
                and time.time() - self.start >= 60 * self.duration_in_mins)
        flag = torch.tensor([2 if self.received else int(late)], device=cpu_compat.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return {0: None, 1: f"--exit-duration-in-mins {self.duration_in_mins} passed",
                2: "SIGTERM received"}[int(flag.item())]


def _check_inputs(config: RunConfig):
    """Before any process group: a tokenizer file that does not load or has no EOD, damaged
    .idx/.bin files, and a --split that gives a split no documents (which megatron-core would
    try to fill forever). The only full read of the .idx files. Returns the tokenizer."""
    data = config.data
    try:
        tokenizer = build_tokenizer_from(data)
        check_for_training(tokenizer, data.tokenizer_type, data.tokenizer_model)
        if data.data_path:
            check_data_path(list(data.data_path), split=data.split)
    except (ValueError, ImportError, OSError, RuntimeError) as error:
        raise ConfigError(str(error)) from None
    return tokenizer


def _build_batches(config: RunConfig, tokenizer, iteration: int, consumed: int):
    """Train and validation batches; both resume where the run left them (as Megatron-LM).
    --skip-train: the validation batches from the split's start (the same for every
    checkpoint), one train batch's worth of train samples (never read)."""
    training = config.training
    gbs = training.global_batch_size
    if training.skip_train:
        sizes, valid_consumed = [gbs, training.eval_iters * gbs, 0], 0
    else:
        evaluations = training.train_iters // training.eval_interval + 1
        sizes = [training.train_iters * gbs, evaluations * training.eval_iters * gbs, 0]
        valid_consumed = iteration // training.eval_interval * training.eval_iters * gbs
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        tokenizer, config.model.seq_length, sizes,
        data_path=list(config.data.data_path) if config.data.data_path else None,
        split=config.data.split, mock_data=config.data.mock_data, seed=training.seed,
        data_cache_path=config.data.data_cache_path,
        reset_position_ids=config.data.reset_position_ids,
        eod_mask_loss=config.data.eod_mask_loss,
    )
    mbs = training.micro_batch_size
    train = Batches(train_ds, consumed, mbs, config.data, tokenizer) if train_ds else None
    valid = None
    if valid_ds is not None and training.eval_iters > 0:
        valid = Batches(valid_ds, valid_consumed, mbs, config.data, tokenizer)
    return train, valid


def evaluate_only(config: RunConfig, tokenizer) -> None:
    """--skip-train: the model's weights from --load (no optimizer), `--eval-iters` validation
    batches, one validation line at the checkpoint's iteration."""
    model_config, training = config.model, config.training
    model = build_model(model_config, config.optimizer, training.seed,
                        transformer_config(model_config, config.dims))
    iteration = 0
    if config.checkpoint.load:
        iteration, _ = load_checkpoint(config.checkpoint.load, model, None, None, config)
    _, valid_batches = _build_batches(config, tokenizer, iteration, 0)
    logger = TrainingLogger(config, config.dims.world_size)
    local_seq = config.dims.local_seq_length(model_config.seq_length)
    logger.log_validation(iteration, evaluate(valid_batches, model, training, local_seq))
    logger.close()


def pretrain(config: RunConfig) -> None:
    """Build everything and train for `--train-iters` steps (resuming from `--load`)."""
    start = time.time()  # --exit-duration-in-mins counts from here
    guard_rank()  # its helper processes die with it, it with torchrun
    if config.checkpoint.save and os.environ.get("RANK", "0") == "0":
        lock_save_dir(config.checkpoint.save)  # one live job per --save
    tokenizer = _check_inputs(config)
    dims = config.dims
    config = config.with_padded_vocab_size(padded_vocab_size(
        tokenizer.vocab_size, config.model.make_vocab_size_divisible_by, dims.tp))
    model_config, training, checkpoint = config.model, config.training, config.checkpoint
    initialize_distributed(config)
    print_rank_0(f" > world {dims.world_size} = TP {dims.tp} x PP {dims.pp} x DP {dims.dp} x "
                 f"Ulysses SP {dims.sp}; {training.num_microbatches} micro batches per step; "
                 f"attention backend {model_config.ulysses_attention_backend} in "
                 f"{model_config.transformer_impl} layers; padded vocab "
                 f"{model_config.padded_vocab_size}")

    if training.skip_train:
        return evaluate_only(config, tokenizer)
    model, optimizer, scheduler = build_model_and_optimizer(config)
    print_rank_0(f" > parameters on rank 0: {sum(p.numel() for p in model.parameters()):,}")

    iteration, consumed = 0, 0
    extra_common = {}
    if checkpoint.load:
        iteration, consumed = load_checkpoint(checkpoint.load, model, optimizer, scheduler,
                                              config)
        extra_common = carried_common_state(checkpoint.load)
    scheduler.step(increment=0)  # set lr for the first step (no-op after a load)
    train_batches, valid_batches = _build_batches(config, tokenizer, iteration, consumed)

    local_seq = dims.local_seq_length(model_config.seq_length)
    logger = TrainingLogger(config, dims.world_size)
    exit_request = ExitRequest(training.exit_signal_handler, training.exit_duration_in_mins,
                               start)

    def save():
        with logger.paused():
            save_checkpoint(checkpoint.save, iteration, model, optimizer, scheduler, config,
                            consumed, extra_common)

    print_rank_0(f" > training from iteration {iteration} to {training.train_iters}")
    saved = True
    while iteration < training.train_iters:
        try:
            loss, grad_norm, ok = train_step(train_batches, model, optimizer, scheduler,
                                             training, local_seq)
        except NonFiniteError as error:
            last = (f"the last checkpoint (--save {checkpoint.save}) is the one to resume "
                    f"from" if checkpoint.save else "no checkpoint was saved (no --save)")
            raise NonFiniteError(
                f"iteration {iteration + 1}: {error}. The update was not applied and {last}. "
                f"Lower --lr or raise --lr-warmup-iters, check --clip-grad and the data, or "
                f"pass --no-check-for-nan-in-loss-and-grad to train on regardless") from None
        iteration += 1
        consumed += training.global_batch_size
        saved = False
        logger.log_iteration(iteration, consumed, loss, optimizer.param_groups[0]["lr"],
                             grad_norm, optimizer.get_loss_scale(), skipped=not ok)
        if valid_batches is not None and iteration % training.eval_interval == 0:
            with logger.paused():
                logger.log_validation(iteration, evaluate(valid_batches, model, training,
                                                          local_seq))
        reason = exit_request.reason()
        stop = reason is not None or bool(training.exit_interval
                                          and iteration % training.exit_interval == 0)
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
    logger.close()
