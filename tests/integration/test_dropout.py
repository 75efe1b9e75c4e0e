"""Dropout under Ulysses SP: every head group and every sequence shard draws its own masks, while
every rank still builds the same initial weights (CPU, gloo, fp32; two workers, one spawn).

Everything runs the training loop's own seeding: `loop.initialize_distributed` (it keeps the
workers' process group) and `model.build_model`. Layouts of the two
workers: SP 2, TP 2 (with and without --sequence-parallel) and SP 1 x DP 2 as the reference.

  * Attention dropout (`UlyssesAttention`, sdpa and local backends, SP 1, SP 2 and TP 2): with
    q = 0 every causal probability is 1/(t+1), and with v the one-hot of the key position the
    output is the dropout mask itself, scaled by 1/(1-p). Gathered over all head groups: no two
    heads drop the same positions (at SP 2 head h and head h + H/2 sit on different SP ranks, at
    TP 2 on different TP ranks), the kept entries are exactly 1/((t+1)(1-p)), and the dropped
    fraction is p within 4 standard errors.
  * Hidden, embedding and attention dropout in the whole model (local backend; F.dropout
    recorded): the hidden and embedding masks of the two sequence shards differ (SP 2, and TP 2
    with --sequence-parallel), TP ranks holding the same tokens share them (TP 2 without it:
    replicated activations need identical masks), the two ranks' attention masks (other heads)
    differ, also inside a --sequence-parallel block, and the dropped fractions are p.
  * Full activation recompute with dropout gives the same loss and grads as none (SP 2, TP 2
    with --sequence-parallel; sdpa and local): the recomputed forward draws the same masks.
  * Initial weights: identical on every rank and equal to SP 1's, from megatron-core's CPU
    initialization and from its GPU initialization path (the RNG tracker's model-parallel stream
    for TP-split weights), which runs on CPU too.
  * The live streams after the build: different across SP ranks and pipeline stages, the default
    generator equal across TP ranks, none of them replaying a weight-initialization stream; the
    CPU tracker nests forks of one stream as megatron-core's does.
  * Loss statistics: with attention and hidden dropout 0.1, the mean per-step loss over many
    forward passes of SP 2 equals SP 1's within 4 standard errors, and so does its spread; with
    dropout 0, SP 2's loss equals SP 1's.
"""

import dataclasses
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig

from megatron_ulysses.sp import parallel_state as ps
from megatron_ulysses.sp import rng
from megatron_ulysses.sp.attention import UlyssesAttention
from megatron_ulysses.data.sharding import get_batch_for_sp_rank
from megatron_ulysses.sp.loss import global_mean, masked_sum
from megatron_ulysses import cpu_compat
from megatron_ulysses.sp.parallel_state import ParallelDims
from megatron_ulysses.training import loop
from megatron_ulysses.training import model as model_builders
from megatron_ulysses.training.arguments import padded_vocab_size, parse_args

from distributed import spawn

WORLD = 2
SEED = 1234
V, S, B = 128, 32, 2
EOD, PAD = 1, 0
MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", str(S),
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--micro-batch-size", str(B), "--lr", "1e-3", "--train-iters", "1",
    "--mock-data", "--vocab-size", str(V), "--seed", str(SEED),
]
# (TP, SP, --sequence-parallel); DP = 2 / (TP x SP).
LAYOUTS = [(1, 1, False), (1, 2, False), (2, 1, False), (2, 1, True)]
STAT_PASSES = 300  # forward passes per layout for the loss statistics
# Weights large enough that dropout moves the loss (std 0.3 over passes; at the default 0.02 the
# untrained model's loss barely depends on its hidden states).
STAT_INIT_STD = 0.3


def _args(tp, sp, sequence_parallel=False, attention_dropout=0.0, hidden_dropout=0.0,
          backend="sdpa", init_std=0.02):
    argv = MODEL + ["--tensor-model-parallel-size", str(tp), "--ulysses-sp-size", str(sp),
                    "--init-method-std", str(init_std),
                    "--attention-dropout", str(attention_dropout),
                    "--hidden-dropout", str(hidden_dropout),
                    "--ulysses-attention-backend", backend]
    if sequence_parallel:
        argv.append("--sequence-parallel")
    config = parse_args(argv, world_size=WORLD)
    return config.with_padded_vocab_size(
        padded_vocab_size(V, config.model.make_vocab_size_divisible_by, tp))


def _init(args):
    """The loop's initialization on the workers' existing process group; it seeds python's
    `random` and numpy's global generator from the dropout seed too (a resume restores them)."""
    assert not ps.is_initialized()
    random.seed(os.getpid())
    np.random.seed(os.getpid())
    loop.initialize_distributed(args)
    base = rng.dropout_seed(SEED)
    assert random.getstate() == random.Random(base).getstate()
    assert np.random.rand() == np.random.RandomState(base).rand()


def _gather(tensor, group=None):
    """This tensor from every rank of `group` (default: the world), in group-rank order."""
    size = dist.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _dropped_fraction_ok(dropped, total, p, label):
    """The dropped fraction is p within 4 binomial standard errors."""
    fraction = dropped / total
    stderr = (p * (1 - p) / total) ** 0.5
    assert abs(fraction - p) < 4 * stderr, f"{label}: dropped {fraction:.4f}, p = {p}"
    return fraction


# ----------------------------------------------------------------------- attention dropout

HEADS, D = 8, 16  # D = attention length, so v can be the one-hot of the key position
ATTN_S = 16
ATTN_P = 0.25


def _attention_masks(backend, tp, sp, passes=2):
    """The attention-dropout keep masks of every head, `[passes, s, b, H, s]` bool, gathered
    over SP (tokens) and TP (heads), identical on every rank."""
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS, kv_channels=D,
        attention_dropout=ATTN_P, hidden_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
    )
    attention = UlyssesAttention(config, layer_number=1, backend=backend).train()
    local_heads = HEADS // tp
    sp_rank = ps.get_ulysses_sp_rank()
    rows = slice(sp_rank * ATTN_S // sp, (sp_rank + 1) * ATTN_S // sp)
    q = torch.zeros(ATTN_S, B, local_heads, D)
    v = torch.eye(ATTN_S)[:, None, None, :].expand(ATTN_S, B, local_heads, D).contiguous()
    causal = torch.ones(ATTN_S, ATTN_S, dtype=torch.bool).tril()[:, None, None, :]
    expected = 1 / (torch.arange(1, ATTN_S + 1.0) * (1 - ATTN_P))[:, None, None, None]
    masks = []
    for _ in range(passes):
        out = attention(q[rows], q[rows], v[rows]).view(ATTN_S // sp, B, local_heads, ATTN_S)
        out = torch.cat(_gather(out, ps.get_ulysses_sp_group()), dim=0)  # all tokens
        out = torch.cat(_gather(out, mpu.get_tensor_model_parallel_group()), dim=2)  # all heads
        kept = out != 0
        assert not (kept & ~causal).any(), "attention to future tokens"
        torch.testing.assert_close(out[kept], expected.expand_as(out)[kept], rtol=1e-6, atol=0)
        masks.append(kept)
    return torch.stack(masks)


def _check_attention_dropout(backend, tp, sp):
    label = f"attention dropout {backend} TP{tp} SP{sp}"
    masks = _attention_masks(backend, tp, sp)
    causal = torch.ones(ATTN_S, ATTN_S, dtype=torch.bool).tril()[:, None, None, :]
    causal = causal.expand_as(masks[0])
    # No two heads share a mask (a shared one has probability 2^-272 per pair and pass).
    for step, kept in enumerate(masks):
        per_head = [kept[:, :, h][causal[:, :, h]] for h in range(HEADS)]
        for h1 in range(HEADS):
            for h2 in range(h1 + 1, HEADS):
                assert not torch.equal(per_head[h1], per_head[h2]), (
                    f"{label}: heads {h1} and {h2} drop the same positions (pass {step})")
    assert not torch.equal(masks[0], masks[1]), f"{label}: two passes drew the same masks"
    total = int(causal.sum()) * len(masks)
    dropped = total - int((masks & causal).sum())
    return _dropped_fraction_ok(dropped, total, ATTN_P, label)


# -------------------------------------------------------------------------- model runs


def _sample():
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(2, V, (B, S + 1), generator=gen)
    return {
        "tokens": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "loss_mask": (torch.rand(B, S, generator=gen) > 0.2).float(),
        "position_ids": torch.arange(S).repeat(B, 1),
    }


def _shard(sample):
    return get_batch_for_sp_rank(sample, ps.get_ulysses_sp_rank(),
                                 ps.get_ulysses_sp_world_size(), PAD, EOD)


def _loss(model, batch):
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_sum, count = masked_sum(per_token, batch["loss_mask"])
    return global_mean(torch.stack([loss_sum.detach(), count]))


def _build(config, cpu_init=True):
    mcore_config = model_builders.transformer_config(config.model, config.dims)
    mcore_config.use_cpu_initialization = cpu_init
    return model_builders.build_model(config.model, config.optimizer, config.training.seed,
                                      mcore_config)


class _DropoutRecorder:
    """Records the keep mask of every F.dropout call in training mode (hidden and embedding
    dropout; the local backend's attention dropout too)."""

    def __init__(self):
        self.masks, self.original = [], F.dropout

    def __enter__(self):
        def recording(input, p=0.5, training=True, inplace=False):
            out = self.original(input, p, training, inplace)
            if training and p > 0:
                self.masks.append((out != 0).detach().clone())
            return out

        F.dropout = recording
        return self

    def __exit__(self, *exc):
        F.dropout = self.original
        return False


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _check_weights(label, weights, reference=None):
    """Every rank holds the same weights (and, given, the reference's)."""
    for name, weight in weights.items():
        for other in _gather(weight):
            assert torch.equal(other, weight), f"{label}: {name} differs across ranks"
        if reference is not None:
            assert torch.equal(weight, reference[name]), f"{label}: {name} differs from SP 1"


def _check_model_dropout(args, tp, sp, sequence_parallel):
    """The dropout masks of one forward pass (local backend, so attention dropout is an F.dropout
    too), per rank, then across ranks: hidden and embedding masks `[s/(SP·TP'), b, h]` (TP' = TP
    with --sequence-parallel), attention masks `[b, H/(TP·SP), s, s]` of each layer."""
    label = f"dropout in the model TP{tp} SP{sp}{' seq-par' if sequence_parallel else ''}"
    model = _build(args)
    with _DropoutRecorder() as recorder, torch.no_grad():
        _loss(model, _shard(_sample()))
    local_s = S // sp // (tp if sequence_parallel else 1)
    hidden_shape, attention_shape = (local_s, B, 64), (B, 8 // (tp * sp), S, S)
    # embedding; then per layer attention probabilities, self-attention and MLP output
    assert [tuple(m.shape) for m in recorder.masks] == [hidden_shape] + 2 * [
        attention_shape, hidden_shape, hidden_shape], label
    hidden = [m for m in recorder.masks if m.shape == hidden_shape]
    attention = [m for m in recorder.masks if m.shape == attention_shape]
    total = sum(m.numel() for m in hidden)
    fractions = [_dropped_fraction_ok(total - sum(int(m.sum()) for m in hidden), total,
                                      args.model.hidden_dropout, f"{label}: hidden")]
    causal = torch.ones(S, S, dtype=torch.bool).tril().expand(attention_shape)
    total = int(causal.sum()) * len(attention)
    assert not any((m & ~causal).any() for m in attention), label
    fractions.append(_dropped_fraction_ok(total - sum(int(m.sum()) for m in attention), total,
                                          args.model.attention_dropout, f"{label}: attention"))
    if sp == 1 and tp == 1:
        return fractions  # DP ranks: different samples in training, no constraint
    for index, mask in enumerate(hidden):
        mine, other = _gather(mask)
        if tp > 1 and not sequence_parallel:  # TP ranks hold replicas of the same tokens
            assert torch.equal(mine, other), f"{label}: TP replicas drop differently ({index})"
        else:
            assert not torch.equal(mine, other), (
                f"{label}: the two sequence shards share hidden dropout mask {index}")
    for index, mask in enumerate(attention):  # other heads on the other rank
        assert not torch.equal(*_gather(mask)), (
            f"{label}: the two head groups share attention dropout mask {index}")
    return fractions


def _check_live_streams(tp, sp):
    """After the build: the default generator differs across SP ranks but not TP ranks, the
    tracker's model-parallel stream differs across both, and neither replays the stream the
    weights were drawn from."""
    draw = torch.rand(16)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(16)
    for init_seed in (SEED, SEED + 2718 + mpu.get_tensor_model_parallel_rank()):
        fresh = torch.rand(16, generator=torch.Generator().manual_seed(init_seed))
        assert not torch.equal(draw, fresh) and not torch.equal(tracked, fresh)
    draws, tracked_draws = _gather(draw), _gather(tracked)
    if sp > 1:
        assert not torch.equal(*draws) and not torch.equal(*tracked_draws)
    if tp > 1:
        assert torch.equal(*draws) and not torch.equal(*tracked_draws)


def _grads_with_recompute(args, recompute):
    """Loss and main grads of one forward/backward with dropout, from freshly seeded dropout
    streams, with or without full recompute (which must replay the forward's masks)."""
    model = _build(dataclasses.replace(args, model=dataclasses.replace(
        args.model, recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None)))
    rng.seed_dropout_streams(SEED)
    batch = _shard(_sample())
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_sum, _ = masked_sum(per_token, batch["loss_mask"])
    loss_sum.backward()
    return loss_sum.detach(), {n: p.main_grad.clone() for n, p in model.named_parameters()}


def _check_recompute_replays_masks(args, label):
    """Full recompute with dropout: the same loss and grads as without, so the recomputed
    forward drew the same hidden and attention masks (under --sequence-parallel the block runs
    under model-parallel-rng and attention must not fork it again: a fork nested there would
    replay the block's entry state on recompute)."""
    plain_loss, plain = _grads_with_recompute(args, False)
    loss, grads = _grads_with_recompute(args, True)
    assert torch.equal(loss, plain_loss), label
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-7,
                                   msg=f"{label}: recompute grad {name}")


def _check_nested_forks():
    """The CPU tracker, as megatron-core's: a fork inside a fork of the same stream (attention
    inside a --sequence-parallel block) continues it, and the default generator is untouched."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states, default = tracker.get_states(), torch.get_rng_state()
    with tracker.fork():
        flat = torch.rand(12)
    tracker.set_states(states)
    with tracker.fork():
        first = torch.rand(4)
        with tracker.fork():
            inner = torch.rand(4)
        last = torch.rand(4)
    assert torch.equal(torch.cat([first, inner, last]), flat)
    assert torch.equal(torch.get_rng_state(), default)


def _check_pipeline_stages():
    """PP 2 (the loop's initialization only: the CLI takes PP > 1 on GPU only): the two stages'
    dropout streams differ, the default generator's and model-parallel-rng's."""
    _init(dataclasses.replace(_args(1, 1), dims=ParallelDims(world_size=WORLD, pp=2)))
    try:
        assert mpu.get_pipeline_model_parallel_rank() == dist.get_rank()
        draw = torch.rand(16)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            tracked = torch.rand(16)
        assert not torch.equal(*_gather(draw)) and not torch.equal(*_gather(tracked))
    finally:
        ps.destroy_model_parallel()


def _loss_statistics(args, sample):
    model = _build(args)
    batch = _shard(sample)
    with torch.no_grad():
        losses = torch.tensor([_loss(model, batch) for _ in range(STAT_PASSES)],
                              dtype=torch.float64)
    return losses


# ------------------------------------------------------------------------------ cases


def _cases(rank, world_size):
    cpu_compat.install()
    report = {}
    sp1_weights = {}
    sample = _sample()
    for tp, sp, sequence_parallel in LAYOUTS:
        tag = f"TP{tp} SP{sp}{' seq-par' if sequence_parallel else ''}"
        args = _args(tp, sp, sequence_parallel, attention_dropout=0.3, hidden_dropout=0.3,
                     backend="local")
        _init(args)
        try:
            _check_nested_forks()
            if not sequence_parallel:
                for backend in ("sdpa", "local"):
                    report[f"attention {backend} {tag}"] = _check_attention_dropout(
                        backend, tp, sp)
            report[f"model hidden, attention {tag}"] = _check_model_dropout(
                args, tp, sp, sequence_parallel)
            if sp > 1 or sequence_parallel:
                for backend in ("sdpa", "local"):
                    recompute_args = _args(tp, sp, sequence_parallel, attention_dropout=0.3,
                                           hidden_dropout=0.3, backend=backend, init_std=0.3)
                    _check_recompute_replays_masks(recompute_args, f"{backend} {tag}")
            if tp == 1:
                for cpu_init in (True, False):
                    weights = _weights(_build(args, cpu_init))
                    if sp == 1:
                        sp1_weights[cpu_init] = weights
                    _check_weights(f"{tag} cpu_init={cpu_init}", weights,
                                   None if sp == 1 else sp1_weights[cpu_init])
                    _check_live_streams(tp, sp)
            else:
                _build(args, cpu_init=False)
                _check_live_streams(tp, sp)
        finally:
            ps.destroy_model_parallel()

    _check_pipeline_stages()

    # Loss statistics: SP 1 (both ranks run the whole sample) against SP 2, same seed.
    stats, exact = {}, {}
    for sp in (1, 2):
        for dropout in (0.0, 0.1):
            args = _args(1, sp, attention_dropout=dropout, hidden_dropout=dropout,
                         init_std=STAT_INIT_STD)
            _init(args)
            try:
                if dropout:
                    stats[sp] = _loss_statistics(args, sample)
                else:
                    model = _build(args)
                    with torch.no_grad():
                        exact[sp] = _loss(model, _shard(sample))
            finally:
                ps.destroy_model_parallel()
    torch.testing.assert_close(exact[2], exact[1], rtol=1e-6, atol=0)
    mean = {sp: stats[sp].mean().item() for sp in stats}
    std = {sp: stats[sp].std().item() for sp in stats}
    stderr = (std[1] ** 2 / STAT_PASSES + std[2] ** 2 / STAT_PASSES) ** 0.5
    z = (mean[2] - mean[1]) / stderr
    # A sample std is off by about std / sqrt(2 (N - 1)), a ratio of two by 1 / sqrt(N - 1).
    ratio = std[2] / std[1]
    ratio_err = 1 / (STAT_PASSES - 1) ** 0.5
    if rank == 0:
        print(f"\n{report}\nloss without dropout {exact}; with 0.1 over {STAT_PASSES} passes: "
              f"SP1 {mean[1]:.5f} +- {std[1]:.5f}, SP2 {mean[2]:.5f} +- {std[2]:.5f}, "
              f"z = {z:.2f}, std ratio {ratio:.3f} (+- {ratio_err:.3f})")
    assert abs(z) < 4, f"mean loss SP2 {mean[2]} vs SP1 {mean[1]}: {z:.2f} standard errors"
    assert abs(ratio - 1) < 4 * ratio_err, f"loss spread SP2/SP1 = {ratio:.3f}"


def test_dropout_seeds_are_distinct():
    """Over TP, SP, PP ranks < 8: the default generator's dropout seed is one per (SP, PP), the
    tracker's one per (TP, SP, PP), and none is a weight-init seed (megatron-core's seeding
    adds 2718 + TP rank for model-parallel-rng and 1024 + ... for the expert stream)."""
    init = {SEED} | {SEED + 2718 + tp for tp in range(8)} | {SEED + 1024 + tp for tp in range(8)}
    default, tracked = set(), set()
    for sp in range(8):
        for pp in range(8):
            base = rng.dropout_seed(SEED, sp_rank=sp, pp_rank=pp)
            default.add(base)
            tracked |= {base + 2718 + tp for tp in range(8)} | {base + 1024 + tp
                                                                 for tp in range(8)}
    assert len(default) == 64 and len(tracked) == 2 * 512
    assert not (default & tracked) and not ((default | tracked) & init)


def test_dropout_masks_and_statistics_under_sp():
    spawn(_cases, WORLD)
