"""Data pipeline: tokenizers, vocab padding, megatron-core GPT datasets and Ulysses sequence
sharding."""
