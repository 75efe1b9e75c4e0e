"""The virtual pipeline (--num-layers-per-virtual-pipeline-stage, issue 26): megatron-core's
interleaved 1F1B schedule over model chunks, on CPU over gloo.

- PP 2 x VPP 2 (4 layers, one per virtual stage) at SP 1 and SP 2, and PP 2 without chunks, log
  PP 1's losses and grad norms: the same weights (set from each parameter's global name), the
  same micro batches.
- Its checkpoint (Megatron-LM's "model0" / "model1" keys) resumes to the uninterrupted run's
  digits (torchrun); a run with other chunks than the checkpoint's is told which flag differs.
- --overlap-grad-reduce at PP 2 x VPP 2 x SP 2: the schedule starts each chunk's reduction
  (Megatron-LM's aligned grad_sync_func), bitwise the synchronous run's digits; the sync
  functions follow Megatron-LM's flags (--no-align-grad-reduce, --no-align-param-gather).
- A bad layout is one ConfigError (Megatron-LM's rules).
"""

import dataclasses
import functools
import os
import re
import subprocess
import sys
import types
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
        out.put((steps, _sync_funcs(model)))
    destroy_model_parallel()


def _sync_funcs(model) -> dict:
    """What megatron-core's schedule calls for DP communication: for each of the config's
    no_sync / grad_sync / param_sync functions None, or [(method name, is it its chunk's)]."""
    chunks = model_chunks(model)
    described = {}
    for name in ("no_sync_func", "grad_sync_func", "param_sync_func"):
        funcs = getattr(chunks[0].config, name)
        funcs = funcs if funcs is None or isinstance(funcs, list) else [funcs]
        described[name] = None if funcs is None else [
            (func.__name__, func.__self__ is chunk) for func, chunk in zip(funcs, chunks)]
    return described


@functools.lru_cache(maxsize=None)
def _run_with_funcs(world_size: int, argv: tuple):
    """(per step (loss, grad norm), `_sync_funcs`) of rank 0; each run once per session."""
    queue = torch.multiprocessing.get_context("spawn").Queue()
    spawn(_train, world_size, list(argv), queue)
    return queue.get(timeout=5)


def _run(world_size: int, argv: list) -> list:
    return _run_with_funcs(world_size, tuple(argv))[0]


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


def test_overlapped_grad_reduce_started_by_the_schedule_logs_the_same_digits():
    """--overlap-grad-reduce at PP 2 x VPP 2 x SP 2 (DP x SP = 2): megatron-core's
    interleaved schedule starts each chunk's asynchronous reduction (`grad_sync_func`,
    Megatron-LM's aligned default), bitwise the digits of the synchronous reduction."""
    layout = (*VPP, "--ulysses-sp-size", "2")
    plain, plain_funcs = _run_with_funcs(4, layout)
    overlapped, funcs = _run_with_funcs(4, (*layout, "--overlap-grad-reduce"))
    assert overlapped == plain
    assert funcs == {"no_sync_func": [("no_sync", True)] * 2,
                     "grad_sync_func": [("start_grad_sync", True)] * 2, "param_sync_func": None}
    assert plain_funcs == {**funcs, "grad_sync_func": None}


def _flags(*argv) -> tuple:
    config = parse_args(MODEL + VPP + list(argv), world_size=2)
    return config.optimizer, config.performance


@pytest.mark.parametrize("argv, chunks, expected", [
    ((), 2, {"no_sync_func": "no_sync"}),
    (("--overlap-grad-reduce",), 2,
     {"no_sync_func": "no_sync", "grad_sync_func": "start_grad_sync"}),
    (("--overlap-grad-reduce", "--no-align-grad-reduce"), 2, {"no_sync_func": "no_sync"}),
    (("--overlap-grad-reduce", "--disable-align-grad-reduce"), 1, {"no_sync_func": "no_sync"}),
    (("--overlap-grad-reduce",), 1,
     {"no_sync_func": "no_sync", "grad_sync_func": "start_grad_sync"}),
])
def test_the_sync_funcs_follow_megatron_lms_flags(argv, chunks, expected):
    """`set_sync_funcs` on stand-in chunks: a list per chunk for several, one function for one
    model; --overlap-param-gather (GPU: the distributed optimizer) adds `param_sync_func` only
    where `align_param_gather` holds (the performance section's rule: a virtual pipeline)."""
    from megatron_ulysses.training.model import set_sync_funcs

    class Chunk:
        def no_sync(self): ...
        def start_grad_sync(self): ...
        def start_param_sync(self): ...

    model = [Chunk() for _ in range(chunks)] if chunks > 1 else Chunk()
    optimizer, performance = _flags(*argv)
    for gather, aligned in ((False, True), (True, False), (True, True)):
        config = types.SimpleNamespace(no_sync_func=None, grad_sync_func=None,
                                       param_sync_func=None)
        set_sync_funcs(config, model, optimizer, dataclasses.replace(
            performance, overlap_param_gather=gather, align_param_gather=aligned))
        wanted = {**expected, **({"param_sync_func": "start_param_sync"}
                                 if gather and aligned else {})}
        for name in ("no_sync_func", "grad_sync_func", "param_sync_func"):
            funcs = getattr(config, name)
            if name not in wanted:
                assert funcs is None, (name, argv)
                continue
            funcs = funcs if chunks > 1 else [funcs]
            assert [(f.__name__, f.__self__) for f in funcs] == \
                [(wanted[name], chunk) for chunk in model_chunks(model)], (name, argv)


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
