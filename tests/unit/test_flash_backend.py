"""`--ulysses-attention-backend flash` (FlashAttention-4) without a GPU or flash-attn-4: the
refusals, each one ConfigError naming the flag (the GPU, flash-attn-4 and CUDA mocked where the
rule, not the import, is tested), `auto` never picking it, and `backends.FlashAttention`'s
plumbing (bshd views, native GQA, packed documents as varlen over `[b*s]`, the deterministic
flag) against plain attention, with FA4's two entries replaced by fp32 SDPA fakes that check
what FA4 checks. tests/gpu/test_flash_backend_gpu.py runs the real kernels."""

from unittest import mock

import pytest
import torch
import test_perf_flags as perf_flags
import torch.nn.functional as F
from attention_reference import reference_attention
from megatron.core.transformer import TransformerConfig

from megatron_ulysses.sp import backends
from megatron_ulysses.sp.head_layout import HeadLayout
from megatron_ulysses.training import arguments
from megatron_ulysses.training.arguments import ConfigError, parse_args
from megatron_ulysses.training.config import model as model_section

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

FLASH = ["--ulysses-attention-backend", "flash", "--bf16", "--attention-dropout", "0"]


def on_gpu(argv, capability=(9, 0)):
    """The model section as `validate_args` makes it on a GPU node with TE and flash-attn-4
    (test_perf_flags' mocks; the GPU's generation mocked too)."""
    return perf_flags.on_gpu(argv, capability=capability).model


@pytest.mark.skipif(backends.flash_import_error() is None, reason="flash-attn-4 is installed")
def test_missing_flash_attn_4_is_one_error_saying_what_to_install():
    with pytest.raises(ConfigError) as error:
        parse_args(perf_flags.BASE + FLASH, world_size=1)
    message = str(error.value)
    assert message.startswith("--ulysses-attention-backend flash needs flash-attn-4: pip install")
    assert "megatron_ulysses[flash]" in message and backends.FLASH_ATTN_4 in message


def test_flash_needs_cuda():
    with mock.patch.object(backends, "flash_import_error", return_value=None), \
            mock.patch("torch.cuda.is_available", return_value=False), \
            pytest.raises(ValueError, match="--ulysses-attention-backend flash needs CUDA"):
        backends.resolve_backend("flash")


def test_auto_never_picks_flash():
    with mock.patch.object(backends, "flash_import_error", return_value=None), \
            mock.patch("torch.cuda.is_available", return_value=True):
        assert backends.resolve_backend("flash") == "flash"
        for te in (True, False):
            with mock.patch.object(backends, "te_available", return_value=te):
                assert backends.resolve_backend("auto") == ("te" if te else "sdpa")
    assert on_gpu(["--bf16"]).ulysses_attention_backend == "te"


@pytest.mark.parametrize("argv, capability, layers", [
    (FLASH, (9, 0), "transformer_engine"),
    (FLASH + ["--transformer-impl", "local"], (9, 0), "local"),
    (FLASH + ["--deterministic-mode", "--kv-channels", "256"], (9, 0), "transformer_engine"),
    (FLASH + ["--fp8-format", "hybrid"], (9, 0), "transformer_engine"),  # FP8 linear layers
    ([f for f in FLASH if f != "--bf16"] + ["--fp16", "--kv-channels", "256"], (10, 0),
     "transformer_engine"),
    (FLASH + ["--kv-channels", "128"], (12, 0), "transformer_engine"),
])
def test_flash_is_accepted_where_fa4_runs(argv, capability, layers):
    model = on_gpu(argv, capability)
    assert (model.ulysses_attention_backend, model.transformer_impl) == ("flash", layers)


@pytest.mark.parametrize("argv, capability, message", [
    ([f for f in FLASH if f != "--bf16"], (9, 0),
     "--ulysses-attention-backend flash runs in bf16 or fp16 (FlashAttention-4 has no fp32 "
     "kernels): add --bf16"),
    (FLASH[:3], (9, 0), "--ulysses-attention-backend flash has no attention dropout "
     "(FlashAttention-4 implements none): add --attention-dropout 0 (got 0.1; the default is "
     "0.1)"),
    (FLASH, (8, 0), "--ulysses-attention-backend flash needs a Hopper or Blackwell GPU "
     "(compute capability 9.0 to 12.x: FlashAttention-4 has no backward below); this GPU is "
     "8.0"),
    (FLASH + ["--kv-channels", "264"], (9, 0), "head dim --kv-channels 264 is not one "
     "FlashAttention-4 runs on compute capability 9.0 (8 to 256, a multiple of 8)"),
    (FLASH + ["--kv-channels", "192"], (10, 0), "--kv-channels 192 is not one FlashAttention-4 "
     "runs on compute capability 10.0 (8 to 128, or 256"),
    (FLASH + ["--kv-channels", "20"], (9, 0), "--kv-channels 20 is not one"),
    (FLASH + ["--kv-channels", "256"], (12, 0), "compute capability 12.0 (8 to 128,"),
    (FLASH + ["--deterministic-mode"], (12, 0), "--ulysses-attention-backend flash has no "
     "deterministic backward on compute capability 12.0"),
    (FLASH + ["--fp8-format", "hybrid", "--fp8-dot-product-attention"], (9, 0),
     "--fp8-dot-product-attention"),
])
def test_what_fa4_cannot_run_is_one_error_naming_the_flag(argv, capability, message):
    with pytest.raises(ConfigError) as error:
        on_gpu(argv, capability)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_flash_on_cpu_is_refused_by_the_config():
    args = arguments.build_parser().parse_args(perf_flags.BASE + FLASH[:2] + ["--attention-dropout", "0"])
    with mock.patch.object(model_section, "resolve_backend", side_effect=lambda name: name), \
            pytest.raises(ConfigError, match="--ulysses-attention-backend flash needs CUDA"):
        arguments.validate_args(args, world_size=1, cuda=False)


# ------------------------------------------------------------------ FlashAttention's plumbing


class FakeFA4:
    """flash_attn_func / flash_attn_varlen_func of flash-attn-4 4.0.0b36 in fp32 torch: their
    layouts (bshd; thd with int32 cu_seqlens), their GQA rule (H % G == 0, kv heads not
    expanded) and their `(out, lse)` result; records each call's options."""

    def __init__(self):
        self.calls = []

    def _attend(self, q, k, v, softmax_scale, causal, deterministic, **extra):
        """q `[b, s, H, d]`, k, v `[b, s, G, d]` -> `[b, s, H, d]`."""
        assert causal and q.shape[2] % k.shape[2] == 0 and k.shape[2] == v.shape[2]
        self.calls.append(dict(heads=q.shape[2], kv_heads=k.shape[2], scale=softmax_scale,
                               deterministic=deterministic, **extra))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             is_causal=True, scale=softmax_scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)

    def func(self, q, k, v, softmax_scale=None, causal=False, deterministic=False):
        return self._attend(q, k, v, softmax_scale, causal, deterministic), None

    def varlen(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, softmax_scale=None, causal=False, deterministic=False):
        assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32
        assert cu_seqlens_q is cu_seqlens_k and int(cu_seqlens_q[-1]) == q.shape[0]
        bounds = cu_seqlens_q.tolist()
        out = torch.cat([self._attend(q[None, a:b], k[None, a:b], v[None, a:b], softmax_scale,
                                      causal, deterministic, max_seqlen=max_seqlen_q)[0]
                         for a, b in zip(bounds[:-1], bounds[1:])])
        return out, None


def _flash(heads, groups, deterministic=False, dropout=0.0):
    config = TransformerConfig(num_layers=1, hidden_size=heads * 8, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=8,
                               deterministic_mode=deterministic)
    return backends.build_backend_attention("flash", config, 1, heads, groups, None, dropout)


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_attention_layout_matches_plain_attention(heads, groups, packed):
    """[s, b, H, d] in and out, GQA kv heads handed over as they are, documents kept apart;
    forward and q/k/v grads equal plain attention (fp32)."""
    s, b, d = 24, 2, 8
    fake = FakeFA4()
    gen = torch.Generator().manual_seed(heads + groups)
    q, k, v, grad = (torch.randn(s, b, n, d, generator=gen) for n in (heads, groups, groups,
                                                                         heads))
    cu = doc_ids = None
    if packed:  # documents of 10, 14 | 5, 19 tokens over [b*s]
        cu = torch.tensor([0, 10, 24, 29, 48], dtype=torch.int64)
        doc_ids = torch.repeat_interleave(torch.arange(4), cu.diff()).view(b, s)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, doc_ids)
    expected.backward(grad)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    with mock.patch.object(backends, "_flash_functions", return_value=(fake.func, fake.varlen)):
        out = _flash(heads, groups)(*mine, cu, None if cu is None else 19)
    out.backward(grad)
    assert out.shape == (s, b, heads, d)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, ref in zip(mine, full):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-5, atol=1e-5)
    assert {(c["heads"], c["kv_heads"]) for c in fake.calls} == {(heads, groups)}
    assert all(c.get("max_seqlen", 19) == 19 for c in fake.calls)


def test_flash_attention_passes_the_scale_and_deterministic_mode():
    fake = FakeFA4()
    q, k, v = (torch.randn(8, 1, n, 8) for n in (4, 2, 2))
    with mock.patch.object(backends, "_flash_functions", return_value=(fake.func, fake.varlen)):
        for deterministic in (False, True):
            config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                       num_query_groups=2, deterministic_mode=deterministic)
            backends.build_backend_attention("flash", config, 1, 4, 2, 0.25, 0.0)(q, k, v)
    assert [(c["scale"], c["deterministic"]) for c in fake.calls] == [(0.25, False),
                                                                       (0.25, True)]


def test_flash_attention_refuses_dropout():
    with pytest.raises(ValueError, match="flash has no attention dropout; got 0.1"):
        _flash(4, 2, dropout=0.1)


@pytest.mark.parametrize("heads, groups, sp", [(14, 2, 4), (28, 4, 8), (12, 3, 8), (7, 7, 4),
                                               (32, 8, 8), (8, 1, 4)])
def test_every_sp_rank_hands_fa4_a_layout_it_takes(heads, groups, sp):
    """FA4 needs its kv heads to divide its query heads: every rank's backend gets that, kv
    heads in uneven runs already repeated into equal ones (`expand_kv`)."""
    layout = HeadLayout(heads, groups, sp)
    for rank in range(sp):
        assert len(layout.query_heads(rank)) % layout.attended_kv_heads(rank) == 0
