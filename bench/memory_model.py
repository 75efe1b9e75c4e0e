"""Analytic memory model of training a GPT (Llama shape) with the trainer: the bytes per token
(per layer for the layer) each module saves for backward, derived from the shape (h hidden, ffn,
H heads, G kv heads, d head dim, e bytes per element) and what megatron-core's modules save, and
how each memory feature (recompute, TiledMLP, tiled loss, activation offload) changes them.

`layer_terms` and `outside_terms` give the terms without recompute, `apply_features` what the
features remove, add (checkpoints) or move to host, `analytic` the sums by submodule / bucket.
Checked exactly on CPU against memory_record.py's measurement (tests/integration/
test_memory_model.py) for the local and sdpa backends; for TE (norms fused into the qkv / fc1
GEMMs, fused RoPE and SwiGLU, TE's fused cross entropy) it is a prediction from their sources,
which the GPU run confirms or not. The bytes grow with s only through the materialized attention
scores (the local backend's [b, H, s, s] probabilities and its [s, s] causal mask): flash / fused
attention (te, sdpa) has no s^2 term.
"""

import dataclasses
from dataclasses import dataclass

import torch

# Where a saved tensor outside the layers belongs (bytes per token, not per layer).
OUTSIDE = ("embedding", "final_layernorm", "output_layer", "loss", "outside model", "decoder",
           "shared")


@dataclass(frozen=True)
class Profile:
    """What the built model's modules are, as far as what they save depends on it."""
    e: int               # bytes per activation element: 2 (bf16) or 4 (fp32)
    spec: str            # "te": TE layers (norm fused into linear_qkv / linear_fc1); "local"
    attention: str       # the Ulysses backend: te, sdpa or local
    norm: str            # "te", "torch-cpu" (decomposed RMSNorm) or "torch-cuda" (fused kernel)
    rope_fused: bool     # TE's fused RoPE (saves the shared frequencies only)
    swiglu_fused: bool   # megatron-core's bias_swiglu (saves the fc1 output only)
    cross_entropy: str   # "te" (fused, grad in place in the logits) or "unfused"
    verified: bool       # terms checked: on CPU by tests/integration/test_memory_model.py (local, sdpa),
                         # te on the H200 (bench/results/memory_model.json, 2026-12-04)

    @classmethod
    def of(cls, config, gpt) -> "Profile":
        model, mcore = config.model, gpt.config
        cuda = torch.cuda.is_available()
        backend = model.ulysses_attention_backend
        spec = "te" if model.transformer_impl == "transformer_engine" else "local"
        norm = "te" if spec == "te" else ("torch-cuda" if cuda else "torch-cpu")
        fused_ce = bool(mcore.cross_entropy_loss_fusion) and mcore.cross_entropy_fusion_impl == "te"
        return cls(e=2 if (model.bf16 or model.fp16) else 4, spec=spec, attention=backend,
                   norm=norm, rope_fused=bool(mcore.apply_rope_fusion),
                   swiglu_fused=bool(mcore.bias_activation_fusion),
                   cross_entropy="te" if fused_ce else "unfused",
                   verified=(backend == "te") == cuda == (spec == "te"))


@dataclass(frozen=True)
class Term:
    owner: str           # "layer" (bytes per token per layer) or an OUTSIDE bucket (per token)
    sub: str             # the layer's submodule ("" outside)
    name: str
    formula: str
    per_token: float
    kind: str = "activation"
    where: str = "device"


def _norm_terms(owner, sub, p: Profile, h: int, fused_output: bool) -> list:
    e = p.e
    if p.norm == "torch-cpu":  # torch RMSNorm's CPU decomposition: x^2 mean, rsqrt, x*rstd*w
        return [Term(owner, sub, "norm input x", "h·e", h * e),
                Term(owner, sub, "rstd", "e", e),
                Term(owner, sub, "x·rstd (for the weight grad)", "h·e", h * e)]
    terms = [Term(owner, sub, "norm input x", "h·e", h * e),
             Term(owner, sub, "rstd (fp32)", "4", 4)]
    if fused_output:  # TE LayerNormLinear keeps the norm output, its GEMM input
        terms.append(Term(owner, sub, "norm output (GEMM input)", "h·e", h * e))
    return terms


def layer_terms(shape, s: int, p: Profile) -> list:
    """What one layer saves per token without recompute (b = 1)."""
    h, f, H, G, e = shape.hidden, shape.ffn, shape.heads, shape.kv_heads, p.e
    d = h // H
    L = "layer"
    terms = []
    if p.spec == "te":
        terms += _norm_terms(L, "self_attention.linear_qkv", p, h, fused_output=True)
    else:
        terms += _norm_terms(L, "input_layernorm", p, h, fused_output=False)
        terms.append(Term(L, "self_attention.linear_qkv", "GEMM input (norm output)", "h·e",
                          h * e))
    if not p.rope_fused:
        terms.append(Term(L, "self_attention", "RoPE cos, sin of q and of k [s,1,1,d]",
                          "4·d·e", 4 * d * e))
    A = "self_attention.core_attention"
    if p.attention == "local":  # megatron-core's DotProductAttention
        terms += [Term(L, A, "q", "H·d·e", H * d * e),
                  Term(L, A, "k repeated to H heads", "H·d·e", H * d * e),
                  Term(L, A, "v repeated to H heads", "H·d·e", H * d * e),
                  Term(L, A, "causal mask [s,s] bool (s^2)", "s", s)]
        if e == 4:
            terms.append(Term(L, A, "softmax probs [H,s,s] (s^2)", "H·s·e", H * s * e))
        else:
            terms += [Term(L, A, "softmax output fp32 [H,s,s] (s^2)", "4·H·s", 4 * H * s),
                      Term(L, A, "probs [H,s,s] (s^2)", "H·s·e", H * s * e)]
    else:  # flash / fused: q, k (rotated copies), v, output and the softmax statistics
        terms += [Term(L, A, "q (rotated)", "H·d·e", H * d * e),
                  Term(L, A, "k (rotated)", "G·d·e", G * d * e),
                  # sdpa: v is a view and keeps the whole qkv GEMM output alive; TE's fused
                  # attention saves its own contiguous v (measured on the H200, 2026-12-04).
                  Term(L, A, "v (own copy)", "G·d·e", G * d * e) if p.attention == "te" else
                  Term(L, A, "v: a view, keeps the whole qkv GEMM output", "(H+2G)·d·e",
                       (H + 2 * G) * d * e),
                  Term(L, A, "output", "H·d·e", H * d * e),
                  Term(L, A, "logsumexp (fp32)", "4·H", 4 * H)]
    if p.attention == "local":  # sdpa / te: linear_proj's input is the output's storage
        terms.append(Term(L, "self_attention.linear_proj", "GEMM input (attention output)",
                          "h·e", h * e))
    if p.spec == "te":
        terms += _norm_terms(L, "mlp.linear_fc1", p, h, fused_output=True)
    else:
        terms += _norm_terms(L, "pre_mlp_layernorm", p, h, fused_output=False)
        terms.append(Term(L, "mlp.linear_fc1", "GEMM input (norm output)", "h·e", h * e))
    terms.append(Term(L, "mlp", "fc1 output [2·ffn] (SwiGLU input)", "2·ffn·e", 2 * f * e))
    if not p.swiglu_fused:  # glu(): silu(gate) * (up + glu_linear_offset)
        terms += [Term(L, "mlp", "silu(gate)", "ffn·e", f * e),
                  Term(L, "mlp", "up + glu_linear_offset (a copy, offset 0)", "ffn·e", f * e)]
    terms.append(Term(L, "mlp.linear_fc2", "GEMM input (SwiGLU output)", "ffn·e", f * e))
    return terms


def outside_terms(shape, vocab: int, p: Profile) -> list:
    """What the model saves per token outside its layers (b = 1; `vocab`: the padded V)."""
    h, V, e = shape.hidden, vocab, p.e
    d = h // shape.heads
    terms = [Term("embedding", "", "token ids (int64)", "8", 8)]
    if p.norm == "te":
        terms += [Term("final_layernorm", "", "norm input x", "h·e", h * e),
                  Term("final_layernorm", "", "rstd (fp32)", "4", 4)]
    else:
        terms += _norm_terms("final_layernorm", "", p, h, fused_output=False)
    terms.append(Term("output_layer", "", "GEMM input (final norm output)", "h·e", h * e))
    if p.cross_entropy == "te":
        terms.append(Term("loss", "", "logits [V] (TE writes the grad into them)", "V·e", V * e))
    else:
        terms += [Term("loss", "", "softmax [V] fp32 (in the logits' storage in fp32)", "4·V",
                       4 * V),
                  Term("loss", "", "target mask (bool)", "1", 1),
                  Term("loss", "", "masked target (int64)", "8", 8)]
    terms.append(Term("outside model", "", "loss mask (fp32) of loss·mask", "4", 4))
    if p.rope_fused:
        terms.append(Term("shared", "", "RoPE frequencies [s,1,1,d] fp32, one for all layers",
                          "4·d", 4 * d))
    return terms


def features_of(config) -> set:
    model = config.model
    features = set()
    if model.recompute_granularity == "full":
        features.add("full")
    elif model.recompute_granularity == "selective":
        features.add("selective")
    if model.tiled_mlp_shards is not None:
        features.add("tiled_mlp")
    if model.tiled_loss_shards is not None:
        features.add("tiled_loss")
    if model.offload_activations:
        features.add("offload")
    return features


def apply_features(terms: list, shape, s: int, p: Profile, features: set,
                   offload_min_bytes: int) -> list:
    """The no-recompute terms as `features` change them: removed terms, added checkpoints,
    offloaded (host) ones."""
    h, H, G, e = shape.hidden, shape.heads, shape.kv_heads, p.e
    d = h // H
    ckpt = "checkpoint"
    out = list(terms)
    if "tiled_mlp" in features:
        out = [t for t in out if not (t.owner == "layer" and t.sub.startswith("mlp"))]
        out.append(Term("layer", "mlp", "MLP input (TiledMLP checkpoint)", "h·e", h * e, ckpt))
    if "selective" in features:
        out = [t for t in out if t.sub != "self_attention.core_attention"]
        out += [Term("layer", "self_attention", "q (core_attn checkpoint)", "H·d·e", H * d * e,
                     ckpt),
                Term("layer", "self_attention", "k (core_attn checkpoint)", "G·d·e", G * d * e,
                     ckpt),
                Term("layer", "self_attention", "v: view of the qkv GEMM output (checkpoint)",
                     "(H+2G)·d·e", (H + 2 * G) * d * e, ckpt),
                Term("layer", "self_attention", "attn_mask_type [1] int32 (checkpoint)", "4/s",
                     4 / s, ckpt)]
        if p.attention != "local":  # no longer the attention output's storage
            out.append(Term("layer", "self_attention.linear_proj",
                            "GEMM input (checkpoint output)", "h·e", h * e))
    if "full" in features:
        out = [t for t in out if t.owner != "layer" and t.owner != "shared"]
        out += [Term("layer", "(block)", "layer input [s,b,h] (checkpoint)", "h·e", h * e, ckpt),
                Term("shared", "", "RoPE frequencies [s,1,1,d] fp32 (checkpoint of every layer)",
                     "4·d", 4 * d, ckpt)]
    if "tiled_loss" in features:
        out = [t for t in out if t.owner not in ("output_layer", "loss")]
        out.append(Term("loss", "", "final norm output (tiled loss checkpoint)", "h·e", h * e,
                        ckpt))
    if "offload" in features:  # what the decoder saves, tensors of at least min bytes
        out = [dataclasses.replace(t, where="host")
               if t.owner in ("layer", "final_layernorm", "shared")
               and t.per_token * s >= offload_min_bytes else t for t in out]
    return out


def analytic(shape, vocab: int, s: int, p: Profile, features: set,
             offload_min_bytes: int) -> dict:
    """Bytes per token (per layer for the layer) by submodule / bucket, and the terms."""
    terms = apply_features(layer_terms(shape, s, p) + outside_terms(shape, vocab, p), shape, s,
                           p, features, offload_min_bytes)
    layer = {"device": 0.0, "host": 0.0, "checkpoint": 0.0, "subs": {}}
    outside = {name: {"device": 0.0, "host": 0.0, "checkpoint": 0.0} for name in OUTSIDE}
    for t in terms:
        targets = [layer, layer["subs"].setdefault(t.sub, {"device": 0.0, "host": 0.0,
                                                            "checkpoint": 0.0})] \
            if t.owner == "layer" else [outside[t.owner]]
        for target in targets:
            target[t.where] += t.per_token
            if t.kind == "checkpoint":
                target["checkpoint"] += t.per_token
    return {"layer": layer, "outside": outside,
            "terms": [dataclasses.asdict(t) for t in terms]}

