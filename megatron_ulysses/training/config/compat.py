"""Megatron-LM's flags that are not ours to parse: those accepted so that its command lines run
(each names what this package always does; the one with a rule, --no-position-embedding, is
checked in `rules.py`), and those of features out of scope here (MoE, RL, inference, ...), which
`arguments.py` refuses together, one group a line."""

from typing import Dict, List, Sequence


def add_arguments(parser) -> None:
    g = parser.add_argument_group(
        "Megatron-LM flags accepted for compatibility (what this package always does)")
    for flag, why in (
        ("--use-mcore-models", "the model is always megatron-core's GPTModel"),
        ("--log-throughput", "throughput and TFLOP/s are always logged"),
        ("--use-flash-attn", "fused attention comes from --ulysses-attention-backend"),
        ("--attention-softmax-in-fp32", "the attention backends keep softmax in fp32"),
        ("--no-masked-softmax-fusion", "no masked-softmax fusion is used"),
        ("--no-create-attention-mask-in-dataloader", "the loader builds no attention mask: "
         "attention is causal (within documents with --reset-attention-mask)"),
        ("--no-position-embedding", "no learned position embedding: needs "
         "--position-embedding-type rope"),
        ("--apply-query-key-layer-scaling", "Megatron-LM's fp16 overflow guard for q.k "
         "(it forces the softmax into fp32): every attention backend here computes the "
         "softmax in fp32, so the result is the same"),
        ("--no-persist-layer-norm", "apex's persistent LayerNorm kernel is never used here"),
        ("--auto-detect-ckpt-format", "--load always recognizes the checkpoint's format: "
         "torch_dist (ours or Megatron-LM's) loads, any other is refused with one message"),
    ):
        g.add_argument(flag, action="store_true", help=why)


# Megatron-LM features outside dense GPT pretraining: (group, why, flag-name prefixes, flags).
# Membership is by prefix where Megatron-LM names a feature's flags that way.
OUT_OF_SCOPE = (
    ("MoE", "mixture-of-experts layers (and multi-token prediction) are not supported",
     ("--moe-", "--mtp-", "--expert-"),
     ("--num-experts", "--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm")),
    ("multi-latent / DSA / linear attention", "only standard (grouped-query) softmax "
     "attention is split by Ulysses here", ("--dsa-", "--linear-", "--mla-", "--mscale"),
     ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
      "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor", "--cache-mla-latents",
      "--attention-output-gate", "--experimental-attention-variant")),
    ("RL", "use Megatron-LM's RL pipeline", ("--rl-", "--grpo-"),
     ("--langrl-env-config", "--perform-rl-step", "--pretrained-checkpoint", "--refit-method")),
    ("inference", "this is a training script", ("--inference-",),
     ("--cuda-graph-modules", "--cuda-graph-scope", "--decode-only-cuda-graphs",
      "--enable-chunked-prefill", "--max-tokens-to-oom", "--num-speculative-tokens",
      "--output-bert-embeddings", "--use-legacy-static-engine",
      "--use-same-sampling-seed-across-dp-ranks")),
    ("vision / multimodal", "the model is a text GPT", ("--dino-", "--img-", "--vision-"),
     ("--classes-fraction", "--data-per-class-fraction", "--head-lr-mult", "--iter-per-epoch",
      "--mask-factor", "--mask-type", "--no-data-sharding", "--num-channels", "--num-classes",
      "--patch-dim", "--swin-backbone-type")),
    ("BERT / T5 / biencoder", "the model is a decoder-only GPT",
     ("--bert-", "--biencoder-", "--ict-", "--indexer-", "--retriever-", "--encoder-"),
     ("--block-data-path", "--decoder-seq-length", "--embedding-path", "--evidence-data-path",
      "--query-in-block-prob", "--titles-data-path", "--use-one-sent-docs",
      "--vocab-extra-ids")),
    ("hybrid / Mamba / heterogeneous layers", "every layer is the same transformer layer",
     ("--mamba-", "--hybrid-", "--heterogeneous-layers-"), ("--spec",)),
    ("distillation / ModelOpt / SFT", "use Megatron-LM's post-training scripts",
     ("--logits-", "--export-", "--sft"), ()),
    ("FIM data", "Megatron-LM's fill-in-the-middle dataset is not in megatron-core",
     ("--fim-",), ()),
)


def out_of_scope(flags: Sequence[str]) -> Dict[str, List[str]]:
    """`flags` (unknown to the parser) that name an out-of-scope feature, by its group."""
    groups: Dict[str, List[str]] = {}
    for flag in dict.fromkeys(flags):
        for group, _, prefixes, names in OUT_OF_SCOPE:
            if flag in names or flag.startswith(prefixes):
                groups.setdefault(group, []).append(flag)
                break
    return groups


def refusal(groups: Dict[str, List[str]], extra: Sequence[str] = ()) -> str:
    """The one refusal naming every given out-of-scope flag with its group's reason (`extra`:
    refusals of known flags, e.g. --context-parallel-size > 1)."""
    why = {group: reason for group, reason, _, _ in OUT_OF_SCOPE}
    parts = [f"{group} ({', '.join(flags)}): {why[group]}" for group, flags in groups.items()]
    return ("these Megatron-LM features are out of scope for megatron_ulysses (dense GPT "
            "pretraining with Ulysses SP): " + "; ".join(parts + list(extra)))
