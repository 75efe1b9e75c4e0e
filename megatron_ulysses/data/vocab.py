"""Megatron-LM's vocabulary padding: the embedding and output layer have `Vp` rows, the
tokenizer's `V` rounded up so that every tensor-parallel rank holds the same number."""

import math


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocab padding: a multiple of `--make-vocab-size-divisible-by` x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def model_vocab_size(vocab_size: int, given, divisible_by: int, tp: int,
                     pad: bool = True) -> int:
    """The model's vocab rows: `given` (--padded-vocab-size, as Megatron-LM takes it) when set,
    else `padded_vocab_size`, or `vocab_size` itself without `pad` (--no-pad-vocab-size).
    Raises `ConfigError` when `given` cannot hold the tokenizer's `vocab_size` ids, or the
    unpadded rows do not split over TP."""
    from ..errors import ConfigError

    if given is None and not pad:
        if vocab_size % tp:
            raise ConfigError(f"--no-pad-vocab-size: the tokenizer's vocabulary ({vocab_size}) "
                              f"does not divide by --tensor-model-parallel-size ({tp}); drop "
                              "the flag or give --padded-vocab-size")
        return vocab_size
    if given is None:
        return padded_vocab_size(vocab_size, divisible_by, tp)
    if given < vocab_size:
        raise ConfigError(f"--padded-vocab-size ({given}) is smaller than the tokenizer's "
                          f"vocabulary ({vocab_size}); give at least {vocab_size} or drop it")
    return given
