"""What the loop does around each step for Megatron-LM's run flags: --manual-gc, the profiler
(--profile, --use-pytorch-profiler), --empty-unused-memory-level and
--check-weight-hash-across-dp-replicas-interval."""

import contextlib
import gc
import hashlib
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from .chunks import model_chunks
from .config import TrainingConfig


def weights_match_across_replicas(model) -> bool:
    """Every rank of megatron-core's DP group (here DP x SP, whose ranks all hold the same
    weights) holds bit-identical parameters: SHA-1 digests gathered over the group. (megatron-
    core's `check_param_hashes_across_dp_replicas` does this on GPU; it moves them to CUDA.)"""
    digest = hashlib.sha1()
    for index, chunk in enumerate(model_chunks(model)):
        for name, param in chunk.named_parameters(prefix=f"model{index}"):
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    mine = torch.tensor(list(digest.digest()), dtype=torch.uint8)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    group = mpu.get_data_parallel_group()
    everyone = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine.to(device), group=group)
    return all(torch.equal(other.cpu(), mine) for other in everyone)


class StepHooks:
    """Called by the loop: `before_step(iteration)`, `after_step(iteration, model)` (the
    iteration just done), `around_evaluation()`, `close()`."""

    def __init__(self, training: TrainingConfig, tensorboard_dir):
        self.training = training
        self.profiler = None
        rank = dist.get_rank()
        self.profiling = training.profile and (not training.profile_ranks
                                               or rank in training.profile_ranks)
        if training.manual_gc:  # one collection at the same points on every rank
            gc.disable()
            gc.collect()
        if self.profiling and training.use_pytorch_profiler:
            self.profiler = _torch_profiler(training, trace_dir(tensorboard_dir), rank)
            self.profiler.start()

    def before_step(self, iteration: int) -> None:
        """`iteration`: the number of steps done (Megatron-LM's counter before the step)."""
        if not self.profiling:
            return
        if self.profiler is not None:
            self.profiler.step()
        elif iteration == self.training.profile_step_start and torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStart()

    def after_step(self, iteration: int, model) -> None:
        training = self.training
        if self.profiling and iteration == training.profile_step_end:
            if self.profiler is not None:
                self.profiler.stop()
                self.profiler = None
            elif torch.cuda.is_available():
                torch.cuda.cudart().cudaProfilerStop()
        interval = training.check_weight_hash_across_dp_replicas_interval
        if interval and iteration % interval == 0 and not weights_match_across_replicas(model):
            raise RuntimeError(f"iteration {iteration}: the data-parallel replicas hold "
                               "different weights (--check-weight-hash-across-dp-replicas-"
                               "interval)")
        if training.manual_gc and training.manual_gc_interval and \
                iteration % training.manual_gc_interval == 0:
            gc.collect()
        if training.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def around_evaluation(self):
        training = self.training
        collect = training.manual_gc and training.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect()
        if training.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.profiler is not None:  # the run ended inside the profiled steps
            self.profiler.stop()
        if self.training.manual_gc:
            gc.enable()


def trace_dir(tensorboard_dir) -> str:
    """Megatron-LM's place: <--tensorboard-dir>/../torch_profile (./torch_profile without)."""
    if tensorboard_dir is None:
        return os.path.abspath("torch_profile")
    return os.path.join(os.path.dirname(os.path.abspath(tensorboard_dir)), "torch_profile")


def _torch_profiler(training: TrainingConfig, directory: str, rank: int):
    """torch.profiler over the steps [profile_step_start, profile_step_end), stepped once per
    iteration before it (Megatron-LM's schedule); the chrome trace goes to
    `directory`/rank-R.json.gz."""
    def write(profiler):
        os.makedirs(directory, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(directory, f"rank-{rank}.json.gz"))

    start = training.profile_step_start
    return torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                         active=training.profile_step_end - start, repeat=1),
        on_trace_ready=write, record_shapes=training.pytorch_profiler_collect_shapes,
        with_stack=training.pytorch_profiler_collect_callstack,
    )
