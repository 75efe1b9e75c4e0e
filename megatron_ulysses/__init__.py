"""Ulysses sequence parallelism for megatron-core GPT pretraining."""

__version__ = "0.1.0"
