"""Pure re-sharding layouts (no process group) and the configuration checks."""

import pytest
import torch
from megatron.core.parallel_state import RankGenerator

from megatron_ulysses.sp.all_to_all import (
    output_chunk_sizes,
    pack_output,
    pack_qkv,
    qkv_chunk_sizes,
    unpack_output,
    unpack_qkv,
)
from megatron_ulysses.sp.head_layout import HeadLayout, expand_kv
from megatron_ulysses.sp.parallel_state import ParallelDims

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

S, B, D = 24, 2, 4  # S divides by every P below

# (H, G, P): MHA, G >= P, G < P (replicated), no SP; uneven: H % P != 0 with MHA (H/P < P,
# DeepSpeed's case), with G < P, with G > P and P not dividing G, with a kv head on 3 ranks.
SHAPES = [(4, 4, 1), (4, 4, 2), (8, 2, 4), (8, 1, 2), (8, 8, 4), (8, 4, 2),
          (7, 7, 4), (28, 4, 8), (14, 2, 4), (32, 8, 3), (40, 8, 8), (6, 1, 4), (12, 4, 6)]


def exchange_reference(sends, sizes):
    """What one all-to-all does to the P ranks' flat send buffers split by `sizes[j]` (rank j's
    send split sizes), without a process group: rank i receives chunk i of every rank j, in
    order of j. Differentiable, so it also gives the exchange's backward."""
    chunks = [buf.split(size) for buf, size in zip(sends, sizes)]
    return [torch.cat([c[i] for c in chunks]) for i in range(len(sends))]


def _shards(full, p):
    return list(full.chunk(p, dim=0))


def _exchange_qkv(q, k, v, layout):
    """Every rank's q, k, v after the pure pack -> reference exchange -> unpack."""
    p = layout.sp_size
    packed = [pack_qkv(qs, ks, vs, layout)
              for qs, ks, vs in zip(_shards(q, p), _shards(k, p), _shards(v, p))]
    received = exchange_reference([buf for buf, _ in packed], [sizes for _, sizes in packed])
    for r, buf in enumerate(received):
        assert [c.numel() for c in buf.split(qkv_chunk_sizes(layout, r, S // p, B, D))] == \
            [sizes[r] for _, sizes in packed]
    return [unpack_qkv(buf, layout, r, B, D) for r, buf in enumerate(received)]


@pytest.mark.parametrize("heads,groups,p", SHAPES)
def test_head_layout(heads, groups, p):
    """Query heads: contiguous, ceil(H/P) for ranks r < H % P, floor(H/P) after; kv heads:
    exactly the ones a rank's query heads use; expanded kv: native GQA grouping."""
    layout = HeadLayout(heads, groups, p)
    ranges = [layout.query_heads(r) for r in range(p)]
    assert [h for rng in ranges for h in rng] == list(range(heads))
    assert [len(rng) for rng in ranges] == [-(-heads // p) if r < heads % p else heads // p
                                            for r in range(p)]
    for r in range(p):
        used = sorted({h * groups // heads for h in ranges[r]})
        assert list(layout.kv_heads(r)) == used
        # After expand_kv, local query head i uses backend kv head i // (H_r / attended).
        kv = torch.tensor(used, dtype=torch.float)[None, None, :, None]
        expanded = expand_kv(kv, layout, r)[0, 0, :, 0]
        attended = layout.attended_kv_heads(r)
        assert expanded.numel() == attended and len(ranges[r]) % attended == 0
        per = len(ranges[r]) // attended
        assert [int(expanded[i // per]) for i in range(len(ranges[r]))] == \
            [h * groups // heads for h in ranges[r]]
        if heads % p == 0 and (groups % p == 0 or p % groups == 0):  # the even layout
            assert len(layout.kv_heads(r)) == max(groups, p) // p and attended == len(used)


@pytest.mark.parametrize("heads,groups,p", SHAPES)
def test_qkv_exchange_gives_every_rank_all_tokens_of_its_heads(heads, groups, p):
    layout = HeadLayout(heads, groups, p)
    q, k, v = (torch.randn(S, B, n, D) for n in (heads, groups, groups))
    for r, (qr, kr, vr) in enumerate(_exchange_qkv(q, k, v, layout)):
        heads_r, kv_r = layout.query_heads(r), layout.kv_heads(r)
        assert qr.shape == (S, B, len(heads_r), D) and kr.shape == vr.shape == (S, B, len(kv_r), D)
        torch.testing.assert_close(qr, q[:, :, heads_r.start:heads_r.stop], rtol=0, atol=0)
        torch.testing.assert_close(kr, k[:, :, kv_r.start:kv_r.stop], rtol=0, atol=0)
        torch.testing.assert_close(vr, v[:, :, kv_r.start:kv_r.stop], rtol=0, atol=0)


@pytest.mark.parametrize("heads,groups,p", SHAPES)
def test_qkv_exchange_backward_sums_over_kv_replicas(heads, groups, p):
    """Through the exchange and expand_kv, every grad lands on its source shard; a kv head sent to
    several ranks (and repeated for GQA) gets the sum of its copies' grads."""
    layout = HeadLayout(heads, groups, p)
    full = [torch.randn(S, B, n, D, requires_grad=True) for n in (heads, groups, groups)]
    weights = [[torch.randn(S, B, n, D) for n in (len(layout.query_heads(r)),
                                                    layout.attended_kv_heads(r),
                                                    layout.attended_kv_heads(r))]
               for r in range(p)]
    loss = 0
    for r, (qr, kr, vr) in enumerate(_exchange_qkv(*full, layout)):
        got = (qr, expand_kv(kr, layout, r), expand_kv(vr, layout, r))
        loss = loss + sum((t * w).sum() for t, w in zip(got, weights[r]))
    loss.backward()
    grads = [t.grad for t in full]
    expected = [torch.zeros_like(t) for t in full]
    for r in range(p):  # by hand: query head h of rank r, and the kv head it attends with
        heads_r = layout.query_heads(r)
        per = len(heads_r) // layout.attended_kv_heads(r)
        for i, h in enumerate(heads_r):
            expected[0][:, :, h] += weights[r][0][:, :, i]
        for j in range(layout.attended_kv_heads(r)):  # backend kv head j serves queries j*per..
            group = heads_r[j * per] * groups // heads
            expected[1][:, :, group] += weights[r][1][:, :, j]
            expected[2][:, :, group] += weights[r][2][:, :, j]
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("heads,groups,p", SHAPES)
def test_output_exchange_is_the_inverse_of_the_query_exchange(heads, groups, p):
    layout = HeadLayout(heads, groups, p)
    out = torch.randn(S, B, heads, D, requires_grad=True)
    # Rank r holds its heads for all tokens; it sends every rank the same amount.
    sends = [pack_output(out[:, :, rng.start:rng.stop]) for rng in map(layout.query_heads,
                                                                      range(p))]
    equal = [[buf.numel() // p] * p for buf in sends]
    received = exchange_reference(sends, equal)
    back = []
    for r, buf in enumerate(received):
        assert [c.numel() for c in buf.split(output_chunk_sizes(layout, S // p, B, D))] == \
            [size[r] for size in equal]
        back.append(unpack_output(buf, layout, S // p, B, D))
        expected = out[r * S // p:(r + 1) * S // p].reshape(S // p, B, heads * D)
        torch.testing.assert_close(back[r], expected, rtol=0, atol=0)
    grad = torch.randn(S, B, heads * D)
    torch.cat(back).backward(grad)  # the backward returns every grad to its head
    torch.testing.assert_close(out.grad, grad.view(S, B, heads, D), rtol=0, atol=0)


def test_parallel_dims():
    dims = ParallelDims(world_size=16, tp=2, pp=1, sp=4)
    assert dims.dp == 2
    dims.validate_model(32, 8, 4096)
    ParallelDims(world_size=8, sp=8).validate_model(32, 2, 8192)  # kv replication: 8 % 2 == 0
    # Heads that do not divide by SP, kv groups neither dividing nor divided by SP.
    for world, tp, sp, heads, groups in ((8, 1, 8, 28, 4), (16, 1, 16, 40, 8), (4, 1, 4, 7, 7),
                                         (8, 2, 4, 28, 4), (3, 1, 3, 32, 8), (8, 1, 8, 8, 8)):
        ParallelDims(world_size=world, tp=tp, sp=sp).validate_model(heads, groups)


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
        (dict(world_size=8, tp=2, sp=4), (6, 6, None), "--num-attention-heads (6) / "
         "--tensor-model-parallel-size (2) = 3 query heads per tensor-parallel rank, fewer than "
         "--ulysses-sp-size (4): every SP rank needs at least one head; the largest "
         "--ulysses-sp-size that works is 2 (at most 3 heads per tensor-parallel rank, and a "
         "divisor of world size 8 / (--tensor-model-parallel-size 2 x "
         "--pipeline-model-parallel-size 1) = 4), or lower --tensor-model-parallel-size"),
        (dict(world_size=16, sp=16), (12, 4, None),
         "the largest --ulysses-sp-size that works is 8"),
        (dict(world_size=12, sp=12), (7, 7, None), "the largest --ulysses-sp-size that works is 6"),
        (dict(world_size=8, tp=2, sp=2), (7, 7, None),
         "--num-attention-heads (7) must be divisible by --tensor-model-parallel-size (2)"),
        (dict(world_size=8, tp=2, sp=2), (12, 3, None), "--num-query-groups (3) must be divisible by --tensor-model-parallel-size (2)"),
        (dict(world_size=8, sp=4), (8, 8, 1022), "--seq-length (1022) must be divisible by --ulysses-sp-size"),
        (dict(world_size=4, sp=2), (8, 3, None), "--num-attention-heads (8) must be divisible by --num-query-groups (3)"),
    ],
)
def test_configuration_errors_name_the_flag(dims, model, message):
    with pytest.raises(ValueError) as err:
        ParallelDims(**dims).validate_model(*model) if model else ParallelDims(**dims)
    assert message in str(err.value)
