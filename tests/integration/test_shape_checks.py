"""Shape checks at the exchange boundaries (`all_to_all.check_*`) and UlyssesAttention's head
counts: each bad shape raises ValueError naming the values and the flag that fixes it; good
shapes pass, agree with `ParallelDims.validate_model`, and still exchange over 2 gloo processes.
"""

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_ulysses.sp import all_to_all
from megatron_ulysses import cpu_compat
from megatron_ulysses.sp import parallel_state as ps
from megatron_ulysses.sp.all_to_all import check_output_shape, check_qkv_shapes
from megatron_ulysses.sp.attention import UlyssesAttention
from megatron_ulysses.sp.head_layout import HeadLayout
from megatron_ulysses.sp.parallel_state import ParallelDims

from distributed import spawn

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

S, B, D = 8, 2, 4


def _qkv(heads, groups, s=S, b=B, d=D):
    return torch.empty(s, b, heads, d), torch.empty(s, b, groups, d), torch.empty(s, b, groups, d)


@pytest.mark.parametrize(
    "qkv,p,fragments",
    [
        (_qkv(3, 3), 4, ["H = 3", "--num-attention-heads / --tensor-model-parallel-size",
                         "fewer than P = --ulysses-sp-size (4)", "[8, 2, 3, 4]",
                         "--ulysses-sp-size <= 3"]),
        (_qkv(8, 3), 2, ["H = 8", "G = 3", "--num-query-groups", "[8, 2, 3, 4]"]),
        (_qkv(8, 0), 2, ["G = 0", "--num-query-groups"]),
        ((_qkv(8, 2)[0], *_qkv(8, 2, s=4)[1:]), 2,
         ["internal error", "s/P, b and d", "q [8, 2, 8, 4], k [4, 2, 2, 4]"]),
        ((_qkv(8, 2)[0], *_qkv(8, 2, b=1)[1:]), 2, ["internal error", "k [8, 1, 2, 4]"]),
        ((_qkv(8, 2)[0], *_qkv(8, 2, d=8)[1:]), 2, ["internal error", "k [8, 2, 2, 8]"]),
        ((*_qkv(8, 2)[:2], torch.empty(S, B, 4, D)), 2,
         ["internal error", "k with v in G", "v [8, 2, 4, 4]"]),
        ((torch.empty(S, B, 8 * D), *_qkv(8, 2)[1:]), 2, ["4-d", "q [8, 2, 32]"]),
    ],
)
def test_bad_qkv_shapes_name_the_flag(qkv, p, fragments):
    with pytest.raises(ValueError) as err:
        check_qkv_shapes(*qkv, p)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    "shape,layout,fragments",
    [
        ((15, B, 2, D), HeadLayout(4, 4, 2), ["s = 15", "--ulysses-sp-size (2)", "--seq-length",
                                              "[15, 2, 2, 4]"]),
        ((S, B, 2 * D), HeadLayout(4, 4, 2), ["4-d", "[8, 2, 8]"]),
        # 7 heads over 4 ranks: rank 3 has 1, not 2.
        ((S, B, 2, D), HeadLayout(7, 7, 4), ["SP rank 3 has 2 heads, expected H_r = 1",
                                             "H = 7 query heads over P = 4"]),
    ],
)
def test_bad_output_shape_names_the_flag(shape, layout, fragments):
    with pytest.raises(ValueError) as err:
        check_output_shape(torch.empty(shape), layout, layout.sp_size - 1)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("heads,groups,p", [(8, 8, 2), (8, 4, 2), (8, 8, 4), (8, 2, 4), (8, 1, 4),
                                            (4, 4, 1), (7, 7, 4), (6, 2, 4), (24, 6, 4),
                                            (24, 3, 8), (4, 4, 4)])
def test_good_shapes_pass(heads, groups, p):  # MHA, G >= P, G < P (replicated), no SP, uneven
    check_qkv_shapes(*_qkv(heads, groups), p)
    layout = HeadLayout(heads, groups, p)
    for r in range(p):
        check_output_shape(torch.empty(S, B, len(layout.query_heads(r)), D), layout, r)


def test_exchange_checks_agree_with_validate_model():
    """On every TP rank's shapes the exchange accepts exactly the configs validate_model does."""
    for tp in (1, 2):
        for sp in (1, 2, 3, 4, 8):
            for heads in range(tp, 25, tp):
                for groups in range(tp, heads + 1, tp):
                    dims = ParallelDims(world_size=tp * sp, tp=tp, sp=sp)
                    try:
                        dims.validate_model(heads, groups)
                        config_ok = True
                    except ValueError:
                        config_ok = False
                    try:
                        check_qkv_shapes(*_qkv(heads // tp, groups // tp), sp)
                        shapes_ok = True
                    except ValueError:
                        shapes_ok = False
                    assert shapes_ok == config_ok, (tp, sp, heads, groups)


def _config(heads, groups):
    return TransformerConfig(
        num_layers=1, hidden_size=heads * D, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=D, attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
    )


def _exchange_cases(rank, world_size):
    p, sl = world_size, slice(rank * S // world_size, (rank + 1) * S // world_size)
    # Good shapes (even and uneven heads): both exchanges over the real group, exact.
    for heads, groups in ((4, 4), (4, 2), (4, 1), (3, 3), (3, 1), (6, 2)):
        layout = HeadLayout(heads, groups, p)
        gen = torch.Generator().manual_seed(heads * 10 + groups)
        q, k, v = (torch.randn(S, B, n, D, generator=gen) for n in (heads, groups, groups))
        qr, kr, vr = all_to_all.qkv_to_head_sharded(q[sl], k[sl], v[sl], layout, rank, None)
        heads_r, kv_r = layout.query_heads(rank), layout.kv_heads(rank)
        torch.testing.assert_close(qr, q[:, :, heads_r.start:heads_r.stop], rtol=0, atol=0)
        torch.testing.assert_close(kr, k[:, :, kv_r.start:kv_r.stop], rtol=0, atol=0)
        torch.testing.assert_close(vr, v[:, :, kv_r.start:kv_r.stop], rtol=0, atol=0)
        back = all_to_all.output_to_sequence_sharded(qr, layout, rank, None)
        torch.testing.assert_close(back, q[sl].reshape(S // p, B, heads * D), rtol=0, atol=0)

    # Bad shapes raise on every rank before any collective, so no rank is left waiting.
    calls = []
    original = all_to_all.dist.all_to_all_single
    all_to_all.dist.all_to_all_single = lambda *args, **kwargs: calls.append(1)
    try:
        with pytest.raises(ValueError, match="--ulysses-sp-size"):
            all_to_all.qkv_to_head_sharded(*_qkv(1, 1), HeadLayout(2, 2, p), rank, None)
        with pytest.raises(ValueError, match="--seq-length"):
            all_to_all.output_to_sequence_sharded(torch.empty(S + 1, B, 2, D),
                                                  HeadLayout(4, 4, p), rank, None)
    finally:
        all_to_all.dist.all_to_all_single = original
    assert calls == []

    # UlyssesAttention: q and k carry the config's heads per TP rank.
    cpu_compat.install()
    ps.initialize_model_parallel(ulysses_sp_size=world_size)
    try:
        attn = UlyssesAttention(_config(8, 2), layer_number=1, backend="local")
        for qkv, fragment in (
            (_qkv(6, 2), "query [s/P, b, H, d] [8, 2, 6, 4] has H = 6 heads, expected "
                         "--num-attention-heads / --tensor-model-parallel-size (8 / 1 = 8)"),
            (_qkv(8, 4), "key [s/P, b, G, d] [8, 2, 4, 4] has G = 4 heads, expected "
                         "--num-query-groups / --tensor-model-parallel-size (2 / 1 = 2)"),
        ):
            with pytest.raises(ValueError) as err:
                attn(*qkv, None)
            assert fragment in str(err.value)
    finally:
        ps.destroy_model_parallel()


def test_exchange_over_two_processes():
    spawn(_exchange_cases, 2)
