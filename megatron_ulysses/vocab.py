"""Megatron-LM's vocabulary padding: the embedding and output layer have `Vp` rows, the
tokenizer's `V` rounded up so that every tensor-parallel rank holds the same number."""

import math


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocab padding: a multiple of `--make-vocab-size-divisible-by` x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def model_vocab_size(vocab_size: int, given, divisible_by: int, tp: int) -> int:
    """The model's vocab rows: `given` (--padded-vocab-size, as Megatron-LM takes it) when set,
    else `padded_vocab_size`. Raises `ConfigError` when `given` cannot hold the tokenizer's
    `vocab_size` ids."""
    if given is None:
        return padded_vocab_size(vocab_size, divisible_by, tp)
    if given < vocab_size:
        from .errors import ConfigError

        raise ConfigError(f"--padded-vocab-size ({given}) is smaller than the tokenizer's "
                          f"vocabulary ({vocab_size}); give at least {vocab_size} or drop it")
    return given
