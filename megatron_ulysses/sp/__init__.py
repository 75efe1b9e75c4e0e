"""The Ulysses core: one sequence split over the P ranks of an SP group, re-sharded to heads
around core attention. Imports nothing of the trainer.

- `parallel_state`: SP groups carved out of megatron-core's DP (world = TP x PP x DP x SP);
- `head_layout`: which query / kv heads each SP rank takes (the head rules, checked once);
- `all_to_all`: the pure re-shard layouts and the two autograd exchanges;
- `attention`: `UlyssesAttention`, the `core_attention` of the layer spec;
- `backends`: the attention between the exchanges (TE, SDPA, local, FlashAttention-4);
- `rope`: rotary embeddings at each shard's global positions;
- `layer_specs`: the GPT layer spec and model with Ulysses attention;
- `rng`: dropout streams per (TP, SP, PP) rank; `loss`: the per-token loss over SP x DP.
"""
