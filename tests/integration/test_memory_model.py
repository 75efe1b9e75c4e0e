"""bench/memory_record.py end to end on CPU (fp32, e = 4): the tiny preset at s = 64 and 128; then
memory_plan.py's per-GPU state of each data-parallel strategy.

The formulas here are written out from the shape on their own (not taken from the script's
analytic model), from what megatron-core's modules save on CPU: torch's RMSNorm decomposition
keeps x, rstd and x*rstd; each linear its input; unfused RoPE cos and sin of q and k; the local
backend (megatron-core's DotProductAttention) q, k and v repeated to H heads, the [s, s] causal
mask and the [H, s, s] probabilities (the s^2 term); unfused SwiGLU the fc1 output [2 ffn],
silu(gate) and a copy of up (+ glu_linear_offset), fc2 its input [ffn].
"""

import json
import sys
from pathlib import Path

import pytest

from bench_run import run_bench

REPO_ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("none", "selective", "full", "full-tiled-mlp", "tiled-mlp", "tiled-loss", "full-all")
S1, S2 = 64, 128
E = 4  # fp32 on CPU


def run_script(tmp_path, backend, variants):
    out = tmp_path / f"memory_{backend}.json"
    run = run_bench("memory_record.py", "--preset", "tiny", "--backend", backend, "--seq", S1,
                    "--offload-min-bytes", "0", "--variants", ",".join(variants), "--json", out,
                    timeout=180)
    results = json.loads(out.read_text())
    rows = {(row["key"], row["s"]): row for row in results["rows"]}
    for row in rows.values():
        assert "error" not in row, row
        assert row["measured"]["leaked"] == 0, row["key"]  # backward released every save
    return results, rows, run.stdout


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return run_script(tmp_path_factory.mktemp("local"), "local", VARIANTS)


@pytest.fixture(scope="module")
def dims(local):
    shape = local[0]["shape"]
    h, H, G, f = shape["hidden"], shape["heads"], shape["kv_heads"], shape["ffn"]
    return dict(h=h, H=H, G=G, f=f, d=h // H, V=shape["padded_vocab"], L=shape["layers"])


def no_recompute_layer(s, h, H, G, f, d, **_):
    """Bytes one layer saves without recompute (local backend, CPU, b = 1)."""
    norm = (2 * h + 1) * E                      # x, rstd, x*rstd
    return s * (norm + h * E                    # input norm, qkv GEMM input
                + 4 * d * E                     # RoPE cos, sin of q and k
                + 3 * H * d * E                 # q, k and v repeated to H heads
                + h * E                         # out-proj input
                + norm + h * E                  # pre-MLP norm, fc1 input
                + 2 * f * E + 2 * f * E         # fc1 output, silu(gate), up copy
                + f * E) + s * s * (H * E + 1)  # fc2 input; probs [H,s,s] and bool mask [s,s]


def test_no_recompute_layers_match_the_formula(local, dims):
    _, rows, _ = local
    for s in (S1, S2):
        measured = rows[("none", s)]["measured"]
        assert len(measured["layers"]) == dims["L"]
        for layer in measured["layers"]:
            assert layer["device"] == no_recompute_layer(s, **dims)
            assert layer["host"] == 0 and layer["checkpoint"] == 0
        subs = measured["layers"][0]["subs"]
        h, H, f, d = dims["h"], dims["H"], dims["f"], dims["d"]
        assert subs["input_layernorm"]["device"] == subs["pre_mlp_layernorm"]["device"] \
            == s * (2 * h + 1) * E
        assert subs["self_attention.core_attention"]["device"] == \
            s * 3 * H * d * E + s * s * (H * E + 1)
        assert subs["mlp"]["device"] == s * 4 * f * E
        assert subs["mlp.linear_fc2"]["device"] == s * f * E


def test_s_squared_term_is_the_local_attention_scores(local, dims):
    results, rows, _ = local
    fits = {fit["key"]: fit for fit in results["fits"]}
    # bytes/token/layer = a + c*s: c = H*e (fp32 probs) + 1 (bool mask); a = the rest.
    assert fits["none"]["c"] == dims["H"] * E + 1
    assert fits["none"]["c"] == fits["none"]["analytic_c"]
    assert fits["full"]["c"] == 0 and fits["tiled-mlp"]["c"] == dims["H"] * E + 1


def test_script_analytic_model_matches_every_measured_term(local):
    _, rows, stdout = local
    for (key, s), row in rows.items():
        analytic, measured = row["analytic"], row["per_token"]
        for field in ("device", "host", "checkpoint"):
            assert measured["layer"][field] == pytest.approx(analytic["layer"][field]), (key, s)
            for sub in set(analytic["layer"]["subs"]) | set(measured["layer"]["subs"]):
                got = measured["layer"]["subs"].get(sub, {}).get(field, 0)
                want = analytic["layer"]["subs"].get(sub, {}).get(field, 0)
                assert got == pytest.approx(want), (key, s, sub, field)
            for name, bucket in analytic["outside"].items():
                assert measured["outside"][name][field] == pytest.approx(bucket[field]), \
                    (key, s, name, field)
    assert "### Which feature removes which term" in stdout


def test_full_recompute_keeps_one_layer_input_per_layer(local, dims):
    _, rows, _ = local
    h, d = dims["h"], dims["d"]
    for key in ("full", "full-tiled-mlp"):
        for s in (S1, S2):
            measured = rows[(key, s)]["measured"]
            for layer in measured["layers"]:
                assert layer["device"] == layer["checkpoint"] == s * h * E  # [s, b, h]
                assert layer["host"] == 0
                assert list(layer["subs"]) == ["(block)"]
            # RoPE frequencies [s,1,1,d] fp32, one tensor saved by every layer's checkpoint
            assert measured["outside"]["shared"]["device"] == s * d * 4
    # Backward recomputes one layer at a time: its working set is the layer's saves but the
    # input, which is the checkpoint itself.
    for s in (S1, S2):
        assert rows[("full", s)]["measured"]["backward_working_set"] == \
            no_recompute_layer(s, **dims) - s * h * E


def test_offload_moves_the_checkpoints_to_host(local, dims):
    _, rows, _ = local
    h = dims["h"]
    for s in (S1, S2):
        full, offload = rows[("full", s)]["measured"], rows[("full-all", s)]["measured"]
        for before, after in zip(full["layers"], offload["layers"]):
            assert after["device"] == 0
            assert after["host"] == after["checkpoint"] == s * h * E
            assert before["device"] - after["device"] == after["host"]
        # The final norm runs inside the decoder too: its saves go to host as well.
        assert offload["outside"]["final_layernorm"]["device"] == 0
        assert offload["outside"]["final_layernorm"]["host"] == \
            full["outside"]["final_layernorm"]["device"]


def test_tiled_loss_removes_the_logits(local, dims):
    _, rows, _ = local
    h, V = dims["h"], dims["V"]
    for s in (S1, S2):
        base, tiled = rows[("none", s)]["measured"], rows[("tiled-loss", s)]["measured"]
        # Unfused cross entropy: softmax [s, V] fp32 (in the logits' storage), target mask
        # (bool) and masked target (int64); the output layer keeps its input.
        assert base["outside"]["loss"]["device"] == s * (4 * V + 1 + 8)
        assert base["outside"]["output_layer"]["device"] == s * h * E
        assert tiled["outside"]["loss"]["device"] == tiled["outside"]["loss"]["checkpoint"] \
            == s * h * E  # the final norm output, recomputed tile by tile
        assert tiled["outside"]["output_layer"]["device"] == 0
        assert not [t for t in tiled["outside_tensors"] if V in t["shape"]]
        assert [t for t in base["outside_tensors"] if V in t["shape"]]
        assert tiled["layers"] == base["layers"]  # the layers are untouched
        # Backward computes one tile's softmax (one tile at these lengths).
        assert tiled["backward_working_set"] == s * (4 * V + 1 + 8)


def test_tiled_mlp_keeps_only_its_input(local, dims):
    _, rows, _ = local
    h, f = dims["h"], dims["f"]
    for s in (S1, S2):
        subs = rows[("tiled-mlp", s)]["measured"]["layers"][0]["subs"]
        assert subs["mlp"]["device"] == subs["mlp"]["checkpoint"] == s * h * E
        assert "mlp.linear_fc1" not in subs and "mlp.linear_fc2" not in subs
    # auto tiles = ceil(s / h): 1 tile at 64, 2 at 128; one tile's fc1 output, silu, up copy
    # and fc2 input live at a time in backward (the tile's fc1 input is a view of the input).
    assert rows[("tiled-mlp", S1)]["measured"]["backward_working_set"] == S1 * 5 * f * E
    assert rows[("tiled-mlp", S2)]["measured"]["backward_working_set"] == S2 // 2 * 5 * f * E


def test_model_and_optimizer_state_is_16_bytes_per_param(local, dims):
    results, _, _ = local
    state = results["model_state"]
    h, H, G, f, d, V, L = (dims[k] for k in ("h", "H", "G", "f", "d", "V", "L"))
    per_layer = h + (H + 2 * G) * d * h + h * h + h + 2 * f * h + f * h  # norms, qkv, proj, MLP
    params = V * h + L * per_layer + h + V * h  # untied embedding and output layer
    assert state["params"] == params
    measured = state["measured"]
    assert measured["weights"] == measured["main_grad"] == 4 * params  # fp32, fp32 grad buffer
    assert measured["master_weights"] == 0  # fp32 training keeps no copy
    assert measured["optimizer exp_avg"] == measured["optimizer exp_avg_sq"] == 4 * params
    assert measured["optimizer step"] == 4 * state["param_tensors"]  # a float32 scalar each
    assert state["total_measured"] == 16 * params + 4 * state["param_tensors"]


def test_sdpa_has_no_s_squared_term(tmp_path, dims):
    """torch's fused attention: q, k (rotated), v as a view that keeps the whole qkv output,
    the output and the logsumexp, and no [s, s] anything; the out-proj input is the output's
    own storage."""
    results, rows, _ = run_script(tmp_path, "sdpa", ["none", "selective"])
    h, H, G, f, d = (dims[k] for k in ("h", "H", "G", "f", "d"))
    fits = {fit["key"]: fit for fit in results["fits"]}
    assert fits["none"]["c"] == 0
    for s in (S1, S2):
        subs = rows[("none", s)]["measured"]["layers"][0]["subs"]
        assert subs["self_attention.core_attention"]["device"] == \
            s * ((H + G + (H + 2 * G) + H) * d * E + 4 * H)
        assert "self_attention.linear_proj" not in subs
        # selective recompute of core_attn keeps q, k, v (+ the mask-type int32) instead and
        # gives the out-proj its own input: it frees only the logsumexp.
        none_layer = rows[("none", s)]["measured"]["layers"][0]["device"]
        selective_layer = rows[("selective", s)]["measured"]["layers"][0]["device"]
        assert none_layer - selective_layer == s * 4 * H - 4
        for row in (rows[("none", s)], rows[("selective", s)]):
            assert row["per_token"]["layer"]["device"] == \
                pytest.approx(row["analytic"]["layer"]["device"])


# ---------------------------------------------------------------------------------------------
# Per-GPU state of each data-parallel strategy (memory_plan.py): formulas, no model is built.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mm():
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import memory_plan
    return memory_plan


def test_parameter_counts_are_llama_3_1s(mm):
    """Meta's published counts of Llama-3.1-8B and 70B; the 1B one measured on the H200."""
    count = {name: mm.ParamCounts.of(shape, shape.vocab).total
             for name, shape in mm.SHAPES.items()}
    assert count["llama-3.1-8b"] == 8_030_261_248
    assert count["llama-3.1-70b"] == 70_553_706_496
    with open(mm.MEASURED_PEAKS) as f:
        assert count["llama-1b"] == json.load(f)["params"]


def test_one_shard_fsdp_is_ddp_without_sharding(mm):
    """At DP x SP = 1 nothing is split: every Megatron-FSDP strategy with fp32 main grads holds
    what DDP + distributed optimizer does (2 + 4 + 4 + 8 bytes per parameter), with no transient
    buffer; bf16 main grads (Megatron-LM's default) save 2 bytes per parameter."""
    counts = mm.ParamCounts.of(mm.SHAPES["llama-3.1-8b"], 128256)
    P = counts.total
    ddp = mm.strategy_state(counts, "ddp", 1)
    assert ddp.device == 18 * P and ddp.host == 0
    for name in ("optim", "optim_grads", "optim_grads_params"):
        fp32 = mm.strategy_state(counts, name, 1, fsdp_grad_bytes=4)
        assert fp32.device == ddp.device and fp32.transient == 0, name
        assert mm.strategy_state(counts, name, 1, fsdp_grad_bytes=2).device == 16 * P, name


@pytest.mark.parametrize("shards", [2, 8, 64])
def test_sharded_terms_divide_by_dp_times_sp(mm, shards):
    counts = mm.ParamCounts.of(mm.SHAPES["llama-3.1-70b"], 128256)
    one = {name: mm.strategy_state(counts, name, 1) for name in mm.STRATEGIES}
    many = {name: mm.strategy_state(counts, name, shards) for name in mm.STRATEGIES}
    sharded = {"ddp": ("master", "moments"), "optim": ("master", "moments"),
               "optim_grads": ("grads", "master", "moments"),
               "optim_grads_params": ("weights", "grads", "master", "moments")}
    for name, fields in sharded.items():
        for field in ("weights", "grads", "master", "moments"):
            ratio = shards if field in fields else 1
            assert getattr(many[name], field) * ratio == pytest.approx(
                getattr(one[name], field)), (name, field)
    # What is sharded comes back whole while it is used: optim_grads' one bucket of grads, and
    # optim_grads_params' gathered layers (at least the running one and the next) + the
    # embedding / output bucket, and their grads.
    g = 2
    assert many["optim_grads"].transient == g * counts.total
    low = (2 + g) * (counts.outside + 2 * counts.layer)
    assert low <= many["optim_grads_params"].transient < (2 + g) * counts.total
    assert many["optim_grads_params"].device < many["optim_grads"].device \
        < many["ddp"].device


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("shards", [1, 8])
def test_offload_moves_the_fraction_of_master_and_moments_to_host(mm, fraction, shards):
    counts = mm.ParamCounts.of(mm.SHAPES["llama-3.1-8b"], 128256)
    P, N = counts.total, shards
    ddp = mm.strategy_state(counts, "ddp", N)
    off = mm.strategy_state(counts, "offload", N, offload_fraction=fraction)
    state = ddp.master + ddp.moments
    assert off.master + off.moments == pytest.approx((1 - fraction) * state)
    assert off.host_optimizer == pytest.approx(fraction * state)
    # the weights and the fp32 grad buffer stay; the host also keeps a pinned fp32 grad copy
    # of the offloaded share, and the bf16 staging copies of the whole model's share
    assert (off.weights, off.grads) == (ddp.weights, ddp.grads)
    assert off.host_grads == pytest.approx(fraction * 4 * P / N)
    assert off.host_staging == pytest.approx(fraction * 2 * P)
    assert off.device + off.host_optimizer == pytest.approx(ddp.device)
    if fraction == 0:
        assert off == ddp
    # --grad-reduce-in-bf16 halves the grad buffer, but the hybrid optimizer casts the GPU
    # share's grads to fp32 copies it keeps: a saving only above f = 0.5 at one shard.
    bf16 = mm.strategy_state(counts, "offload", N, offload_fraction=fraction, ddp_grad_bytes=2)
    assert bf16.grads == pytest.approx(2 * P + 4 * (1 - fraction) * P / N)
    if N == 1:
        assert (bf16.device < off.device) == (fraction > 0.5)


def test_the_calibration_predicts_the_measured_peaks(mm):
    """The model's state of the 1B run (18 bytes per parameter, not fitted) plus the fitted slope
    gives each measured peak of max_seq_len.py within 0.5%."""
    cal = mm.Calibration.load()
    shape = mm.SHAPES["llama-1b"]
    state = mm.strategy_state(mm.ParamCounts.of(shape, shape.vocab), "ddp", 1)
    assert state.device / mm.harness.GIB == pytest.approx(cal.static_gib, rel=5e-3)
    with open(mm.MEASURED_PEAKS) as f:
        rows = [r for r in json.load(f)["rows"] if r["status"] == "ok"]
    assert len(rows) >= 3
    for r in rows:
        predicted = state.device + r["s"] * cal.slope_of(shape, shape.vocab, r["s"])
        assert predicted / mm.harness.GIB == pytest.approx(r["peak_alloc_gib"], rel=5e-3), r["s"]
    assert 0 < cal.extra < 16  # grads and workspaces of one layer's backward, in [s, h] tensors


def test_longest_sequence_is_the_last_that_fits(mm):
    cal = mm.Calibration.load()
    shape = mm.SHAPES["llama-3.1-8b"]
    counts = mm.ParamCounts.of(shape, shape.vocab)
    for name in mm.STRATEGIES:
        state = mm.strategy_state(counts, name, 8)
        s = mm.longest_sequence(shape, shape.vocab, state, 8, 79.2, cal)
        limit = (79.2 - mm.CARD_RESERVE_GIB) * mm.harness.GIB
        peak = lambda seq: state.device + seq // 8 * cal.slope_of(shape, shape.vocab, seq // 8)
        assert s % (4096 * 8) == 0 and 0 < s, name
        assert peak(s) <= limit < peak(s + 4096 * 8), name


def test_offloaded_activations_take_power_of_two_pinned_blocks(mm):
    shape = mm.SHAPES["llama-3.1-8b"]
    h, L = shape.hidden, shape.layers
    s = 3 * 2**16  # [s, h] bf16 = 1.5 GiB: a 2 GiB block each
    exact = mm.offloaded_host_bytes(shape, shape.vocab, s, rounded=False)
    rounded = mm.offloaded_host_bytes(shape, shape.vocab, s)
    assert exact >= (L + 1) * s * h * 2  # every layer's input and the final norm's
    assert rounded >= (L + 1) * 2 * 2**30 and rounded / exact == pytest.approx(4 / 3, rel=1e-2)


def test_strategies_cli_prints_plans_within_the_budgets(tmp_path):
    out = tmp_path / "strategies.json"
    run = run_bench("memory_plan.py", "--strategies", "--json", out)
    assert "### Per-GPU model + optimizer state (GiB)" in run.stdout
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 * 2 * 6  # models x layouts x strategies
    for plan in result["one_gpu"]:
        if plan["longest_s"]:
            assert plan["device_gib"] <= result["cards"][plan["card"]] - 2.5
            assert plan["host_gib"] <= 125.0
