"""Training logs: one Megatron-LM-format line per `--log-interval` on rank 0, the same scalars to
TensorBoard, plus throughput, TFLOP/s per GPU (attention over the full sequence), peak memory (on
GPU also peak host memory, where offloaded activations live) and ETA. `tools/plot_run.py` reads
both."""

import contextlib
import datetime
import math
import resource
import sys
import time

import torch
import torch.distributed as dist


def is_rank_0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank_0(message: str) -> None:
    if is_rank_0():
        print(message, flush=True)


def matmul_params(model) -> int:
    """Weights every token multiplies through: the layers' linear layers and the output layer
    (tied or not); no input embedding, norms or biases."""
    h, d = model.hidden_size, model.kv_channels
    attention = h * (model.num_attention_heads + 2 * model.num_query_groups) * d \
        + model.num_attention_heads * d * h
    mlp = h * model.ffn_hidden_size * (3 if model.swiglu else 2)
    return model.num_layers * (attention + mlp) + model.padded_vocab_size * h


def model_flops_per_sample(model) -> float:
    """fwd+bwd FLOPs of one `--seq-length` sample: 6 x matmul params x s plus
    6 x layers x s^2 x (heads x kv channels) for causal attention over the whole sequence
    (QK^T and AV, half of the square, three passes). `model`: a `ModelConfig`."""
    s = model.seq_length
    attention = 6 * model.num_layers * s * s * model.num_attention_heads * model.kv_channels
    return 6 * matmul_params(model) * s + attention


def peak_host_memory_gib() -> float:
    """Peak resident host memory of this rank's process (pinned offload buffers included)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_memory_gib() -> float:
    """Peak allocated CUDA memory of this rank, or peak resident memory on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return peak_host_memory_gib()


def _as_float(value):
    """A Python float from a float, int or 0-d tensor; None stays None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return float(value)


class TrainingLogger:
    """Accumulates per-iteration figures between log lines; rank 0 prints and writes TB."""

    def __init__(self, config, world_size: int):
        """`config`: the `RunConfig` (its logging, training and model sections)."""
        self.log_interval = config.logging.log_interval
        self.train_iters = config.training.train_iters
        self.global_batch_size = config.training.global_batch_size
        self.seq_length = config.model.seq_length
        self.flops_per_sample = model_flops_per_sample(config.model)
        self.world_size = world_size
        self.writer = None
        if config.logging.tensorboard_dir and is_rank_0():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=config.logging.tensorboard_dir, max_queue=10)
        self.start = time.time()
        self.window_start = time.time()
        self.window_iters = 0
        self.skipped = 0
        self.nan = 0
        self.first_iteration = None

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluation, checkpoint saves) does not count as training time."""
        start = time.time()
        try:
            yield
        finally:
            self.window_start += time.time() - start
            self.start += time.time() - start

    def log_iteration(self, iteration: int, consumed_samples: int, loss: float, lr: float,
                      grad_norm, loss_scale, skipped: bool, global_batch_size: int = None) -> None:
        """`grad_norm` and `loss_scale` as the optimizer returns them: a float, a 0-d tensor
        (megatron-core 0.19) or None; `global_batch_size`: this iteration's (a ramp's)."""
        if global_batch_size is not None:
            self.global_batch_size = global_batch_size
        grad_norm = _as_float(grad_norm)
        loss_scale = _as_float(loss_scale)
        if self.first_iteration is None:
            self.first_iteration = iteration - 1
        self.window_iters += 1
        self.skipped += int(skipped)
        self.nan += int(loss != loss)
        if iteration % self.log_interval != 0:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.time() - self.window_start
        per_iter = elapsed / self.window_iters
        samples_per_s = self.global_batch_size / per_iter
        tokens_per_s = samples_per_s * self.seq_length
        tflops = self.flops_per_sample * samples_per_s / self.world_size / 1e12
        memory = peak_memory_gib()
        host_memory = peak_host_memory_gib() if torch.cuda.is_available() else None
        done = iteration - self.first_iteration
        eta = (time.time() - self.start) / max(done, 1) * (self.train_iters - iteration)
        if self.writer is not None:
            for tag, value in (("lm loss", loss), ("learning-rate", lr),
                               ("throughput/tokens-per-sec", tokens_per_s),
                               ("throughput/tflops-per-gpu", tflops),
                               ("memory/peak-GiB", memory), ("loss-scale", loss_scale)):
                self.writer.add_scalar(tag, value, iteration)
            if grad_norm is not None:
                self.writer.add_scalar("grad-norm", grad_norm, iteration)
            if host_memory is not None:
                self.writer.add_scalar("memory/peak-host-GiB", host_memory, iteration)
            self.writer.flush()
        grad = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
        fields = [
            f"iteration {iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {per_iter * 1000:.1f}",
            f"throughput (tokens/s): {tokens_per_s:.1f}",
            f"TFLOP/s per GPU: {tflops:.3f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {self.global_batch_size:5d}",
            f"lm loss: {loss:.6E}",
            f"loss scale: {loss_scale:.1f}",
            f"grad norm: {grad}",
            f"peak memory (GiB): {memory:.2f}",
            *([f"peak host memory (GiB): {host_memory:.2f}"] if host_memory is not None else []),
            f"number of skipped iterations: {self.skipped:3d}",
            f"number of nan iterations: {self.nan:3d}",
            f"ETA: {datetime.timedelta(seconds=int(eta))}",
        ]
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        print_rank_0(f" [{now}] " + " | ".join(fields) + " |")
        self.window_start = time.time()
        self.window_iters = 0
        self.skipped = self.nan = 0

    def log_validation(self, iteration: int, loss: float, label: str = "validation") -> None:
        ppl = math.exp(min(20.0, loss))
        line = f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | " \
               f"lm loss PPL: {ppl:.6E} |"
        print_rank_0("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        if self.writer is not None:
            self.writer.add_scalar(f"{label}/lm loss", loss, iteration)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        sys.stdout.flush()
