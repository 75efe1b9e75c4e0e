"""What the whole-model benchmarks share: the presets, the two sides built from one set of
Megatron-LM flags, their training step, FLOP counting, timing and result files.

`run_config` parses the preset's Megatron-LM flags as pretrain_gpt.py does
(`arguments.parse_args` -> RunConfig). From it `Trainer` builds one side:

    ours   the trainer itself: training/model.py's `build_model_and_optimizer` (the trainer's
           TransformerConfig, the Ulysses GPTModel in megatron-core DDP, optimizer, scheduler)
    stock  megatron-core's own GPTModel (TE layer spec; the local spec without TE) with the
           TransformerConfig Megatron-LM's pretrain_gpt.py makes of the same flags at its
           default fusions (`stock_transformer_config`) and megatron-core's own loss, in DDP,
           with the trainer's optimizer and scheduler of the same flags

and steps it as the loop does (`schedule.train_step`: megatron-core's forward-backward schedule
on GPU over the step's micro batches with the trainer's per-token loss function, then the
optimizer and the LR scheduler).

Glossary: `s` sequence, `b` micro batch (1 here), `h` hidden, `L` layers, `V` vocab, `P` SP size.

Model FLOPs per micro batch (BASELINES.md): 6 * (params - input embedding) * s * b
+ 6 * L * s^2 * h * b. The second term is causal attention: q.k^T and p.v cost 4 * s^2 * h forward
for the full square, half of it under the causal mask, times 3 for forward + backward. Recompute
is not counted (MFU).
"""

import gc
import importlib.util
import itertools
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if torch.cuda.is_available():
    # Load torch's own cuDNN before Transformer Engine (imported by megatron-core) loads an
    # older one it finds first; torch refuses a cuDNN older than the one it was built with.
    torch.backends.cudnn.version()
# megatron-core announces its fallbacks on import; without apex (and on CPU without TE) they are
# expected here (as in pretrain_gpt.py).
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")

from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.transformer import TransformerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
from megatron_ulysses import cpu_compat
from megatron_ulysses.sp import rng
from megatron_ulysses.sp import parallel_state as ps
from megatron_ulysses.sp.backends import te_available
from megatron_ulysses.data.sharding import shard_for_sp_rank
from megatron_ulysses.training.arguments import padded_vocab_size, parse_args
from megatron_ulysses.training.config.performance import PerformanceConfig, transformer_kwargs
from megatron_ulysses.training.model import (
    attach_optimizer,
    build_model_and_optimizer,
    wrap_model,
)
from megatron_ulysses.training.schedule import train_step

H200_PEAK_TFLOPS = 989.0  # dense bf16, datasheet (MFU denominator, as in BASELINES.md)
GIB = 1 << 30

# Megatron-LM flags of the memory variants.
FULL_RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1")
SELECTIVE_RECOMPUTE = ("--recompute-granularity", "selective")
TILED_MLP = ("--tiled-mlp-shards", "auto")
TILED_LOSS = ("--tiled-loss-shards", "auto")
OFFLOAD = ("--offload-activations",)
# FP8 GEMMs as Megatron-LM's Llama-3 8B H100 FP8 example sets them (delayed scaling, hybrid).
FP8 = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
       "--fp8-amax-compute-algo", "max")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rotary_base: int = 500000


PRESETS = {
    # Llama-3.2-1B: head dim 2048 / 32 = 64, untied embeddings.
    "llama-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    # CPU smoke test of the scripts themselves.
    "tiny": Shape(hidden=64, layers=2, heads=8, kv_heads=4, ffn=128, vocab=512),
}


device = cpu_compat.device


def megatron_flags(shape: Shape, seq: int, backend: str, num_microbatches: int = 1, sp: int = 1,
                   world_size: int = 1, fused_cross_entropy: bool = True) -> list:
    """Megatron-LM flags of `shape` (Llama: RoPE, RMSNorm, SwiGLU, no biases, untied, no
    dropout) at `seq` tokens, micro batch 1, `num_microbatches` per optimizer step; bf16 on GPU;
    on GPU with TE and `fused_cross_entropy` also BASELINES.md's peer's fused cross entropy
    (`--cross-entropy-loss-fusion --cross-entropy-fusion-impl te`)."""
    flags = [
        "--num-layers", shape.layers, "--hidden-size", shape.hidden,
        "--ffn-hidden-size", shape.ffn, "--num-attention-heads", shape.heads,
        "--group-query-attention", "--num-query-groups", shape.kv_heads,
        "--seq-length", seq, "--position-embedding-type", "rope",
        "--rotary-base", shape.rotary_base, "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--attention-dropout", 0, "--hidden-dropout", 0,
        "--micro-batch-size", 1, "--global-batch-size", num_microbatches * world_size // sp,
        "--lr", 1e-5, "--train-iters", 1000, "--mock-data", "--vocab-size", shape.vocab,
        "--ulysses-sp-size", sp, "--ulysses-attention-backend", backend,
    ]
    if torch.cuda.is_available():
        flags.append("--bf16")
        if fused_cross_entropy and te_available():
            flags += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]
    return [str(flag) for flag in flags]


def run_config(shape: Shape, seq: int, backend: str, flags=(), num_microbatches: int = 1,
               sp: int = 1, world_size: int = 1):
    """The RunConfig pretrain_gpt.py would train with `megatron_flags(...) + flags` (without the
    cross-entropy fusion when `flags` tile the loss: tiled loss has its own), its vocab padded
    as `pretrain` pads the tokenizer's (`shape.vocab` ids)."""
    flags = list(flags)
    config = parse_args(megatron_flags(shape, seq, backend, num_microbatches, sp, world_size,
                                       fused_cross_entropy="--tiled-loss-shards" not in flags)
                        + flags, world_size=world_size)
    return config.with_padded_vocab_size(padded_vocab_size(
        shape.vocab, config.model.make_vocab_size_divisible_by, config.dims.tp))


def stock_transformer_config(model, performance=PerformanceConfig()):
    """**Megatron-LM's defaults.** The TransformerConfig Megatron-LM's pretrain_gpt.py makes
    (`core_transformer_config_from_args`) of the flags in `model` (a `ModelConfig`) and the FP8
    flags in `performance` (a `PerformanceConfig`, as ours passes them) without any
    `--no-*-fusion` flag: RoPE, bias + SwiGLU, bias + dropout + add and masked-softmax fusion on,
    gradient-accumulation fusion where apex's kernel imports (as Megatron-LM turns it off
    without), the cross-entropy fusion as its flags say, mean loss per micro batch
    (`calculate_per_token_loss` off). On CPU every fusion is off."""
    if model.tiled_mlp_shards or model.tiled_loss_shards or model.offload_activations:
        raise ValueError("stock megatron-core has no TiledMLP, tiled loss or offload")
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():  # 0.16 warns about its own default cuda_graph_scope
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        return TransformerConfig(
            num_layers=model.num_layers, hidden_size=model.hidden_size,
            ffn_hidden_size=model.ffn_hidden_size,
            num_attention_heads=model.num_attention_heads,
            num_query_groups=model.num_query_groups, kv_channels=model.kv_channels,
            normalization=model.normalization, layernorm_epsilon=model.norm_epsilon,
            qk_layernorm=model.qk_layernorm, gated_linear_unit=model.swiglu,
            activation_func=F.silu if model.swiglu else F.gelu,
            add_bias_linear=not model.disable_bias_linear, add_qkv_bias=model.add_qkv_bias,
            attention_dropout=model.attention_dropout, hidden_dropout=model.hidden_dropout,
            init_method_std=model.init_method_std, sequence_parallel=model.sequence_parallel,
            params_dtype=model.params_dtype, pipeline_dtype=model.params_dtype,
            bf16=model.bf16, fp16=model.fp16, use_cpu_initialization=not cuda,
            recompute_granularity=model.recompute_granularity,
            recompute_method=model.recompute_method,
            recompute_num_layers=model.recompute_num_layers,
            calculate_per_token_loss=False,
            apply_rope_fusion=cuda and te_available(),
            bias_activation_fusion=cuda and (model.swiglu or not model.disable_bias_linear),
            bias_dropout_fusion=cuda,
            masked_softmax_fusion=cuda,
            gradient_accumulation_fusion=cuda
            and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
            cross_entropy_loss_fusion=model.cross_entropy_loss_fusion,
            cross_entropy_fusion_impl=model.cross_entropy_fusion_impl,
            **transformer_kwargs(performance),
        )


class MaskedGPTModel(GPTModel):
    """GPTModel given the `[1, 1, s, s]` causal mask Megatron-LM's loader makes by default
    (--create-attention-mask-in-dataloader) when the schedule passes none (the local spec's own
    default mask is made on device "cuda")."""

    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        if attention_mask is None:
            s = input_ids.shape[1]
            attention_mask = torch.ones(s, s, dtype=torch.bool,
                                        device=input_ids.device).triu(1)[None, None]
        return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)


def build_stock(config):
    """megatron-core's GPTModel (TE spec with TE's layers, else the local spec) at
    `stock_transformer_config`, wrapped as Megatron-LM's get_model wraps it (Float16Module for
    bf16/fp16, DDP with an fp32 grad buffer), weights from the run's seed as ours; the trainer's
    optimizer and scheduler. Returns (model, optimizer, scheduler)."""
    model = config.model
    if config.dims.sp != 1:
        raise ValueError("stock megatron-core has no Ulysses SP: --ulysses-sp-size must be 1")
    mcore_config = stock_transformer_config(model, config.performance)
    if model.transformer_impl == "transformer_engine":
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=model.qk_layernorm)
        model_class = GPTModel
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=model.normalization,
                                                        qk_layernorm=model.qk_layernorm)
        model_class = MaskedGPTModel  # local spec: megatron-core's unfused attention
    with rng.weight_init_streams(config.training.seed):
        gpt = model_class(
            config=mcore_config, transformer_layer_spec=spec, vocab_size=model.padded_vocab_size,
            max_sequence_length=model.max_position_embeddings, parallel_output=True,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding_type,
            rotary_percent=model.rotary_percent, rotary_base=model.rotary_base,
            rope_scaling=model.use_rope_scaling, rope_scaling_factor=model.rope_scaling_factor,
            seq_len_interpolation_factor=model.rotary_seq_len_interpolation_factor,
        ).to(device())
    return attach_optimizer(config, mcore_config, wrap_model(gpt, model, config.optimizer,
                                                             mcore_config, config.performance))


class Trainer:
    """One side ("stock" or "ours") of `config` (a RunConfig): model (DDP), optimizer and LR
    scheduler. Needs the process groups (`training.loop.initialize_distributed`)."""

    def __init__(self, side: str, config):
        builders = {"stock": build_stock, "ours": build_model_and_optimizer}
        if side not in builders:
            raise ValueError(f"side must be stock or ours, got {side!r}")
        self.side, self.config = side, config
        self.model, self.optimizer, self.scheduler = builders[side](config)

    def step(self, batch, progress=None) -> float:
        """One optimizer step: `num_microbatches` times `batch` (`random_batch`), through
        `schedule.train_step`; returns the step's loss. `progress(name)` is called after the
        forward of each micro batch ("forward") and after the step ("step")."""
        hook = None
        if progress is not None:
            hook = self.model.register_forward_hook(lambda *_: progress("forward"))
        try:
            loss, *_ = train_step(itertools.repeat(batch), self.model, self.optimizer,
                                  self.scheduler, self.config.training,
                                  batch["tokens"].shape[1])
        finally:
            if hook is not None:
                hook.remove()
        if progress is not None:
            progress("step")
        return loss

    def init_optimizer_state(self) -> None:
        """One update on zero grads so Adam's moments exist before memory is measured."""
        self.model.zero_grad_buffer()
        self.optimizer.step()
        self.optimizer.zero_grad()


def unwrap(model):
    """The GPTModel inside DDP (and Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def count_params(model) -> tuple:
    """(all parameters, all minus the input embedding)."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - unwrap(model).embedding.word_embeddings.weight.numel()


def model_flops(params_no_emb: int, shape: Shape, seq: int, batch: int = 1) -> float:
    return 6.0 * params_no_emb * seq * batch + 6.0 * shape.layers * seq * seq * shape.hidden * batch


def random_batch(vocab: int, seq: int, seed: int = 0, sp_rank: int = 0, sp: int = 1) -> dict:
    """One micro batch as the trainer's loader gives it: random token and label ids `[1, s]`
    drawn on CPU from `seed`, loss mask 1, positions 0..s-1, SP rank `sp_rank`'s `[1, s/P]` slice
    (`data.sharding`) moved to the device, no packed documents."""
    gen = torch.Generator().manual_seed(seed)
    full = {"tokens": torch.randint(0, vocab, (1, seq), generator=gen),
            "labels": torch.randint(0, vocab, (1, seq), generator=gen),
            "loss_mask": torch.ones(1, seq), "position_ids": torch.arange(seq).unsqueeze(0)}
    batch = {key: value.to(device()) for key, value in
             shard_for_sp_rank(full, sp_rank, sp).items()}
    batch["packed_seq_params"] = None
    return batch


def shutdown() -> None:
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_calls(fn, iters: int) -> list:
    """Seconds of each of `iters` calls of `fn` (CUDA events on GPU, wall clock on CPU)."""
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def median(values):
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def reset_memory() -> None:
    """Free cached GPU blocks (and cached pinned host blocks, where torch can) and reset the
    peak counters."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> tuple:
    """(max allocated, max reserved) in GiB since the last reset."""
    if not torch.cuda.is_available():
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB


def versions() -> dict:
    import megatron.core

    info = {"torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", "?")}
    try:
        import transformer_engine

        info["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        info["transformer_engine"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    return info


def write_json(path, payload) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def describe_failure(exc: BaseException) -> str:
    """'OOM', or the exception with its traceback printed (a benchmark row records it and the
    run goes on)."""
    if is_oom(exc):
        return "OOM"
    import traceback

    traceback.print_exception(exc)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
