"""The attention backends UlyssesAttention runs after the exchange, on head-sharded tensors.

Every backend maps q `[s, b, Hl, d]`, k, v `[s, b, Gl, d]` (this SP rank's own Hl query and Gl kv
heads, `head_layout.HeadLayout`: Hl is ceil(H/P) or floor(H/P), and Gl divides Hl with local
query head i using kv head i // (Hl/Gl); full sequence `s`) to `[s, b, Hl, d]`, causally. Each rank
builds its backend for its own counts, so ranks of one SP group may hold different module shapes.
With packed documents, `cu_seqlens` (int32 `[n+1]`, over the batch-major flattened `[b*s]` sequence, global since every
rank now holds all `s` tokens) bounds the documents and attention never crosses them.

    te     Transformer Engine DotProductAttention (fused/cuDNN kernels; THD for packed documents)
    sdpa   torch scaled_dot_product_attention (native GQA, enable_gqa=True; packed documents run
           one causal call per document)
    local  megatron-core's DotProductAttention (unfused reference; packed documents as a mask)
    flash  FlashAttention-4 (flash-attn-4's flash_attn.cute, CuTe-DSL kernels for Hopper and
           Blackwell; native GQA; packed documents through its varlen entry); bf16 / fp16 and
           no dropout: the model config section refuses the rest, naming the flag

Attention dropout draws from the stream in place: UlyssesAttention calls the backends under the
RNG tracker's model-parallel-rng, seeded per head group (`megatron_ulysses.sp.rng`), or, under
--sequence-parallel, inside megatron-core's block, which runs under it. megatron-core's attention
and TE's (given `get_rng_state_tracker`) fork that same stream, but, told `sequence_parallel`,
not again inside the block (activation recompute would not replay a nested fork's masks).
"""

import copy
import functools
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

BACKENDS = ("te", "sdpa", "local", "flash")
# The flash-attn-4 release the flash backend is measured and tested with (bench/RESULTS.md).
FLASH_ATTN_4 = "flash-attn-4==4.0.0b36"

# scaled_dot_product_attention takes enable_gqa from torch 2.5 on.
_SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@functools.lru_cache(maxsize=None)
def flash_import_error():
    """None where FlashAttention-4 (`flash_attn.cute`) imports, else why it does not. Any error
    counts: its CuTe-DSL runtime can fail on import with more than an ImportError."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as error:  # noqa: BLE001 -- reported in resolve_backend's message
        return f"{type(error).__name__}: {error}"
    return None


def resolve_backend(name: str) -> str:
    """`auto` -> `te` when Transformer Engine is installed and CUDA is there, else `sdpa` (a
    CPU node with TE installed, e.g. to convert a checkpoint, runs sdpa); `flash` only when asked
    for."""
    if name == "auto":
        return "te" if te_available() and torch.cuda.is_available() else "sdpa"
    if name not in BACKENDS:
        raise ValueError(
            f"--ulysses-attention-backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}"
        )
    if name == "te" and not te_available():
        raise ValueError(
            "--ulysses-attention-backend te needs Transformer Engine "
            "(pip install 'megatron_ulysses[te]'); use sdpa or local instead"
        )
    if name == "te" and not torch.cuda.is_available():
        raise ValueError(
            "--ulysses-attention-backend te needs CUDA (Transformer Engine's kernels); on CPU "
            "use sdpa or local"
        )
    if name == "flash" and flash_import_error() is not None:
        raise ValueError(
            f"--ulysses-attention-backend flash needs flash-attn-4: pip install "
            f"'megatron_ulysses[flash]' (or '{FLASH_ATTN_4}'); importing flash_attn.cute "
            f"failed with {flash_import_error()}. Or use te, sdpa or local"
        )
    if name == "flash" and not torch.cuda.is_available():
        raise ValueError(
            "--ulysses-attention-backend flash needs CUDA (FlashAttention-4's kernels); on CPU "
            "use sdpa or local"
        )
    return name


def document_spans(cu_seqlens: torch.Tensor, seq_len: int):
    """Yield `(sample, start, end)` for each document of a batch-major packed `[b*s]` sequence."""
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            sample = start // seq_len
            yield sample, start - sample * seq_len, end - sample * seq_len


def block_causal_mask(cu_seqlens: torch.Tensor, seq_len: int, batch: int, device) -> torch.Tensor:
    """`[b, 1, s, s]` bool, True where attention is masked out (future tokens, other documents)."""
    doc = torch.zeros(batch * seq_len, dtype=torch.long, device=device)
    doc[cu_seqlens[1:-1].long().to(device)] = 1
    doc = doc.cumsum(0).view(batch, seq_len)
    same_doc = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    return ~(same_doc & causal)[:, None]


class SDPAAttention(torch.nn.Module):
    def __init__(self, num_heads, num_kv_heads, softmax_scale, attention_dropout):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.softmax_scale, self.dropout = softmax_scale, attention_dropout

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        gqa = {}
        if self.num_kv_heads != self.num_heads:
            if _SDPA_HAS_GQA:
                # Native GQA: on an H200 with torch 2.11 + cuDNN 9.19 it stays on cuDNN and beats
                # expanding the kv heads first (bench/attention_overhead.py: 530 vs 484 TFLOP/s
                # at s=8K, 554 vs 530 at 32K, 32/8 heads, d=128) and saves the expanded copies.
                gqa = {"enable_gqa": True}
            else:  # torch < 2.5 has no enable_gqa
                k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)
                v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, Hl|Gl, s, d]
        dropout = self.dropout if self.training else 0.0
        if cu_seqlens is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale, **gqa
            )
        else:
            out = torch.empty_like(q)
            for i, start, end in document_spans(cu_seqlens, q.shape[2]):
                out[i, :, start:end] = F.scaled_dot_product_attention(
                    q[i, :, start:end], k[i, :, start:end], v[i, :, start:end],
                    is_causal=True, dropout_p=dropout, scale=self.softmax_scale, **gqa,
                )
        return out.permute(2, 0, 1, 3)


class LocalAttention(torch.nn.Module):
    """megatron-core's unfused DotProductAttention sized for Hl query and Gl kv heads."""

    def __init__(self, config, layer_number, num_heads, num_kv_heads, softmax_scale, dropout):
        super().__init__()
        tp = config.tensor_model_parallel_size
        local_config = copy.copy(config)
        # megatron-core divides head counts by TP itself.
        local_config.num_attention_heads = num_heads * tp
        local_config.num_query_groups = num_kv_heads * tp
        self.attention = DotProductAttention(
            config=local_config,
            layer_number=layer_number,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            attention_dropout=dropout,
            softmax_scale=softmax_scale,
        )

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        s, b = q.shape[:2]
        if cu_seqlens is None:
            # Explicit: megatron-core's default causal mask is built on device "cuda".
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)[None, None]
            mask_type = AttnMaskType.causal
        else:
            mask, mask_type = block_causal_mask(cu_seqlens, s, b, q.device), AttnMaskType.padding
        # megatron-core views its inputs; the exchange hands over strided head slices.
        q, k, v = (t.contiguous() for t in (q, k, v))
        out = self.attention(q, k, v, mask, attn_mask_type=mask_type)
        return out.view(s, b, q.shape[2], q.shape[3])


class TEAttention(torch.nn.Module):
    def __init__(self, config, layer_number, num_heads, num_kv_heads, softmax_scale, dropout):
        super().__init__()
        from transformer_engine.pytorch import DotProductAttention as TEDotProductAttention

        self.attention = TEDotProductAttention(
            num_attention_heads=num_heads,
            kv_channels=config.kv_channels,
            num_gqa_groups=num_kv_heads,
            attention_dropout=dropout,
            qkv_format="sbhd",
            attn_mask_type="causal",
            layer_number=layer_number,
            softmax_scale=softmax_scale,
            # As megatron-core's TEDotProductAttention: fork the tracker's model-parallel-rng,
            # except inside a --sequence-parallel block, which already runs under it.
            sequence_parallel=config.sequence_parallel,
            get_rng_state_tracker=tensor_parallel.get_cuda_rng_tracker if dropout > 0 else None,
        )

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        s, b, h, d = q.shape
        if cu_seqlens is None:
            if k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr():
                # TE infers its memory layout from storage and offsets: a strided view of the
                # exchange buffer next to k, v of their own (`expand_kv`'s copies) is read as a
                # dense sbhd q (H100: relative error 0.5-0.7 at 14 / 2 heads, P 4), so densify.
                q = q.contiguous()
            return self.attention(q, k, v).view(s, b, h, d)
        q, k, v = (t.transpose(0, 1).reshape(b * s, t.shape[2], d) for t in (q, k, v))
        # TE asserts int32 cu_seqlens and does host arithmetic on max_seqlen (a Python int).
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if max_seqlen is not None:
            max_seqlen = int(max_seqlen)
        out = self.attention(
            q, k, v,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
        )
        return out.view(b, s, h, d).transpose(0, 1)


@functools.lru_cache(maxsize=None)
def _flash_functions():
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func


class FlashAttention(torch.nn.Module):
    """FlashAttention-4 on q `[s, b, Hl, d]`, k, v `[s, b, Gl, d]`, as their bshd views: it takes
    Gl < Hl kv heads itself (query head i uses kv head i // (Hl/Gl), the layout every backend
    gets, `expand_kv` having evened out uneven runs first), so no kv head is copied. Packed
    documents go through `flash_attn_varlen_func` on the batch-major `[b*s]` tokens, whose order
    `cu_seqlens` counts in. Under --deterministic-mode (megatron-core's `deterministic_mode`) its
    backward runs without atomics (bitwise repeatable). It has no dropout."""

    def __init__(self, config, num_heads, num_kv_heads, softmax_scale, dropout):
        super().__init__()
        if dropout > 0:  # the config refuses this first, in flag terms
            raise ValueError(f"--ulysses-attention-backend flash has no attention dropout; "
                             f"got {dropout} (use --attention-dropout 0)")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.softmax_scale = softmax_scale  # None: FA4's 1/sqrt(d), as the other backends
        self.deterministic = bool(getattr(config, "deterministic_mode", False))

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        s, b, h, d = q.shape
        func, varlen_func = _flash_functions()
        options = dict(softmax_scale=self.softmax_scale, causal=True,
                       deterministic=self.deterministic)
        if cu_seqlens is None:
            # [b, s, H|G, d] views (FA4 reads strided tensors; it copies only misaligned ones)
            out = func(*(t.transpose(0, 1) for t in (q, k, v)), **options)
            return _flash_output(out).transpose(0, 1)
        q, k, v = (t.transpose(0, 1).reshape(b * s, t.shape[2], d) for t in (q, k, v))
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)  # FA4 asserts int32
        if max_seqlen is not None:
            max_seqlen = int(max_seqlen)
        out = varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                          max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, **options)
        return _flash_output(out).view(b, s, h, d).transpose(0, 1)


def _flash_output(result):
    """FA4's entries return `(out, lse)` (flash-attn-4 4.0.0b36), earlier betas `out`."""
    return result[0] if isinstance(result, tuple) else result


def build_backend_attention(backend, config, layer_number, num_heads, num_kv_heads, softmax_scale,
                          attention_dropout):
    """The backend module for Hl = `num_heads` query and Gl = `num_kv_heads` kv heads."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if backend == "sdpa":
        return SDPAAttention(num_heads, num_kv_heads, softmax_scale, dropout)
    if backend == "flash":
        return FlashAttention(config, num_heads, num_kv_heads, softmax_scale, dropout)
    cls = {"te": TEAttention, "local": LocalAttention}[backend]
    return cls(config, layer_number, num_heads, num_kv_heads, softmax_scale, dropout)
