"""The pretraining loop: megatron-core GPTModel with the Ulysses layer spec, megatron-core DDP
(per-token loss, reduced over DP x SP), the optimizer and `OptimizerParamScheduler`, sequence-
sharded batches, evaluation, logging, checkpoints and signal handling.

Micro batches of one step: with PP = 1 the loop runs them itself (forward, backward of Σ loss·mask,
gradient sync on the last one) and then calls megatron-core's `finalize_model_grads` with the
token count, so gradients are Σ grads / Σ mask over DP x SP x micro batches. With PP > 1 (GPU
only) megatron-core's pipeline schedule does the same with the same loss function.
"""

import contextlib
import datetime
import functools
import os
import signal
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from .. import parallel_state as ps
from .. import rng
from ..data.datasets import (
    build_data_iterator,
    build_train_valid_test_datasets,
    check_data_path,
)
from ..data.sharding import get_batch_for_sp_rank
from ..data.tokenizers import build_tokenizer, check_for_training, padding_id
from ..layer_specs import build_gpt_model
from ..loss import global_mean, loss_func, masked_sum
from ..memory.activation_offload import enable_activation_offload
from . import cpu_compat
from .arguments import ConfigError, padded_vocab_size
from .checkpointing import load_checkpoint, save_checkpoint
from .logging import TrainingLogger, model_flops_per_sample, print_rank_0
from .optimizer import build_optimizer


def start_process_group(backend: str, timeout_minutes: int = 10) -> None:
    """The default process group from torchrun's environment (a world of one without it), on
    this process's GPU, or on CPU with the compat shim installed."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        cpu_compat.install()
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def set_deterministic_mode() -> None:
    """`--deterministic-mode`: what TE and torch need for bitwise run-to-run equality on GPU.
    Set before the first kernel runs (TE reads NVTE_* when it picks an attention kernel)."""
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # TE: no atomics in attention bwd
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    # warn_only: an op without a deterministic kernel warns (once) instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)


def initialize_distributed(args) -> None:
    """The default process group, then the megatron-core and Ulysses groups and the seeds."""
    if args.deterministic_mode:
        set_deterministic_mode()
    start_process_group(args.distributed_backend, args.distributed_timeout_minutes)
    ps.initialize_model_parallel(args.tensor_model_parallel_size,
                                 args.pipeline_model_parallel_size, args.ulysses_sp_size)
    rng.seed_dropout_streams(args.seed)  # per SP rank and stage; build_model seeds its own


def transformer_config(args) -> TransformerConfig:
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=not cuda,
        calculate_per_token_loss=True,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        bias_activation_fusion=cuda and not args.disable_bias_linear
        and not (args.no_bias_swiglu_fusion if args.swiglu else args.no_bias_gelu_fusion),
        masked_softmax_fusion=False,
        bias_dropout_fusion=cuda and not args.no_bias_dropout_fusion,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        deterministic_mode=args.deterministic_mode,
    )


def build_model(args, config):
    """The Ulysses GPTModel (in `Float16Module` for bf16/fp16) wrapped in megatron-core DDP,
    which reduces over DP x SP."""
    with rng.weight_init_streams(args.seed):  # identical initial weights on every DP x SP rank
        model = build_gpt_model(
            config, args.padded_vocab_size, args.max_position_embeddings,
            backend=args.ulysses_attention_backend,
            pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
            tiled_mlp_shards=args.tiled_mlp_shards, tiled_loss_shards=args.tiled_loss_shards,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.offload_activations:
        enable_activation_offload(model.decoder)
    if args.bf16 or args.fp16:  # half-precision weights, fp32 logits out (as Megatron-LM)
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """LR and weight-decay schedule in samples, as Megatron-LM counts them."""
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


class Batches:
    """Sequence-sharded micro batches for this rank: reads the pure-DP rank's samples on CPU,
    keeps this SP rank's `[b, s/P]` slice, then moves only that slice to the device."""

    def __init__(self, dataset, consumed_samples, args, tokenizer):
        self.iterator = build_data_iterator(
            dataset, consumed_samples, args.micro_batch_size, ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(), num_workers=args.num_workers,
        )
        self.shard = functools.partial(
            get_batch_for_sp_rank, sp_rank=ps.get_ulysses_sp_rank(),
            sp_size=ps.get_ulysses_sp_world_size(), pad_id=padding_id(tokenizer),
            eod_id=tokenizer.eod, vocab_size=tokenizer.vocab_size,
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        )

    def __iter__(self):
        return self

    def __next__(self):
        local = self.shard(next(self.iterator))
        device = cpu_compat.device()
        batch = {key: local[key].to(device, non_blocking=True)
                 for key in ("tokens", "labels", "loss_mask", "position_ids")}
        batch["packed_seq_params"] = None
        if "cu_seqlens" in local:
            cu = local["cu_seqlens"].to(device)
            batch["packed_seq_params"] = PackedSeqParams(
                qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                max_seqlen_q=local["max_seqlen"], max_seqlen_kv=local["max_seqlen"],
            )
        return batch


def _per_token_loss(model, batch):
    """The model on one sequence-sharded micro batch: per-token loss `[b, s/P]`."""
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                 packed_seq_params=batch["packed_seq_params"])


def forward_step(data_iterator, model):
    """megatron-core's forward_step_func: per-token loss `[b, s/P]` and its loss function."""
    batch = next(data_iterator)
    return _per_token_loss(model, batch), functools.partial(loss_func, batch["loss_mask"])


def _no_pipeline_forward_backward(data_iterator, model, num_microbatches, forward_only,
                                  grad_scale_func):
    """PP = 1: backward of each micro batch's Σ loss·mask; returns [Σ loss·mask, Σ mask]."""
    totals = torch.zeros(2, dtype=torch.float64, device=cpu_compat.device())
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        sync = contextlib.nullcontext() if forward_only or last else model.no_sync()
        with sync, torch.set_grad_enabled(not forward_only):
            batch = next(data_iterator)
            loss_sum, count = masked_sum(_per_token_loss(model, batch), batch["loss_mask"])
            if not forward_only:
                scaled = grad_scale_func(loss_sum) if grad_scale_func else loss_sum
                scaled.backward()
        totals += torch.stack([loss_sum.detach(), count]).double()
    return totals


def forward_backward(data_iterator, model, args, forward_only=False):
    """All micro batches of one step; returns this rank's [Σ loss·mask, Σ mask] (float64),
    summed over micro batches (zeros off the last pipeline stage)."""
    config = model.config
    if args.pipeline_model_parallel_size == 1:
        return _no_pipeline_forward_backward(data_iterator, model, args.num_microbatches,
                                             forward_only, config.grad_scale_func)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=[model],
        num_microbatches=args.num_microbatches,
        seq_length=-(-args.seq_length // args.ulysses_sp_size),  # s/P after padding
        micro_batch_size=args.micro_batch_size, forward_only=forward_only,
    )
    totals = torch.zeros(2, dtype=torch.float64, device=cpu_compat.device())
    for report in reports:
        totals += report["lm loss"].double()
    return totals


def train_step(data_iterator, model, optimizer, scheduler, args):
    """One optimizer step over the global batch; returns (loss, grad norm, update ok)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    totals = forward_backward(data_iterator, model, args)
    if args.pipeline_model_parallel_size == 1:
        num_tokens = totals[1].round().to(torch.int64)
        finalize_model_grads([model], num_tokens=num_tokens)
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=args.global_batch_size)
    return global_mean(totals), grad_norm, ok


def evaluate(data_iterator, model, args) -> float:
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=cpu_compat.device())
    with torch.no_grad():
        for _ in range(args.eval_iters):
            totals += forward_backward(data_iterator, model, args, forward_only=True)
    model.train()
    return global_mean(totals)


class SignalFlag:
    """SIGTERM received on any rank (checked collectively once per iteration)."""

    def __init__(self, enabled: bool):
        self.received = False
        self.enabled = enabled
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self) -> bool:
        if not self.enabled:
            return False
        flag = torch.tensor([int(self.received)], device=cpu_compat.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def pretrain(args) -> None:
    """Build everything and train for `--train-iters` steps (resuming from `--load`)."""
    # Before any process group: a tokenizer file that does not load or has no EOD, damaged
    # .idx/.bin files, and a --split that gives a split no documents (which megatron-core would
    # try to fill forever). The only full read of the .idx files.
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
        check_for_training(tokenizer, args.tokenizer_type, args.tokenizer_model)
        if args.data_path:
            check_data_path(args.data_path, split=args.split)
    except (ValueError, ImportError, OSError, RuntimeError) as error:
        raise ConfigError(str(error)) from None
    initialize_distributed(args)
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size,
                                               args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    dims = ps.get_parallel_dims()
    print_rank_0(f" > world {dims.world_size} = TP {dims.tp} x PP {dims.pp} x DP {dims.dp} x "
                 f"Ulysses SP {dims.sp}; {args.num_microbatches} micro batches per step; "
                 f"attention backend {args.ulysses_attention_backend}; padded vocab "
                 f"{args.padded_vocab_size}")

    config = transformer_config(args)
    model = build_model(args, config)
    optimizer = build_optimizer(args, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    if args.fp16:
        config.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(args, optimizer)
    print_rank_0(f" > parameters on rank 0: {sum(p.numel() for p in model.parameters()):,}")

    iteration, consumed = 0, 0
    if args.load:
        iteration, consumed = load_checkpoint(args.load, model, optimizer, scheduler, args)
    scheduler.step(increment=0)  # set lr for the first step (no-op after a load)

    eval_samples = (args.train_iters // args.eval_interval + 1) * args.eval_iters \
        * args.global_batch_size
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        tokenizer, args.seq_length,
        [args.train_iters * args.global_batch_size, eval_samples, 0],
        data_path=args.data_path, split=args.split, mock_data=args.mock_data, seed=args.seed,
        data_cache_path=args.data_cache_path,
    )
    train_batches = Batches(train_ds, consumed, args, tokenizer)
    # As Megatron-LM: the validation iterator resumes where the evaluations so far left it.
    valid_consumed = iteration // args.eval_interval * args.eval_iters * args.global_batch_size
    valid_batches = Batches(valid_ds, valid_consumed, args, tokenizer) \
        if valid_ds is not None and args.eval_iters > 0 else None

    logger = TrainingLogger(args, model_flops_per_sample(args), dims.world_size)
    signals = SignalFlag(args.exit_signal_handler)
    print_rank_0(f" > training from iteration {iteration} to {args.train_iters}")
    saved = True
    while iteration < args.train_iters:
        loss, grad_norm, ok = train_step(train_batches, model, optimizer, scheduler, args)
        iteration += 1
        consumed += args.global_batch_size
        saved = False
        logger.log_iteration(iteration, consumed, loss, optimizer.param_groups[0]["lr"],
                             grad_norm, optimizer.get_loss_scale(), skipped=not ok)
        if valid_batches is not None and iteration % args.eval_interval == 0:
            with logger.paused():
                logger.log_validation(iteration, evaluate(valid_batches, model, args))
        stop = signals.any_rank() or (args.exit_interval and iteration % args.exit_interval == 0)
        if args.save and (stop or (args.save_interval and iteration % args.save_interval == 0)):
            with logger.paused():
                save_checkpoint(args.save, iteration, model, optimizer, scheduler, args,
                                consumed)
            saved = True
        if stop:
            print_rank_0(f" exiting at iteration {iteration}")
            break
    if args.save and not saved:
        save_checkpoint(args.save, iteration, model, optimizer, scheduler, args, consumed)
    logger.close()

