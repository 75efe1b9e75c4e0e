"""`--ulysses-attention-backend flash` (FlashAttention-4's kernels) on one GPU, against the te
backend and plain fp32 attention. Skipped, with the reason, only where `flash_attn.cute` does
not import (pip install 'megatron_ulysses[flash]').

- UlyssesAttention(flash), bf16, at SP 1, 2 and 4 (gloo on one GPU, as test_sp_on_one_gpu.py):
  output and q/k/v grads against fp32 attention on the whole sequence and against
  UlyssesAttention(te) on the same inputs; MHA, GQA, G < P (kv heads replicated), uneven heads
  (14 / 2 at P 4: kv heads repeated into equal runs on one rank), packed documents (FA4's varlen
  entry against TE's THD); deterministic_mode repeats bitwise (output and grads).
- The GPT model (TE layers, RoPE, GQA 8 / 2, 2 layers, bf16) with flash attention: loss and every
  gradient at SP 1 against the same weights with te attention, and at DP 2 x SP 2 and SP 4
  against te at SP 1 (summed over DP x SP), also on packed documents.
- pretrain_gpt.py with --ulysses-attention-backend flash logs the te run's losses within
  test_trainer.py's backend tolerance (in TE's and in megatron-core's local layers, and on
  packed documents); with --deterministic-mode two runs log the same digits.

Tolerances: relative norm errors ||x - ref|| / ||ref|| (bf16 2e-2, test_sp_on_one_gpu.py's);
the flash-vs-te trainer losses test_trainer.py's FIRST_TOL / ALL_TOL.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from megatron_ulysses.sp.backends import flash_import_error

if flash_import_error() is not None:
    pytest.skip(f"flash_attn.cute (flash-attn-4) does not import: {flash_import_error()}",
                allow_module_level=True)

from distributed import spawn  # noqa: E402
from test_sp_on_one_gpu import (  # noqa: E402
    BF16_REL, B, S, SEED, V, _config, _on_gpu, _rel, _reference_attention, _report, _run,
    _samples,
)
from test_trainer import MOCK, MODEL, RUN, Run, _close, _wave, packed_documents  # noqa: E402

from megatron_ulysses import cpu_compat  # noqa: E402
from megatron_ulysses.sp import parallel_state as ps  # noqa: E402
from megatron_ulysses.sp.attention import UlyssesAttention  # noqa: E402
from megatron_ulysses.sp.layer_specs import build_gpt_model  # noqa: E402
from megatron_ulysses.sp.loss import global_mean  # noqa: E402

D = 64
# (H, G) per SP size: MHA and GQA everywhere; at P 4 also G < P and uneven heads (14 / 2).
HEADS = {1: [(8, 8), (8, 2)], 2: [(8, 8), (8, 2), (8, 1)], 4: [(8, 2), (8, 1), (14, 2)]}


# ----------------------------------------------------------------------------- attention


def _attention(heads, groups, backend, deterministic=False):
    config = TransformerConfig(num_layers=1, hidden_size=heads * D, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=D, attention_dropout=0.0,
                               hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
                               deterministic_mode=deterministic)
    return UlyssesAttention(config, layer_number=1, backend=backend)


def _inputs(heads, groups, packed):
    """q `[S, B, H, D]`, k, v `[S, B, G, D]`, the output grad (fp32, the same on every rank);
    packed: PackedSeqParams of documents of 100, 60, 96 | 256 tokens over [B*S] and their
    `[B, S]` document ids."""
    gen = torch.Generator(device="cuda").manual_seed(heads * 10 + groups)
    tensors = [torch.randn(S, B, n, D, device="cuda", generator=gen)
               for n in (heads, groups, groups, heads)]
    if not packed:
        return tensors, None, None
    cu = torch.tensor([0, 100, 160, 256, 512], dtype=torch.int32, device="cuda")
    doc_ids = torch.repeat_interleave(torch.arange(4, device="cuda"), cu.diff()).view(B, S)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=256, max_seqlen_kv=256)
    return tensors, params, doc_ids


def _local_run(attention, tensors, params, rows):
    """This rank's `[S/P, B, H*D]` output and q, k, v grads (bf16) for its rows."""
    q, k, v, grad = tensors
    local = [t[rows].to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    out = attention(*local, None, packed_seq_params=params)
    out.backward(grad[rows].reshape(out.shape).to(torch.bfloat16))
    return [out.detach()] + [t.grad for t in local]


def _attention_cases(rank, world_size):
    ps.initialize_model_parallel(ulysses_sp_size=world_size)
    cpu_compat.model_parallel_manual_seed(SEED)
    p, r = world_size, ps.get_ulysses_sp_rank()
    rows = slice(r * S // p, (r + 1) * S // p)
    worst = {"vs_fp32": 0.0, "vs_te": 0.0}
    try:
        for heads, groups in HEADS[p]:
            flash, te = _attention(heads, groups, "flash"), _attention(heads, groups, "te")
            deterministic = _attention(heads, groups, "flash", deterministic=True)
            for packed in (False, True):
                label = f"P{p} H{heads} G{groups} packed={packed}"
                tensors, params, doc_ids = _inputs(heads, groups, packed)
                full = [t.clone().requires_grad_() for t in tensors[:3]]
                expected = _reference_attention(*full, doc_ids)
                expected.backward(tensors[3])
                reference = [expected[rows].reshape(S // p, B, -1)] + [t.grad[rows] for t in full]
                got = _local_run(flash, tensors, params, rows)
                by_te = _local_run(te, tensors, params, rows)
                for name, ref in (("vs_fp32", reference), ("vs_te", by_te)):
                    errors = [_rel(a, b) for a, b in zip(got, ref)]
                    assert max(errors) < BF16_REL, (label, name, errors)
                    worst[name] = max(worst[name], *errors)
                once = _local_run(deterministic, tensors, params, rows)
                again = _local_run(deterministic, tensors, params, rows)
                assert all(torch.equal(a, b) for a, b in zip(once, again)), label
                errors = [_rel(a, b) for a, b in zip(once, reference)]
                assert max(errors) < BF16_REL, (label, "deterministic vs_fp32", errors)
        _report(test="attention_flash_bf16", P=p, **worst)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_flash_attention_matches_te_and_fp32_attention(world):
    spawn(_on_gpu, world, _attention_cases)


# ----------------------------------------------------------------------------- whole model


def _build(backend, weights=None):
    """The model with `backend` attention in TE's layers; `weights` (the te model's) copied in,
    so every backend and rank holds the same ones."""
    torch.manual_seed(SEED)
    model = build_gpt_model(_config(torch.bfloat16), V, S, backend=backend,
                            transformer_impl="transformer_engine",
                            position_embedding_type="rope",
                            share_embeddings_and_output_weights=False).cuda()
    if weights is not None:
        params = dict(model.named_parameters())
        assert params.keys() == weights.keys(), sorted(params.keys() ^ weights.keys())
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name])
    return model


def _per_sample(model, samples, packed):
    """Each sample's (loss sum, token count) and parameter grads at SP 1."""
    sums, grads = [], []
    for sample in samples:
        sums.append(torch.stack(_run(model, sample, 0, 1, packed)))
        grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return sums, grads


def _check(label, loss, ref_loss, grads, ref_grads, worst):
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    assert loss_err < BF16_REL, (label, loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), label
    errors = {name: _rel(grads[name], ref_grads[name]) for name in grads}
    assert max(errors.values()) < BF16_REL, (label, errors)
    worst["loss"] = max(worst["loss"], loss_err)
    worst["grad"] = max(worst["grad"], *errors.values())


def _model_case(packed):
    samples, worst = _samples(packed), {"loss": 0.0, "grad": 0.0}
    ps.initialize_model_parallel(ulysses_sp_size=1)  # SP 1: te, then flash, every sample
    cpu_compat.model_parallel_manual_seed(SEED)
    try:
        te = _build("te")
        weights = {n: p.detach().clone() for n, p in te.named_parameters()}
        ref_sums, ref_grads = _per_sample(te, samples, packed)
        del te
        flash = _build("flash", weights)
        sums, grads = _per_sample(flash, samples, packed)
        for i in range(len(samples)):
            _check(f"SP 1 sample {i} packed={packed}", (sums[i][0] / sums[i][1]).item(),
                   (ref_sums[i][0] / ref_sums[i][1]).item(), grads[i], ref_grads[i], worst)
    finally:
        ps.destroy_model_parallel()
    for sp in (2, 4):
        dims = ps.initialize_model_parallel(ulysses_sp_size=sp)
        cpu_compat.model_parallel_manual_seed(SEED)
        try:
            model = _build("flash", weights)
            sample = samples[ps.get_pure_data_parallel_rank()]
            loss_sum, count = _run(model, sample, ps.get_ulysses_sp_rank(), sp, packed)
            total = sum(ref_sums[:dims.dp])
            got = {}
            for name, param in model.named_parameters():
                got[name] = param.grad.detach().float().clone()
                dist.all_reduce(got[name], group=mpu.get_data_parallel_group())  # DP x SP
            expected = {n: sum(g[n] for g in ref_grads[:dims.dp]) for n in got}
            _check(f"SP {sp} packed={packed}", global_mean(torch.stack([loss_sum, count])),
                   (total[0] / total[1]).item(), got, expected, worst)
        finally:
            ps.destroy_model_parallel()
    _report(test="gpt_model_flash_vs_te", packed=packed, **worst)


def _model_cases(rank, world_size):
    for packed in (False, True):
        _model_case(packed)


def test_gpt_model_flash_matches_te_at_sp_1_2_4():
    spawn(_on_gpu, 4, _model_cases)


# ----------------------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sp_model, corpus_prefix):
    work = tmp_path_factory.mktemp("flash_runs")
    packed = packed_documents(corpus_prefix, sp_model, work / "cache")
    flash = ["--ulysses-attention-backend", "flash"]
    te = ["--ulysses-attention-backend", "te"]
    deterministic = ["--deterministic-mode", "--use-distributed-optimizer", *flash]
    return _wave([
        Run("te", [*MODEL, *RUN, *MOCK, *te], work),
        Run("flash", [*MODEL, *RUN, *MOCK, *flash], work),
        Run("flash_local_layers", [*MODEL, *RUN, *MOCK, *flash, "--transformer-impl", "local"],
            work),
        Run("flash_deterministic", [*MODEL, *RUN, *MOCK, *deterministic], work),
        Run("flash_deterministic_again", [*MODEL, *RUN, *MOCK, *deterministic], work),
        Run("packed_te", [*MODEL, *RUN, *packed, *te], work),
        Run("packed_flash", [*MODEL, *RUN, *packed, *flash], work),
    ])


@pytest.mark.parametrize("name, layers", [("flash", "transformer_engine"),
                                          ("flash_local_layers", "local"),
                                          ("flash_deterministic", "transformer_engine")])
def test_trainer_flash_logs_the_te_losses(runs, name, layers):
    run = runs[name].check()
    assert f"attention backend flash in {layers} layers" in run.output
    _close(run.losses, runs["te"].check().losses, f"{name} vs te")


def test_trainer_flash_packed_documents_log_the_te_losses(runs):
    te, flash = runs["packed_te"].check(), runs["packed_flash"].check()
    assert "attention backend flash" in flash.output
    assert flash.losses[8] < flash.losses[1]
    _close(flash.losses, te.losses, "packed flash (varlen) vs te (THD)")


def test_trainer_flash_deterministic_mode_is_bitwise_run_to_run(runs):
    once, again = runs["flash_deterministic"].check(), runs["flash_deterministic_again"].check()
    assert sorted(once.iterations) == list(range(1, 9))
    assert once.iterations == again.iterations  # loss, loss scale, grad norm: the same digits
    assert once.validation == again.validation and once.validation
