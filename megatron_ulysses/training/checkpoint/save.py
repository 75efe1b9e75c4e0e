"""`save_checkpoint`: a durable, atomic save (see the package docstring)."""

import errno
import functools
import inspect
import math
import os
import shutil
import time

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from ...errors import ConfigError
from .. import processes
from ..logging import append_progress, print_rank_0
from . import save_guard
from .rng_state import rng_layout, rng_tensors
from .saver import CheckpointSaver
from .state import (
    FORMAT_VERSION,
    TRACKER,
    args_of,
    checkpoint_dir,
    plain,
    quiet_torch_checkpoint,
    read_tracker,
    sharded_state_dict,
)


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
    rng_states = None if flags.no_save_rng else rng_tensors()
    common = plain({
        "format_version": FORMAT_VERSION, "iteration": iteration,
        "consumed_samples": consumed_samples,
        "args": args_of(config),
        "rng_layout": rng_layout(rng_states) if rng_states is not None else None,
        **({"optimizer_refusal": "it was saved with --no-save-optim"}
           if flags.no_save_optim else {}),
        **(extra_common or {}),
    }, "common state")
    state = sharded_state_dict(model, optimizer, scheduler, is_loading=False,
                                with_optimizer=not flags.no_save_optim,
                                rng_states=rng_states, common=common)
    final = checkpoint_dir(root, iteration)
    needed = lambda: _checkpoint_bytes(root, state)  # noqa: E731 (only asked after a failure)
    validate = saver.validate_structure
    with save_guard.staged_save(root, iteration, final, needed) as staging:
        commit = functools.partial(_commit_save, root, iteration, staging, previous, flags)
        # Helpers (megatron-core's Manager, its writers) keep SIGTERM, SIGINT blocked: processes.
        with processes.helpers_keep_signals_blocked(), quiet_torch_checkpoint():
            request = dist_checkpointing.save(
                state, staging, sharded_strategy=saver.strategy(),
                validate_access_integrity=validate, async_sharded_save=flags.async_save,
                **_save_options(flags))
            if request is not None:  # the write goes on in a helper; commit when it is done
                request.add_finalize_fn(commit)
                saver.schedule(request, (root, iteration, staging, needed))
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
