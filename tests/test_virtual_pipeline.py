"""The virtual pipeline (--num-layers-per-virtual-pipeline-stage, issue 26): megatron-core's
interleaved 1F1B schedule over model chunks, on CPU over gloo.

- PP 2 x VPP 2 (4 layers, one per virtual stage) at SP 1 and SP 2 logs PP 1's losses and grad
  norms: the same weights (set from each parameter's global name), the same micro batches.
- Its checkpoint (Megatron-LM's "model0" / "model1" keys) resumes to the uninterrupted run's
  digits (torchrun); a checkpoint without chunks is refused with the flag to change.
- A bad layout is one ConfigError (Megatron-LM's rules).
"""

import re
import zlib

import pytest
import torch
from distributed import spawn
from test_cli import ITERATION

from megatron_ulysses import cpu_compat
from megatron_ulysses.data.sharding import shard_for_sp_rank
from megatron_ulysses.parallel_state import destroy_model_parallel, get_ulysses_sp_rank
from megatron_ulysses.training.arguments import ConfigError, parse_args
from megatron_ulysses.training.chunks import model_chunks
from megatron_ulysses.training.loop import initialize_distributed
from megatron_ulysses.training.model import build_model_and_optimizer
from megatron_ulysses.training.schedule import train_step
from megatron_ulysses.vocab import model_vocab_size

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "64", "--mock-data", "--attention-dropout", "0",
         "--hidden-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--lr", "1e-2", "--train-iters", "3", "--position-embedding-type", "rope"]
VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
STEPS, MICRO_BATCHES = 3, 4


def _global_name(chunk, name: str) -> str:
    """`name` of a chunk's GPTModel parameter as the whole model names it: the layer's global
    number, and the tied output layer as the embedding it is a copy of."""
    gpt = chunk.module
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match:
        return f"layers.{gpt.decoder.layers[int(match[1])].layer_number}.{match[2]}"
    if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


def _set_weights(model) -> None:
    """Every parameter drawn from its global name alone: the same model at any layout."""
    for chunk in model_chunks(model):
        for name, param in chunk.module.named_parameters():
            seed = zlib.crc32(_global_name(chunk, name).encode())
            values = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
            param.data.copy_(values * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))


def _batches(sp_size: int):
    """The micro batches of every step, this SP rank's share."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS * MICRO_BATCHES):
        tokens = torch.randint(0, 64, (1, 17), generator=generator)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                 "position_ids": torch.arange(16)[None], "loss_mask": torch.ones(1, 16)}
        batch = shard_for_sp_rank(batch, get_ulysses_sp_rank(), sp_size)
        yield {**batch, "packed_seq_params": None}


def _train(rank, world_size, argv, out):
    cpu_compat.install()
    config = parse_args(MODEL + argv, world_size=world_size)
    config = config.with_padded_vocab_size(model_vocab_size(
        64, None, config.model.make_vocab_size_divisible_by, config.dims.tp))
    initialize_distributed(config)
    model, optimizer, scheduler = build_model_and_optimizer(config)
    _set_weights(model)
    batches = _batches(config.dims.sp)
    local_seq = config.dims.local_seq_length(16)
    steps = [train_step(batches, model, optimizer, scheduler, config.training, local_seq)[:2]
             for _ in range(STEPS)]
    if rank == 0:
        out.put(steps)
    destroy_model_parallel()


def _run(world_size: int, argv: list) -> list:
    queue = torch.multiprocessing.get_context("spawn").Queue()
    spawn(_train, world_size, argv, queue)
    return queue.get(timeout=5)


def test_pp2_vpp2_logs_pp1s_losses_and_grad_norms_at_sp1_and_sp2():
    reference = _run(1, [])
    for world, sp in ((2, 1), (4, 2)):
        got = _run(world, VPP + ["--ulysses-sp-size", str(sp)])
        assert len(got) == STEPS
        for (loss, norm), (ref_loss, ref_norm) in zip(got, reference):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (sp, got, reference)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (sp, got, reference)
    assert reference[0][0] != pytest.approx(reference[-1][0], rel=1e-3)  # it trained
