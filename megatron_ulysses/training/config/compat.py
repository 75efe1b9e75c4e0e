"""Megatron-LM flags accepted so that its command lines run: each names what this package always
does (the one with a rule, --no-position-embedding, is checked in `rules.py`)."""


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
    ):
        g.add_argument(flag, action="store_true", help=why)
