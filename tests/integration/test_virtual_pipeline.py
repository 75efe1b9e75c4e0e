"""The virtual pipeline (--num-layers-per-virtual-pipeline-stage): megatron-core's
interleaved 1F1B schedule over model chunks, on CPU over gloo.

- PP 2 x VPP 2 (4 layers, one per virtual stage) at SP 1 and SP 2, and PP 2 without chunks, log
  PP 1's losses and grad norms: the same weights (set from each parameter's global name), the
  same micro batches.
- Its checkpoint (Megatron-LM's "model0" / "model1" keys) resumes to the uninterrupted run's
  digits (pretrain_gpt.py), and at PP 1 to them at PP 1's precision: the pipeline layout of a
  checkpoint need not match the run's.
- --overlap-grad-reduce at PP 2 x VPP 2 x SP 2: the schedule starts each chunk's reduction
  (Megatron-LM's aligned grad_sync_func), bitwise the synchronous run's digits; the sync
  functions follow Megatron-LM's flags (--no-align-grad-reduce, --no-align-param-gather).
- A bad layout is one ConfigError (Megatron-LM's rules).
"""

import dataclasses
import functools
import re
import types
import zlib

import pytest
import torch
from distributed import spawn
from launcher import pretrain
from test_cli import ITERATION, validation

from megatron_ulysses import cpu_compat
from megatron_ulysses.data.sharding import shard_for_sp_rank
from megatron_ulysses.sp.parallel_state import destroy_model_parallel, get_ulysses_sp_rank
from megatron_ulysses.training.checkpoint import load as checkpoint_load
from megatron_ulysses.training.checkpoint import state as checkpoint_state
from megatron_ulysses.training.arguments import parse_args
from megatron_ulysses.training.chunks import model_chunks
from megatron_ulysses.training.loop import initialize_distributed
from megatron_ulysses.training.model import build_model_and_optimizer
from megatron_ulysses.training.schedule import train_step
from megatron_ulysses.data.vocab import model_vocab_size

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "64", "--mock-data", "--attention-dropout", "0",
         "--hidden-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--lr", "1e-2", "--train-iters", "3", "--position-embedding-type", "rope"]
VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
STEPS, MICRO_BATCHES = 3, 4


def global_name(gpt, name: str) -> str:
    """`name` of a parameter of `gpt` (a GPTModel: one chunk, any layout) as the whole model
    names it: the layer's global number, megatron-core's local-spec norms by the TE spec's names
    its checkpoints use (the layer's `sharded_state_dict_keys_map`), and the tied output layer
    as the embedding it is a copy of."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match:
        layer, rest = gpt.decoder.layers[int(match[1])], match[2]
        for old, new in layer.submodules_config.sharded_state_dict_keys_map.items():
            rest = new + rest[len(old):] if rest.startswith(old) else rest
        return f"layers.{layer.layer_number}.{rest}"
    if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


def weight(name: str, shape) -> torch.Tensor:
    """The test's value of the parameter of global `name`: the same at any layout."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return values * 0.1 + (1.0 if name.endswith(("norm.weight", "norm_weight")) else 0.0)


def set_weights(gpts) -> None:
    """Every parameter of the GPTModels `gpts` (a rank's chunks) its `weight`."""
    with torch.no_grad():
        for gpt in gpts:
            for name, param in gpt.named_parameters():
                param.copy_(weight(global_name(gpt, name), param.shape))


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
    set_weights([chunk.module for chunk in model_chunks(model)])
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


def _launch(nproc: int, *flags: str):
    return pretrain(nproc, [*MODEL, "--log-interval", "1", "--num-workers", "0",
                            "--log-params-norm", *flags])


def _logged(result) -> dict:
    """iteration -> the logged line's loss, grad norm and params norm, as printed."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {int(line.split("iteration")[1].split("/")[0]): re.findall(
        r"(?:lm loss|grad norm|params norm): (\S+)", line)
        for line in result.stdout.splitlines() if ITERATION.search(line)}


def test_a_chunked_checkpoint_resumes_to_the_uninterrupted_runs_digits(tmp_path):
    """A PP 2 x VPP 2 run saved at iteration 2 resumes to the uninterrupted run's digits, and
    at PP 1 (one model, one process) logs its loss, grad norm and params norm of iteration 3
    to PP 1's precision (the weights, Adam moments and LR schedule load at any pipeline
    layout)."""
    flags = ["--train-iters", "4", "--save-interval", "2", "--eval-interval", "2",
             "--eval-iters", "1"]
    runs = [_launch(2, *VPP, *flags, "--save", str(tmp_path / "a")),
            _launch(2, *VPP, *flags, "--exit-interval", "2", "--save", str(tmp_path / "b"))]
    at_pp1 = _launch(1, *flags, "--load", str(tmp_path / "b"), "--exit-interval", "3")
    runs.append(_launch(2, *VPP, *flags, "--load", str(tmp_path / "b"), "--save",
                        str(tmp_path / "b")))
    straight, first, resumed = map(_logged, runs)
    assert list(straight) == [1, 2, 3, 4] and list(first) == [1, 2] and list(resumed) == [3, 4]
    assert {**first, **resumed} == straight
    # evaluation runs over the chunks too, at iterations 2 and 4 of either story
    evaluated = [validation(run) for run in runs]
    assert list(evaluated[0]) == [2, 4] and {**evaluated[1], **evaluated[2]} == evaluated[0]
    assert "RNG states are per rank and are not restored" in at_pp1.stdout
    logged = _logged(at_pp1)
    assert list(logged) == [3]
    assert [float(x) for x in logged[3]] == pytest.approx(
        [float(x) for x in straight[3]], rel=1e-5)


def test_the_model_parallel_layout_of_a_checkpoint_need_not_match():
    """`check_args`: pipeline size, chunks and TP are saved, not checked (the padded vocab,
    which depends on TP, is: test_checkpointing)."""
    saved = checkpoint_state.args_of(parse_args(MODEL + VPP, world_size=2))
    assert saved["virtual_pipeline_model_parallel_size"] == 2
    for argv, world in (([], 1), (["--pipeline-model-parallel-size", "2"], 2),
                        (["--tensor-model-parallel-size", "2"], 2)):
        checkpoint_load.check_args("ckpt", saved, checkpoint_state.args_of(
            parse_args(MODEL + argv, world_size=world)))
