"""What the whole-model benchmarks share: process setup, the Llama-3.2-1B shape, the stock and
Ulysses models, one megatron-core training step, FLOP counting and timing.

Glossary: `s` sequence, `b` micro batch (1 here), `h` hidden, `L` layers, `V` vocab.

Model FLOPs per step (BASELINES.md): 6 * (params - input embedding) * s * b + 6 * L * s^2 * h * b.
The second term is causal attention: q.k^T and p.v cost 4 * s^2 * h forward for the full square,
half of it under the causal mask, times 3 for forward + backward. Recompute is not counted (MFU).
"""

import gc
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

if torch.cuda.is_available():
    # Load torch's own cuDNN before Transformer Engine (imported by megatron-core) loads an
    # older one it finds first; torch refuses a cuDNN older than the one it was built with.
    torch.backends.cudnn.version()

from megatron_ulysses import parallel_state as ps
from megatron_ulysses import cpu_compat
from megatron_ulysses.parallel_state import start_process_group

H200_PEAK_TFLOPS = 989.0  # dense bf16, datasheet (MFU denominator, as in BASELINES.md)
GIB = 1 << 30


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


def init_distributed(sp=1) -> None:
    """Default group (torchrun's env, else a single process) and, unless `sp` is None, the
    Ulysses/megatron groups for SP size `sp`."""
    start_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if sp is not None:
        init_parallel(sp)


def init_parallel(sp: int) -> None:
    """megatron-core's groups and ours for SP size `sp` (DP = world / sp)."""
    ps.initialize_model_parallel(ulysses_sp_size=sp)
    cpu_compat.model_parallel_manual_seed(1234)


def shutdown() -> None:
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def transformer_config(shape: Shape, recompute: bool = False):
    """bf16 (fp32 on CPU) TransformerConfig of `shape`; full recompute is one layer per
    checkpoint (the granularity can be switched per run: megatron reads it in forward)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.hidden // shape.heads,
        ffn_hidden_size=shape.ffn,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )


def set_recompute(config, on: bool) -> None:
    config.recompute_granularity = "full" if on else None
    config.recompute_method = "uniform" if on else None
    config.recompute_num_layers = 1 if on else None


def build_model(kind: str, shape: Shape, config, max_seq: int, backend: str = "te",
                tiled_mlp: bool = False, tiled_loss: bool = False):
    """`stock`: megatron-core's own GPTModel with its TE layer spec (local spec if `backend` is
    not te). `ours`: megatron_ulysses.layer_specs.build_gpt_model with `backend`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_ulysses.layer_specs import build_gpt_model

    common = dict(
        vocab_size=shape.vocab,
        max_sequence_length=max_seq,
        position_embedding_type="rope",
        rotary_base=shape.rotary_base,
        share_embeddings_and_output_weights=False,
    )
    cpu_compat.model_parallel_manual_seed(1234)
    if kind == "stock":
        if tiled_mlp or tiled_loss:
            raise ValueError("the stock model has no tiled MLP / tiled loss")
        spec = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec() if backend == "te"
                else gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm"))
        model = GPTModel(config=config, transformer_layer_spec=spec, **common)
    elif kind == "ours":
        model = build_gpt_model(
            config, backend=backend, tiled_mlp_shards="auto" if tiled_mlp else None,
            tiled_loss_shards="auto" if tiled_loss else None, **common,
        )
    else:
        raise ValueError(f"model kind must be stock or ours, got {kind!r}")
    return model.to(device())


def count_params(model) -> tuple:
    """(all parameters, all minus the input embedding)."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.embedding.word_embeddings.weight.numel()


def model_flops(params_no_emb: int, shape: Shape, seq: int, batch: int = 1) -> float:
    return 6.0 * params_no_emb * seq * batch + 6.0 * shape.layers * seq * seq * shape.hidden * batch


class Trainer:
    """megatron-core DDP (fp32 grad buffer, as megatron's bf16 training sets it) + megatron-core
    Adam (fp32 master weights and moments; Transformer Engine's FusedAdam when TE is present),
    or no optimizer at all."""

    def __init__(self, model, config, optimizer: bool = True):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.gpt = model
        self.model = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=model,
        )
        self.optimizer = None
        if optimizer:
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-5, weight_decay=0.1, clip_grad=1.0,
                                bf16=config.bf16, params_dtype=config.params_dtype),
                [self.model],
            )

    def init_optimizer_state(self) -> None:
        """One step on zero grads so Adam's moments exist before memory is measured."""
        if self.optimizer is not None:
            self.model.zero_grad_buffer()
            self.optimizer.step()
            self.optimizer.zero_grad()

    def step(self, tokens, labels, position_ids, progress=None) -> float:
        """Forward, per-token mean loss backward, grad sync, optimizer step. `progress(name)`
        is called after each phase."""
        loss = self.model(tokens, position_ids, None, labels=labels)  # [b, s] per-token
        if progress:
            progress("forward")
        (loss.float().sum() / loss.numel()).backward()
        if progress:
            progress("backward")
        self.model.finish_grad_sync()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.model.zero_grad_buffer()
        if progress:
            progress("optimizer")
        return loss.detach()


def random_batch(shape: Shape, seq: int, batch: int = 1, seed: int = 0):
    gen = torch.Generator(device=device()).manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (batch, seq), device=device(), generator=gen)
    labels = torch.randint(0, shape.vocab, (batch, seq), device=device(), generator=gen)
    position_ids = torch.arange(seq, device=device()).unsqueeze(0).expand(batch, seq)
    return tokens, labels, position_ids


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
