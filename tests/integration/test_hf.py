"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 <-> megatron-core GPTModel conversion
(megatron_ulysses.hf).

Tiny random HF models (fp32, CPU; hidden 64, 2 layers, 4 heads, vocab 100, so the vocab is padded
to 128 x TP) are converted and loaded into our `build_gpt_model`; its logits must equal HF's
`model(input_ids).logits` at SP = 1, SP = 2 (each rank holds s/P tokens) and TP = 2 x SP = 2
(sequence parallel, kv heads replicated over SP), gathered over TP (vocab) and SP (sequence). Four
gloo workers run every case and layout in one spawn. Cases: Llama with GQA, llama3 RoPE scaling
and untied embeddings; Llama MHA, tied; Llama with linear RoPE scaling; Qwen2 with q/k/v bias,
tied; Mistral with head_dim != hidden / heads; Qwen3 (q/k norms, head_dim != hidden / heads);
YaRN: a Qwen3 with HF's default YaRN and a Llama with mscale / mscale_all_dim / beta / truncate
set, both at 4x their original context, whose sharded RoPE tables (cos, sin with the attention
factor) also equal HF's there. HF -> megatron -> HF is bitwise on every tensor
(also from TP = 2 shards and TE-spec names), the config survives, and every config the conversion
cannot express exactly is refused by name.
"""

import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers  # the [test] extra installs it
from distributed import spawn

from megatron_ulysses import hf
from megatron_ulysses.hf_rope import rope_parameters
from megatron_ulysses.sp.rope import YARN_DEFAULTS, yarn_attention_factor

WORLD = 4
VOCAB, HIDDEN, LAYERS, HEADS, FFN = 100, 64, 2, 4, 96
B, S = 2, 32
SEED = 1234
# Observed (fp32, CPU; megatron-core 0.16 and 0.19): max |logit error| <= 4.1e-6, i.e. <= 8.4e-7
# relative to max |logit| (4.5 .. 5.5); the YaRN cases at 128 tokens (megatron-core 0.16):
# <= 6.8e-6, relative <= 1.3e-6.
LOGIT_RTOL = 1e-5
LAYOUTS = [(1, 1), (1, 2), (2, 2)]  # (TP, SP)

YARN_WINDOW = 32  # the YaRN cases' original context; they run at 4x it
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": YARN_WINDOW}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# name -> (config class, kwargs)
CASES = {
    "llama_gqa_llama3_untied": ("LlamaConfig", dict(
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_parameters=LLAMA3_ROPE)),
    "llama_mha_tied": ("LlamaConfig", dict(num_key_value_heads=HEADS, tie_word_embeddings=True)),
    "llama_linear_rope": ("LlamaConfig", dict(
        num_key_value_heads=2, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 10000.0})),
    "qwen2_qkv_bias_tied": ("Qwen2Config", dict(
        num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral_head_dim": ("MistralConfig", dict(
        num_key_value_heads=2, head_dim=32, sliding_window=None)),
    "qwen3_qk_norm_head_dim": ("Qwen3Config", dict(
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3_yarn": ("Qwen3Config", dict(
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=4 * YARN_WINDOW, rope_parameters=YARN_ROPE)),
    "llama_yarn_mscale": ("LlamaConfig", dict(
        num_key_value_heads=2, max_position_embeddings=4 * YARN_WINDOW, rope_parameters={
            **YARN_ROPE, "rope_theta": 100.0, "beta_fast": 8.0, "beta_slow": 0.5,
            "mscale": 0.9, "mscale_all_dim": 0.5, "truncate": False})),
}
YARN_CASES = ("qwen3_yarn", "llama_yarn_mscale")
MODEL_CLASSES = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
                 "MistralConfig": "MistralForCausalLM", "Qwen3Config": "Qwen3ForCausalLM"}


def _hf_model(name: str, dtype=torch.float32, **overrides):
    """The case's tiny HF model with random weights (norms 1 + noise, biases nonzero)."""
    config_class, kwargs = CASES[name]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, rms_norm_eps=1e-5, **{**kwargs, **overrides})
    config.architectures = [MODEL_CLASSES[config_class]]
    torch.manual_seed(SEED)
    model = getattr(transformers, MODEL_CLASSES[config_class])._from_config(
        config, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in pname else 0.15 * noise)
    return model.to(dtype).eval()


def _config_dict(model) -> dict:
    """What `save_pretrained` writes as config.json."""
    return json.loads(model.config.to_json_string())


def _seq_length(name: str) -> int:
    return 4 * YARN_WINDOW if name in YARN_CASES else S


def _tokens(name: str = "") -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, _seq_length(name)),
                         generator=torch.Generator().manual_seed(7))


def _hf_logits(model, name: str = "") -> torch.Tensor:
    with torch.no_grad():
        return model(_tokens(name)).logits.float()


def _hf_rope(model, name: str):
    """HF's RoPE table (cos, sin `[s, d]`, its attention factor applied) and the factor."""
    rotary = model.model.rotary_emb
    positions = torch.arange(_seq_length(name))[None]
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0], sin[0], rotary.attention_scaling


def _state_dict(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ megatron-core side (workers)


def _transformer_config(args: dict, tp: int):
    """Our model flags -> TransformerConfig (as the training loop maps them; fp32, no dropout)."""
    from megatron.core.transformer import TransformerConfig

    from megatron_ulysses.sp.rope import set_yarn_config

    config = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        ffn_hidden_size=args["ffn_hidden_size"], num_attention_heads=args["num_attention_heads"],
        num_query_groups=args["num_query_groups"], kv_channels=args["kv_channels"],
        normalization=args["normalization"], layernorm_epsilon=args["norm_epsilon"],
        gated_linear_unit=args["swiglu"], activation_func=F.silu,
        add_bias_linear=not args["disable_bias_linear"], add_qkv_bias=args["add_qkv_bias"],
        qk_layernorm=args["qk_layernorm"], attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1, use_cpu_initialization=True, apply_rope_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if args["position_embedding_type"] == "yarn":
        set_yarn_config(config, args)
    return config


def _build_megatron(args: dict, tp: int):
    from megatron_ulysses.sp.layer_specs import build_gpt_model

    return build_gpt_model(
        _transformer_config(args, tp), hf.padded_vocab_size(args["vocab_size"], 128, tp),
        args["max_position_embeddings"], backend="auto",
        share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
        position_embedding_type=args["position_embedding_type"], rotary_base=args["rotary_base"],
        rope_scaling=args.get("use_rope_scaling", False),
        rope_scaling_factor=args.get("rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=args.get("rotary_seq_len_interpolation_factor"),
    )


def _gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _megatron_logits(hf_state: dict, args: dict, tokens: torch.Tensor, tp: int, sp: int):
    """Logits `[b, s, V]` of our model at (TP, SP) with the converted weights, gathered."""
    from megatron.core import parallel_state as mpu

    from megatron_ulysses import cpu_compat
    from megatron_ulysses.sp import parallel_state as ps

    cpu_compat.install()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, ulysses_sp_size=sp)
    try:
        cpu_compat.model_parallel_manual_seed(SEED)
        tp_rank = mpu.get_tensor_model_parallel_rank()
        model = _build_megatron(args, tp)
        state = hf.hf_to_megatron_state_dict(hf_state, args, tp_rank=tp_rank, tp_size=tp)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        assert all(key.endswith("_extra_state") for key in missing), missing
        model.eval()
        local = tokens.shape[1] // sp
        start = ps.get_ulysses_sp_rank() * local
        shard = tokens[:, start:start + local]
        positions = torch.arange(start, start + local).repeat(tokens.shape[0], 1)
        with torch.no_grad():
            logits = model(shard, positions, None)  # [b, s/P, Vp/T]
        logits = _gather(logits, 2, mpu.get_tensor_model_parallel_group())
        logits = _gather(logits, 1, ps.get_ulysses_sp_group())
        rope = None
        if args["position_embedding_type"] == "yarn":  # this rank's table, as attention uses it
            emb, factor = model.rotary_pos_emb(local)  # [s/P, 1, 1, d]
            rope = [_gather(t(emb[:, 0, 0]) * factor, 0, ps.get_ulysses_sp_group())
                    for t in (torch.cos, torch.sin)] + [factor]
        return logits[:, :, :args["vocab_size"]], rope
    finally:
        ps.destroy_model_parallel()


def _logit_cases(rank, world_size, cases_path, out_path):
    cases = torch.load(cases_path)
    results = {}
    for name, case in cases.items():
        for tp, sp in LAYOUTS:
            results[name, tp, sp], results[name, tp, sp, "rope"] = _megatron_logits(
                case["state"], case["args"], case["tokens"], tp, sp)
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def megatron_logits(tmp_path_factory):
    """{(case, TP, SP): our model's logits, (case, TP, SP, "rope"): its YaRN table} from one
    4-worker spawn, and {case: HF logits, (case, "rope"): HF's table}."""
    tmp = tmp_path_factory.mktemp("hf")
    cases, reference = {}, {}
    for name in CASES:
        model = _hf_model(name)
        cases[name] = {"state": _state_dict(model), "args": hf.model_args_from_hf_config(
            _config_dict(model)), "tokens": _tokens(name)}
        reference[name] = _hf_logits(model, name)
        reference[name, "rope"] = _hf_rope(model, name)
    torch.save(cases, tmp / "cases.pt")
    spawn(_logit_cases, WORLD, str(tmp / "cases.pt"), str(tmp / "logits.pt"))
    return torch.load(tmp / "logits.pt"), reference


@pytest.mark.parametrize("tp,sp", LAYOUTS, ids=[f"tp{t}_sp{s}" for t, s in LAYOUTS])
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(megatron_logits, name, tp, sp):
    ours, reference = megatron_logits[0][name, tp, sp], megatron_logits[1][name]
    assert ours.shape == reference.shape == (B, _seq_length(name), VOCAB)
    scale = reference.abs().max()
    err = (ours - reference).abs().max()
    print(f"{name} TP={tp} SP={sp}: max |logit error| {err:.3e} (max |logit| {scale:.3f}, "
          f"relative {err / scale:.3e})")
    assert err <= LOGIT_RTOL * scale, (err, scale)


@pytest.mark.parametrize("tp,sp", LAYOUTS, ids=[f"tp{t}_sp{s}" for t, s in LAYOUTS])
@pytest.mark.parametrize("name", YARN_CASES)
def test_yarn_tables_match_hf_beyond_the_original_context(megatron_logits, name, tp, sp):
    """Each SP rank's YaRN cos / sin at its global positions (0 .. 4x the original context),
    scaled by megatron-core's factor, are HF's (which carry its attention factor), bitwise."""
    (cos, sin, factor), (hf_cos, hf_sin, hf_factor) = (megatron_logits[0][name, tp, sp, "rope"],
                                                       megatron_logits[1][name, "rope"])
    assert factor == hf_factor != 1.0
    assert cos.shape == hf_cos.shape == (4 * YARN_WINDOW, 32 if name == "qwen3_yarn" else 16)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_rope_scaling_matters_for_these_inputs():
    """The llama3 / linear / yarn cases' logits differ from plain RoPE far beyond the tolerance,
    so matching them proves megatron-core applied the same scaling."""
    for name in ("llama_gqa_llama3_untied", "llama_linear_rope") + YARN_CASES:
        scaled = _hf_logits(_hf_model(name), name)
        plain = _hf_logits(_hf_model(name, rope_parameters={"rope_type": "default",
                                                            "rope_theta": CASES[name][1][
                                                                "rope_parameters"]["rope_theta"]}),
                           name)
        assert (scaled - plain).abs().max() > 100 * LOGIT_RTOL * scaled.abs().max()


# ------------------------------------------------------------------------- weights round trip


def _expected_hf_state(model, args) -> dict:
    """HF's tensors as `save_pretrained` writes them (no tied lm_head)."""
    state = _state_dict(model)
    if not args["untie_embeddings_and_output_weights"]:
        state.pop("lm_head.weight", None)
    return state


@pytest.mark.parametrize("spec", hf.SPECS)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_round_trip_is_bitwise(name, tp, spec):
    model = _hf_model(name, dtype=torch.bfloat16 if name.startswith("qwen2") else torch.float32)
    args = hf.model_args_from_hf_config(_config_dict(model))
    shards = [hf.hf_to_megatron_state_dict(_state_dict(model), args, r, tp, spec=spec)
              for r in range(tp)]
    padded = hf.padded_vocab_size(VOCAB, 128, tp)
    norm_names = hf.megatron_norm_names(spec)
    for shard in shards:
        assert shard["embedding.word_embeddings.weight"].shape == (padded // tp, HIDDEN)
        assert f"decoder.layers.0.{norm_names['input']}" in shard
        assert ("output_layer.weight" in shard) == args["untie_embeddings_and_output_weights"]
        assert ("decoder.layers.0.self_attention.linear_qkv.bias" in shard) == args["add_qkv_bias"]
    full_embedding = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert not full_embedding[VOCAB:].any()  # zero padding rows
    expected = _expected_hf_state(model, args)
    back = hf.megatron_to_hf_state_dict(shards, args)
    assert back.keys() == expected.keys()
    for key, tensor in expected.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_state_dict_accepts_tied_lm_head_and_refuses_unknown_tensors():
    model = _hf_model("llama_mha_tied")
    args = hf.model_args_from_hf_config(_config_dict(model))
    state = _state_dict(model)
    assert "lm_head.weight" in state  # tied: present in state_dict(), not used
    hf.hf_to_megatron_state_dict(state, args)
    del state["lm_head.weight"]  # as in a safetensors file
    hf.hf_to_megatron_state_dict(state, args)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.bias"):
        hf.hf_to_megatron_state_dict(
            {**state, "model.layers.0.self_attn.o_proj.bias": torch.zeros(HIDDEN)}, args)
    untied_model = _hf_model("llama_gqa_llama3_untied")
    untied = _state_dict(untied_model)
    del untied["lm_head.weight"]
    with pytest.raises(KeyError, match="lm_head.weight"):
        hf.hf_to_megatron_state_dict(
            untied, hf.model_args_from_hf_config(_config_dict(untied_model)))


def test_qkv_and_fc1_layouts():
    """megatron-core's fused layouts, by row labels: H = 4 query heads in G = 2 groups, d = 1;
    F = 4 over TP = 2."""
    q, k, v = (torch.tensor([[x] for x in rows]) for rows in
               ([0, 1, 2, 3], [10, 11], [20, 21]))
    fused = hf.fuse_qkv(q, k, v, num_query_groups=2)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.flatten().tolist() for t in hf.split_qkv(fused, 4, 2, 1)] == [[0, 1, 2, 3],
                                                                             [10, 11], [20, 21]]
    bias = hf.fuse_qkv(q.flatten(), k.flatten(), v.flatten(), num_query_groups=2)
    assert bias.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    gate, up = torch.arange(4)[:, None], torch.arange(10, 14)[:, None]
    shards = [hf.shard_fc1(gate, up, r, 2) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    assert [t.flatten().tolist() for t in hf.unshard_fc1(shards)] == [[0, 1, 2, 3],
                                                                       [10, 11, 12, 13]]


# ---------------------------------------------------------------------------------- configs

# A Llama 3.1 8B and a Qwen2 7B config.json as on the Hub (transformers 4.x format).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.37.2", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
}


def test_llama31_config_to_model_args():
    assert hf.model_args_from_hf_config(LLAMA31_8B) == {
        "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
        "num_attention_heads": 32, "group_query_attention": True, "num_query_groups": 8,
        "kv_channels": 128, "max_position_embeddings": 131072, "position_embedding_type": "rope",
        "rotary_base": 500000, "use_rope_scaling": True, "rope_scaling_factor": 8.0,
        "normalization": "RMSNorm", "norm_epsilon": 1e-05, "swiglu": True,
        "untie_embeddings_and_output_weights": True, "disable_bias_linear": True,
        "add_qkv_bias": False, "qk_layernorm": False, "vocab_size": 128256,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    }
    qwen = hf.model_args_from_hf_config(QWEN2_7B)
    assert qwen["add_qkv_bias"] and qwen["rotary_base"] == 1000000 and qwen["kv_channels"] == 128
    assert "use_rope_scaling" not in qwen


# Qwen3 8B's config.json as on the Hub, with the YaRN entry its model card gives for 128K.
QWEN3_8B_YARN = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32768},
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_yarn_config_to_model_args():
    args = hf.model_args_from_hf_config(QWEN3_8B_YARN)
    assert args["qk_layernorm"] and not args["add_qkv_bias"] and args["kv_channels"] == 128
    assert {k: args[k] for k in YARN_DEFAULTS} == {
        "rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 32768,
        "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
        "yarn_correction_range_round_to_int": True}
    assert args["position_embedding_type"] == "yarn" and args["rotary_base"] == 1000000
    # an explicit attention factor becomes megatron-core's --mscale and comes back
    rope = {**QWEN3_8B_YARN["rope_scaling"], "attention_factor": 1.3}
    explicit = hf.model_args_from_hf_config({**QWEN3_8B_YARN, "rope_scaling": rope})
    assert yarn_attention_factor(explicit) == pytest.approx(1.3, rel=1e-15)
    exported = hf.hf_config_from_model_args(explicit, "Qwen3ForCausalLM")
    assert hf.model_args_from_hf_config(exported) == explicit


def test_yarn_attention_factor_is_megatron_cores_and_hfs():
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for factor, mscale, mscale_all_dim in ((4.0, 1.0, 0.0), (8.0, 0.9, 0.5), (1.0, 2.0, 1.0)):
        values = {"rotary_scaling_factor": factor, "mscale": mscale,
                  "mscale_all_dim": mscale_all_dim}
        ours = yarn_attention_factor(values)
        assert ours == _yarn_get_concentration_factor(factor, mscale, mscale_all_dim)
        config = transformers.Qwen3Config(**hf.hf_config_from_model_args(
            {**hf.model_args_from_hf_config(QWEN3_8B_YARN), **values}, "Qwen3ForCausalLM"))
        assert ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")[1] == ours


def _all_configs():
    configs = {"llama31_8b_hub": LLAMA31_8B, "qwen2_7b_hub": QWEN2_7B,
               "qwen3_8b_yarn_hub": QWEN3_8B_YARN}
    configs.update({name: _config_dict(_hf_model(name)) for name in CASES})
    return configs


@pytest.mark.parametrize("name", ["llama31_8b_hub", "qwen2_7b_hub", "qwen3_8b_yarn_hub"]
                         + list(CASES))
def test_config_round_trip(name):
    config = _all_configs()[name]
    args = hf.model_args_from_hf_config(config)
    arch = config["architectures"][0]
    # With the imported config as base: the very same dict (token ids, dtype, format kept).
    assert hf.hf_config_from_model_args(args, arch, base_config=config) == config
    # From the flags alone: a config transformers reads back to the same model.
    fresh = hf.hf_config_from_model_args(args, arch)
    assert hf.model_args_from_hf_config(fresh) == args
    loaded = transformers.AutoConfig.for_model(**copy.deepcopy(fresh))
    assert hf.model_args_from_hf_config(json.loads(loaded.to_json_string())) == args
    # A changed flag (context extension: longer max positions, llama3 factor) is written.
    longer = {**args, "max_position_embeddings": 2 * args["max_position_embeddings"]}
    exported = hf.hf_config_from_model_args(longer, arch, base_config=config)
    assert hf.model_args_from_hf_config(exported) == longer
    if args.get("use_rope_scaling"):
        rescaled = {**args, "rope_scaling_factor": 16.0}
        exported = hf.hf_config_from_model_args(rescaled, arch, base_config=config)
        assert hf.model_args_from_hf_config(exported) == rescaled
        assert rope_parameters(exported)["factor"] == 16.0
    if args["position_embedding_type"] == "yarn":  # a longer context for the same model
        rescaled = {**args, "rotary_scaling_factor": 8.0}
        exported = hf.hf_config_from_model_args(rescaled, arch, base_config=config)
        assert hf.model_args_from_hf_config(exported) == rescaled
        assert rope_parameters(exported)["factor"] == 8.0


def _llama(**changes):
    config = copy.deepcopy(LLAMA31_8B)
    config.update(changes)
    return config


def _rope(**changes):
    return _llama(rope_scaling={**LLAMA31_8B["rope_scaling"], **changes})


REFUSED = {
    "dynamic": (_llama(rope_scaling={"type": "dynamic", "factor": 2.0}),
                "rope_scaling.rope_type='dynamic': its frequencies depend on each batch"),
    "longrope": (_rope(rope_type="longrope"), "rope_scaling.rope_type='longrope': .*LongRoPE"),
    "yarn_attention_factor_at_factor_1": (
        _llama(rope_scaling={"rope_type": "yarn", "factor": 1.0, "attention_factor": 1.2}),
        "rope_scaling.attention_factor=1.2"),
    "qwen3_moe": ({**QWEN3_8B_YARN, "architectures": ["Qwen3MoeForCausalLM"],
                   "model_type": "qwen3_moe"}, "Qwen3-MoE is a mixture-of-experts model"),
    "qwen3_moe_model_type": ({k: v for k, v in QWEN3_8B_YARN.items() if k != "architectures"}
                             | {"model_type": "qwen3_moe"}, "Qwen3MoeForCausalLM"),
    "qwen3_sliding_window": ({**QWEN3_8B_YARN, "use_sliding_window": True},
                             "use_sliding_window=True"),
    "llama3_low_freq": (_rope(low_freq_factor=2.0), "rope_scaling.low_freq_factor=2.0"),
    "llama3_high_freq": (_rope(high_freq_factor=8.0), "rope_scaling.high_freq_factor=8.0"),
    "llama3_original_max": (_rope(original_max_position_embeddings=4096),
                            "rope_scaling.original_max_position_embeddings=4096"),
    "partial_rotary": (_llama(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    "gelu": (_llama(hidden_act="gelu"), "hidden_act='gelu'"),
    "attention_bias": (_llama(attention_bias=True), "attention_bias=True"),
    "mlp_bias": (_llama(mlp_bias=True), "mlp_bias=True"),
    "architecture": (_llama(architectures=["GemmaForCausalLM"], model_type="gemma"),
                     "architectures=\\['GemmaForCausalLM'\\]"),
    "model_type_mismatch": (_llama(model_type="qwen2"), "model_type='qwen2'"),
    "no_architecture": ({k: v for k, v in _llama(model_type="phi3").items()
                         if k != "architectures"}, "model_type='phi3'"),
    "kv_heads": (_llama(num_key_value_heads=5), "num_key_value_heads=5"),
    "mistral_sliding_window": (_llama(architectures=["MistralForCausalLM"], model_type="mistral",
                                      sliding_window=4096, rope_scaling=None),
                               "sliding_window=4096"),
    "qwen2_sliding_window": ({**QWEN2_7B, "use_sliding_window": True}, "use_sliding_window=True"),
    "qwen2_layer_types": ({**QWEN2_7B, "layer_types": ["full_attention", "sliding_attention"]},
                          "layer_types='sliding_attention'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_configs_are_refused(name):
    config, message = REFUSED[name]
    with pytest.raises(ValueError, match=message):
        hf.model_args_from_hf_config(config)


@pytest.mark.parametrize("change, message", [
    ({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ({"swiglu": False}, "swiglu=False"),
    ({"add_qkv_bias": True}, "add_qkv_bias=True"),
    ({"qk_layernorm": True}, "qk_layernorm=True"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type"),
])
def test_unexportable_flags_are_refused(change, message):
    args = hf.model_args_from_hf_config(LLAMA31_8B)
    with pytest.raises(ValueError, match=message):
        hf.hf_config_from_model_args({**args, **change}, "LlamaForCausalLM")


def test_qwen3_export_needs_its_qk_norms():
    args = hf.model_args_from_hf_config(QWEN3_8B_YARN)
    with pytest.raises(ValueError, match="qk_layernorm=False"):
        hf.hf_config_from_model_args({**args, "qk_layernorm": False}, "Qwen3ForCausalLM")


def test_unknown_architecture_is_refused():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        hf.hf_config_from_model_args(hf.model_args_from_hf_config(LLAMA31_8B),
                                     "GPT2LMHeadModel")
