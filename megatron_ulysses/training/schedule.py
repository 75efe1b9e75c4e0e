"""One optimizer step: forward and backward over the micro batches, gradient sync, the update.

megatron-core's schedule (`get_forward_backward_func`: no pipelining, 1F1B with PP > 1, or the
interleaved 1F1B over the model chunks of a virtual pipeline, `training.chunks`) runs the micro
batches with our per-token loss function, on GPU and on CPU alike (`cpu_compat` moves the token
count it allocates off "cuda"): each micro batch backpropagates Σ loss·mask inside the config's
`no_sync_func` but the last, and `finalize_model_grads` (the config's
`finalize_model_grads_func`) divides the gradients reduced over DP x SP by the step's Σ mask.
"""

import contextlib
import functools

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from .. import cpu_compat
from ..sp.loss import global_mean, loss_func
from .chunks import chunk_iterators, model_chunks
from .config import TrainingConfig
from .fsdp import local_grad


def per_token_loss(model, batch):
    """The model on one sequence-sharded micro batch: per-token loss `[b, s/P]`."""
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                 packed_seq_params=batch["packed_seq_params"])


def forward_step(data_iterator, model):
    """megatron-core's forward_step_func: per-token loss `[b, s/P]` and its loss function."""
    batch = next(data_iterator)
    return per_token_loss(model, batch), functools.partial(loss_func, batch["loss_mask"])


@contextlib.contextmanager
def _timer(model, name: str, log_level: int):
    """megatron-core's timer `name` around the block, as its schedules time themselves, when the
    training logger gave the model's config its `Timers` (Megatron-LM's `config.timers`)."""
    timers = getattr(model_chunks(model)[0].config, "timers", None)
    if timers is None:
        yield
        return
    timers(name, log_level=log_level).start()
    yield
    timers(name).stop()


def forward_backward(data_iterator, model, num_microbatches: int, micro_batch_size: int,
                     local_seq_length: int, forward_only=False):
    """All micro batches of one step; returns this rank's [Σ loss·mask, Σ mask] (float64),
    summed over micro batches (zeros off the last pipeline stage). `local_seq_length`: s/P
    after padding, the sequence length of one rank's activations."""
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=chunk_iterators(model, data_iterator),
        model=model_chunks(model),
        num_microbatches=num_microbatches, seq_length=local_seq_length,
        micro_batch_size=micro_batch_size, forward_only=forward_only,
    )
    totals = torch.zeros(2, dtype=torch.float64, device=cpu_compat.device())
    for report in reports:
        totals += report["lm loss"].double()
    return totals


class NonFiniteError(RuntimeError):
    """A NaN loss, or a NaN / Inf gradient, found before the update (every rank raises it)."""


def check_finite(totals: torch.Tensor, model, check_grads: bool, check_loss: bool = True) -> None:
    """--check-for-nan-in-loss-and-grad, between the backward and the update: raise
    `NonFiniteError` on every rank when any rank's Σ loss·mask is NaN (`check_loss`: not with
    --rerun-mode disabled, as Megatron-LM's rerun machine then skips it) or (`check_grads`: no
    loss scaler, which would skip the step itself) any gradient holds NaN or Inf."""
    grads = [(name, local_grad(param)) for chunk in model_chunks(model)
             for name, param in chunk.named_parameters() if check_grads and param.requires_grad]
    grads = [(name, grad) for name, grad in grads if grad is not None]  # Megatron-FSDP: buffers
    nan_loss = torch.isnan(totals[0]) & check_loss
    finite = torch.stack([torch.isfinite(grad).all() for _, grad in grads]
                         + [~nan_loss])  # on the device: one sync, below
    counts = torch.stack([(~finite[:-1]).sum(), ~finite[-1]]).double()
    dist.all_reduce(counts)
    bad_grads, nan_loss = int(counts[0]), int(counts[1])
    if not (nan_loss or bad_grads):
        return
    bad = [name for (name, _), ok in zip(grads, finite[:-1].tolist()) if not ok]
    found = []
    if nan_loss:
        found.append(f"the loss is NaN on {nan_loss} rank(s)")
    if bad_grads:
        here = f" (on this rank: {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
        found.append(f"{bad_grads} parameter gradient(s), counted over the ranks, hold NaN or Inf"
                     f"{here if bad else ''}")
    raise NonFiniteError("; ".join(found))


def train_step(data_iterator, model, optimizer, scheduler, training: TrainingConfig,
               local_seq_length: int, num_microbatches: int = None, after_backward=None):
    """One optimizer step over the global batch of `num_microbatches` micro batches (default
    the constant batch's; a batch-size ramp passes the current one); returns (loss, grad norm,
    update ok, number of zero gradients or None). Raises `NonFiniteError` before the update
    (--check-for-nan-in-loss-and-grad). `after_backward()`, if given, runs before the update."""
    if num_microbatches is None:
        num_microbatches = training.num_microbatches
    for chunk in model_chunks(model):
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    totals = forward_backward(data_iterator, model, num_microbatches, training.micro_batch_size,
                              local_seq_length)
    if training.check_for_nan_in_loss_and_grad:
        check_finite(totals, model, check_grads=not model_chunks(model)[0].config.fp16,
                     check_loss=training.rerun_mode != "disabled")
    if after_backward is not None:
        after_backward()
    with _timer(model, "optimizer", 1):
        ok, grad_norm, num_zeros = optimizer.step()
    if ok:  # the samples of this step (micro batch x pure DP is the constant batch's share)
        per_micro_batch = training.global_batch_size // training.num_microbatches
        scheduler.step(increment=num_microbatches * per_micro_batch)
    return global_mean(totals), grad_norm, ok, num_zeros


def evaluate(data_iterator, model, training: TrainingConfig, local_seq_length: int) -> float:
    """Mean per-token loss over `--eval-iters` batches of --eval-global-batch-size."""
    for chunk in model_chunks(model):
        chunk.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=cpu_compat.device())
    with torch.no_grad():
        for _ in range(training.eval_iters):
            totals += forward_backward(data_iterator, model, training.eval_num_microbatches,
                                       training.eval_micro_batch_size, local_seq_length,
                                       forward_only=True)
    for chunk in model_chunks(model):
        chunk.train()
    return global_mean(totals)
