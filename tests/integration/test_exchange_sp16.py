"""The two exchanges alone at SP 16 with uneven heads (40 query / 8 kv heads: 3 heads on ranks
0-7, 2 on ranks 8-15; kv heads split over up to 3 ranks), over 16 gloo processes: sequence
shard -> exchange -> plain attention on the rank's heads -> exchange back gives unsharded
attention's output and q/k/v gradients. Torch-only imports, so 16 processes start quickly."""

import torch
import torch.distributed as dist

from attention_reference import reference_attention
from distributed import spawn
from megatron_ulysses.sp.all_to_all import output_to_sequence_sharded, qkv_to_head_sharded
from megatron_ulysses.sp.head_layout import HeadLayout, expand_kv

P, HEADS, GROUPS = 16, 40, 8
S, B, D = 32, 1, 4


def _exchange_cases(rank, world_size):
    layout = HeadLayout(HEADS, GROUPS, world_size)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(S, B, n, D, generator=gen)
                     for n in (HEADS, GROUPS, GROUPS, HEADS))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full)
    expected.backward(grad)

    sl = slice(rank * S // world_size, (rank + 1) * S // world_size)
    local = [t[sl].clone().requires_grad_() for t in (q, k, v)]
    qr, kr, vr = qkv_to_head_sharded(*local, layout, rank, None)
    heads = layout.query_heads(rank)
    assert qr.shape == (S, B, len(heads), D) and len(heads) == (3 if rank < 8 else 2)
    out = reference_attention(qr, expand_kv(kr, layout, rank), expand_kv(vr, layout, rank))
    torch.testing.assert_close(out, expected[:, :, heads.start:heads.stop].detach(),
                               rtol=1e-5, atol=1e-5)
    back = output_to_sequence_sharded(out, layout, rank, None)
    assert back.shape == (S // world_size, B, HEADS * D)
    back.backward(grad[sl].reshape(S // world_size, B, HEADS * D))
    torch.testing.assert_close(back, expected[sl].reshape(S // world_size, B, -1),
                               rtol=1e-5, atol=1e-5)
    for got, ref in zip(local, full):
        torch.testing.assert_close(got.grad, ref.grad[sl], rtol=1e-5, atol=1e-5)
    dist.barrier()


def test_uneven_exchange_40_heads_8_kv_heads_sp16():
    spawn(_exchange_cases, P)
