"""The one CPU-compatibility shim: lets megatron-core run on a machine without CUDA (tests, the
CPU quickstart). `install()` does nothing when CUDA is available.

megatron-core assumes CUDA in a few places that matter for a CPU run: `torch.cuda.current_device()`
as a tensor device (RoPE, GlobalMemoryBuffer, local attention), `torch.cuda.current_stream()`
(DDP), `torch.cuda.synchronize()` (dist_checkpointing), the token count its schedules
allocate on "cuda", the CUDA RNG tracker (dropout under
tensor parallelism, activation recompute) and the "cuda" device mesh of its FSDP2 wrapper. On CPU
these map to the CPU device, no-ops, a tracker over CPU generator states and a CPU mesh.
"""

import contextlib

import torch

_INSTALLED = False


class _NullStream:
    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Same contract as megatron-core's tracker, over CPU generator states: unique seeds,
        and a fork inside a fork continues the outer fork's stream instead of replaying it."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cpu rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"cpu rng state {name} is not added")
            # As megatron-core's fork: the generator holds the current fork's state, so an inner
            # fork first stores it, and restores the outer one's latest state on exit.
            orig, orig_name = torch.get_rng_state(), self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig = self.states_[orig_name]
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def device() -> torch.device:
    """Where this process's tensors live: its CUDA device, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _CpuDeviceMesh:
    """megatron-core's FSDP2 wrapper builds `DeviceMesh.from_group(group, "cuda")`: on CPU the
    same mesh on "cpu" (gloo), so `fully_shard` keeps the shards on the CPU."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


class _CpuTokenCountTorch:
    """`torch` as megatron-core's schedules (no pipelining, 1F1B, interleaved) see it:
    `torch.zeros(..., device="cuda")` (their step's token count, the one CUDA tensor they make) on
    the CPU; all else is torch."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def tensors_stay_on_cpu():
    """On CPU, `Tensor.cuda()` returns the tensor inside: megatron-core's GPTModel moves the
    tied embedding to "cuda" before its first-to-last-stage all-reduce (PP > 1)."""
    if torch.cuda.is_available():
        yield
        return
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


def install() -> None:
    """Apply the shim once, only when CUDA is absent."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    from megatron.core.distributed import torch_fully_sharded_data_parallel as torch_fsdp
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda *args, **kwargs: _NullStream()
    torch.cuda.stream = lambda *args, **kwargs: _NullStream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mcore_random._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker_class()()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch_fsdp.DeviceMesh = _CpuDeviceMesh
    schedules.torch = _CpuTokenCountTorch()
    _INSTALLED = True


def model_parallel_manual_seed(seed: int) -> None:
    """megatron-core's `model_parallel_cuda_manual_seed` on GPU; on CPU the same named streams
    (default, tensor-model-parallel, data-parallel) over CPU generator states."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718 + mpu.get_tensor_model_parallel_rank())
    tracker.add(tensor_parallel.random.get_data_parallel_rng_tracker_name(), seed)
    tracker.add(tensor_parallel.random.get_expert_parallel_rng_tracker_name(),
                seed + 1024 + 100 * mpu.get_expert_model_parallel_rank()
                + mpu.get_tensor_model_parallel_rank())
