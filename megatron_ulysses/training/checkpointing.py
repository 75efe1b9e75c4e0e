"""Checkpoints with megatron-core `dist_checkpointing`: model, optimizer, LR scheduler, RNG,
iteration, consumed samples and args.

Layout (Megatron-LM's): `<save>/iter_0000100/` and `<save>/latest_checkpointed_iteration.txt`.
A save goes to `iter_0000100.tmp/`, is renamed when every rank has finished, and only then is the
"latest" marker replaced (write + rename): a crash at any point leaves the last good checkpoint
loadable. Tensors are stored unsharded-by-layout, so a run can resume with another
`--ulysses-sp-size` or data-parallel size (TP and PP must match).
"""

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject

from .logging import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"
# The distributed optimizer's canonical, per-parameter layout: it loads at any DP x SP size (SP
# lives inside megatron-core's DP, so a new --ulysses-sp-size changes DP'). megatron-core 0.19's
# default, fully_sharded_model_space, is deprecated there and fails to save; dp_reshardable
# reshards over DP only with the same bucket layout. `CpuAdamW` takes and ignores it.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# Args that must match between the checkpoint and the run that loads it.
_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "kv_channels", "padded_vocab_size",
               "tensor_model_parallel_size", "pipeline_model_parallel_size",
               "position_embedding_type", "swiglu", "normalization",
               "untie_embeddings_and_output_weights", "disable_bias_linear")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str):
    """The iteration in `root`'s "latest" marker, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"--load: {path} holds {text!r}, expected an iteration number")
    return int(text)


def _rng_state():
    """This rank's RNG states as a ShardedObject: one per (PP, TP) position, DP x SP replicas."""
    state = {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp, tp = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
    return ShardedObject("rng_state", state,
                         (mpu.get_pipeline_model_parallel_world_size(),
                          mpu.get_tensor_model_parallel_world_size()),
                         (pp, tp), replica_id=mpu.get_data_parallel_rank())


def _set_rng_state(state) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(model, optimizer, scheduler, args, iteration, consumed_samples,
                        is_loading, with_optimizer=True, with_rng=True):
    model_sd = model.module.sharded_state_dict()
    state = {"model": model_sd, "iteration": iteration, "consumed_samples": consumed_samples,
             "args": {key: getattr(args, key) for key in _SHAPE_ARGS}}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                         metadata=OPTIMIZER_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, args,
                    consumed_samples: int) -> None:
    """Save atomically to `<root>/iter_<iteration>` and point the "latest" marker at it."""
    final = checkpoint_dir(root, iteration)
    staging = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(staging)
    dist.barrier()
    state = _sharded_state_dict(model, optimizer, scheduler, args, iteration, consumed_samples,
                                is_loading=False)
    dist_checkpointing.save(state, staging)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        tracker = os.path.join(root, TRACKER)
        with open(tracker + ".tmp", "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker + ".tmp", tracker)
    dist.barrier()
    print_rank_0(f" saved checkpoint at iteration {iteration:8d} to {final}")


def load_checkpoint(root: str, model, optimizer, scheduler, args):
    """Load the latest checkpoint in `root`; returns (iteration, consumed_samples), (0, 0)
    when there is none. `--finetune` loads the model only and restarts at 0."""
    iteration = read_tracker(root)
    if iteration is None:
        print_rank_0(f" WARNING: no checkpoint at --load {root} ({TRACKER} missing); "
                     "training from scratch")
        return 0, 0
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--load: {TRACKER} points at {path}, which does not exist")
    saved_args = dist_checkpointing.load_common_state_dict(path)["args"]
    mismatched = {key: (saved_args[key], getattr(args, key)) for key in _SHAPE_ARGS
                  if saved_args.get(key) != getattr(args, key)}
    if mismatched:
        details = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in
                            mismatched.items())
        raise ValueError(f"--load {path} was saved with a different model or TP/PP layout: "
                         f"{details}")
    with_optimizer = not (args.finetune or args.no_load_optim)
    with_rng = not (args.finetune or args.no_load_rng)
    state = _sharded_state_dict(model, optimizer, scheduler, args, 0, 0, is_loading=True,
                                with_optimizer=with_optimizer, with_rng=with_rng)
    loaded = dist_checkpointing.load(state, path)
    model.module.load_state_dict(loaded["model"])
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        try:
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
        except AssertionError as error:  # megatron-core's check of flags vs checkpoint
            raise ValueError(
                f"--load {path}: the LR schedule of the flags differs from the checkpoint's "
                f"({error}); pass --override-opt_param-scheduler to use the flags or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's") from None
    if with_rng:
        _set_rng_state(loaded["rng_state"])
    print_rank_0(f" loaded checkpoint from {path} at iteration {loaded['iteration']}")
    if args.finetune:
        return 0, 0
    return loaded["iteration"], loaded["consumed_samples"]
