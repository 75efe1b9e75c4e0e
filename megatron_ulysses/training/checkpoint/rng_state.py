"""Every rank's RNG states as CPU tensors (one row per rank in the checkpoint), restored only at
the layout they were saved at."""

import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from ...sp import parallel_state as ps
from ..logging import print_rank_0
from . import megatron_lm


def _generator_state(state) -> torch.Tensor:
    return state.get_state() if isinstance(state, torch.Generator) else state


def rng_tensors() -> dict:
    """This rank's RNG states, every one a CPU tensor."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert kind == "MT19937", kind
    states = {
        "python": torch.tensor([version, *internal, gauss is not None], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        states[f"tracker.{name}"] = _generator_state(state)
    return {name: tensor.detach().cpu().clone() for name, tensor in states.items()}


def set_rng_tensors(states: dict) -> None:
    python = [int(x) for x in states["python"].tolist()]
    random.setstate((python[0], tuple(python[1:-1]),
                     float(states["python_gauss"][0]) if python[-1] else None))
    numpy = [int(x) for x in states["numpy"].tolist()]
    np.random.set_state(("MT19937", np.array(numpy[:-2], dtype=np.uint32), numpy[-2],
                         numpy[-1], float(states["numpy_gauss"][0])))
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    for name in current:
        state = states[f"tracker.{name}"]
        if isinstance(current[name], torch.Generator):
            current[name].set_state(state)
        else:
            current[name] = state
    tracker.set_states(current)


def rng_layout(states: dict) -> dict:
    """What must match for every rank to restore its own RNG states (JSON-able)."""
    dims = ps.get_parallel_dims()
    return {"world_size": dims.world_size, "tp": dims.tp, "pp": dims.pp, "sp": dims.sp,
            "states": {name: list(tensor.shape) for name, tensor in sorted(states.items())}}


def rng_sharded(states: dict) -> dict:
    """One row per rank: `rng_state.<name>` has shape [world size, *state shape]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {name: ShardedTensor.from_rank_offsets(f"rng_state.{name}", tensor.unsqueeze(0),
                                                  (0, rank, world), replica_id=0)
            for name, tensor in states.items()}


def _describe(layout: dict) -> str:
    dp = layout["world_size"] // (layout["tp"] * layout["pp"] * layout["sp"])
    return (f"world {layout['world_size']} = TP {layout['tp']} x PP {layout['pp']} x "
            f"DP {dp} x Ulysses SP {layout['sp']}")


def rng_states_to_load(path: str, common: dict, seed: int):
    """This rank's RNG tensors (names and shapes) for the load to overwrite, or None with a
    warning when the checkpoint was saved at another layout (its states are per rank)."""
    rng_states = rng_tensors()
    saved_layout, layout = common.get("rng_layout"), rng_layout(rng_states)
    if saved_layout == layout:
        return rng_states
    if common.get("saved_by") == megatron_lm.SAVED_BY:
        why = ("it was saved by Megatron-LM, whose RNG states are one per TP x PP rank, seeded "
               "without Ulysses SP ranks")
    elif saved_layout is None and "rng_layout" in common:
        why = "it was saved with --no-save-rng"
    elif isinstance(saved_layout, dict) and all(
            saved_layout.get(k) == layout[k] for k in ("world_size", "tp", "pp", "sp")):
        why = (f"its RNG states {sorted(saved_layout.get('states', {}))} differ from "
               f"this run's {sorted(layout['states'])}")
    else:
        try:
            why = f"it was saved at {_describe(saved_layout)}"
        except (TypeError, KeyError, ZeroDivisionError):
            why = "it holds no usable RNG layout"
    print_rank_0(f" WARNING: --load {path}: {why}, this run is {_describe(layout)}: "
                 "RNG states are per rank and are not restored; this run keeps the "
                 f"RNG states seeded from --seed {seed}")
    return None
