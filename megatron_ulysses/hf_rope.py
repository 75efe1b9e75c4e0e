"""Hugging Face RoPE parameters <-> Megatron-LM's RoPE flags (default, llama3, linear, yarn).

Pure functions on plain dicts. HF's YaRN scales cos and sin by its attention factor; megatron-core's
`YarnRotaryEmbedding` returns the same factor (`--mscale` over `--mscale-all-dim`'s, its
"concentration factor") and megatron-core's `apply_rotary_pos_emb` scales cos and sin by it, so q·k
carries its square in both, with the softmax scale 1/sqrt(d) in both.
"""

import math

from .sp.rope import YARN_DEFAULTS, yarn_attention_factor

# megatron-core's RotaryEmbedding._apply_scaling (0.16 and 0.19) takes only the factor; these are
# its hard-coded llama3 parameters.
MCORE_LLAMA3_ROPE = {
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}
_HF_ROPE_DEFAULT_THETA = 10000.0
_REFUSED_ROPE_TYPES = {
    "dynamic": "its frequencies depend on each batch's sequence length (no fixed table that "
               "megatron-core's RoPE could hold)",
    "longrope": "its per-dimension rescale factors switch at the original context length; "
                "megatron-core has no LongRoPE embedding",
}


def refuse(field: str, value, why: str):
    """ValueError naming the HF config field, its value and why it cannot convert."""
    raise ValueError(f"unsupported Hugging Face config: {field}={value!r}: {why}")


def rope_parameters(config: dict) -> dict:
    """The RoPE parameters of an HF config in transformers 5's form {"rope_type", "rope_theta",
    ...}, from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older
    config.json files; the legacy key "type" is read as "rope_type"). As transformers, llama3 and
    yarn take a top-level `original_max_position_embeddings` first, else max_position_embeddings."""
    if config.get("rope_parameters") is not None:
        params = dict(config["rope_parameters"])
        if "rope_theta" not in params and "rope_type" not in params:
            refuse("rope_parameters", config["rope_parameters"],
                   "per-layer-type RoPE parameters are not supported")
    else:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", _HF_ROPE_DEFAULT_THETA))
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", config.get("rope_theta", _HF_ROPE_DEFAULT_THETA))
    if params["rope_type"] in ("llama3", "yarn"):
        if "original_max_position_embeddings" in config:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params


def _int_if_integral(value):
    return int(value) if float(value).is_integer() else value


def _yarn_model_args(params: dict, config: dict) -> dict:
    """HF yarn parameters -> Megatron-LM's YaRN flags, with HF's defaults (factor
    max_position_embeddings / original, beta_fast 32, beta_slow 1, truncate true)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config["max_position_embeddings"] / original
    args = {"rotary_scaling_factor": float(factor),
            "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(params.get("beta_fast") or 32),
            "yarn_beta_slow": float(params.get("beta_slow") or 1),
            "mscale": 1.0, "mscale_all_dim": 0.0,
            "yarn_correction_range_round_to_int": bool(params.get("truncate", True))}
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):  # HF uses both or neither
            args.update(mscale=float(params["mscale"]),
                        mscale_all_dim=float(params["mscale_all_dim"]))
        return args
    if attention_factor != yarn_attention_factor(args):
        if factor <= 1:
            refuse("rope_scaling.attention_factor", attention_factor,
                   "megatron-core's YaRN scales cos / sin by 1 when factor <= 1")
        # megatron-core's factor is mscale's: solve 0.1 * mscale * ln(factor) + 1 = it
        args["mscale"] = (attention_factor - 1.0) / (0.1 * math.log(factor))
        if not math.isclose(yarn_attention_factor(args), attention_factor, rel_tol=1e-12):
            refuse("rope_scaling.attention_factor", attention_factor,
                   "megatron-core's YaRN (--mscale) cannot express it to 1e-12")
    return args


def rope_model_args(config: dict) -> dict:
    """HF RoPE parameters -> Megatron-LM flags: rotary_base, and use_rope_scaling +
    rope_scaling_factor (llama3, with megatron-core's hard-coded low/high frequency factors and
    original context), rotary_seq_len_interpolation_factor (linear) or position_embedding_type
    yarn with its flags. ValueError otherwise."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        refuse("partial_rotary_factor", partial, "only full rotary embeddings are supported")
    args = {"position_embedding_type": "rope",
            "rotary_base": _int_if_integral(params["rope_theta"])}
    if rope_type == "default":
        return args
    if rope_type == "llama3":
        for key, value in MCORE_LLAMA3_ROPE.items():
            if params.get(key) != value:
                refuse(f"rope_scaling.{key}", params.get(key),
                       f"megatron-core's llama3 RoPE scaling hard-codes {key}={value}")
        if params.get("attention_factor", 1.0) != 1.0:
            refuse("rope_scaling.attention_factor", params["attention_factor"],
                   "llama3 RoPE scaling has no attention factor")
        return {**args, "use_rope_scaling": True, "rope_scaling_factor": params["factor"]}
    if rope_type == "linear":
        return {**args, "rotary_seq_len_interpolation_factor": _int_if_integral(params["factor"])}
    if rope_type == "yarn":
        return {**args, "position_embedding_type": "yarn", **_yarn_model_args(params, config)}
    refuse("rope_scaling.rope_type", rope_type, _REFUSED_ROPE_TYPES.get(
        rope_type, "megatron-core's GPTModel supports 'default', 'llama3', 'linear' and 'yarn'"))


def hf_rope_parameters_from_model_args(args: dict) -> dict:
    """Megatron-LM RoPE flags -> HF RoPE parameters {"rope_type", "rope_theta", ...}."""
    params = {"rope_theta": args.get("rotary_base", _HF_ROPE_DEFAULT_THETA)}
    if args.get("position_embedding_type") == "yarn":
        yarn = {**YARN_DEFAULTS, **{k: v for k, v in args.items()
                                    if k in YARN_DEFAULTS and v is not None}}
        params.update(rope_type="yarn", factor=yarn["rotary_scaling_factor"],
                      original_max_position_embeddings=yarn[
                          "yarn_original_max_position_embeddings"],
                      beta_fast=yarn["yarn_beta_fast"], beta_slow=yarn["yarn_beta_slow"],
                      truncate=yarn["yarn_correction_range_round_to_int"])
        if yarn["mscale"] and yarn["mscale_all_dim"]:
            params.update(mscale=yarn["mscale"], mscale_all_dim=yarn["mscale_all_dim"])
        elif (yarn["mscale"], yarn["mscale_all_dim"]) != (1.0, 0.0):
            params["attention_factor"] = yarn_attention_factor(yarn)
        return params
    if args.get("use_rope_scaling"):
        return {"rope_type": "llama3", **params, "factor": args.get("rope_scaling_factor", 8.0),
                **MCORE_LLAMA3_ROPE}
    if args.get("rotary_seq_len_interpolation_factor") is not None:
        return {"rope_type": "linear", **params,
                "factor": args["rotary_seq_len_interpolation_factor"]}
    return {"rope_type": "default", **params}


def put_rope(config: dict, args: dict) -> None:
    """Write the RoPE parameters in the base config's form (transformers 5 `rope_parameters`, or
    `rope_theta` + `rope_scaling`), leaving a base entry that gives the same flags as it is."""
    wanted = hf_rope_parameters_from_model_args(args)
    if "rope_parameters" in config or "rope_theta" in config:
        try:
            have = hf_rope_parameters_from_model_args(rope_model_args(config))
        except ValueError:
            have = None
        if have == wanted:
            return
    if config.get("rope_parameters") is not None:
        config["rope_parameters"] = wanted
        return
    config["rope_theta"] = wanted.pop("rope_theta")
    config["rope_scaling"] = None if wanted["rope_type"] == "default" else wanted
