"""Megatron-LM's vocabulary padding: the embedding and output layer have `Vp` rows, the
tokenizer's `V` rounded up so that every tensor-parallel rank holds the same number."""

import math


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocab padding: a multiple of `--make-vocab-size-divisible-by` x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
