"""Upper bounds no machine reaches: sizes whose first allocation would need more memory than any
machine has end here in one message naming the flags, not in an allocation traceback later.

The estimates are lower bounds of what the run must hold (so a real configuration -- a 70B
model, a million-token sequence over SP 64 -- is far below them): the weights of one pipeline
stage in 2 bytes each, one hidden-state tensor of a micro batch, and megatron-core's dataset
index of 16 bytes per sample, which one host builds.
"""

from .checks import Context, require

DEVICE_BYTES = 2**46  # 64 TiB: more than any accelerator or host's memory
HOST_BYTES = 2**42  # 4 TiB: more than one host's memory, where the dataset index is built


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**40:,.0f} TiB"


def validate(args, ctx: Context) -> None:
    """After the sections: the shapes, batch sizes and run length are filled in."""
    dims = ctx.dims
    layer = 4 * args.hidden_size * args.kv_channels * args.num_attention_heads + \
        3 * args.hidden_size * args.ffn_hidden_size
    vocab = max(args.padded_vocab_size or 0, args.vocab_size or 0)
    positions = args.max_position_embeddings \
        if args.position_embedding_type == "learned_absolute" else 0
    weights = 2 * (args.num_layers * layer / dims.pp + (vocab + positions)
                   * args.hidden_size) / dims.tp
    require(weights <= DEVICE_BYTES, f"--num-layers {args.num_layers} x --hidden-size "
            f"{args.hidden_size} (--ffn-hidden-size {args.ffn_hidden_size}) and the embeddings "
            f"of {vocab} vocab + {positions} positions (--max-position-embeddings, default "
            f"--seq-length): the weights of one pipeline stage alone need at least "
            f"{_size(weights)} per rank, more than any machine has; check these sizes")
    hidden = 2 * args.micro_batch_size * dims.local_seq_length(args.seq_length) * \
        args.hidden_size
    require(hidden <= DEVICE_BYTES, f"--seq-length {args.seq_length} / --ulysses-sp-size "
            f"{dims.sp} x --micro-batch-size {args.micro_batch_size} x --hidden-size "
            f"{args.hidden_size}: one layer's activations alone need at least "
            f"{_size(hidden)} per rank, more than any machine has; check these sizes (or "
            "raise --ulysses-sp-size)")
    steps = args.train_iters  # filled in from --train-samples by the training section
    samples = args.global_batch_size * (steps + args.eval_iters * (
        steps // args.eval_interval + 1))
    require(16 * samples <= HOST_BYTES, f"{samples:,} samples to train and evaluate on "
            f"(--train-iters / --train-samples, --eval-iters x --global-batch-size): "
            f"megatron-core's dataset index alone would need {_size(16 * samples)} of host "
            "memory, more than any machine has; check these counts")
