"""Records the tensors a GPTModel's forward saves for backward, and what its backward saves anew.

Under `torch.autograd.graph.saved_tensors_hooks` every saved tensor is counted by its storage (a
view counts its whole storage; a storage counts once; parameters, main_grad buffers and module
buffers are excluded), with where it stays (device, or host when the activation offload moved
it) and whether it is a checkpoint (saved by the `torch.autograd.Function` of a recompute:
megatron-core's CheckpointFunction, the sequence-tiled recompute of TiledMLP / tiled loss). A
module stack (forward pre/post hooks) attributes each saved tensor to a layer and a submodule
(two levels below the layer), or to the embedding, the final norm, the output layer, the loss
(GPTModel._postprocess) or the loss·mask sum outside the model; a storage saved by more than one
of these is "shared" (RoPE frequencies). The activation offload pushes its own hooks inside the
decoder (the innermost hooks win), so the recorder wraps them: it calls the offload's pack first
and records what that leaves on the device. In backward the new saved storages are the
recompute working set (peak of the live ones); `live` is what is still held.
"""

import contextlib
import re
from dataclasses import dataclass
from typing import Optional

import torch

import harness
from megatron_ulysses.memory import activation_offload, tiling
from memory_model import OUTSIDE


def storage_of(tensor: torch.Tensor) -> tuple:
    """(key, bytes) of the storage behind `tensor` (a view keeps its whole storage alive)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one
        return id(tensor), tensor.numel() * tensor.element_size()


@dataclass
class Saved:
    owner: str            # "layer" or one of OUTSIDE
    layer: Optional[int]
    sub: str              # the layer's submodule ("" outside a layer)
    kind: str             # "activation" or "checkpoint" (a recompute's input)
    where: str            # "device" or "host"
    nbytes: int
    shape: tuple
    dtype: str


class _Held:
    """What the pack hook returns: the packed object, and the key whose refcount it holds (so
    the recorder knows which saved storages are alive)."""

    __slots__ = ("recorder", "key", "inner")

    def __init__(self, recorder, key, inner):
        self.recorder, self.key, self.inner = recorder, key, inner

    def __del__(self):
        self.recorder._release(self.key)


class SavedTensorRecorder:
    """Records the tensors saved for backward while `recording(phase)` is active, attributed to
    the module (of `model`, a DDP-wrapped GPTModel) whose forward saved them."""

    def __init__(self, model):
        self.gpt = harness.unwrap(model)
        self.excluded = set()  # storages that are state, not activations
        for param in model.parameters():
            self.excluded.add(storage_of(param)[0])
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                self.excluded.add(storage_of(main_grad)[0])
        for buffer in self.gpt.buffers():  # (DDP.buffers is its list of grad buffers)
            self.excluded.add(storage_of(buffer)[0])
        self.on_cuda = torch.cuda.is_available()
        self.phase = None
        self.stack = []
        self.last_layer = None
        self.recompute_depth = 0
        self.saved = {}       # key -> Saved, first saver of each storage in forward
        self.savers = {}      # key -> {(owner, layer)}
        self.tensors = []     # every forward save, duplicates included (for the JSON detail)
        self.live = {}        # key -> [refcount, bytes, phase]
        self.backward_live = 0
        self.backward_peak = 0

    # -- module stack ---------------------------------------------------------------------
    def _labels(self):
        for name, module in self.gpt.named_modules():
            if name in ("embedding", "decoder", "decoder.final_layernorm", "output_layer"):
                yield name, module
            elif re.fullmatch(r"decoder\.layers\.\d+(\.[^.]+){0,2}", name):
                yield name, module

    def _owner(self) -> tuple:
        if not self.stack:
            return "outside model", None, ""
        label = self.stack[-1]
        if label == "decoder":
            if self.last_layer is None:
                return "decoder", None, ""
            return "layer", self.last_layer, "(block)"  # CheckpointFunction, around a layer
        match = re.fullmatch(r"decoder\.layers\.(\d+)(?:\.(.+))?", label)
        if match:
            return "layer", int(match.group(1)), match.group(2) or "(layer)"
        if label.startswith("decoder.final_layernorm"):
            return "final_layernorm", None, ""
        if label == "":
            return "loss", None, ""  # GPTModel outside its children: _postprocess's loss
        return label, None, ""

    @contextlib.contextmanager
    def _module_hooks(self):
        handles = []

        def enter(label, index):
            def hook(module, args):
                if label == "decoder":
                    self.last_layer = None
                if index is not None:
                    self.last_layer = index
                self.stack.append(label)
            return hook

        def leave(module, args, output):
            self.stack.pop()

        modules = [("", self.gpt)] + list(self._labels())
        for label, module in modules:
            match = re.fullmatch(r"decoder\.layers\.(\d+)", label)
            handles.append(module.register_forward_pre_hook(
                enter(label, int(match.group(1)) if match else None)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- recompute functions ------------------------------------------------------------
    @contextlib.contextmanager
    def _recompute_flags(self):
        """Count the saves made inside `apply` of the recompute functions as checkpoints."""
        from megatron.core.tensor_parallel.random import CheckpointFunction

        classes = [CheckpointFunction] + [
            obj for obj in vars(tiling).values()
            if isinstance(obj, type) and issubclass(obj, torch.autograd.Function)]
        patched = []
        for cls in classes:
            original = cls.apply

            def apply(*args, _original=original, **kwargs):
                self.recompute_depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.recompute_depth -= 1
            patched.append((cls, cls.__dict__.get("apply")))
            cls.apply = staticmethod(apply)
        try:
            yield
        finally:
            for cls, own in reversed(patched):
                if own is None:
                    del cls.apply
                else:
                    cls.apply = own

    @contextlib.contextmanager
    def _offload_wrapped(self, min_bytes_override):
        """The decoder's offload context (looked up when the decoder's forward starts) with the
        recorder's hooks composed inside it."""
        original = activation_offload.offload_saved_activations

        @contextlib.contextmanager
        def recorded(min_bytes=activation_offload.DEFAULT_MIN_OFFLOAD_BYTES, stats=None):
            if min_bytes_override is not None:
                min_bytes = min_bytes_override
            with original(min_bytes, stats):
                top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
                if top is None:
                    raise RuntimeError("this torch cannot compose saved-tensor hooks "
                                       "(torch._C._autograd._top_saved_tensors_default_hooks)")
                pack, unpack = top(True)
                with self._hooks(pack, unpack):
                    yield

        activation_offload.offload_saved_activations = recorded
        try:
            yield
        finally:
            activation_offload.offload_saved_activations = original

    @contextlib.contextmanager
    def installed(self, offload_min_bytes=None):
        with self._module_hooks(), self._recompute_flags(), \
                self._offload_wrapped(offload_min_bytes):
            yield

    # -- the hooks ------------------------------------------------------------------------
    def _hooks(self, pack_inner=None, unpack_inner=None):
        def pack(tensor):
            inner = pack_inner(tensor) if pack_inner is not None else tensor
            return self._record(tensor, inner)

        def unpack(held):
            inner = held.inner if isinstance(held, _Held) else held
            return unpack_inner(inner) if unpack_inner is not None else inner

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @contextlib.contextmanager
    def recording(self, phase: str):
        self.phase = phase
        try:
            with self._hooks():
                yield
        finally:
            self.phase = None

    def _record(self, tensor, inner):
        ptr, nbytes = storage_of(tensor)
        if nbytes == 0 or ptr in self.excluded:
            return inner
        if inner is not tensor:  # the offload's pack moved it: its host copy is `.cpu`
            where, key = "host", ("host", id(inner))
            nbytes = storage_of(inner.cpu)[1]
        elif self.on_cuda and tensor.device.type == "cpu":
            where, key = "host", ("host", ptr)
        else:
            where, key = "device", ("device", ptr)
        if self.phase == "forward":
            owner, layer, sub = self._owner()
            kind = "checkpoint" if self.recompute_depth else "activation"
            new = key not in self.saved
            if new:
                self.saved[key] = Saved(owner, layer, sub, kind, where, nbytes,
                                        tuple(tensor.shape), str(tensor.dtype).split(".")[-1])
            self.savers.setdefault(key, set()).add((owner, layer))
            self.tensors.append({"owner": owner, "layer": layer, "sub": sub, "kind": kind,
                                 "where": where, "shape": list(tensor.shape),
                                 "dtype": str(tensor.dtype).split(".")[-1], "bytes": nbytes,
                                 "new_storage": new})
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, nbytes, self.phase]
            if self.phase == "backward":
                self.backward_live += nbytes
                self.backward_peak = max(self.backward_peak, self.backward_live)
        else:
            entry[0] += 1
        return _Held(self, key, inner)

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            if entry[2] == "backward":
                self.backward_live -= entry[1]

    # -- results ---------------------------------------------------------------------------
    def summary(self, num_layers: int) -> dict:
        """Bytes (not per token) by layer and submodule, outside buckets and totals."""
        def bucket():
            return {"device": 0, "host": 0, "checkpoint": 0}

        def add(target, saved):
            target[saved.where] += saved.nbytes
            if saved.kind == "checkpoint":
                target["checkpoint"] += saved.nbytes

        layers = [dict(bucket(), subs={}) for _ in range(num_layers)]
        outside = {name: bucket() for name in OUTSIDE}
        shared_tensors = []
        totals = bucket()
        for key, saved in self.saved.items():
            add(totals, saved)
            if len(self.savers[key]) > 1:
                add(outside["shared"], saved)
                shared_tensors.append({"shape": list(saved.shape), "dtype": saved.dtype,
                                       "bytes": saved.nbytes, "where": saved.where,
                                       "kind": saved.kind, "savers": sorted(
                                           f"{o}{'' if l is None else f' {l}'}"
                                           for o, l in self.savers[key])})
            elif saved.owner == "layer":
                layer = layers[saved.layer]
                add(layer, saved)
                add(layer["subs"].setdefault(saved.sub, bucket()), saved)
            else:
                add(outside[saved.owner], saved)
        return {"layers": layers, "outside": outside, "shared_tensors": shared_tensors,
                "totals": totals, "backward_working_set": self.backward_peak,
                "layer0_tensors": [t for t in self.tensors if t["layer"] == 0],
                "outside_tensors": [t for t in self.tensors if t["owner"] != "layer"]}
