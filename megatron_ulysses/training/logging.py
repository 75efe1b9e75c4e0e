"""Training logs: one Megatron-LM-format line per `--log-interval` on rank 0, the same scalars to
TensorBoard and W&B (`writers`), plus throughput, TFLOP/s per GPU (attention over the full
sequence), peak memory (on GPU also peak host memory, where offloaded activations live) and ETA;
on request the params norm, the zero gradients, megatron-core's Timers (--timing-log-level),
memory reports and progress.txt. `tools/plot_run.py` reads both."""

import contextlib
import datetime
import logging
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.timers import Timers

from .chunks import model_chunks
from .fsdp import sum_over_shards
from .writers import ScalarWriters


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


# megatron-core Timers logged per --timing-log-level, as Megatron-LM's training_log lists them;
# a timer nobody started (a piece megatron-core skips on this run) is left out of the report.
TIMERS_BY_LEVEL = (
    (),
    ("forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
     "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
     "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros",
     "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer"),
    ("batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send",
     "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
     "backward-send-forward-recv", "backward-send-backward-recv",
     "forward-backward-send-forward-backward-recv"),
)


def timers_to_log(level: int):
    return [name for names in TIMERS_BY_LEVEL[:level + 1] for name in names]


@torch.no_grad()
def params_l2_norm(model) -> float:
    """L2 norm of all parameters, each counted once: TP-sharded ones summed over TP x PP,
    shared and TP-duplicated ones once (DP x SP replicas are equal, so not summed over; FSDP's
    shards are). `model`: the model or its virtual pipeline chunks."""
    squares = sum_over_shards([(param, param.detach()) for chunk in model_chunks(model)
                               for param in chunk.parameters()],
                              lambda shard: shard.double().pow(2).sum())
    if dist.is_initialized():  # on the parameters' device: NCCL reduces no CPU tensor
        dist.all_reduce(squares, group=mpu.get_model_parallel_group())
    return math.sqrt(squares.item())  # one sync


def memory_stats() -> dict:
    """--log-memory-to-tensorboard's scalars: Megatron-LM's CUDA allocator figures, or on CPU the
    current and peak resident host memory."""
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"]}
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"mem-rss-bytes": resident, "mem-max-rss-bytes": peak_host_memory_gib() * 2**30}


def append_progress(save_dir, text: str) -> None:
    """--log-progress: one line in <--save>/progress.txt (rank 0), Megatron-LM's format:
    time, job id, number of processes, event."""
    if save_dir is None or not is_rank_0():
        return
    os.makedirs(save_dir, exist_ok=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    with open(os.path.join(save_dir, "progress.txt"), "a+") as progress:
        progress.write(f"{now}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}\t# GPUs: {world}\t"
                       f"{text}\n")


def set_logging_level(level) -> None:
    """--logging-level: the level of every Python logger (megatron-core's included)."""
    if level is not None:
        logging.basicConfig(level=level)
        logging.getLogger().setLevel(level)


class TrainingLogger:
    """Accumulates per-iteration figures between log lines; rank 0 prints and writes the scalars.
    Its `timers` (megatron-core's) are given to the model's config, so megatron-core's schedule,
    gradient sync and optimizer time themselves (Megatron-LM's `config.timers`)."""

    def __init__(self, config, world_size: int, model=None):
        """`config`: the `RunConfig` (its logging, training and model sections); `model`: for
        --log-params-norm."""
        self.logging = config.logging
        self.log_interval = config.logging.log_interval
        self.train_iters = config.training.train_iters
        self.global_batch_size = config.training.global_batch_size
        self.seq_length = config.model.seq_length
        self.flops_per_sample = model_flops_per_sample(config.model)
        self.world_size = world_size
        self.model = model
        self.timers = Timers(config.logging.timing_log_level, config.logging.timing_log_option)
        if model is not None:  # the chunks of a virtual pipeline share one config
            model_chunks(model)[0].config.timers = self.timers
        self.writer = ScalarWriters(config)
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

    def job_throughput(self, consumed_since_start: int) -> float:
        """TFLOP/s per GPU of this job so far (progress.txt's 'Job throughput')."""
        seconds = max(time.time() - self.start, 1e-9)
        return self.flops_per_sample * consumed_since_start / seconds / 1e12 / self.world_size

    def log_iteration(self, iteration: int, consumed_samples: int, loss: float, lr: float,
                      grad_norm, loss_scale, skipped: bool, num_zeros=None,
                      global_batch_size: int = None) -> None:
        """`grad_norm`, `loss_scale` and `num_zeros` as the optimizer returns them: a float, a
        0-d tensor (megatron-core 0.19) or None; `global_batch_size`: this iteration's (a
        ramp's). Every rank calls it (the params norm and the timers are collectives)."""
        if global_batch_size is not None:
            self.global_batch_size = global_batch_size
        if self.first_iteration is None:
            self.first_iteration = iteration - 1
        self.window_iters += 1
        self.skipped += int(skipped)
        self.nan += int(loss != loss)
        if iteration % self.log_interval != 0:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        figures = self._figures(iteration, _as_float(grad_norm), _as_float(loss_scale),
                                _as_float(num_zeros))
        self._write(iteration, loss, lr, figures)
        print_rank_0(self._line(iteration, consumed_samples, loss, lr, figures))
        self._log_timers(iteration)
        interval = self.logging.log_memory_interval
        if interval and iteration % interval == 0:
            print_rank_0(f" [Rank 0] (after {iteration} iterations) memory: " + " | ".join(
                f"{tag}: {value / 2**20:.1f} MiB" for tag, value in memory_stats().items()))
        self.window_start = time.time()
        self.window_iters = 0
        self.skipped = self.nan = 0

    def _figures(self, iteration: int, grad_norm, loss_scale, num_zeros) -> dict:
        """The log window's measures (collectives first, on every rank)."""
        per_iter = (time.time() - self.window_start) / self.window_iters
        samples_per_s = self.global_batch_size / per_iter
        done = iteration - self.first_iteration
        return dict(
            per_iter=per_iter, tokens_per_s=samples_per_s * self.seq_length,
            tflops=self.flops_per_sample * samples_per_s / self.world_size / 1e12,
            memory=peak_memory_gib(),
            host_memory=peak_host_memory_gib() if torch.cuda.is_available() else None,
            eta=(time.time() - self.start) / max(done, 1) * (self.train_iters - iteration),
            grad_norm=grad_norm, loss_scale=loss_scale, num_zeros=num_zeros,
            params_norm=params_l2_norm(self.model) if self.logging.log_params_norm else None,
        )

    def _write(self, iteration: int, loss: float, lr: float, f: dict) -> None:
        if not self.writer.active:
            return
        scalars = {"lm loss": loss, "learning-rate": lr, "grad-norm": f["grad_norm"],
                   "throughput/tokens-per-sec": f["tokens_per_s"],
                   "throughput/tflops-per-gpu": f["tflops"], "memory/peak-GiB": f["memory"],
                   "memory/peak-host-GiB": f["host_memory"], "num-zeros": f["num_zeros"],
                   "params-norm": f["params_norm"]}
        if self.logging.log_loss_scale_to_tensorboard:
            scalars["loss-scale"] = f["loss_scale"]
        if self.logging.log_world_size_to_tensorboard:
            scalars["world-size"] = self.world_size
        if self.logging.log_timers_to_tensorboard:
            scalars["iteration-time"] = f["per_iter"]
        if self.logging.log_memory_to_tensorboard:
            scalars.update(memory_stats())
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, iteration)
        self.writer.flush()

    def _line(self, iteration: int, consumed_samples: int, loss: float, lr: float,
              f: dict) -> str:
        grad = f"{f['grad_norm']:.3f}" if f["grad_norm"] is not None else "n/a"
        fields = [
            f"iteration {iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {f['per_iter'] * 1000:.1f}",
            f"throughput (tokens/s): {f['tokens_per_s']:.1f}",
            f"TFLOP/s per GPU: {f['tflops']:.3f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {self.global_batch_size:5d}",
            f"lm loss: {loss:.6E}",
            f"loss scale: {f['loss_scale']:.1f}",
            f"grad norm: {grad}",
            *([f"num zeros: {int(f['num_zeros'])}"] if f["num_zeros"] is not None else []),
            *([f"params norm: {f['params_norm']:.3f}"] if f["params_norm"] is not None else []),
            f"peak memory (GiB): {f['memory']:.2f}",
            *([f"peak host memory (GiB): {f['host_memory']:.2f}"]
              if f["host_memory"] is not None else []),
            f"number of skipped iterations: {self.skipped:3d}",
            f"number of nan iterations: {self.nan:3d}",
            f"ETA: {datetime.timedelta(seconds=int(f['eta']))}",
        ]
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        return f" [{now}] " + " | ".join(fields) + " |"

    def _log_timers(self, iteration: int) -> None:
        """megatron-core's timer report (averaged over the window; collective on every rank),
        and with --log-timers-to-tensorboard their max over ranks as '<name>-time'."""
        names = timers_to_log(self.logging.timing_log_level)
        if not names:
            return
        if self.logging.log_timers_to_tensorboard:
            for writer in self.writer.timer_writers():
                self.timers.write(names, writer, iteration, normalizer=self.window_iters,
                                  reset=False)
            self.writer.flush()
        report = self.timers.get_all_timers_string(names, normalizer=self.window_iters,
                                                   reset=True)
        if report:
            print_rank_0(report)

    def log_validation(self, iteration: int, loss: float, label: str = "validation") -> None:
        ppl = math.exp(min(20.0, loss))
        line = f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | " \
               f"lm loss PPL: {ppl:.6E} |"
        print_rank_0("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        self.writer.add_scalar(f"{label}/lm loss", loss, iteration)
        if self.logging.log_validation_ppl_to_tensorboard:
            self.writer.add_scalar(f"{label}/lm loss ppl", ppl, iteration)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        sys.stdout.flush()
