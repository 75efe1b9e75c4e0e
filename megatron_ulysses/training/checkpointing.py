"""Checkpoints with megatron-core `dist_checkpointing` (torch_dist): model, optimizer, LR scheduler,
every rank's RNG states, iteration, consumed samples and the model arguments.

Layout (Megatron-LM's): `<save>/iter_0000100/` and `<save>/latest_checkpointed_iteration.txt`.

Durability. A save goes to a job-unique `iter_0000100.tmp.<pid>-<random>/` (`save_guard`); when
every rank has written, each rank fsyncs the shard files it wrote (`__<rank>_*.distcp`) and rank 0
the other files and the directories, the ranks record every file's size and CRC-32
(`integrity.json`, checked before a load: `save_guard`); then rank 0 renames an existing
`iter_0000100/` aside (`.old`), renames the new one in, fsyncs `<save>`, replaces the tracker
(write, fsync, rename, fsync) and only then deletes the old directory. A
crash at any point leaves the tracker pointing at a complete checkpoint: in the one window where
`iter_0000100/` is missing (between the two renames) the loader takes `iter_0000100.old/`.

Safety: `--load` never runs code from the checkpoint: every file megatron-core would unpickle is
checked first by `trust.check_checkpoint_files` (see `trust`), and the loaded `_extra_state`
bytes by `trust.check_extra_states`.

RNG: each rank saves its own torch CPU, CUDA, megatron-core tracker, python `random` and numpy
states as tensors (one row per rank). A load with the same world size, TP, PP and SP restores each
rank's own; at another layout (another --ulysses-sp-size, data-parallel, tensor-parallel or
pipeline size) the RNG states are not restored: the run keeps the streams seeded from --seed, and
rank 0 says so.

Model tensors are stored unsharded-by-layout (megatron-core's global keys and shapes; its
dist_checkpointing reshards them on load), so a run can resume with another `--ulysses-sp-size`,
data-parallel size, TP size, pipeline size or virtual pipeline, its Adam moments too (they are
sharded as their parameters). The padded vocabulary must match: it depends on TP
(`_check_args` names --padded-vocab-size).

--async-save: the files are written by megatron-core's async writer and the steps after the
write (fsync, record, rename, tracker, --save-retain-interval) are its request's finalize step
(`checkpoint_saver`), so the tracker still moves last.

Megatron-LM's torch_dist checkpoints load too (`megatron_lm_checkpoint` maps their common
state onto ours): the model at any SP size and pipeline layout (a virtual pipeline's `model0`,
`model1`, ... included), its LR schedule, iteration and consumed samples; RNG states restart
from --seed.
"""

import contextlib
import dataclasses
import errno
import functools
import inspect
import json
import math
import os
import pickle
import random
import re
import shutil
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import __version__ as megatron_core_version
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    maybe_report_missing_and_unexpected_keys,
)
from megatron.core.transformer.module import Float16Module

from .. import parallel_state as ps
from .. import processes
from ..data.tokenizers import tokenizer_files
from ..errors import ConfigError, flag_name
from . import megatron_lm_checkpoint, save_guard
from .checkpoint_saver import CheckpointSaver
from .chunks import model_chunks, state_keys
from .fsdp import (
    local_shards_as_dtensors,
    main_params_as_dtensors,
    model_sharded_state_dict,
    shard_loaded_states,
)
from .logging import append_progress, print_rank_0
from .optimizer import count_on_after_load
from .trust import check_checkpoint_files, check_extra_states, extra_states_checked

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 2  # 2: RNG states as per-rank tensors, no pickled objects
# The distributed optimizer's canonical, per-parameter layout: it loads at any DP x SP size (SP
# lives inside megatron-core's DP, so a new --ulysses-sp-size changes DP), TP and PP size (as
# Megatron-LM requires of a load at another TP x PP: its checkpoint_fully_reshardable_formats).
# megatron-core 0.19's default, fully_sharded_model_space, is deprecated there and fails to
# save; dp_reshardable reshards over DP only with the same bucket layout. `CpuAdamW` takes and
# ignores it.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# Args that change parameter shapes or their meaning: they must match between the checkpoint
# and the run that loads it (max_position_embeddings only with learned absolute positions).
_MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "kv_channels", "padded_vocab_size",
               "position_embedding_type", "rotary_percent", "swiglu", "normalization",
               "qk_layernorm", "untie_embeddings_and_output_weights", "disable_bias_linear",
               "add_qkv_bias", "apply_layernorm_1p", "squared_relu", "rotary_interleaved")
# What a checkpoint saved before an arg existed means by its absence (it still loads).
_MISSING_MEANS = {"add_qkv_bias": False, "apply_layernorm_1p": False, "squared_relu": False,
                  "rotary_interleaved": False}
# The model-parallel layout: saved, not checked. megatron-core's keys number the layers over
# the whole model and the tied output layer is saved as the embedding, so the model loads at any
# PP and virtual pipeline; its ShardedTensors hold global shapes with each TP rank's offsets
# (SwiGLU's fc1 as its gate and up halves), so dist_checkpointing reshards them at any TP. The
# Adam moments are sharded as their parameters (`CpuAdamW`, megatron-core's optimizers, the
# distributed one in `OPTIMIZER_METADATA`'s layout) and load too, as Megatron-LM loads
# torch_dist checkpoints. Only the per-rank RNG states need the same layout
# (`_rng_states_to_load`), and the padded vocabulary, which depends on TP, the same rows.
_LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size")
# Args that change the optimizer state's keys (megatron-core's distributed optimizer, its
# mixed-precision optimizer and the fp32 one each name them differently).
_OPTIMIZER_ARGS = ("use_distributed_optimizer", "bf16", "fp16")
# Also saved (not checked; --use-checkpoint-args takes them): RoPE and norm numerics, the vocab
# padding, the sequence length and dropout, --vocab-size (None with a tokenizer file) and the
# tokenizer (`_saved_tokenizer`).
_TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "tiktoken_pattern")
_SAVED_ARGS = _MODEL_ARGS + _LAYOUT_ARGS + _OPTIMIZER_ARGS + (
    "max_position_embeddings", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", "norm_epsilon", "make_vocab_size_divisible_by",
    "vocab_size", "seq_length", "attention_dropout", "hidden_dropout") + _TOKENIZER_ARGS


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str):
    """The iteration in `root`'s "latest" marker, or None when there is no marker."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isascii() or not text.isdigit():
        raise ConfigError(f"--load {root}: {path} holds {raw[:32]!r}, not an iteration number; "
                          "fix or delete it (without it the run trains from scratch)")
    return int(text)


# --- RNG states ---------------------------------------------------------------------------------

def _generator_state(state) -> torch.Tensor:
    return state.get_state() if isinstance(state, torch.Generator) else state


def _rng_tensors() -> dict:
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


def _set_rng_tensors(states: dict) -> None:
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


def _rng_layout(states: dict) -> dict:
    """What must match for every rank to restore its own RNG states (JSON-able)."""
    dims = ps.get_parallel_dims()
    return {"world_size": dims.world_size, "tp": dims.tp, "pp": dims.pp, "sp": dims.sp,
            "states": {name: list(tensor.shape) for name, tensor in sorted(states.items())}}


def _rng_sharded(states: dict) -> dict:
    """One row per rank: `rng_state.<name>` has shape [world size, *state shape]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {name: ShardedTensor.from_rank_offsets(f"rng_state.{name}", tensor.unsqueeze(0),
                                                  (0, rank, world), replica_id=0)
            for name, tensor in states.items()}


def _describe(layout: dict) -> str:
    dp = layout["world_size"] // (layout["tp"] * layout["pp"] * layout["sp"])
    return (f"world {layout['world_size']} = TP {layout['tp']} x PP {layout['pp']} x "
            f"DP {dp} x Ulysses SP {layout['sp']}")


# --- save ---------------------------------------------------------------------------------------

def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError as error:  # some file systems cannot fsync a directory
        if not (directory and error.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _fsync_tree(staging: str, rank: int) -> None:
    """Each rank fsyncs the shard files it wrote; rank 0 also every other file, then the
    directories (deepest first)."""
    directories = []
    for directory, _, files in os.walk(staging):
        directories.append(directory)
        for name in files:
            if save_guard.owns(name, rank):
                _fsync(os.path.join(directory, name))
    if rank == 0:
        for directory in reversed(directories):
            _fsync(directory, directory=True)


def _plain(value, what: str):
    """`value`, checked to be JSON-able: what is stored besides tensors needs no pickled
    objects to load."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"the checkpoint's {what} must hold only plain values: {error}") from None
    return value


def _sharded_state_dict(model, optimizer, scheduler, is_loading, with_optimizer=True,
                        rng_states=None, common=None):
    model_sd = {key: model_sharded_state_dict(chunk)  # Megatron-LM's keys, `training.chunks`
                for key, chunk in zip(state_keys(model), model_chunks(model))}
    state = {**model_sd, **(common or {})}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd.get("model", model_sd), is_loading=is_loading, metadata=OPTIMIZER_METADATA)
        if not is_loading:
            state["opt_param_scheduler"] = _plain(scheduler.state_dict(), "scheduler")
    if rng_states is not None:
        state["rng_state"] = _rng_sharded(rng_states)
    return state


def _commit(root: str, iteration: int, staging: str) -> None:
    """Rank 0: put the fsynced `staging` in place of `iter_<iteration>` and point the tracker
    at it, so that the tracker always names a complete directory (the old one until the new one
    is in; `load_checkpoint` takes `.old` in between)."""
    final = checkpoint_dir(root, iteration)
    old = final + ".old"
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)  # debris: `final` is the good copy
        os.replace(final, old)  # 1. the old checkpoint aside
    os.replace(staging, final)  # 2. the new one in
    _fsync(root, directory=True)
    tracker = os.path.join(root, TRACKER)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker + ".tmp", tracker)
    _fsync(root, directory=True)
    shutil.rmtree(old, ignore_errors=True)  # 3. only now the old one goes


@contextlib.contextmanager
def _quiet_torch_checkpoint():
    """torch's checkpoint internals warn about the APIs megatron-core's dist_checkpointing uses."""
    with warnings.catch_warnings():
        for message in ("Please use DTensor instead", "`load_state_dict` is deprecated"):
            warnings.filterwarnings("ignore", message=message)
        yield


def _saved_args(config) -> dict:
    """The `_SAVED_ARGS` values of a `RunConfig`, by Megatron-LM argument name."""
    values = {**dataclasses.asdict(config.model), "tensor_model_parallel_size": config.dims.tp,
              "pipeline_model_parallel_size": config.dims.pp,
              "use_distributed_optimizer": config.optimizer.use_distributed_optimizer,
              "vocab_size": config.data.vocab_size, **_saved_tokenizer(config.data)}
    return {key: values[key] for key in _SAVED_ARGS}


def _saved_tokenizer(data) -> dict:
    """The tokenizer that --use-checkpoint-args takes back, as Megatron-LM's args hold it: one
    read from a --tokenizer-model file (its absolute path: a later run may start elsewhere).
    None for the others: Megatron-LM takes no --vocab-file / --merge-file from a checkpoint,
    so GPT2BPETokenizer's files come from the command line anyway, and NullTokenizer stands
    for no tokenizer here (mock data; --vocab-size is saved), e.g. in tools/convert_hf.py's
    checkpoints, whose tokenizer the run that loads them names."""
    model = tokenizer_files(data).get("--tokenizer-model")
    if model is None:
        return dict.fromkeys(_TOKENIZER_ARGS)
    return {"tokenizer_type": data.tokenizer_type, "tokenizer_model": os.path.abspath(model),
            "tiktoken_pattern": data.tiktoken_pattern if data.tokenizer_type == "TikTokenizer"
            else None}


def _save_options(flags) -> dict:
    """dist_checkpointing.save's options that megatron-core 0.16 lacks: the async strategy
    (0.19 defaults to nvidia-resiliency-ext's "nvrx", a ModuleNotFoundError at the first async
    save without it; ours is always megatron-core's own queue) and --verify-integrity."""
    options = {"verify_integrity": True} if flags.verify_integrity else {}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        options["async_strategy"] = flags.async_strategy
    return options


def _checkpoint_bytes(root: str, state) -> int:
    """About what a save of `state` writes, for an out-of-space message: the last checkpoint's
    files in `root`, else the tensors' bytes (each once, whole; files add headers)."""
    try:
        last = read_tracker(root)
        if last is not None:
            path = checkpoint_dir(root, last)
            return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    except (OSError, ConfigError):
        pass
    shapes = {t.key: (t.global_shape, t.data.element_size()) for t in nested_values(state)
              if isinstance(t, ShardedTensor)}
    return sum(math.prod(shape) * size for shape, size in shapes.values())


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, config,
                    consumed_samples: int, extra_common: dict = None,
                    saver: CheckpointSaver = None) -> None:
    """Save durably to `<root>/iter_<iteration>` and point the "latest" marker at it.
    `config`: the `RunConfig` (the shape and optimizer values a load checks); `extra_common`:
    more plain values for the common state (tools/convert_hf.py's "hf_config"); `saver`: what
    persists between the run's saves (with --async-save this returns once the write started and
    `saver.finalize` commits it). An I/O error while writing is one `save_guard.SaveError`, the
    committed checkpoints untouched."""
    start = time.time()
    flags = config.checkpoint
    saver = saver or CheckpointSaver(flags)
    saver.finalize(blocking=True)  # the previous async save is committed first
    rank = dist.get_rank()
    previous = read_tracker(root) if rank == 0 else None  # --save-retain-interval's candidate
    rng_states = None if flags.no_save_rng else _rng_tensors()
    common = _plain({
        "format_version": FORMAT_VERSION, "iteration": iteration,
        "consumed_samples": consumed_samples,
        "args": _saved_args(config),
        "rng_layout": _rng_layout(rng_states) if rng_states is not None else None,
        **({"optimizer_refusal": "it was saved with --no-save-optim"}
           if flags.no_save_optim else {}),
        **(extra_common or {}),
    }, "common state")
    state = _sharded_state_dict(model, optimizer, scheduler, is_loading=False,
                                with_optimizer=not flags.no_save_optim,
                                rng_states=rng_states, common=common)
    final = checkpoint_dir(root, iteration)
    needed = lambda: _checkpoint_bytes(root, state)  # noqa: E731 (only asked after a failure)
    validate = saver.validate_structure
    with save_guard.staged_save(root, iteration, final, needed) as staging:
        commit = functools.partial(_commit_save, root, iteration, staging, previous, flags)
        # Helpers (megatron-core's Manager, its writers) keep SIGTERM blocked: see processes.
        with processes.helpers_keep_sigterm_blocked(), _quiet_torch_checkpoint():
            request = dist_checkpointing.save(
                state, staging, sharded_strategy=saver.strategy(),
                validate_access_integrity=validate, async_sharded_save=flags.async_save,
                **_save_options(flags))
            if request is not None:  # the write goes on in a helper; commit when it is done
                request.add_finalize_fn(commit)
                saver.schedule(request)
        if request is None:
            commit()
    if request is not None:
        print_rank_0(f" started an async save of iteration {iteration} to {staging}")
        return
    if config.training.exit_signal_handler:
        late = processes.save_beyond_grace(time.time() - start)
        if late:
            print_rank_0(f" WARNING: {late}")


def _commit_save(root: str, iteration: int, staging: str, previous, flags) -> None:
    """Every rank, once every rank's files are written: fsync, the integrity record, rank 0's
    rename and tracker update, then --save-retain-interval (an async save's finalize step)."""
    rank = dist.get_rank()
    dist.barrier()
    _fsync_tree(staging, rank)
    save_guard.seal(staging, rank)  # the files' record, checked before the rename
    save_guard.on_rank_0(_commit, root, iteration, staging)
    if rank == 0:
        if flags.async_save and flags.log_progress:
            append_progress(root, f"Saved async checkpoint\tIteration: {iteration}")
        _retain(root, previous, iteration, flags)
    print_rank_0(f" saved checkpoint at iteration {iteration:8d} to "
                 f"{checkpoint_dir(root, iteration)}")


def _retain(root: str, previous, iteration: int, flags) -> None:
    """Rank 0, after the commit: --save-retain-interval deletes the previous checkpoint unless
    its iteration is a multiple of the interval (Megatron-LM's rule; never the one just
    written, never a symlink). A failed delete is a warning, as in Megatron-LM."""
    interval = flags.save_retain_interval
    if interval is None or not previous or previous == iteration or previous % interval == 0:
        return
    path = checkpoint_dir(root, previous)
    if os.path.islink(path) or not os.path.isdir(path):
        return
    try:
        shutil.rmtree(path)
    except OSError as error:
        print(f" WARNING: could not delete {path} (--save-retain-interval {interval}): {error}",
              flush=True)
        return
    print(f"  deleted checkpoint from iteration {previous:7d} at {root} "
          f"(--save-retain-interval {interval})", flush=True)
    if flags.log_progress:
        append_progress(root, f"Deleted checkpoint\tIteration: {previous}")


# --- load ---------------------------------------------------------------------------------------

# What a checkpoint may lack: TE attention's `_extra_state` (FP8 metadata; none without FP8), absent
# from checkpoints of the sdpa / local backends, e.g. tools/convert_hf.py's on a CPU node.
_OPTIONAL_KEYS = re.compile(r".*core_attention\.backend_attention\.(.+\.)?_extra_state(/.*)?")


def _check_missing(path: str, keys) -> None:
    """Keys this run's model and optimizer have and the checkpoint lacks: one `ConfigError`
    unless all are `_OPTIONAL_KEYS`."""
    missing = sorted(key for key in keys if not _OPTIONAL_KEYS.fullmatch(key))
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4
                                          else "")
        raise ConfigError(f"--load {path} lacks {len(missing)} entries this model has ({shown}): "
                          "it was saved by another model or layer spec")


def _flag(key: str) -> str:
    if key == "padded_vocab_size":
        return ("padded vocab size (from the tokenizer or --vocab-size, "
                "--make-vocab-size-divisible-by and TP, or --padded-vocab-size)")
    return flag_name(key)


def _vocab_hint(saved: dict, run: dict) -> str:
    """How to run with the checkpoint's padded vocab rows (`saved`) at this run's TP: they are
    the tokenizer's rounded up to a multiple of --make-vocab-size-divisible-by x TP, so another
    TP may pad to other rows (Megatron-LM's --use-checkpoint-args takes the checkpoint's)."""
    rows, tp = saved.get("padded_vocab_size"), run["tensor_model_parallel_size"]
    if not isinstance(rows, int) or saved.get("tensor_model_parallel_size") in (None, tp):
        return ""
    if rows % tp:
        return (f" (its {rows} vocab rows do not split over --tensor-model-parallel-size {tp}; "
                "run at a TP that divides them)")
    return (f" (the padding depends on TP: give --padded-vocab-size {rows} to keep the "
            "checkpoint's rows)")


def _check_args(path: str, saved: dict, run: dict) -> None:
    """The checkpoint's model values (`saved`) against this run's (`run`); its TP and pipeline
    layout may differ (`_LAYOUT_ARGS`), not its padded vocab."""
    keys = list(_MODEL_ARGS)
    if run["position_embedding_type"] == "learned_absolute":
        keys.append("max_position_embeddings")
    missing = object()
    saved = {**_MISSING_MEANS, **saved}
    mismatched = [(key, saved.get(key, missing), run[key]) for key in keys
                  if saved.get(key, missing) != run[key]]
    if mismatched:
        details = "; ".join(
            f"{_flag(key)}: checkpoint {'(not saved)' if a is missing else repr(a)}, "
            f"this run {b!r}" for key, a, b in mismatched)
        vocab = any(key == "padded_vocab_size" for key, _, _ in mismatched)
        hint = _vocab_hint(saved, run) if vocab else ""
        raise ConfigError(f"--load {path} was saved with another model: {details}. Run with "
                          f"the checkpoint's values{hint}")
    if run["position_embedding_type"] == "rope" and saved.get("rotary_base") not in \
            (None, run["rotary_base"]):
        print_rank_0(f" WARNING: --rotary-base {run['rotary_base']} differs from the checkpoint's "
                     f"{saved['rotary_base']} (--load {path})")


def _check_optimizer_args(path: str, saved: dict, run: dict) -> None:
    different = [key for key in _OPTIMIZER_ARGS if key in saved and saved[key] != run[key]]
    if different:
        details = ", ".join(f"{_flag(k)}: checkpoint {saved[k]}, this run {run[k]}"
                            for k in different)
        raise ConfigError(f"--load {path}: its optimizer state was saved with another optimizer "
                          f"({details}); run with the checkpoint's flags, or pass --no-load-optim "
                          "to load the weights only (Adam moments restart)")


def _checkpoint_path(root: str, iteration: int) -> str:
    path = checkpoint_dir(root, iteration)
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + ".old"):  # a crash between the two renames of a re-save
        print_rank_0(f" {path} is missing (a save was interrupted); loading {path}.old")
        return path + ".old"
    raise ConfigError(f"--load {root}: {TRACKER} names iteration {iteration}, but {path} does "
                      "not exist; fix the tracker or --load another directory")


def _load_common(path: str):
    """megatron-core's read of the common state (torch's weights_only unpickler with
    megatron-core's safe globals, after `check_checkpoint_files`)."""
    try:
        return dist_checkpointing.load_common_state_dict(path)
    except pickle.UnpicklingError as error:  # an admitted class this megatron-core lacks
        raise ConfigError(f"--load {path}: this megatron-core ({megatron_core_version}) "
                          f"cannot read its common state: {str(error).splitlines()[0]}") from None


def read_common_state(root: str):
    """(iteration, path, common state dict) of the latest checkpoint in `root`, None when there
    is none; its files are checked for pickled code before megatron-core reads them. A
    Megatron-LM checkpoint's common state comes in our layout (`megatron_lm_checkpoint`). Needs
    no process group."""
    iteration = read_tracker(root)
    if iteration is None:
        _refuse_hf_model(root)
        return None
    path = _checkpoint_path(root, iteration)
    megatron_lm_checkpoint.refuse_legacy_format(path)
    check_checkpoint_files(path)  # before megatron-core unpickles anything
    save_guard.verify_files(path)  # the save's record: no file missing, short or foreign
    with save_guard.read_errors_named(path):
        common = _load_common(path)
    if megatron_lm_checkpoint.is_megatron_lm(common):
        return iteration, path, megatron_lm_checkpoint.common_state(
            path, common, _SAVED_ARGS, OPTIMIZER_METADATA)
    if not isinstance(common, dict) or common.get("format_version") != FORMAT_VERSION:
        version = common.get("format_version") if isinstance(common, dict) else None
        raise ConfigError(f"--load {path} has checkpoint format {version}, this version of "
                          f"megatron_ulysses reads format {FORMAT_VERSION} and Megatron-LM's "
                          "torch_dist checkpoints")
    return iteration, path, common


def _refuse_hf_model(root: str) -> None:
    """A HuggingFace model directory (config.json beside its weights) given as --load is one
    message naming the conversion, not a run from scratch with a warning."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    if "config.json" in names and any(name.endswith((".safetensors", ".safetensors.index.json"))
                                      or re.fullmatch(r"pytorch_model.*\.bin", name)
                                      for name in names):
        raise ConfigError(
            f"--load {root} is a HuggingFace model directory (config.json and its weights), "
            f"not a checkpoint: convert it with `python tools/convert_hf.py import --hf-path "
            f"{root} --output CKPT`, then give --load CKPT (--use-checkpoint-args takes its "
            "model flags)")


CARRIED_COMMON_KEYS = ("hf_config",)  # common state a save keeps from the loaded checkpoint


def carried_common_state(root: str) -> dict:
    """What the next save keeps from the checkpoint at `root`: the Hugging Face config
    tools/convert_hf.py stored on import (so a trained checkpoint still exports)."""
    found = read_common_state(root)
    if found is None:
        return {}
    return {key: found[2][key] for key in CARRIED_COMMON_KEYS if key in found[2]}


def read_checkpoint_args(root: str):
    """The saved model args (a dict) of the latest checkpoint in `root`, None when there is
    none (for --use-checkpoint-args)."""
    found = read_common_state(root)
    if found is None:
        return None
    saved = found[2].get("args")
    if not isinstance(saved, dict):
        raise ConfigError(f"--load {found[1]} holds no saved args (its common state has no "
                          "'args' dict); give the model flags instead of --use-checkpoint-args")
    return saved


def _check_resume(path: str, iteration: int, common: dict, config, model_only: bool) -> dict:
    """The checkpoint's saved args (returned) against this run's, its iteration against the
    tracker's and, when resuming training, against --train-iters."""
    saved_args = common.get("args")
    saved_args = saved_args if isinstance(saved_args, dict) else {}
    _check_args(path, saved_args, _saved_args(config))
    saved_iteration = common.get("iteration")
    if saved_iteration != iteration:
        raise ConfigError(f"--load {path} holds iteration {saved_iteration}, but {TRACKER} "
                          f"names {iteration}")
    train_iters = config.training.train_iters
    if not model_only and iteration > train_iters:
        samples = iteration * config.training.global_batch_size
        raise ConfigError(f"--train-iters ({train_iters}) is smaller than the iteration "
                          f"of the checkpoint at --load {path} ({iteration}); give "
                          f"--train-iters {iteration} or more (--train-samples {samples} or "
                          f"more) or --finetune")
    return saved_args


def _rng_states_to_load(path: str, common: dict, seed: int):
    """This rank's RNG tensors (names and shapes) for the load to overwrite, or None with a
    warning when the checkpoint was saved at another layout (its states are per rank)."""
    rng_states = _rng_tensors()
    saved_layout, layout = common.get("rng_layout"), _rng_layout(rng_states)
    if saved_layout == layout:
        return rng_states
    if common.get("saved_by") == megatron_lm_checkpoint.SAVED_BY:
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


def _load_scheduler(path: str, scheduler, state: dict) -> None:
    try:
        scheduler.load_state_dict(state)
    except AssertionError as error:  # megatron-core's check of flags vs checkpoint
        raise ConfigError(
            f"--load {path}: the LR schedule of the flags differs from the checkpoint's "
            f"({error}); pass --override-opt_param-scheduler to use the flags or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's") from None


def _load_strategy(path: str, flags):
    """megatron-core's load strategy for `path`; --ckpt-fully-parallel-load: each DP x SP replica
    reads a slice of the replicated tensors and they exchange them."""
    if not flags.ckpt_fully_parallel_load:
        return None
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path),
                                            mpu.get_data_parallel_group())


def _apply_strictness(path: str, strictness: str, unexpected, not_loaded) -> None:
    """--dist-ckpt-strictness on megatron-core's key lists: log_* logs, raise_* refuses (one
    `ConfigError`) what StrictHandling would. Keys this run needs and the checkpoint lacks
    (`unexpected`) are refused by `_check_missing` whatever the value (a model half loaded is
    never right); the other values are megatron-core's 'do nothing more'."""
    both = strictness.endswith("_all")
    extra = sorted(not_loaded) if both else []
    if strictness.startswith("log_"):
        maybe_report_missing_and_unexpected_keys(extra, unexpected, raise_error=False)
    elif strictness.startswith("raise_") and extra:
        shown = ", ".join(extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
        raise ConfigError(f"--load {path} holds {len(extra)} entries this run does not load "
                          f"({shown}) and --dist-ckpt-strictness is {strictness}")


def _load_weights(path: str, model, weights: dict) -> None:
    """The loaded `weights` (checked) into the GPTModel of `model` (DDP, one chunk)."""
    check_extra_states(path, weights)
    gpt = model.module.module if isinstance(model.module, Float16Module) else model.module
    weights = local_shards_as_dtensors(gpt, weights)
    with extra_states_checked():
        missing = gpt.load_state_dict(weights, strict=False).missing_keys
    _check_missing(path, missing)


def load_checkpoint(root: str, model, optimizer, scheduler, config):
    """Load the latest checkpoint in `root`; returns (iteration, consumed_samples), (0, 0)
    when there is none. `--finetune` loads the model only and restarts at 0; `optimizer` None
    loads the model only, at the checkpoint's iteration (--skip-train). Every problem with the
    checkpoint is one `ConfigError` naming --load. `config`: the `RunConfig`."""
    flags = config.checkpoint
    found = read_common_state(root)
    if found is None:
        print_rank_0(f" WARNING: no checkpoint at --load {root} ({TRACKER} missing); "
                     "training from scratch")
        return 0, 0
    iteration, path, common = found
    save_guard.verify_shards(path)  # their CRC-32, before training on them
    model_only = optimizer is None or flags.finetune
    saved_args = _check_resume(path, iteration, common, config, model_only)
    with_optimizer = not (model_only or flags.no_load_optim)
    if with_optimizer:
        _check_optimizer_args(path, saved_args, _saved_args(config))
        if common.get("optimizer_refusal"):
            raise ConfigError(f"--load {path}: {common['optimizer_refusal']}; pass "
                              "--no-load-optim to load the weights only (Adam moments restart)")
    rng_states = None
    if not (model_only or flags.no_load_rng):
        rng_states = _rng_states_to_load(path, common, config.training.seed)
    state = _sharded_state_dict(model, optimizer, scheduler, is_loading=True,
                                with_optimizer=with_optimizer, rng_states=rng_states)
    with _quiet_torch_checkpoint(), save_guard.read_errors_named(path):
        # megatron-core's "unexpected": asked for, not in the checkpoint; "missing": the reverse
        loaded, not_loaded, missing = dist_checkpointing.load(
            state, path, sharded_strategy=_load_strategy(path, flags),
            strict=StrictHandling.RETURN_ALL,
            **({"verify_integrity": True} if flags.verify_integrity else {}))
    _apply_strictness(path, flags.dist_ckpt_strictness, missing, not_loaded)
    _check_missing(path, missing)
    for key, chunk in zip(state_keys(model), model_chunks(model)):
        _load_weights(path, chunk, loaded[key])
    if with_optimizer:
        main_params_as_dtensors(optimizer, loaded["optimizer"])
        optimizer.load_state_dict(loaded["optimizer"])
        shard_loaded_states(optimizer)
        count_on_after_load(optimizer)
        _load_scheduler(path, scheduler, loaded["opt_param_scheduler"])
    if rng_states is not None:
        _set_rng_tensors({name: tensor[0] for name, tensor in loaded["rng_state"].items()})
    print_rank_0(f" loaded checkpoint from {path} at iteration {iteration}")
    if flags.finetune:
        return 0, 0
    return iteration, common["consumed_samples"]
