"""Checkpoint trust: `--load` never runs code from the checkpoint.

A checkpoint is untrusted input. Everything megatron_ulysses stores besides tensors is a plain
value (int, float, str, bool, None, lists, dicts): RNG states are tensors, the iteration,
samples, arguments and the scheduler state are JSON-able. Megatron-LM's checkpoints also pickle
its args (an `argparse.Namespace`), numpy RNG states and a few of megatron-core's enums
(`_MEGATRON_LM`). Before megatron-core reads anything, every file it would unpickle is checked
with a restricted unpickler that admits only tensors, plain containers, torch.distributed.
checkpoint's metadata classes (in `.metadata`) and the `_MEGATRON_LM` types and the offloaded
optimizer's classes, as values only (in `.pt` files and ShardedObjects), for both megatron-core
0.16 and 0.19:
  * `.metadata` (and any rank-local `__<rank>.metadata`): `pickle.load` in DCP's FileSystemReader;
  * every BytesIO item those files list (ShardedObjects: the common state in 0.19, layers'
    `_extra_state`, anything planted), read from `*.distcp` and unpickled by DCP's
    `load_bytes` with `torch.load(weights_only=False)`;
  * `common.pt` (0.16's common state; 0.19 still loads one if it exists) and any other `*.pt`
    (0.16's per-object files), read with `torch.load`;
  * `metadata.json` (JSON, no code) must name the torch_dist backend.
Tensor items of `*.distcp` are read by DCP with `torch.load(weights_only=True)`. After the load,
non-empty `_extra_state` byte tensors (Transformer Engine unpickles them) get the same check
(`check_extra_states`); Transformer Engine >= 2.20 then unpickles FP8 delayed scaling's only
inside `extra_states_checked` (its NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE opt-in). Anything else is refused with one `ConfigError` naming `--load` and the
offending file; a truncated or garbage file is one `ConfigError` too, and never reaches the real
unpickler.
"""

import collections
import contextlib
import io
import json
import os
import pickle
import zipfile

import torch

from ...errors import ConfigError


class _Refused(Exception):
    """What a checked pickle holds that is not allowed."""


class _Stub:
    """Stands for a tensor, storage or admitted object while a payload is checked: nothing is
    rebuilt, and no constructor or `__setstate__` of the real class runs."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _stub(*args, **kwargs):
    return _Stub()


def _dcp_classes() -> dict:
    """torch.distributed.checkpoint's metadata classes (those this torch version has)."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    names = {
        metadata: ("Metadata", "StorageMeta", "MetadataIndex", "BytesStorageMetadata",
                   "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                   "_MEM_FORMAT_ENCODING"),
        planner: ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                  "BytesIOWriteData"),
        filesystem: ("_StorageInfo", "_StoragePrefix"),
    }
    return {(module.__name__, name): getattr(module, name)
            for module, attrs in names.items() for name in attrs if hasattr(module, name)}


_PLAIN = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
}
# torch.save's tensor pickles: checked with stubs, so no rebuild code runs while checking.
_TENSOR_REBUILD = {("torch._utils", "_rebuild_tensor_v2"): _stub}
# What Megatron-LM's `save_checkpoint` pickles besides tensors and plain values (the subset of
# megatron-core's own `safe_globals.SAFE_GLOBALS` that a GPT checkpoint holds), admitted in
# `.pt` files and ShardedObject items only: its `args` (an argparse.Namespace holding torch
# dtypes, `--attention-backend`'s AttnBackend, `model_type`, `--exit-signal`'s signal, paths,
# CUDA-graph scopes), the rerun state machine's enums, numpy's RNG state (a tuple with a uint32
# ndarray: `_reconstruct`, `ndarray`, `dtype`, numpy scalars) and protocol 2's bytes
# (`_codecs.encode`). All are stubs while checking; megatron-core then reads `common.pt` with
# torch's weights_only unpickler, which builds these from its own list.
_MEGATRON_LM = {key: _Stub for key in (
    ("argparse", "Namespace"), ("pathlib", "PosixPath"), ("signal", "Signals"),
    ("_codecs", "encode"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "CudaGraphScope"),
    ("megatron.core.transformer.enums", "CudaGraphModule"),
    ("megatron.core.transformer.enums", "InferenceCudaGraphScope"),
    ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"),
    ("megatron.core.rerun_state_machine", "RerunDiagnostic"),
)}


def _storage_from_bytes(data) -> _Stub:
    """`torch.storage._load_from_bytes(b)`, pickle's form of a CPU storage, hands `b` (a legacy
    torch.save of the storage) to torch.load's full unpickler when the real object is built: `b`
    is checked here first: three plain header pickles, the storage reference, its keys, then raw
    bytes that are never unpickled."""
    if not isinstance(data, (bytes, bytearray)):
        raise _Refused(f"a storage built from {type(data).__name__}, not bytes")
    stream = io.BytesIO(bytes(data))
    for _ in range(3):  # magic number, protocol version, sys info
        _RestrictedUnpickler(stream, _PLAIN, storages=False).load()
    _RestrictedUnpickler(stream, _PLAIN, storages=True).load()
    _RestrictedUnpickler(stream, {}, storages=False).load()  # the storage keys: strings
    return _Stub()


# Transformer Engine's FP8 `_extra_state` is `pickle.dumps` of a dict holding its recipe (the
# dataclasses, enums and named tuples of `transformer_engine.common.recipe`) and CPU tensors
# (the delayed recipe's scales and amax histories).
_TE_EXTRA_STATE = {
    **{("transformer_engine.common.recipe", name): _Stub for name in (
        "Format", "_FormatHelper", "_OverrideLinearPrecision", "MMParams", "QParams", "Recipe",
        "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
        "NVFP4BlockScaling")},
    # megatron-core's subclass of the delayed recipe, what its TE layers store (H100 run)
    ("megatron.core.extensions.transformer_engine", "TEDelayedScaling"): _Stub,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    # megatron-core 0.19 replaces torch.storage._load_from_bytes with this weights_only
    # version on import, so the storages it pickles name it (H100 run); same bytes
    ("megatron.core.safe_globals", "safe_load_from_bytes"): _storage_from_bytes,
}


class _ValueOnly:
    """A class a checkpoint may hold as a value but never call (REDUCE / NEWOBJ refuse)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise _Refused(f"a call of {self.name}")


# megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload) keeps its sub-optimizers'
# classes in its param groups' defaults, so the distributed optimizer's common state pickles
# them (H100 run): torch's CPU AdamW / SGD and the GPU side's TE, apex or torch class.
_OFFLOAD_OPTIMIZER_CLASSES = {(module, name): _ValueOnly(f"{module}.{name}") for module, name in (
    ("torch.optim.adamw", "AdamW"), ("torch.optim.sgd", "SGD"),
    ("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam"),
    ("transformer_engine.pytorch.optimizers.fused_sgd", "FusedSGD"),
    ("apex.optimizers.fused_adam", "FusedAdam"), ("apex.optimizers.fused_sgd", "FusedSGD"),
)}


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds only allowed globals; `storages` admits torch.save's storage references."""

    def __init__(self, file, allowed: dict, storages: bool):
        super().__init__(file)
        self._allowed = allowed
        self._storages = storages

    def find_class(self, module, name):
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        if module == "torch":
            value = torch.__dict__.get(name)  # dtypes, layouts, memory formats: plain values
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
            if self._storages and name.endswith("Storage") and isinstance(value, type):
                return _Stub
        raise _Refused(f"a pickled {module}.{name}")

    def persistent_load(self, pid):
        # torch.save's storage references: ("storage", type, key, location, numel), and in the
        # legacy format a sixth item, the view metadata (None).
        if (self._storages and isinstance(pid, tuple) and len(pid) in (5, 6)
                and pid[0] == "storage" and pid[1] is _Stub
                and all(isinstance(x, str) for x in pid[2:4]) and isinstance(pid[4], int)
                and (len(pid) == 5 or pid[5] is None)):
            return _Stub()
        raise _Refused(f"a pickled persistent reference {str(pid)[:80]!r}")


def _unpickle(data: bytes, allowed: dict, storages: bool = False):
    return _RestrictedUnpickler(io.BytesIO(data), allowed, storages).load()


def _check_torch_payload(data: bytes) -> None:
    """A `torch.save` zip: every pickle in it may hold only tensors, plain values and the
    `_MEGATRON_LM` types."""
    if not data.startswith(b"PK\x03\x04"):  # torch.load's own test for its zip format
        raise _Refused("a legacy (non-zip) torch.save pickle")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        if any(os.path.basename(n) == "constants.pkl" for n in names):
            raise _Refused("a TorchScript archive")
        pickles = [n for n in names if n.endswith(".pkl")]
        if not any(os.path.basename(n) == "data.pkl" for n in pickles):
            raise _Refused("a zip without data.pkl")
        for name in pickles:
            _unpickle(archive.read(name), {**_PLAIN, **_TENSOR_REBUILD, **_MEGATRON_LM,
                                           **_OFFLOAD_OPTIMIZER_CLASSES}, storages=True)


def _refusal(path: str, file: str, what: str, where: str = "") -> ConfigError:
    return ConfigError(
        f"--load {path}: refusing to load {file}{where}: it holds {what}, and unpickling it "
        "could run code. Checkpoints may hold only tensors, plain values (numbers, strings, "
        "lists, dicts) and the types Megatron-LM writes (its argparse.Namespace of args, numpy "
        "RNG states, megatron-core's enums); this one was not written by megatron_ulysses or "
        "Megatron-LM, or was tampered with")


def _corrupt(path: str, file: str, error, where: str = "") -> ConfigError:
    return ConfigError(f"--load {path}: {file}{where} is not a valid checkpoint file "
                       f"({type(error).__name__}: {error})")


def _checked(path, file, check, data, where=""):
    try:
        return check(data)
    except _Refused as refused:
        raise _refusal(path, file, str(refused), where) from None
    except Exception as error:  # truncated or garbage: never reaches the real unpickler
        raise _corrupt(path, file, error, where) from None


def _check_bytes_items(path: str, metadata_file: str, metadata) -> None:
    """Every BytesIO item `metadata_file` lists (DCP unpickles them with weights_only=False)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)):
        raise _corrupt(path, metadata_file, TypeError("not a torch.distributed.checkpoint "
                                                      "Metadata"))
    base = os.path.dirname(metadata_file)
    items = collections.defaultdict(list)
    for index, info in metadata.storage_data.items():
        fqn = getattr(index, "fqn", None)
        if isinstance(metadata.state_dict_metadata.get(fqn), BytesStorageMetadata) or \
                fqn not in metadata.state_dict_metadata:
            relative = getattr(info, "relative_path", None)
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if not (isinstance(relative, str) and relative and os.path.basename(relative) ==
                    relative and relative not in (".", "..") and isinstance(offset, int)
                    and isinstance(length, int) and offset >= 0 and length >= 0):
                raise _corrupt(path, metadata_file,
                               ValueError(f"bad storage entry for {fqn!r}: {info!r}"))
            if getattr(info, "transform_descriptors", None):
                raise ConfigError(f"--load {path}: {metadata_file} stores {fqn!r} through "
                                  f"stream transforms {info.transform_descriptors!r}, which "
                                  "this package neither writes nor checks; refusing to load")
            items[relative].append((offset, length, fqn))
    for relative, entries in items.items():
        file = os.path.join(base, relative)
        if not os.path.isfile(file):
            raise _corrupt(path, metadata_file, FileNotFoundError(f"{file} is missing"))
        size = os.path.getsize(file)
        with open(file, "rb") as stream:
            for offset, length, fqn in sorted(entries):
                where = f" (item {fqn!r}, bytes {offset}..{offset + length})"
                if offset + length > size:
                    raise _corrupt(path, file, EOFError(f"the file has {size} bytes"), where)
                stream.seek(offset)
                _checked(path, file, _check_torch_payload, stream.read(length), where)


def check_checkpoint_files(path: str) -> None:
    """Raise `ConfigError` unless every file megatron-core would unpickle from the checkpoint
    directory `path` holds only tensors and plain values (see the module docstring)."""
    config_file = os.path.join(path, "metadata.json")
    try:
        with open(config_file, "rb") as f:
            config = json.loads(f.read(1 << 16))
    except FileNotFoundError:
        raise ConfigError(f"--load {path} is not a torch_dist checkpoint: it has no "
                          "metadata.json") from None
    except ValueError as error:
        raise _corrupt(path, config_file, error) from None
    if not (isinstance(config, dict) and config.get("sharded_backend") == "torch_dist"
            and config.get("common_backend", "torch") == "torch"):
        raise ConfigError(f"--load {path}: {config_file} holds {str(config)[:200]}; only "
                          "torch_dist checkpoints (sharded_backend torch_dist) can be loaded")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ConfigError(f"--load {path} is not a complete torch_dist checkpoint: it has no "
                          ".metadata file")
    dcp_allowed = {**_PLAIN, **_dcp_classes(),
                   ("torch.serialization", "_get_layout"): torch.serialization._get_layout}
    for directory, _, files in os.walk(path):
        for name in sorted(files):
            file = os.path.join(directory, name)
            if name.endswith(".metadata"):
                with open(file, "rb") as f:
                    metadata = _checked(path, file, lambda d: _unpickle(d, dcp_allowed),
                                        f.read())
                _check_bytes_items(path, file, metadata)
            elif name.endswith(".pt"):
                with open(file, "rb") as f:
                    _checked(path, file, _check_torch_payload, f.read())


def check_extra_states(path: str, state, prefix: str = "") -> None:
    """Transformer Engine unpickles non-empty `_extra_state` byte tensors (pickle.loads) in
    load_state_dict: they may hold only plain values, CPU tensors and TE's FP8 recipe."""
    items = state.items() if isinstance(state, dict) else \
        enumerate(state) if isinstance(state, (list, tuple)) else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list, tuple)):
            check_extra_states(path, value, name + ".")
        elif name.endswith("_extra_state") and isinstance(value, torch.Tensor) \
                and value.dtype == torch.uint8 and value.numel() > 0:
            data = value.detach().cpu().contiguous().numpy().tobytes()
            _checked(path, f"{path} (model {name})", lambda d: _unpickle(
                d, {**_PLAIN, **_TENSOR_REBUILD, **_TE_EXTRA_STATE}), data)


_TE_UNSAFE_PICKLE = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@contextlib.contextmanager
def extra_states_checked():
    """Around `load_state_dict` of weights that `check_extra_states` passed: Transformer Engine
    (>= 2.20) unpickles FP8 delayed scaling's `_extra_state` only with its opt-in
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1. Those bytes resolve nothing but plain values, tensor
    rebuilds and TE's recipe (checked), so unpickling them runs no code: the opt-in is set for
    this load alone and the environment restored after."""
    before = os.environ.get(_TE_UNSAFE_PICKLE)
    os.environ[_TE_UNSAFE_PICKLE] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_TE_UNSAFE_PICKLE]
        else:
            os.environ[_TE_UNSAFE_PICKLE] = before
