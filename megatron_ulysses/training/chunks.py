"""The virtual pipeline's model chunks (--num-layers-per-virtual-pipeline-stage): with it a
pipeline rank holds a list of models, one per virtual stage, which megatron-core's interleaved
schedule runs with one data iterator each; without it, one model, seen here as a list of one.
Checkpoints name the chunks' states as Megatron-LM does: "model" for one, "model0", "model1", ...
for several.
"""

import itertools


def model_chunks(model) -> list:
    """The chunks of `model`: the interleaved schedule's list, or [the one model]."""
    return model if isinstance(model, list) else [model]


def chunk_iterators(model, data_iterator):
    """What megatron-core's schedule takes as `data_iterator`: one for one model; for chunks,
    one copy of `data_iterator` per chunk (each chunk's forward reads every micro batch)."""
    if not isinstance(model, list):
        return data_iterator
    return list(itertools.tee(data_iterator, len(model)))


def state_keys(model) -> list:
    """The checkpoint's key of each chunk's state (Megatron-LM's)."""
    chunks = model_chunks(model)
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
