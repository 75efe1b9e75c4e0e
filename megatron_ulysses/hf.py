"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 <-> megatron-core GPTModel: configs and weights.

Pure functions on plain dicts and tensors (no process group, no file I/O, no `transformers`).

Glossary: `h` hidden size, `H` attention heads, `G` kv heads (query groups), `d` head dim
(kv_channels), `F` ffn hidden size, `V` vocab size, `Vp` the padded vocab (a multiple of
make_vocab_size_divisible_by x TP), `T` tensor-parallel size.

Layouts (megatron-core, `rotary_interleaved=False`):

  * `linear_qkv.weight` `[G * (H/G + 2) * d, h]`: per query group g the H/G query heads of g,
    then k_g, then v_g; TP rank r holds the r-th of T equal row blocks (whole groups when
    G % T == 0). `linear_qkv.bias` (Qwen2) has the same row layout.
  * `q_layernorm.weight`, `k_layernorm.weight` `[d]` (Qwen3's per-head q_norm / k_norm, applied
    before RoPE in both): replicated.
  * `linear_fc1.weight` (SwiGLU) `[2F, h]` = [gate; up]; TP rank r holds
    [gate block r; up block r] `[2F/T, h]`.
  * `linear_proj.weight` `[h, H*d]`, `linear_fc2.weight` `[h, F]`: split on the input dim.
  * `embedding.word_embeddings.weight`, `output_layer.weight` `[Vp, h]`: zero rows V..Vp-1,
    split on the vocab dim.
  * norms replicated, named by the layer spec: `input_layernorm.weight` /
    `pre_mlp_layernorm.weight` (local spec) or `self_attention.linear_qkv.layer_norm_weight` /
    `mlp.linear_fc1.layer_norm_weight` (Transformer Engine spec).

HF's Llama RoPE (`rotate_half` on the two halves of each head) is megatron-core's default
non-interleaved RoPE, so q/k rows need no permutation. RoPE parameters: `hf_rope.py`.
"""

import copy
from typing import Dict, List, Optional, Tuple

import torch

from .data.vocab import padded_vocab_size
from .hf_rope import put_rope, refuse as _refuse, rope_model_args

Tensor = torch.Tensor

ARCHITECTURES = {  # HF architecture -> model_type
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Architectures refused by name, with why.
REFUSED_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "Qwen3-MoE is a mixture-of-experts model and megatron_ulysses builds "
                           "dense layers only; the dense Qwen3ForCausalLM models convert",
    "Qwen2MoeForCausalLM": "Qwen2-MoE is a mixture-of-experts model and megatron_ulysses builds "
                           "dense layers only; the dense Qwen2ForCausalLM models convert",
}
_REFUSED_MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
SPECS = ("local", "te")

_IGNORED_HF_KEYS = ("rotary_emb.inv_freq",)  # buffers of old transformers versions


# ------------------------------------------------------------------------------------ configs


def model_type_of(config: dict) -> str:
    """The model_type ("llama", "mistral", "qwen2", "qwen3") of an HF config.json dict;
    ValueError for any other `architectures` / `model_type`, or when the two disagree."""
    archs = config.get("architectures")
    model_type = config.get("model_type")
    arch = archs[0] if archs else None
    refused = arch if arch in REFUSED_ARCHITECTURES else _REFUSED_MODEL_TYPES.get(model_type)
    if refused:
        _refuse("architectures", [refused], REFUSED_ARCHITECTURES[refused])
    if archs:
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            _refuse("architectures", archs, f"supported: one of {sorted(ARCHITECTURES)}")
        expected = ARCHITECTURES[archs[0]]
        if model_type is not None and model_type != expected:
            _refuse("model_type", model_type, f"architectures {archs} needs {expected!r}")
        return expected
    if model_type not in ARCHITECTURES.values():
        _refuse("model_type", model_type, f"supported: one of {sorted(ARCHITECTURES.values())}")
    return model_type


def _check_attention_window(config: dict, model_type: str) -> None:
    """ValueError for sliding-window attention (every layer must be full attention)."""
    if model_type == "mistral" and config.get("sliding_window") is not None:
        _refuse("sliding_window", config["sliding_window"],
                "sliding-window attention is not supported (full causal attention only); "
                "set it to null to convert the model as full attention")
    if model_type in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        _refuse("use_sliding_window", True, "sliding-window attention is not supported")
    for layer_type in config.get("layer_types") or ():
        if layer_type != "full_attention":
            _refuse("layer_types", layer_type, "only 'full_attention' layers are supported")


def _check_biases(config: dict, model_type: str) -> None:
    """ValueError for biases other than Qwen2's q/k/v bias."""
    if config.get("attention_bias"):
        _refuse("attention_bias", True, "biased attention projections (incl. o_proj) are not "
                "supported; only Qwen2's q/k/v bias is")
    if config.get("mlp_bias"):
        _refuse("mlp_bias", True, "MLP biases are not supported")


def _head_dim(config: dict, model_type: str) -> int:
    """head_dim, with transformers' default: 128 for Qwen3, else hidden / heads."""
    default = 128 if model_type == "qwen3" else None
    return config.get("head_dim", default) or config["hidden_size"] // config["num_attention_heads"]


def model_args_from_hf_config(config: dict) -> dict:
    """HF config.json dict (Llama, Mistral, Qwen2, Qwen3) -> our pretrain_gpt.py model flags, as
    a dict of Megatron-LM argument names. ValueError naming the field and value for anything the
    conversion cannot express exactly."""
    model_type = model_type_of(config)
    if config.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", config["hidden_act"], "only 'silu' (SwiGLU) is supported")
    _check_biases(config, model_type)
    _check_attention_window(config, model_type)
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    if heads % groups != 0:
        _refuse("num_key_value_heads", groups,
                f"must divide num_attention_heads ({heads})")
    args = {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "ffn_hidden_size": config["intermediate_size"],
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": _head_dim(config, model_type),
        "max_position_embeddings": config["max_position_embeddings"],
        **rope_model_args(config),
        "normalization": "RMSNorm",
        "norm_epsilon": config.get("rms_norm_eps", 1e-6),
        "swiglu": True,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "disable_bias_linear": True,
        "add_qkv_bias": model_type == "qwen2",
        "qk_layernorm": model_type == "qwen3",
        "vocab_size": config["vocab_size"],
        "attention_dropout": float(config.get("attention_dropout", 0.0)),
        "hidden_dropout": 0.0,  # these HF models have no hidden dropout
    }
    return args


def _check_exportable(args: dict, model_type: str) -> None:
    """ValueError for model flags the HF architecture cannot express."""
    needs = {"normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
             "add_qkv_bias": model_type == "qwen2", "qk_layernorm": model_type == "qwen3"}
    for key, value in needs.items():
        if args.get(key, value) != value:
            raise ValueError(f"cannot export to {model_type}: {key}={args.get(key)!r} "
                             f"(needs {value!r})")
    if args.get("position_embedding_type", "rope") not in ("rope", "yarn"):
        raise ValueError(f"cannot export to {model_type}: position_embedding_type="
                         f"{args['position_embedding_type']!r} (needs 'rope' or 'yarn')")
    for key, value in (("rotary_percent", 1.0),
                       ("rotary_interleaved", False), ("apply_layernorm_1p", False),
                       ("squared_relu", False)):
        if args.get(key, value) != value:
            raise ValueError(f"cannot export to {model_type}: {key}={args[key]!r}")


def _put(config: dict, key: str, value) -> None:
    """Set config[key], keeping an equal existing value as it is (500000.0 stays a float)."""
    if key not in config or config[key] != value:
        config[key] = value


def hf_config_from_model_args(args: dict, architecture: str,
                              base_config: Optional[dict] = None) -> dict:
    """Our model flags (Megatron-LM names) -> HF config.json dict for `architecture`
    (one of `ARCHITECTURES`, or its model_type). Starts
    from a copy of `base_config` (the imported model's config: token ids, dtype, ... survive),
    and leaves its values that already agree untouched, so
    `hf_config_from_model_args(model_args_from_hf_config(c), arch, c) == c`."""
    by_type = {v: k for k, v in ARCHITECTURES.items()}
    if architecture in by_type:
        architecture = by_type[architecture]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}: "
                         f"supported: one of {sorted(ARCHITECTURES)}")
    model_type = ARCHITECTURES[architecture]
    _check_exportable(args, model_type)
    config = copy.deepcopy(base_config) if base_config is not None else {}
    heads = args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    head_dim = args.get("kv_channels") or args["hidden_size"] // heads
    _put(config, "architectures", [architecture])
    _put(config, "model_type", model_type)
    for key, value in (
        ("vocab_size", args["vocab_size"]),
        ("hidden_size", args["hidden_size"]),
        ("intermediate_size", args["ffn_hidden_size"]),
        ("num_hidden_layers", args["num_layers"]),
        ("num_attention_heads", heads),
        ("num_key_value_heads", groups or heads),
        ("hidden_act", "silu"),
        ("max_position_embeddings", args["max_position_embeddings"]),
        ("rms_norm_eps", args["norm_epsilon"]),
        ("tie_word_embeddings", not args["untie_embeddings_and_output_weights"]),
        ("attention_dropout", args.get("attention_dropout", 0.0)),
    ):
        _put(config, key, value)
    if head_dim != args["hidden_size"] // heads or "head_dim" in config or \
            model_type == "qwen3":  # transformers' Qwen3 head_dim defaults to 128
        _put(config, "head_dim", head_dim)
    if model_type in ("llama", "qwen3"):
        _put(config, "attention_bias", False)
    if model_type == "llama":
        _put(config, "mlp_bias", False)
    elif model_type == "mistral":
        _put(config, "sliding_window", None)
    else:
        _put(config, "use_sliding_window", False)
    put_rope(config, args)
    return config


# ------------------------------------------------------------------------------------ weights


def _padded_vocab(args: dict, tp_size: int) -> int:
    return padded_vocab_size(args["vocab_size"], args.get("make_vocab_size_divisible_by", 128),
                             tp_size)


def _heads(args: dict) -> Tuple[int, int, int]:
    """(H, G, d) of the model flags."""
    heads = args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    return heads, groups or heads, args.get("kv_channels") or args["hidden_size"] // heads


def tp_shard(tensor: Tensor, dim: int, tp_rank: int, tp_size: int) -> Tensor:
    """The `tp_rank`-th of `tp_size` equal blocks of `tensor` along `dim` (a copy when T > 1)."""
    if tp_size == 1:
        return tensor
    if tensor.shape[dim] % tp_size != 0:
        raise ValueError(f"dim {dim} of a {tuple(tensor.shape)} tensor is not divisible by "
                         f"tensor-parallel size {tp_size}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank].clone()


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, num_query_groups: int) -> Tensor:
    """HF q `[H*d, ...]`, k, v `[G*d, ...]` (weights `[., h]` or biases) -> megatron-core's fused
    `[G * (H/G + 2) * d, ...]`: per group g, [q heads of g; k_g; v_g]."""
    groups = num_query_groups
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: Tensor, num_heads: int, num_query_groups: int,
              head_dim: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`: fused `[G * (H/G + 2) * d, ...]` -> q `[H*d, ...]`, k, v
    `[G*d, ...]`."""
    groups, per_group = num_query_groups, num_heads // num_query_groups
    grouped = qkv.reshape(groups, (per_group + 2) * head_dim, *qkv.shape[1:])
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v))


def shard_fc1(gate: Tensor, up: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """HF gate, up `[F, h]` -> this TP rank's SwiGLU `linear_fc1` `[2F/T, h]` =
    [gate block r; up block r]."""
    return torch.cat([tp_shard(gate, 0, tp_rank, tp_size), tp_shard(up, 0, tp_rank, tp_size)])


def unshard_fc1(shards: List[Tensor]) -> Tuple[Tensor, Tensor]:
    """Inverse of `shard_fc1` over all TP ranks: `[2F/T, h]` per rank -> gate, up `[F, h]`."""
    halves = [shard.chunk(2, dim=0) for shard in shards]
    return torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])


def pad_vocab(weight: Tensor, padded_size: int) -> Tensor:
    """`[V, h]` -> `[Vp, h]` with zero rows V..Vp-1."""
    extra = padded_size - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocab {weight.shape[0]} is larger than the padded vocab {padded_size}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])])


def megatron_norm_names(spec: str = "local") -> Dict[str, str]:
    """Per-layer names of the two pre-norms (relative to `decoder.layers.{i}.`) for the local or
    Transformer Engine (`te`) layer spec."""
    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    if spec == "te":
        return {"input": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp": "mlp.linear_fc1.layer_norm_weight"}
    return {"input": "input_layernorm.weight", "pre_mlp": "pre_mlp_layernorm.weight"}


def detect_spec(state_dict: dict) -> str:
    """"te" if a megatron state dict names its norms as the Transformer Engine spec, else
    "local"."""
    te = megatron_norm_names("te")["input"]
    return "te" if any(key.endswith(te) for key in state_dict) else "local"


def _qk_norms(args: dict):
    """(megatron-core name, HF name) of the per-head q / k norms under `self_attention` /
    `self_attn` (Qwen3), both specs; none without --qk-layernorm."""
    if not args.get("qk_layernorm"):
        return ()
    return (("q_layernorm.weight", "q_norm.weight"), ("k_layernorm.weight", "k_norm.weight"))


class _Taken(dict):
    """The HF state dict, recording which keys were read (to refuse unknown tensors)."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.used = set()

    def __getitem__(self, key):
        if key not in self:
            raise KeyError(f"Hugging Face state dict has no {key!r}")
        self.used.add(key)
        return super().__getitem__(key)


def hf_to_megatron_state_dict(hf: Dict[str, Tensor], args: dict, tp_rank: int = 0,
                              tp_size: int = 1, spec: str = "local") -> Dict[str, Tensor]:
    """HF Llama/Mistral/Qwen2/Qwen3 state dict (`model.layers.{i}.self_attn.q_proj.weight`) ->
    megatron-core GPTModel state dict of TP rank `tp_rank` of `tp_size`, with norm names of
    `spec` ("local" or "te"). Tensors keep their dtype; TP-split ones are copies. No
    `_extra_state` entries (load with strict=False or through dist_checkpointing). ValueError
    for HF tensors the conversion would drop."""
    hf = _Taken(hf)
    _, groups, _ = _heads(args)
    norms = megatron_norm_names(spec)
    padded = _padded_vocab(args, tp_size)
    out = {"embedding.word_embeddings.weight":
           tp_shard(pad_vocab(hf["model.embed_tokens.weight"], padded), 0, tp_rank, tp_size)}
    for i in range(args["num_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        out[dst + norms["input"]] = hf[src + "input_layernorm.weight"]
        for suffix in ("weight", "bias") if args.get("add_qkv_bias") else ("weight",):
            qkv = fuse_qkv(*(hf[f"{attn}{p}_proj.{suffix}"] for p in "qkv"), groups)
            out[f"{dst}self_attention.linear_qkv.{suffix}"] = tp_shard(qkv, 0, tp_rank, tp_size)
        out[dst + "self_attention.linear_proj.weight"] = tp_shard(
            hf[attn + "o_proj.weight"], 1, tp_rank, tp_size)
        for ours, theirs in _qk_norms(args):
            out[f"{dst}self_attention.{ours}"] = hf[attn + theirs]
        out[dst + norms["pre_mlp"]] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = shard_fc1(
            hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"], tp_rank, tp_size)
        out[dst + "mlp.linear_fc2.weight"] = tp_shard(
            hf[src + "mlp.down_proj.weight"], 1, tp_rank, tp_size)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if args["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = tp_shard(
            pad_vocab(hf["lm_head.weight"], padded), 0, tp_rank, tp_size)
    elif "lm_head.weight" in hf:
        hf.used.add("lm_head.weight")  # tied: the same tensor as the embedding
    unused = sorted(k for k in hf if k not in hf.used and not k.endswith(_IGNORED_HF_KEYS))
    if unused:
        raise ValueError(f"Hugging Face tensors the conversion does not use: {unused}")
    return out


def _cat(shards: List[dict], key: str, dim: int) -> Tensor:
    tensors = [shard[key] for shard in shards]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def megatron_to_hf_state_dict(shards: List[Dict[str, Tensor]], args: dict) -> Dict[str, Tensor]:
    """megatron-core GPTModel state dicts, one per TP rank in rank order (local or TE norm names,
    `_extra_state` entries ignored) -> HF state dict (`ARCHITECTURES`), vocab padding stripped.
    With tied embeddings there is no `lm_head.weight` (as HF's `save_pretrained` writes it)."""
    heads, groups, head_dim = _heads(args)
    norms = megatron_norm_names(detect_spec(shards[0]))
    vocab = args["vocab_size"]
    out = {"model.embed_tokens.weight": _cat(shards, "embedding.word_embeddings.weight", 0)[:vocab]}
    for i in range(args["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = shards[0][src + norms["input"]]
        for suffix in ("weight", "bias") if args.get("add_qkv_bias") else ("weight",):
            qkv = _cat(shards, f"{src}self_attention.linear_qkv.{suffix}", 0)
            for name, tensor in zip("qkv", split_qkv(qkv, heads, groups, head_dim)):
                out[f"{attn}{name}_proj.{suffix}"] = tensor
        out[attn + "o_proj.weight"] = _cat(shards, src + "self_attention.linear_proj.weight", 1)
        for ours, theirs in _qk_norms(args):
            out[attn + theirs] = shards[0][f"{src}self_attention.{ours}"]
        out[dst + "post_attention_layernorm.weight"] = shards[0][src + norms["pre_mlp"]]
        gate, up = unshard_fc1([shard[src + "mlp.linear_fc1.weight"] for shard in shards])
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = _cat(shards, src + "mlp.linear_fc2.weight", 1)
    out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
    if args["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = _cat(shards, "output_layer.weight", 0)[:vocab]
    return {key: tensor.contiguous() for key, tensor in out.items()}
