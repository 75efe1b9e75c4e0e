"""The greedy answer of prompts whose right answer is known, without a generation loop.

Greedy decoding emits answer token t_i iff t_i is the argmax of the logits after the prompt and
t_1..t_{i-1}. So the greedy answer starts with the right answer's tokens iff at every answer
position the argmax given the *right* prefix is the right token, which one teacher-forced forward
over prompt + answer decides for all positions at once (once one position is wrong, the later
ones do not matter: the answer is wrong either way). The argmax is over the tokenizer's ids (the
padded vocabulary rows are not tokens); ties go to the lowest id, as torch.argmax. Right means
token-exact: a model that spells the answer with other tokens is counted wrong, as a greedy
generation compared token by token would be.

The forward is the trainer's model; each batch `[b, s]` is sharded as training shards it
(`data.sharding.get_batch_for_sp_rank`), so every SP rank holds s/P tokens. Only the answer
positions go through the output layer (as megatron-core's own inference path does for the last
token), so no [s/P, V] logits exist; the argmax over the TP-sharded vocabulary is taken per rank
and compared over TP, and the answer tokens are combined over the SP group.
"""

import contextlib
from typing import List, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from .. import cpu_compat
from ..sp import parallel_state as ps
from ..data.sharding import get_batch_for_sp_rank
from ..data.tokenizers import padding_id
from .prompt import Prompt


def _gpt_model(model) -> GPTModel:
    return next(module for module in model.modules() if isinstance(module, GPTModel))


@contextlib.contextmanager
def output_layer_positions(gpt: GPTModel, positions: torch.Tensor):
    """Within: `gpt`'s output layer sees only the decoder's hidden states at `positions` (this
    rank's s/P coordinates), so the logits are [b, len(positions), V/TP]. Under
    --sequence-parallel the hidden states are first gathered over TP and the output layer's
    sequence gather is off, as in megatron-core's GPTModel for the last token in inference."""
    output_layer = gpt.output_layer
    sequence_parallel = output_layer.sequence_parallel

    def select(hidden):
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, group=mpu.get_tensor_model_parallel_group())
        return hidden.index_select(0, positions)

    def hook(module, inputs, output):
        if isinstance(output, tuple):  # 0.19 may return (hidden, intermediate hidden states)
            return (select(output[0]),) + tuple(output[1:])
        return select(output)

    handle = gpt.decoder.register_forward_hook(hook)
    output_layer.sequence_parallel = False
    try:
        yield
    finally:
        handle.remove()
        output_layer.sequence_parallel = sequence_parallel


def vocab_parallel_argmax(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Argmax ids `[...]` of this TP rank's logits `[..., V/TP]` over the whole vocabulary's
    first `vocab_size` ids (the padded rows are not tokens); ties go to the lowest id."""
    local = logits.shape[-1]
    offset = mpu.get_tensor_model_parallel_rank() * local
    ids = torch.arange(offset, offset + local, device=logits.device)
    values, index = logits.float().masked_fill(ids >= vocab_size, float("-inf")).max(dim=-1)
    index = index + offset  # torch.max gives the first of equal maxima
    tp = mpu.get_tensor_model_parallel_world_size()
    if tp == 1:
        return index
    group = mpu.get_tensor_model_parallel_group()
    all_values = [torch.empty_like(values) for _ in range(tp)]
    all_index = [torch.empty_like(index) for _ in range(tp)]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_index, index.contiguous(), group=group)
    best = torch.stack(all_values).argmax(dim=0, keepdim=True)  # the first (lowest id) of ties
    return torch.stack(all_index).gather(0, best).squeeze(0)


def _sharded_sample(prompts: Sequence[Prompt], tokenizer) -> dict:
    """This SP rank's `[b, s/P]` slice of the batch; its loss mask marks the positions that
    predict answer tokens."""
    length = len(prompts[0].tokens)
    tokens = torch.tensor([p.tokens for p in prompts], dtype=torch.long)
    pad = padding_id(tokenizer)
    labels = torch.cat([tokens[:, 1:], torch.full((len(prompts), 1), pad)], dim=1)
    answer_mask = torch.zeros_like(tokens, dtype=torch.float)  # positions that predict answers
    for row, prompt in enumerate(prompts):
        answer_mask[row, length - len(prompt.answer) - 1:length - 1] = 1
    sample = {"tokens": tokens, "labels": labels, "loss_mask": answer_mask,
              "position_ids": torch.arange(length).expand_as(tokens).contiguous()}
    return get_batch_for_sp_rank(sample, ps.get_ulysses_sp_rank(),
                                 ps.get_ulysses_sp_world_size(), pad_id=pad,
                                 eod_id=tokenizer.eod, vocab_size=tokenizer.vocab_size)


def predict(model, prompts: List[Prompt], tokenizer) -> List[List[int]]:
    """The greedy (teacher-forced) token at every answer position of each prompt (all of one
    length s), one forward of the batch sharded over the SP group; the same lists on every rank
    of the group."""
    length = len(prompts[0].tokens)
    local = _sharded_sample(prompts, tokenizer)
    local_mask = local["loss_mask"].bool()  # [b, s/P]
    columns = local_mask.any(dim=0).nonzero().squeeze(1)
    if columns.numel() == 0:  # no answer here; one column keeps every kernel's shape usual
        columns = torch.zeros(1, dtype=torch.long)
    device = cpu_compat.device()
    with torch.no_grad(), output_layer_positions(_gpt_model(model), columns.to(device)):
        logits = model(local["tokens"].to(device), local["position_ids"].to(device), None)
    chosen = vocab_parallel_argmax(logits, tokenizer.vocab_size).cpu()  # [b, len(columns)]

    width = max(len(p.answer) for p in prompts)
    answers = torch.full((len(prompts), width), -1, dtype=torch.long)
    first_global = ps.get_ulysses_sp_rank() * local_mask.shape[1]
    for row, prompt in enumerate(prompts):
        start = length - len(prompt.answer) - 1  # the position that predicts answer token 0
        for j, column in enumerate(columns.tolist()):
            if local_mask[row, column]:
                answers[row, first_global + column - start] = chosen[row, j]
    answers = answers.to(device)
    dist.all_reduce(answers, op=dist.ReduceOp.MAX, group=ps.get_ulysses_sp_group())
    return [answers[row, :len(p.answer)].tolist() for row, p in enumerate(prompts)]
