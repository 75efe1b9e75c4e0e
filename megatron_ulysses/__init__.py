"""Ulysses sequence parallelism for megatron-core GPT pretraining."""

import warnings

__version__ = "0.1.0"

# megatron-core announces its fallbacks on import; without apex (and on CPU without TE) they are
# expected here. TransformerConfig also warns about a default it sets itself, and torch's
# checkpoint internals about APIs megatron-core's dist_checkpointing still uses.
for _message in (".*(Apex|Transformer Engine).* not installed.*", "full scope is deprecated",
                 "Please use DTensor instead", "`load_state_dict` is deprecated"):
    warnings.filterwarnings("ignore", message=_message)
