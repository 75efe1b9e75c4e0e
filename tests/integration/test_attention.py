"""UlyssesAttention against plain unsharded attention and DeepSpeed's DistributedAttention.

Each P runs in one set of gloo workers; every rank builds the same full q, k, v, takes its
sequence shard, and compares its output shard and its q/k/v gradient shards with attention
computed on the whole sequence. Head counts include uneven ones (H % P != 0, also with H/P < P,
and GQA whose kv heads split over several ranks), against DeepSpeed's uneven path too where it
applies (G >= P).
"""

import types

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from megatron_ulysses.sp import all_to_all
from megatron_ulysses.sp import parallel_state as ps
from megatron_ulysses.sp.attention import UlyssesAttention
from megatron_ulysses.sp.head_layout import HeadLayout
from megatron_ulysses import cpu_compat

from attention_reference import reference_attention
from distributed import spawn

S, B, D = 24, 2, 8  # S divides by P = 2, 3 and 4


def _inputs(heads, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(S, B, n, D, generator=gen) for n in (heads, groups, groups, heads)]


def _config(heads, groups):
    return TransformerConfig(
        num_layers=1, hidden_size=heads * D, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=D, attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
    )


def _check_against_reference(attention_fn, heads, groups, p, r, seed, packed=False):
    q, k, v, grad_out = _inputs(heads, groups, seed)
    doc_ids = cu_seqlens = None
    if packed:  # documents of lengths 5, 7, 12 in sample 0 and 9, 15 in sample 1
        cu_seqlens = torch.tensor([0, 5, 12, 24, 33, 48], dtype=torch.int32)
        doc_ids = torch.tensor([0] * 5 + [1] * 7 + [2] * 12 + [3] * 9 + [4] * 15).view(B, S)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, doc_ids)
    expected.backward(grad_out)
    sl = slice(r * S // p, (r + 1) * S // p)
    local = [t[sl].clone().requires_grad_() for t in (q, k, v)]
    out = attention_fn(*local, cu_seqlens)
    assert out.shape == (S // p, B, heads * D)
    out.backward(grad_out[sl].reshape(S // p, B, heads * D))
    torch.testing.assert_close(out, expected[sl].reshape(S // p, B, -1), rtol=1e-5, atol=1e-5)
    for got, ref in zip(local, full):
        torch.testing.assert_close(got.grad, ref.grad[sl], rtol=1e-5, atol=1e-5)


def _ulysses_cases(rank, world_size):
    cpu_compat.install()
    ps.initialize_model_parallel(ulysses_sp_size=world_size)
    cpu_compat.model_parallel_manual_seed(0)
    try:
        r = ps.get_ulysses_sp_rank()
        assert r == rank
        # MHA, G >= P, G < P (replicated); uneven: MHA, GQA with kv heads on several ranks.
        shapes = [(8, 8), (8, 4), (8, 2), (8, 1), (7, 7), (14, 2)]
        for seed, (heads, groups) in enumerate(shapes):
            for backend in ("sdpa", "local"):
                attn = UlyssesAttention(_config(heads, groups), layer_number=1, backend=backend)
                for packed in (False, True):
                    fn = lambda q, k, v, cu: attn(  # noqa: E731
                        q, k, v, None,
                        packed_seq_params=None if cu is None else PackedSeqParams(
                            qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=15, max_seqlen_kv=15),
                    )
                    _check_against_reference(fn, heads, groups, world_size, r, seed, packed)
        _check_strided_output(world_size)
        _check_collective_count(world_size)
        _check_against_deepspeed(world_size, r)
    finally:
        ps.destroy_model_parallel()


def _check_strided_output(p):
    """Backends may return strided views (SDPA's permuted output); the exchange takes them."""
    layout, r = HeadLayout(7, 7, p), ps.get_ulysses_sp_rank()
    dense = torch.randn(S, B, len(layout.query_heads(r)), D)
    strided = dense.transpose(0, 1).contiguous().transpose(0, 1)  # same values, [b, s] storage
    assert not strided.is_contiguous() or dense.shape[2] == 1
    group = ps.get_ulysses_sp_group()
    torch.testing.assert_close(all_to_all.output_to_sequence_sharded(strided, layout, r, group),
                               all_to_all.output_to_sequence_sharded(dense, layout, r, group),
                               rtol=0, atol=0)


def _check_collective_count(p):
    """Two all-to-alls per forward (fused q/k/v in, output out), two per backward, with even
    heads (equal splits) and uneven ones (split sizes)."""
    calls = []
    original = all_to_all.dist.all_to_all_single

    def counting(out, inp, *args, **kwargs):
        calls.append(inp.numel())
        return original(out, inp, *args, **kwargs)

    all_to_all.dist.all_to_all_single = counting
    try:
        for heads, groups in ((8, 2), (7, 7)):
            calls.clear()
            layout = HeadLayout(heads, groups, p)
            attn = UlyssesAttention(_config(heads, groups), layer_number=1, backend="sdpa")
            q, k, v, grad_out = _inputs(heads, groups, 0)
            local = [t[: S // p].clone().requires_grad_() for t in (q, k, v)]
            out = attn(*local, None)
            assert len(calls) == 2, calls
            kv_sent = sum(len(layout.kv_heads(j)) for j in range(p))  # max(G, P) when even
            heads_r = len(layout.query_heads(ps.get_ulysses_sp_rank()))
            assert calls == [(S // p) * B * D * (heads + 2 * kv_sent), S * B * D * heads_r]
            out.backward(grad_out[: S // p].reshape(S // p, B, -1))
            assert len(calls) == 4
    finally:
        all_to_all.dist.all_to_all_single = original


def _check_against_deepspeed(p, r):
    """Same output and grads as DeepSpeed's Ulysses `DistributedAttention`: even heads, and its
    uneven path (whole kv groups per rank; it needs G >= P) where H or G does not divide by P,
    including H/P < P (7 heads at P 4)."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups as ds_groups

    deepspeed.init_distributed(dist_backend="gloo")
    # DeepSpeed's uneven path asks its own registry for the SP rank.
    ds_groups.mpu = types.SimpleNamespace(get_sequence_parallel_rank=ps.get_ulysses_sp_rank)

    def local_attn(q, k, v, *args, **kwargs):  # [s, b, H_r, d] after DeepSpeed's exchange
        return reference_attention(q, k, v)

    ds_attention = DistributedAttention(local_attn, ps.get_ulysses_sp_group(), scatter_idx=2,
                                        gather_idx=0)
    shapes = [(8, 8), (8, 4), (7, 7), (12, 6), (32, 8)]
    try:
        for seed, (heads, groups) in enumerate(shapes):
            ours = UlyssesAttention(_config(heads, groups), layer_number=1, backend="local")
            q, k, v, grad_out = _inputs(heads, groups, 100 + seed)
            sl = slice(r * S // p, (r + 1) * S // p)
            results = []
            for fn in (lambda *t: ours(*t, None), lambda *t: ds_attention(*t, 1)):  # batch dim 1
                local = [t[sl].clone().requires_grad_() for t in (q, k, v)]
                out = fn(*local).reshape(S // p, B, heads * D)
                out.backward(grad_out[sl].reshape(S // p, B, -1))
                results.append([out] + [t.grad for t in local])
            for got, ref in zip(*results):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    finally:
        ds_groups.mpu = None
    dist.barrier()


def test_ulysses_attention_sp2():
    spawn(_ulysses_cases, 2)


def test_ulysses_attention_sp3():  # every shape uneven but 12/6 (and DeepSpeed's 32/8 at P 3)
    spawn(_ulysses_cases, 3)


def test_ulysses_attention_sp4():
    spawn(_ulysses_cases, 4)
