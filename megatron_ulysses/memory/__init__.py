"""ALST memory features, each exact and off by default.

- ``tiled_mlp``: ``TiledMLP`` runs the dense MLP over sequence tiles (``--tiled-mlp-shards``).
- ``tiled_loss``: logits + cross entropy over sequence tiles (``--tiled-loss-shards``).
- ``activation_offload``: checkpointed layer inputs to CPU (``--offload-activations``).
- ``tiling``: the sequence-tiled recompute autograd helper the first two share.
"""
