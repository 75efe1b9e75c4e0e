"""Pure re-sharding layouts (no process group) and the configuration checks."""

import pytest
import torch
from megatron.core.parallel_state import RankGenerator

from megatron_ulysses.all_to_all import (
    pack_output,
    pack_qkv,
    replicate_kv_heads,
    unpack_output,
    unpack_qkv,
)
from megatron_ulysses.parallel_state import ParallelDims

S, B, D = 16, 2, 4


def exchange_reference(send_buffers):
    """What one all-to-all does to the P ranks' send buffers `[P, ...]`, without a process group:
    rank i receives chunk i of every rank j, in order of j."""
    return [torch.stack([buf[i] for buf in send_buffers]) for i in range(len(send_buffers))]


def _shards(full, p):
    return list(full.chunk(p, dim=0))


@pytest.mark.parametrize("p,heads,groups", [(1, 4, 4), (2, 4, 4), (4, 8, 2), (2, 8, 1), (4, 8, 8)])
def test_qkv_exchange_gives_every_rank_all_tokens_of_its_heads(p, heads, groups):
    q, k, v = torch.randn(S, B, heads, D), torch.randn(S, B, groups, D), torch.randn(S, B, groups, D)
    sends = [
        pack_qkv(qs, replicate_kv_heads(ks, p), replicate_kv_heads(vs, p), p)
        for qs, ks, vs in zip(_shards(q, p), _shards(k, p), _shards(v, p))
    ]
    received = exchange_reference(sends)
    kv_full = max(groups, p)
    for r in range(p):
        qr, kr, vr = unpack_qkv(received[r], heads // p, kv_full // p)
        assert qr.shape == (S, B, heads // p, D)
        torch.testing.assert_close(qr, q[:, :, r * heads // p:(r + 1) * heads // p], rtol=0, atol=0)
        # The kv head a rank receives is the group of its query heads.
        for local_head in range(heads // p):
            group = (r * heads // p + local_head) // (heads // groups)
            kv_index = group - r * (groups // p) if groups >= p else 0
            torch.testing.assert_close(kr[:, :, kv_index], k[:, :, group], rtol=0, atol=0)
            torch.testing.assert_close(vr[:, :, kv_index], v[:, :, group], rtol=0, atol=0)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_output_exchange_round_trip(p):
    heads = 8
    out = torch.randn(S, B, heads, D)
    # Rank r holds heads [r*H/P, (r+1)*H/P) for all tokens.
    sends = [pack_output(h.contiguous(), p) for h in out.chunk(p, dim=2)]
    received = exchange_reference(sends)
    for r, buf in enumerate(received):
        expected = out[r * S // p:(r + 1) * S // p].reshape(S // p, B, heads * D)
        torch.testing.assert_close(unpack_output(buf), expected, rtol=0, atol=0)


def test_exchange_is_its_own_inverse():
    sends = [torch.randn(4, 3, 2) for _ in range(4)]
    back = exchange_reference(exchange_reference(sends))
    for a, b in zip(sends, back):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_replication_gradient_sums_over_replicas():
    kv = torch.randn(S, B, 2, D, requires_grad=True)
    grad = torch.randn(S, B, 4, D)
    replicate_kv_heads(kv, 4).backward(grad)
    torch.testing.assert_close(kv.grad, grad.view(S, B, 2, 2, D).sum(3))


def test_parallel_dims():
    dims = ParallelDims(world_size=16, tp=2, pp=1, sp=4)
    assert dims.dp == 2
    dims.validate_model(32, 8, 4096)
    ParallelDims(world_size=8, sp=8).validate_model(32, 2, 8192)  # kv replication: 8 % 2 == 0


def test_sp_groups_are_the_closest_ranks_after_tp():
    dims = ParallelDims(world_size=32, tp=2, pp=2, sp=4)  # DP 2
    sp_groups, dp_groups = dims.rank_groups("sp"), dims.rank_groups("dp")
    assert sp_groups[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dp_groups[:2] == [[0, 8], [1, 9]]
    assert sorted(r for g in sp_groups for r in g) == list(range(32))
    for group in sp_groups:  # TP x SP = 8 consecutive ranks: one 8-GPU node
        assert max(group) // 8 == min(group) // 8
    # Each SP group and each pure-DP group lie inside one megatron-core DP group (DP x SP).
    mcore_dp = RankGenerator(tp=2, ep=1, dp=8, pp=2, cp=1, order="tp-cp-ep-dp-pp").get_ranks("dp")
    for group in sp_groups + dp_groups:
        assert any(set(group) <= set(m) for m in mcore_dp)
    assert len({r for g in dp_groups for r in g}) == 32


@pytest.mark.parametrize(
    "dims,model,message",
    [
        (dict(world_size=6, sp=4), None, "world size 6 is not divisible"),
        (dict(world_size=8, sp=0), None, "--ulysses-sp-size must be >= 1"),
        (dict(world_size=8, sp=4), (6, 6, None), "--num-attention-heads (6) must be divisible"),
        (dict(world_size=8, tp=2, sp=4), (12, 12, None), "--tensor-model-parallel-size x --ulysses-sp-size (2 x 4 = 8)"),
        (dict(world_size=8, sp=4), (24, 6, None), "--num-query-groups (6) per tensor-parallel rank (6) and --ulysses-sp-size (4)"),
        (dict(world_size=8, sp=8), (24, 3, None), "--num-query-groups (3)"),
        (dict(world_size=8, tp=2, sp=2), (12, 3, None), "--num-query-groups (3) must be divisible by --tensor-model-parallel-size (2)"),
        (dict(world_size=8, sp=4), (8, 8, 1022), "--seq-length (1022) must be divisible by --ulysses-sp-size"),
        (dict(world_size=4, sp=2), (8, 3, None), "--num-attention-heads (8) must be divisible by --num-query-groups (3)"),
    ],
)
def test_configuration_errors_name_the_flag(dims, model, message):
    with pytest.raises(ValueError) as err:
        ParallelDims(**dims).validate_model(*model) if model else ParallelDims(**dims)
    assert message in str(err.value)
