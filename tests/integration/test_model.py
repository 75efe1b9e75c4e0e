"""Whole-GPTModel equivalence: a Ulysses-parallel model gives the unsharded model's loss and grads.

The model has everything that interacts with sequence sharding: RoPE (global positions per shard),
GQA with 8 heads over 2 kv groups (kv heads replicated when G < P), SwiGLU, RMSNorm, 2 layers, no
bias (fp32, CPU). Four gloo workers run every case in one spawn. For each case they first build the
model at TP = SP = 1 (pure DP 4) and run every DP sample on the full sequence, in-process, as the
reference; then, for each parallel layout, destroy and re-initialize the parallel state, build the
same model (same seed, so the same master weights), feed each rank its `get_batch_for_sp_rank`
shard of its pure-DP rank's sample and compare:

  * the per-token loss of the rank's shard, and the global per-token loss
    sum(l * mask) / sum(mask) over all ranks (`megatron_ulysses.sp.loss`), on every rank;
  * every parameter gradient (same parameter names), summed over megatron-core's DP x SP group,
    over TP too for `sequence_parallel` (norm) params, divided by the global token count, against
    the reference grad, or its TP shard for tensor-parallel params.

Layouts (4 processes): DP 2 x SP 2, SP 4 (kv heads replicated), TP 2 x SP 2 with sequence
parallelism (kv heads replicated; torch RMSNorm on TP-sequence shards); `sdpa` and `local`
backends, whose references must also agree with each other. Packed documents (cu_seqlens,
`reset_attention_mask`): SP equals SP = 1 equals each document run alone. Learned absolute
positions: SP shards carry global (or reset) position ids.

Uneven heads (H % P != 0; SP rank r attends over ceil(H/P) heads for r < H % P, else floor), with
RoPE, plain and packed, each in its own spawn: 28 / 4 heads at SP 8 and at TP 2 x SP 4 (8
processes), 14 / 2 and 7 / 7 at SP 4 (4), 32 / 8 at SP 3 (3).
"""

from typing import NamedTuple
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from distributed import spawn

from megatron_ulysses import cpu_compat
from megatron_ulysses.sp import all_to_all
from megatron_ulysses.sp import parallel_state as ps
from megatron_ulysses.sp.backends import document_spans
from megatron_ulysses.data.sharding import get_batch_for_sp_rank
from megatron_ulysses.sp.layer_specs import build_gpt_model
from megatron_ulysses.sp.loss import global_mean, masked_sum
import pytest

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

WORLD = 4
V, HIDDEN, FFN, B = 128, 64, 96, 2
MAX_POSITIONS = 32
EOD, PAD = 1, 0
SEED = 1234
# Observed (fp32, CPU): losses within 2e-7 relative, grads (up to 0.1) within 1.4e-7 absolute.
LOSS_TOL = dict(rtol=1e-6, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=3e-7)

# (TP, SP) layouts; DP = 4 / (TP x SP).
LAYOUTS = [(1, 2), (1, 4), (2, 2)]
BACKENDS = ("sdpa", "local")

# Per DP sample, per row: document lengths (30 tokens; the last document of a row has no EOD, as
# when GPTDataset cuts a document). Documents cross the SP shard boundaries at 15 (SP 2) and
# 8, 16, 24 (SP 4, with 2 padding tokens: 30 -> 32).
PACKED_DOCS = [
    [[5, 13, 9, 3], [7, 7, 16]],
    [[30], [4, 11, 1, 14]],
]


class Heads(NamedTuple):
    """Query heads, kv heads (query groups) and head dim of the test model."""

    heads: int
    groups: int
    head_dim: int


EVEN = Heads(8, 2, 8)


def _config(tp: int, shape: Heads = EVEN) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim, ffn_hidden_size=FFN,
        gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.1, use_cpu_initialization=True, apply_rope_fusion=False,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
    )


def _build(tp, backend, position, tied, shape=EVEN):
    torch.manual_seed(SEED)  # every rank and every layout: the same master weights
    return build_gpt_model(
        _config(tp, shape), V, MAX_POSITIONS, backend=backend, position_embedding_type=position,
        share_embeddings_and_output_weights=tied,
    )


# ------------------------------------------------------------------------------------ data


def _sample(text: torch.Tensor, gen: torch.Generator) -> dict:
    """`[b, s+1]` token stream -> GPTDataset-like batch (labels shifted, ~20% loss masked, so
    ranks hold different token counts)."""
    seq_len = text.shape[1] - 1
    return {
        "tokens": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "loss_mask": (torch.rand(B, seq_len, generator=gen) > 0.2).float(),
        "position_ids": torch.arange(seq_len).repeat(B, 1),
    }


def _plain_samples(seq_len=32):
    """One `[B, seq_len]` sample per DP rank; no EOD, so one document per row."""
    gen = torch.Generator().manual_seed(0)
    return [_sample(torch.randint(2, V, (B, seq_len + 1), generator=gen), gen) for _ in range(2)]


def _packed_samples():
    """One `[B, 30]` sample of packed documents per DP rank (`PACKED_DOCS`)."""
    gen = torch.Generator().manual_seed(1)
    samples = []
    for rows in PACKED_DOCS:
        text = torch.randint(2, V, (B, 31), generator=gen)
        for row, lengths in enumerate(rows):
            ends = torch.tensor(lengths).cumsum(0)[:-1]
            text[row, ends - 1] = EOD
        samples.append(_sample(text, gen))
    return samples


# ------------------------------------------------------------------------ model runs


def _forward(model, batch):
    """-> per-token loss `[b, s]`, sum(l * mask), sum(mask)."""
    packed = None
    if "cu_seqlens" in batch:
        cu, max_len = batch["cu_seqlens"], batch["max_seqlen"]
        packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max_len, max_seqlen_kv=max_len)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                      packed_seq_params=packed)
    loss_sum, count = masked_sum(per_token, batch["loss_mask"])
    return per_token, loss_sum, count


def _grads(model):
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    model.zero_grad(set_to_none=True)
    return grads


def _init(tp, sp):
    """Initialize the parallel state for (TP, SP) and check megatron-core sees it (a fresh state
    after `ps.destroy_model_parallel`)."""
    assert not ps.is_initialized() and not mpu.model_parallel_is_initialized()
    dims = ps.initialize_model_parallel(tensor_model_parallel_size=tp, ulysses_sp_size=sp)
    cpu_compat.model_parallel_manual_seed(SEED)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (dims.tp, dims.sp, dims.dp) == (tp, sp, world // (tp * sp))
    assert mpu.get_tensor_model_parallel_world_size() == tp
    assert mpu.get_tensor_model_parallel_rank() == rank % tp
    assert mpu.get_context_parallel_world_size() == 1
    mcore_dp = dist.get_process_group_ranks(mpu.get_data_parallel_group())
    assert mcore_dp == list(range(rank % tp, world, tp)), mcore_dp  # DP' = DP x SP
    sp_ranks = dist.get_process_group_ranks(ps.get_ulysses_sp_group())
    assert len(sp_ranks) == sp and set(sp_ranks) <= set(mcore_dp)
    assert dist.get_process_group_ranks(ps.get_ulysses_sp_group()) == sp_ranks
    assert ps.get_ulysses_sp_rank() == sp_ranks.index(rank)
    return dims


def _destroy():
    """`ps.destroy_model_parallel` tears down our groups and megatron-core's state."""
    ours = [ps.get_ulysses_sp_group(), ps.get_pure_data_parallel_group()]
    ps.destroy_model_parallel()
    assert not ps.is_initialized() and not mpu.model_parallel_is_initialized()
    assert mpu.get_tensor_model_parallel_group(check_initialized=False) is None
    assert mpu.get_model_parallel_group(check_initialized=False) is None
    for group in ours:  # really destroyed (megatron-core's own destroy checks the same map)
        assert group not in dist.distributed_c10d._world.pg_map


def _reference(model, samples, batch_kwargs, per_document):
    """At TP = SP = 1, each sample on the full sequence: per sample, the per-token loss, the
    (loss sum, count) and the grads of the loss sum; with `per_document`, the same sums and grads
    from running each document of the sample alone."""
    ref = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
           "per_token": [], "sums": [], "grads": [], "doc_sums": [], "doc_grads": []}
    for sample in samples:
        full = get_batch_for_sp_rank(sample, 0, 1, PAD, EOD, **batch_kwargs)
        per_token, loss_sum, count = _forward(model, full)
        loss_sum.backward()
        ref["per_token"].append(per_token.detach())
        ref["sums"].append(torch.stack([loss_sum.detach(), count]))
        ref["grads"].append(_grads(model))
        if per_document:
            doc_sum = torch.zeros(2)
            for row, start, end in document_spans(full["cu_seqlens"], full["tokens"].shape[1]):
                doc = {key: full[key][row:row + 1, start:end]
                       for key in ("tokens", "labels", "loss_mask", "position_ids")}
                _, loss_sum, count = _forward(model, doc)
                loss_sum.backward()
                doc_sum += torch.stack([loss_sum.detach(), count])
            ref["doc_sums"].append(doc_sum)
            ref["doc_grads"].append(_grads(model))
    return ref


def _combine(sums, grads, num_samples):
    """Global per-token loss and grads over the first `num_samples` DP samples."""
    total = sum(sums[:num_samples])
    loss = total[0] / total[1]
    combined = {name: sum(g[name] for g in grads[:num_samples]) / total[1] for name in grads[0]}
    return loss, combined


def _tp_shard(full, param, tp, tp_rank):
    """This TP rank's part of a full (TP = 1) tensor, as megatron-core's CPU initialization
    splits the master weight: `partition_stride` contiguous blocks along `partition_dim`, every
    TP-th one (stride 2 for SwiGLU's fc1 = [gate; up]: each rank holds [gate_r; up_r]). Fused QKV
    needs no stride: its rows are grouped by query group, [q heads, k, v] per group."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    return torch.cat(full.chunk(tp * stride, dim=dim)[tp_rank::tp], dim=dim)


class _KvHeadsSent:
    """Records, per fused q/k/v exchange, how many kv heads (over all destinations) it sends."""

    def __init__(self):
        self.sent, original = [], all_to_all.pack_qkv

        def recording(q, k, v, layout):
            self.sent.append(sum(len(layout.kv_heads(j)) for j in range(layout.sp_size)))
            return original(q, k, v, layout)

        self.patch = mock.patch.object(all_to_all, "pack_qkv", recording)

    def __enter__(self):
        self.patch.start()
        return self

    def __exit__(self, *exc):
        self.patch.stop()
        return False


def _sum_over_dp_and_sp(tensor):
    """Sum over megatron-core's DP' = DP x SP group, as its DDP reduces gradients."""
    dist.all_reduce(tensor, group=mpu.get_data_parallel_group())
    return tensor


def _check_model(label, model, dims, samples, batch_kwargs, ref):
    """This rank's shard through the parallel `model` against the TP = SP = 1 reference."""
    tp, sp = dims.tp, dims.sp
    tp_rank, sp_rank = mpu.get_tensor_model_parallel_rank(), ps.get_ulysses_sp_rank()
    dp_rank = ps.get_pure_data_parallel_rank()
    params = dict(model.named_parameters())
    assert params.keys() == ref["weights"].keys(), label
    for name, param in params.items():  # the TP layout of the master weights
        torch.testing.assert_close(
            param.detach(), _tp_shard(ref["weights"][name], param, tp, tp_rank),
            rtol=0, atol=0, msg=f"{label}: weight {name}")

    shard = get_batch_for_sp_rank(samples[dp_rank], sp_rank, sp, PAD, EOD, **batch_kwargs)
    with _KvHeadsSent() as kv_heads:
        per_token, loss_sum, count = _forward(model, shard)
        loss_sum.backward()
    # One fused exchange per layer; every rank receives a kv head, so with fewer kv heads than
    # SP ranks some go to several ranks (replication); even heads send max(G, P) kv heads.
    assert len(kv_heads.sent) == (model.config.num_layers if sp > 1 else 0), label
    heads, groups = model.config.num_attention_heads // tp, model.config.num_query_groups // tp
    even = heads % sp == 0 and (groups % sp == 0 or sp % groups == 0)
    for sent in kv_heads.sent:
        assert sent == max(groups, sp) if even else sent >= max(groups, sp), (label, sent)

    # This shard's per-token loss (padding columns past the sample's length excluded).
    seq_len = samples[dp_rank]["tokens"].shape[1]
    local = per_token.shape[1]
    start, end = sp_rank * local, min((sp_rank + 1) * local, seq_len)
    torch.testing.assert_close(per_token.detach()[:, :end - start],
                               ref["per_token"][dp_rank][:, start:end], **LOSS_TOL,
                               msg=f"{label}: per-token loss")

    ref_loss, ref_grads = _combine(ref["sums"], ref["grads"], dims.dp)
    loss = global_mean(torch.stack([loss_sum.detach(), count]))
    torch.testing.assert_close(torch.tensor(loss), ref_loss, **LOSS_TOL, msg=f"{label}: loss")
    num_tokens = _sum_over_dp_and_sp(count.clone())
    for name, param in params.items():
        grad = _sum_over_dp_and_sp(param.grad.detach().clone())
        if tp > 1 and getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=mpu.get_tensor_model_parallel_group())
        expected = _tp_shard(ref_grads[name], param, tp, tp_rank)
        torch.testing.assert_close(grad / num_tokens, expected, **GRAD_TOL,
                                   msg=f"{label}: grad {name}")
    if tp > 1:  # the norms really run on sequence-parallel shards
        norm_params = [n for n in params if "layernorm" in n]
        assert norm_params and all(params[n].sequence_parallel for n in norm_params)


def _run_case(name, position, tied, samples, layouts, batch_kwargs=None, per_document=False,
              shape=EVEN):
    """One model and data set on both backends: the TP = SP = 1 references agree across backends
    (and, packed, with each document run alone), then every layout matches its backend's
    reference. One parallel-state initialization per layout serves both backends."""
    batch_kwargs = batch_kwargs or {}
    _init(1, 1)
    try:
        refs = {backend: _reference(_build(1, backend, position, tied, shape), samples,
                                    batch_kwargs, per_document)
                for backend in BACKENDS}
    finally:
        _destroy()
    first = _combine(refs[BACKENDS[0]]["sums"], refs[BACKENDS[0]]["grads"], len(samples))
    for backend, ref in refs.items():
        checks = [(f"{BACKENDS[0]} reference", first)] if backend != BACKENDS[0] else []
        if per_document:
            # SP = 1 on packed documents == each document alone: no attention across documents.
            checks.append(("per-document", _combine(ref["doc_sums"], ref["doc_grads"],
                                                    len(samples))))
        loss, grads = _combine(ref["sums"], ref["grads"], len(samples))
        for what, (other_loss, other_grads) in checks:
            label = f"{name} {backend} reference vs {what}"
            torch.testing.assert_close(loss, other_loss, **LOSS_TOL, msg=f"{label}: loss")
            assert grads.keys() == other_grads.keys(), label
            for param in grads:
                torch.testing.assert_close(grads[param], other_grads[param], **GRAD_TOL,
                                           msg=f"{label}: grad {param}")
    for tp, sp in layouts:
        dims = _init(tp, sp)
        try:
            for backend in BACKENDS:
                label = (f"{name} {shape.heads}/{shape.groups} heads {backend} TP{tp} SP{sp} "
                         f"DP{dims.dp}")
                _check_model(label, _build(tp, backend, position, tied, shape), dims, samples,
                             batch_kwargs, refs[backend])
        finally:
            _destroy()


PACKED = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def _model_cases(rank, world_size):
    cpu_compat.install()
    _run_case("rope", "rope", False, _plain_samples(), LAYOUTS)
    _run_case("packed rope", "rope", False, _packed_samples(), [(1, 2), (1, 4)], PACKED,
              per_document=True)
    _run_case("learned_absolute", "learned_absolute", True, _plain_samples(), [(1, 2)])
    _run_case("packed learned_absolute", "learned_absolute", True, _packed_samples(), [(1, 2)],
              PACKED, per_document=True)
    _run_case("none", "none", False, _plain_samples(), [(1, 2)])  # NoPE: no position input


def test_gpt_model_matches_unsharded_model():
    spawn(_model_cases, WORLD)


# Uneven heads (H % P != 0): RoPE, both backends, against SP = 1; one DP sample; plain and packed
# documents (SP 1 on packed documents equals each document alone: checked above).
def _uneven_cases_8(rank, world_size):
    """28 heads / 4 kv heads (Qwen2-7B's ratio) at SP 8 (3 or 4 heads per rank, kv heads split
    over up to 3 ranks) and at TP 2 x SP 4 (14 heads per TP rank: 4, 4, 3, 3)."""
    cpu_compat.install()
    shape = Heads(28, 4, 4)
    _run_case("rope", "rope", False, _plain_samples()[:1], [(1, 8), (2, 4)], shape=shape)
    _run_case("packed rope", "rope", False, _packed_samples()[:1], [(1, 8)], PACKED,
              shape=shape)


def _uneven_cases_4(rank, world_size):
    """14 / 2 heads at SP 4 (kv head 0 on ranks 0 and 1, head 1 on ranks 1-3); 7 / 7 at SP 4
    (MHA with H/P < P, DeepSpeed's uneven case)."""
    cpu_compat.install()
    _run_case("rope", "rope", False, _plain_samples()[:1], [(1, 4)], shape=Heads(14, 2, 4))
    _run_case("packed rope", "rope", False, _packed_samples()[:1], [(1, 4)], PACKED,
              shape=Heads(7, 7, 4))


def _uneven_cases_3(rank, world_size):
    """32 / 8 heads at SP 3 (11, 11, 10 heads; 3, 4, 3 kv heads), 32 tokens padded to 33, and
    packed documents (30 tokens)."""
    cpu_compat.install()
    shape = Heads(32, 8, 2)
    _run_case("rope", "rope", False, _plain_samples()[:1], [(1, 3)], shape=shape)
    _run_case("packed rope", "rope", False, _packed_samples()[:1], [(1, 3)], PACKED,
              shape=shape)


def test_uneven_heads_sp8_and_tp2_sp4():
    spawn(_uneven_cases_8, 8)


def test_uneven_heads_sp4():
    spawn(_uneven_cases_4, 4)


def test_uneven_heads_sp3():
    spawn(_uneven_cases_3, 3)
