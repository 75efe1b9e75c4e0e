"""Per-token language-model loss, exact over SP ranks, DP ranks and micro batches.

Each SP rank holds a contiguous slice of one sample's tokens, and ranks hold different numbers of
unmasked tokens, so the loss is never an average of per-rank averages:

    loss = sum over ranks and micro batches of sum(l * mask) / sum over the same of sum(mask)

Each rank backpropagates its `sum(l * mask)`; megatron-core (`calculate_per_token_loss=True`)
sums gradients over DP x SP and divides them by the all-reduced token count.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from .. import cpu_compat


def masked_sum(per_token_loss: torch.Tensor, loss_mask: torch.Tensor):
    """per-token loss `[b, s/P]`, loss mask `[b, s/P]` -> (sum(l*mask), sum(mask)), float32."""
    mask = loss_mask.reshape(-1).float()
    return (per_token_loss.reshape(-1).float() * mask).sum(), mask.sum()


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """The loss function for megatron-core's forward-backward schedules in per-token mode:
    returns (loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})."""
    loss_sum, num_tokens = masked_sum(per_token_loss, loss_mask)
    reported = torch.stack([loss_sum.detach(), num_tokens])
    return loss_sum, num_tokens.to(torch.int), {"lm loss": reported}


def global_mean(sum_and_count: torch.Tensor) -> float:
    """[Σ loss·mask, Σ mask] of this rank -> the loss over all of megatron-core's DP x SP ranks
    (and pipeline stages: only the last one holds a loss, the others pass zeros)."""
    totals = sum_and_count.detach().to(cpu_compat.device(), torch.float64, copy=True)
    dist.all_reduce(totals, group=mpu.get_data_parallel_group())
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(totals, group=mpu.get_pipeline_model_parallel_group())
    return (totals[0] / totals[1].clamp(min=1)).item()
