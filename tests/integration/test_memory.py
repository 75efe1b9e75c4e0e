"""ALST memory features against their plain megatron-core counterparts (fp32, CPU).

TiledMLP vs MLP, tiled loss vs GPTModel's untiled loss, activation offload vs none:
outputs and every gradient must match; tiling / offloading must really happen.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from distributed import free_port

from megatron_ulysses import cpu_compat
from megatron_ulysses.memory.activation_offload import (
    OffloadStats,
    enable_activation_offload,
    offload_saved_activations,
)
from megatron_ulysses.memory.tiled_loss import (
    TiledLossGPTModelMixin,
    resolve_loss_tiles,
    tiled_cross_entropy,
)
from megatron_ulysses.memory.tiled_mlp import (
    TiledMLP,
    mark_recompute_chunk_ends,
    resolve_mlp_tiles,
    tiled_mlp_layer_spec,
)

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

S, B, H, V = 20, 2, 16, 64


class TiledLossGPTModel(TiledLossGPTModelMixin, GPTModel):
    pass


@pytest.fixture(scope="module", autouse=True)
def megatron_cpu():
    cpu_compat.install()
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _config(swiglu=False, **overrides):
    kwargs = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if swiglu:
        kwargs.update(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _gpt(config, model_cls=GPTModel, layer_spec=None, **kwargs):
    cpu_compat.model_parallel_manual_seed(1234)
    return model_cls(
        config,
        layer_spec or get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=V,
        max_sequence_length=S,
        position_embedding_type="learned_absolute",
        **kwargs,
    )


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    positions = torch.arange(S).expand(B, S)
    # Explicit causal mask (True = masked): megatron's default one is built on CUDA.
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    return ids, positions, mask, labels


def _loss_and_grads(model, batch, weights):
    ids, positions, mask, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(ids, positions, mask, labels=labels)
    (loss * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same_loss_and_grads(ref, got, exact=False):
    tol = dict(rtol=0, atol=0) if exact else {}
    torch.testing.assert_close(got[0], ref[0], **tol)
    assert got[1].keys() == ref[1].keys() and len(ref[1]) > 0
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], **tol, msg=name)


def _loss_weights():
    return torch.rand(B, S, generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------- TiledMLP


def _mlp_pair(config, num_tiles):
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(0)
    plain = MLP(config, submodules, ffn_hidden_size=config.ffn_hidden_size)
    tiled = TiledMLP(config, submodules, num_tiles=num_tiles,
                     ffn_hidden_size=config.ffn_hidden_size)
    tiled.load_state_dict(plain.state_dict())
    return plain, tiled


def _mlp_run(mlp, x, grad_out):
    mlp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, bias = mlp(x)
    (out * grad_out).sum().backward()
    if bias is not None:
        (bias * grad_out.sum((0, 1))).sum().backward()
    return out, bias, x.grad, {n: p.grad for n, p in mlp.named_parameters()}


@pytest.mark.parametrize("swiglu", [True, False], ids=["swiglu", "gelu_bias"])
@pytest.mark.parametrize("num_tiles", [1, 3, "auto"])
def test_tiled_mlp_matches_mlp(swiglu, num_tiles):
    config = _config(swiglu)
    plain, tiled = _mlp_pair(config, num_tiles)
    gen = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)

    fc1_rows = []
    tiled.linear_fc1.register_forward_hook(lambda m, args, out: fc1_rows.append(args[0].shape[0]))
    ref, got = _mlp_run(plain, x, grad_out), _mlp_run(tiled, x, grad_out)

    torch.testing.assert_close(got[0], ref[0])
    if swiglu:
        assert ref[1] is None and got[1] is None
    else:
        assert got[1] is tiled.linear_fc2.bias
        torch.testing.assert_close(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2])
    assert got[3].keys() == ref[3].keys()
    for name in ref[3]:
        torch.testing.assert_close(got[3][name], ref[3][name], msg=name)
    # Forward then backward each visit every tile once; S = 20 is not a multiple of 3.
    expected_rows = {1: [20], 3: [7, 7, 6], "auto": [10, 10]}[num_tiles]
    assert sorted(fc1_rows) == sorted(expected_rows * 2)  # auto: ceil(20 / 16) = 2 tiles


def test_tiled_mlp_hands_each_param_grad_to_autograd_once():
    """Each parameter's AccumulateGrad (where DDP's and Megatron-FSDP's hooks sit) runs once per
    backward with the sum over tiles, as without tiling: Megatron-FSDP's hook copies each
    gradient it sees into its buffer, so a call per tile would keep only the last tile's."""
    plain, tiled = _mlp_pair(_config(), 3)
    calls = {n: 0 for n, _ in tiled.named_parameters()}

    def counter(name):
        return lambda _: calls.update({name: calls[name] + 1})

    for name, p in tiled.named_parameters():
        p.register_post_accumulate_grad_hook(counter(name))
    x = torch.randn(S, B, H, requires_grad=True)
    tiled(x)[0].sum().backward()
    plain(x)[0].sum().backward()
    # fc2.bias is returned whole (not through the tiles) and unused here.
    assert calls == {n: (0 if n == "linear_fc2.bias" else 1) for n in calls}
    for (name, p), q in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


class _FusedWgradLinear(torch.autograd.Function):
    """What Transformer Engine's linear does under gradient-accumulation fusion: the weight
    gradient goes into `weight.main_grad`, `grad_added_to_main_grad` is set, and autograd gets
    a placeholder (garbage) gradient."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        weight.main_grad.add_(grad.flatten(0, -2).t() @ x.flatten(0, -2))
        weight.grad_added_to_main_grad = True
        return grad @ weight, torch.full_like(weight, float("nan"))


def test_tiles_leave_transformer_engines_fused_weight_gradients_in_main_grad():
    from megatron_ulysses.memory.tiling import sequence_tiled_recompute

    weight = torch.nn.Parameter(torch.randn(4, 6))
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(4, 6), False
    x = torch.randn(10, 2, 6, requires_grad=True)
    seen = []
    weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(p.grad_added_to_main_grad))
    out = sequence_tiled_recompute(lambda t, _: _FusedWgradLinear.apply(t, weight), x, 3,
                                   [weight])
    out.square().sum().backward()
    expected = x.detach().requires_grad_()
    (expected @ weight.detach().t()).square().sum().backward()
    w = weight.detach().requires_grad_()
    (x.detach() @ w.t()).square().sum().backward()
    torch.testing.assert_close(weight.main_grad, w.grad)  # every tile's, summed by TE's path
    torch.testing.assert_close(x.grad, expected.grad)
    assert seen == [True]  # one call; the hook skips the placeholder, as megatron-core's does


def test_tiles_add_to_ddps_main_grad_beside_a_tied_use():
    """megatron-core DDP's parameters: each tile's gradient goes to `main_grad` and autograd gets
    zeros, which DDP's hook (emulated: it adds `grad` unless `grad_added_to_main_grad`) adds with
    the gradient of the weight's other use (a tied embedding's lookup), in one call."""
    from megatron_ulysses.memory.tiling import sequence_tiled_recompute

    weight = torch.nn.Parameter(torch.randn(4, 6))
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(4, 6), False
    calls = []

    def ddp_hook(p):
        calls.append(p.grad.clone())
        if not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None

    weight.register_post_accumulate_grad_hook(ddp_hook)
    x = torch.randn(10, 2, 6)

    def loss(w):
        logits = sequence_tiled_recompute(lambda t, _: t @ w.t(), x, 3, [w]) \
            if w is weight else x @ w.t()
        return logits.square().sum() + (w[1] * 3).sum()  # the second use, outside the tiles

    loss(weight).backward()
    w = weight.detach().requires_grad_()
    loss(w).backward()
    torch.testing.assert_close(weight.main_grad, w.grad)
    assert len(calls) == 1 and torch.equal(calls[0][1], torch.full((6,), 3.0))
    assert torch.count_nonzero(calls[0][[0, 2, 3]]) == 0  # the tiles' part went to main_grad


def test_tiled_mlp_param_grads_flow_without_input_grad():
    plain, tiled = _mlp_pair(_config(swiglu=True), 3)
    x = torch.randn(S, B, H)  # e.g. frozen embeddings: only parameters need grads
    plain(x)[0].square().sum().backward()
    tiled(x)[0].square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_tiled_mlp_tile_rule():
    assert resolve_mlp_tiles("auto", 32768, 4096) == 8
    assert resolve_mlp_tiles("auto", 32769, 4096) == 9
    assert resolve_mlp_tiles(5, 3, 4096) == 5  # clamped to s at tiling time


@pytest.mark.parametrize("bad", [0, -1, 1.5, "many", True])
def test_bad_tile_counts_name_the_flag(bad):
    """The CLI's rule (a positive int or "auto") in the resolvers too: 0 is no "auto"."""
    with pytest.raises(ValueError, match="--tiled-mlp-shards must be a positive integer"):
        resolve_mlp_tiles(bad, 10, 10)
    with pytest.raises(ValueError, match="--tiled-loss-shards must be a positive integer"):
        resolve_loss_tiles(bad, 10, 1, 10)


def test_tiled_mlp_rejects_per_token_scale():
    _, tiled = _mlp_pair(_config(), 2)
    with pytest.raises(ValueError, match="--tiled-mlp-shards"):
        tiled(torch.randn(S, B, H), per_token_scale=torch.ones(S * B))


@pytest.mark.parametrize("swiglu", [True, False], ids=["swiglu", "gelu_bias"])
def test_tiled_mlp_layer_spec_in_gpt_model(swiglu):
    config = _config(swiglu)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    plain = _gpt(config, layer_spec=spec)
    tiled = _gpt(config, layer_spec=tiled_mlp_layer_spec(spec, 3))
    assert all(isinstance(layer.mlp, TiledMLP) for layer in tiled.decoder.layers)
    assert all(type(layer.mlp) is MLP for layer in plain.decoder.layers)
    batch, weights = _batch(), _loss_weights()
    _assert_same_loss_and_grads(
        _loss_and_grads(plain, batch, weights), _loss_and_grads(tiled, batch, weights)
    )


def _count_fc1_calls(model):
    calls = [0] * len(model.decoder.layers)
    for index, layer in enumerate(model.decoder.layers):
        layer.mlp.linear_fc1.register_forward_hook(
            lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    return calls


def _seeded_loss_and_grads(model, batch, weights, seed):
    torch.manual_seed(seed)  # hidden dropout draws from the default generator
    cpu_compat.model_parallel_manual_seed(seed)
    return _loss_and_grads(model, batch, weights)


# (method, --recompute-num-layers, layers whose recompute reads the MLP's output): in a
# uniform chunk of layers the next layer reads it, so those MLPs must really run.
RECOMPUTE_CHUNKS = [("uniform", 1, []), ("uniform", 3, [0, 1]), ("block", 2, [])]


@pytest.mark.parametrize("method, chunk, read", RECOMPUTE_CHUNKS,
                         ids=[f"{m}{c}" for m, c, _ in RECOMPUTE_CHUNKS])
def test_tiled_mlp_under_full_recompute_runs_its_tiles_twice(method, chunk, read):
    """Full recompute with dropout: TiledMLP gives plain MLP's loss and grads, and where the
    layer's output ends a checkpointed chunk the recompute runs no tile (2 passes of 3 tiles,
    not 3); the block method's unrecomputed third layer runs 2 passes anyway."""
    config = _config(True, num_layers=3, hidden_dropout=0.3, recompute_granularity="full",
                     recompute_method=method, recompute_num_layers=chunk)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    plain, tiled = _gpt(config, layer_spec=spec), _gpt(config, layer_spec=tiled_mlp_layer_spec(spec, 3))
    mark_recompute_chunk_ends(tiled.decoder)
    assert [layer.mlp.skip_in_recompute for layer in tiled.decoder.layers] == [
        index not in read for index in range(3)]
    calls = _count_fc1_calls(tiled)
    batch, weights = _batch(), _loss_weights()
    ref = _seeded_loss_and_grads(plain, batch, weights, seed=5)
    got = _seeded_loss_and_grads(tiled, batch, weights, seed=5)
    _assert_same_loss_and_grads(ref, got)
    assert calls == [3 * (3 if index in read else 2) for index in range(3)]
    # the dropout is live: another seed draws other masks
    other = _seeded_loss_and_grads(plain, batch, weights, seed=6)
    assert not torch.allclose(other[0], ref[0])


def test_tiled_mlp_without_recompute_never_skips():
    config = _config(num_layers=3)
    tiled = _gpt(config, layer_spec=tiled_mlp_layer_spec(
        get_gpt_layer_local_spec(normalization="RMSNorm"), 3))
    mark_recompute_chunk_ends(tiled.decoder)
    assert not any(layer.mlp.skip_in_recompute for layer in tiled.decoder.layers)


# ---------------------------------------------------------------- tiled loss


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiled_loss_gpt_model_matches_untiled(tied):
    config = _config()
    plain = _gpt(config, share_embeddings_and_output_weights=tied)
    tiled = _gpt(config, TiledLossGPTModel, share_embeddings_and_output_weights=tied,
                 tiled_loss_shards=3)
    logit_rows = []
    tiled.output_layer.register_forward_hook(
        lambda m, args, out: logit_rows.append(out[0].shape[0])
    )
    batch, weights = _batch(), _loss_weights()
    ref, got = _loss_and_grads(plain, batch, weights), _loss_and_grads(tiled, batch, weights)
    _assert_same_loss_and_grads(ref, got)
    assert got[0].shape == (B, S) and got[0].dtype == torch.float32
    assert "embedding.word_embeddings.weight" in got[1]
    assert ("output_layer.weight" in got[1]) == (not tied)
    # Logits only ever exist per tile: [7|7|6, b, V] in forward, again in backward.
    assert sorted(logit_rows) == [6, 6, 7, 7, 7, 7]


def test_tiled_loss_model_without_labels_returns_logits():
    plain = _gpt(_config())
    tiled = _gpt(_config(), TiledLossGPTModel, tiled_loss_shards="auto")
    ids, positions, mask, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(tiled(ids, positions, mask), plain(ids, positions, mask))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiled_cross_entropy_matches_compute_language_model_loss(tied):
    model = _gpt(_config(), share_embeddings_and_output_weights=tied)
    weight = model.shared_embedding_or_output_weight() if tied else None
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(S, B, H, generator=gen)
    labels = _batch()[3]
    grad_loss = torch.rand(B, S, generator=gen)
    trained = weight if tied else model.output_layer.weight

    def run(loss_fn):
        trained.grad = None
        h = hidden.clone().requires_grad_(True)
        loss = loss_fn(h)
        (loss * grad_loss).sum().backward()
        return loss, h.grad, trained.grad.clone()

    ref = run(lambda h: model.compute_language_model_loss(
        labels, model.output_layer(h, weight=weight)[0]))
    for n in (1, 4, 20, 50):
        got = run(lambda h: tiled_cross_entropy(h, model.output_layer, weight, labels, n))
        for r, g in zip(ref, got):
            torch.testing.assert_close(g, r)


def test_tiled_loss_rejects_bad_shards():
    with pytest.raises(ValueError, match="--tiled-loss-shards"):
        _gpt(_config(), TiledLossGPTModel, tiled_loss_shards=-2)


# ---------------------------------------------------------------- activation offload


def _recompute_config():
    return _config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def test_offload_matches_full_recompute_and_moves_layer_inputs():
    config = _recompute_config()
    batch, weights = _batch(), _loss_weights()
    ref = _loss_and_grads(_gpt(config), batch, weights)

    model = _gpt(config)
    stats = OffloadStats()
    hidden_bytes = S * B * H * 4
    handles = enable_activation_offload(model.decoder, min_bytes=hidden_bytes, stats=stats)
    got = _loss_and_grads(model, batch, weights)
    _assert_same_loss_and_grads(ref, got, exact=True)
    # Each layer's checkpointed input plus the final norm's input, all [s, b, h]; the
    # causal mask (400 B) and the weights stayed put.
    assert stats.offloaded_tensors == config.num_layers + 1
    assert stats.offloaded_bytes == stats.offloaded_tensors * hidden_bytes
    assert stats.restored_tensors == stats.offloaded_tensors

    for handle in handles:
        handle.remove()
    _loss_and_grads(model, batch, weights)
    assert stats.offloaded_tensors == config.num_layers + 1  # hooks really removed


def test_offload_skips_small_tensors_and_parameters_and_dedups():
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(64, 64, generator=gen))  # 16 KiB
    x = torch.randn(64, 64, generator=gen, requires_grad=True)  # 16 KiB
    small = torch.randn(64, generator=gen, requires_grad=True)  # 256 B

    def run(context):
        x.grad = weight.grad = small.grad = None
        with context:
            y = F.linear(x * x, weight) * small
        y.square().sum().backward()
        return x.grad, weight.grad, small.grad

    ref = run(torch.enable_grad())
    stats = OffloadStats()
    got = run(offload_saved_activations(min_bytes=64 * 64 * 4, stats=stats))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    # Packed: x (saved twice by x * x, copied once), x * x, the linear output.
    # Kept: `weight` (a parameter) and `small` (under min_bytes).
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (3, 3 * 64 * 64 * 4)
    assert stats.restored_tensors == 4


def test_offload_requires_full_recompute():
    with pytest.raises(ValueError, match="--offload-activations"):
        enable_activation_offload(_gpt(_config()).decoder)
