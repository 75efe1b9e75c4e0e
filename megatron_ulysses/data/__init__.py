"""Data pipeline: tokenizers, megatron-core GPT datasets and Ulysses sequence sharding."""
