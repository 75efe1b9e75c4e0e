"""The virtual pipeline (--num-layers-per-virtual-pipeline-stage, issue 26): megatron-core's
interleaved 1F1B schedule over model chunks, on CPU over gloo.

- PP 2 x VPP 2 (4 layers, one per virtual stage) at SP 1 and SP 2, and PP 2 without chunks, log
  PP 1's losses and grad norms: the same weights (set from each parameter's global name), the
  same micro batches.
- Its checkpoint (Megatron-LM's "model0" / "model1" keys) resumes to the uninterrupted run's
  digits (torchrun); a run with other chunks than the checkpoint's is told which flag differs.
- A bad layout is one ConfigError (Megatron-LM's rules).
"""

import os
import re
import subprocess
import sys
import zlib

import pytest
import torch
from conftest import REPO_ROOT
from distributed import spawn
from test_cli import ITERATION, validation

from megatron_ulysses import cpu_compat
from megatron_ulysses.data.sharding import shard_for_sp_rank
from megatron_ulysses.parallel_state import destroy_model_parallel, get_ulysses_sp_rank
from megatron_ulysses.training import checkpointing
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
    plain_pp = ["--pipeline-model-parallel-size", "2"]  # 1F1B without chunks, on CPU too
    for world, sp, layout in ((2, 1, VPP), (4, 2, VPP), (2, 1, plain_pp)):
        got = _run(world, layout + ["--ulysses-sp-size", str(sp)])
        assert len(got) == STEPS
        for (loss, norm), (ref_loss, ref_norm) in zip(got, reference):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (sp, got, reference)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (sp, got, reference)
    assert reference[0][0] != pytest.approx(reference[-1][0], rel=1e-3)  # it trained


def _torchrun(nproc: int, *flags: str):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(REPO_ROOT / "pretrain_gpt.py"), *MODEL,
               "--log-interval", "1", "--num-workers", "0", "--log-params-norm", *flags]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _logged(result) -> dict:
    """iteration -> the logged line's loss, grad norm and params norm, as printed."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {int(line.split("iteration")[1].split("/")[0]): re.findall(
        r"(?:lm loss|grad norm|params norm): (\S+)", line)
        for line in result.stdout.splitlines() if ITERATION.search(line)}


def test_a_chunked_checkpoint_resumes_to_the_uninterrupted_runs_digits(tmp_path):
    flags = [*VPP, "--train-iters", "4", "--save-interval", "2", "--eval-interval", "2",
             "--eval-iters", "1"]
    runs = [_torchrun(2, *flags, "--save", str(tmp_path / "a")),
            _torchrun(2, *flags, "--exit-interval", "2", "--save", str(tmp_path / "b"))]
    runs.append(_torchrun(2, *flags, "--load", str(tmp_path / "b"), "--save",
                          str(tmp_path / "b")))
    straight, first, resumed = map(_logged, runs)
    assert list(straight) == [1, 2, 3, 4] and list(first) == [1, 2] and list(resumed) == [3, 4]
    assert {**first, **resumed} == straight
    # evaluation runs over the chunks too, at iterations 2 and 4 of either story
    evaluated = [validation(run) for run in runs]
    assert list(evaluated[0]) == [2, 4] and {**evaluated[1], **evaluated[2]} == evaluated[0]


def test_a_run_without_the_checkpoints_chunks_is_told_which_flag_differs():
    saved = checkpointing._saved_args(parse_args(MODEL + VPP, world_size=2))
    run = checkpointing._saved_args(parse_args(
        MODEL + ["--pipeline-model-parallel-size", "2"], world_size=2))
    with pytest.raises(ConfigError, match=r"virtual pipeline stages per rank .*: checkpoint 2, "
                       "this run None"):
        checkpointing._check_args("ckpt", saved, run)
