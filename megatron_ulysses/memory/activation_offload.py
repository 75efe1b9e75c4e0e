"""Offload the checkpointed layer inputs of full activation recompute to CPU (ALST).

Glossary: ``s`` sequence, ``b`` micro batch, ``h`` hidden.

With ``recompute_granularity="full"``, ``recompute_method="uniform"``,
``recompute_num_layers=1`` the only tensors a ``TransformerBlock`` forward saves
for backward are each layer's input ``[s, b, h]`` (held by megatron-core's
``CheckpointFunction``) plus the final norm's input. A
``saved_tensors_hooks`` context moves them to (pinned) CPU memory as they are
saved and brings each back when its layer is recomputed in backward, so GPU
activation memory no longer grows with the number of layers.
"""

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

# Below this size a tensor stays put: the copy would cost more than it frees.
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20


@dataclass
class OffloadStats:
    """Counters of tensors moved to CPU and brought back."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0


class _Offloaded:
    """A CPU copy of a saved tensor, plus what is needed to bring it back."""

    def __init__(self, tensor: torch.Tensor, side_stream: Optional["torch.cuda.Stream"]):
        self.device = tensor.device
        self.event = None
        if side_stream is None:
            self.cpu = tensor.to("cpu", copy=True)
            return
        # D2H on a side stream overlaps the copy with the next layer's compute.
        self.cpu = torch.empty_like(tensor, device="cpu", pin_memory=True)
        side_stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(side_stream):
            self.cpu.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(side_stream)
        # Keep the GPU block from being reused until the side-stream copy is done.
        tensor.record_stream(side_stream)

    def restore(self) -> torch.Tensor:
        if self.event is None:
            return self.cpu
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return self.cpu.to(self.device, non_blocking=True)


@functools.lru_cache(maxsize=None)
def _side_stream(device_index: int) -> "torch.cuda.Stream":
    """One copy stream per GPU, reused across forwards."""
    return torch.cuda.Stream(device=device_index)


def _stays_put(tensor: torch.Tensor, min_bytes: int) -> bool:
    """Parameters (or views of them), tensor subclasses and small tensors are not moved;
    on a CUDA run neither are tensors already on the CPU."""
    base = tensor._base if tensor._base is not None else tensor
    return (
        type(tensor) is not torch.Tensor
        or type(base) is not torch.Tensor
        or tensor.numel() * tensor.element_size() < min_bytes
        or (not tensor.is_cuda and torch.cuda.is_available())
    )


@contextlib.contextmanager
def offload_saved_activations(
    min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES, stats: Optional[OffloadStats] = None
):
    """Within this context, tensors saved for backward of at least ``min_bytes``
    go to CPU (pinned + side stream on CUDA) and come back on use in backward.

    Parameters, tensor subclasses (e.g. FP8) and small tensors stay put. A tensor
    saved several times in the context (attention mask, RoPE) is copied once.
    On a CPU-only run CPU tensors are copied, so tests exercise the same round trip.
    """
    seen = {}  # id -> (weakref, version, packed): dedup without keeping GPU tensors alive

    def pack(tensor: torch.Tensor):
        if _stays_put(tensor, min_bytes):
            return tensor
        hit = seen.get(id(tensor))
        if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
            return hit[2]
        stream = _side_stream(tensor.device.index) if tensor.is_cuda else None
        packed = _Offloaded(tensor, stream)
        seen[id(tensor)] = (weakref.ref(tensor), tensor._version, packed)
        if stats is not None:
            stats.offloaded_tensors += 1
            stats.offloaded_bytes += tensor.numel() * tensor.element_size()
        return packed

    def unpack(packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if stats is not None:
            stats.restored_tensors += 1
        return packed.restore()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def enable_activation_offload(
    block: torch.nn.Module,
    min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    stats: Optional[OffloadStats] = None,
) -> tuple:
    """Run every forward of ``block`` (a ``TransformerBlock``, e.g. ``model.decoder``)
    inside ``offload_saved_activations``; returns the two hook handles (``.remove()``).

    Hooks on the block, not a context around the whole model forward, so only
    the checkpointed layer inputs move, not the embedding's or the logits'.
    """
    if block.config.recompute_granularity != "full":
        raise ValueError("--offload-activations requires --recompute-granularity full")
    active = []

    def enter(module, args):
        ctx = offload_saved_activations(min_bytes, stats)
        ctx.__enter__()
        active.append(ctx)

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)

    return (
        block.register_forward_pre_hook(enter),
        block.register_forward_hook(leave, always_call=True),
    )
