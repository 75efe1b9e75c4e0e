"""pretrain_gpt.py at Ulysses SP > 1 on ONE GPU: each job's ranks share GPU 0 and talk over gloo
(tests/gpu/gloo_launcher.py runs megatron-core's bucket collectives one by one, which gloo
needs on CUDA tensors), with Transformer Engine, bf16 and the distributed optimizer, as users
run the CLI; only pipeline parallelism cannot run this way (gloo has no send/recv on CUDA).

All jobs start together in two waves, the second loading the first's checkpoints; each test
then checks one property of their logs:

- SP 2, SP 4 (kv heads replicated: 2 query groups) and DP 2 x SP 2 log SP 1's losses, grad norms
  and validation losses (--eval-interval / --eval-iters) at every iteration; so, at SP 2 against
  SP 1 with the same flags, do packed documents from real data (--reset-position-ids
  --reset-attention-mask --eod-mask-loss) and TiledMLP + tiled loss + activation offload (with
  full recompute).
- FP8 (TE, delayed scaling) at SP 2 logs FP8 at SP 1's losses (the amax is reduced over the
  SP ranks, so every rank scales as SP 1 does).
- Checkpoints (megatron-core's fully reshardable distributed-optimizer layout, written by the
  fully parallel save across the ranks' GPU tensors) saved at one DP x SP and loaded at another
  (SP 2 -> SP 1, SP 2 -> SP 4, DP 2 x SP 2 -> SP 2) continue SP 1's run.
- Dropout at SP 2: its masks differ per rank (tests/integration/test_dropout.py), so no SP 1 run draws
  them; resumed from its own checkpoint it logs the uninterrupted run's digits
  (--deterministic-mode).
- tools/eval_passkey.py at SP 2 (fp32) on the packed run's checkpoint answers as at SP 1.
- --sft at SP 2 logs SP 1's losses, grad norms and validation losses: packed conversations
  (tests/helpers/sft_conversations.jsonl through SFTTokenizer, its nemotron-h-aligned format,
  loss on the assistant turns only) at SFT_SEQ tokens, positions restarting at each one.

Tolerance: SP changes only the rows of each GEMM (s/P instead of s) and the order of the sums
over ranks, so in bf16 the runs differ by rounding; loss and validation loss within relative
LOSS_REL = 2e-3 (an H100 measured at most 1.2e-4 over 10 iterations for SP 2, DP 2 x SP 2 and
SP 4 against SP 1, and 1.3e-4 for an SP 2 checkpoint resumed at SP 1), grad norm within
GRAD_NORM_REL = 1e-2 (a norm sums bf16-rounded gradients of every weight) plus the 0.001 the
log rounds it to.

What these can catch is the trainer's wiring at P > 1: each rank's shard of the batch, the loss
and gradient reductions over DP x SP (a missed or doubled SP reduction scales the grad norm by
P), the distributed optimizer sharded over DP x SP, checkpoints resharded. Not the attention
numerics: at initialization attention is near uniform and the mock data (runs of consecutive
ids) is learned from the current token alone, so on CPU a wrong RoPE offset at SP 2 moved the
loss by 2e-6 and the grad norm by 1e-5 over 8 iterations; tests/gpu/test_sp_on_one_gpu.py checks
those, per gradient.

Debugging the harness without a GPU: `python tests/gpu/test_trainer_sp.py [pytest args]` runs
the same jobs on CPU (fp32, megatron-core's local layers, a tiny model, no distributed
optimizer: it needs CUDA) with fp32 tolerances; `pytest tests/gpu` skips this file without
CUDA (tests/conftest.py).
"""

import concurrent.futures
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from sft_data import SFT_JSONL
from test_trainer import REPO, Run, report

ON_CPU = os.environ.get("TRAINER_SP_ON_CPU") == "1"  # set by __main__ below, for debugging
LAUNCHER = str(REPO / "tests" / "gpu" / "gloo_launcher.py")
TRACKER = "latest_checkpointed_iteration.txt"
ITERS, HALF = 8, 4  # train 8 iterations; evaluate and save every 4; resume at 4
SFT_SEQ = 64  # the fixture's samples: 1 or 2 conversations of 14 to 31 tokens, padded to it

if ON_CPU:
    SEQ, PACKED_SEQ, PASSKEY_LENGTHS = 128, 256, (128, 256)
    MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
             "--ffn-hidden-size", "128"]
    PRECISION = ["--transformer-impl", "local"]
    LOSS_REL, GRAD_NORM_REL, PASSKEY_AGREE = 1e-5, 1e-5, 1.0  # fp32: sums reordered only
    ENV, PARALLEL_JOBS = {"OMP_NUM_THREADS": "1"}, 3  # a few cores
else:
    SEQ, PACKED_SEQ, PASSKEY_LENGTHS = 2048, 1024, (512, 1024)
    MODEL = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
             "--ffn-hidden-size", "1536"]
    PRECISION = ["--bf16", "--use-distributed-optimizer"]
    LOSS_REL, GRAD_NORM_REL = 2e-3, 1e-2
    # eval_passkey runs fp32 (TE's GEMMs may use TF32): a near tie of the argmax may flip
    PASSKEY_AGREE = 0.95
    ENV, PARALLEL_JOBS = {}, None  # every job at once
MODEL += ["--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization",
          "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--attention-dropout", "0",
          "--hidden-dropout", "0", "--seq-length", str(SEQ)]
RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
       "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--train-iters", str(ITERS),
       "--log-interval", "1", "--eval-interval", str(HALF), "--eval-iters", "2",
       "--num-workers", "0", "--distributed-backend", "gloo", "--deterministic-mode", *PRECISION]
MOCK = ["--mock-data", "--vocab-size", "2048"]
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
# FP8 GEMMs (TE, delayed scaling). megatron-core reduces the amax over TP x DP x CP, which holds
# the SP group: every SP rank scales by the amax of the whole sequence, as SP 1 does.
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo",
       "max"]
# FP8's grad norm at SP 2 against SP 1: the H100 measured 1.7e-2 (loss 9e-4, within LOSS_REL):
# the backward's e5m2 gradients (2 mantissa bits) round differently once the sums over the
# sequence are split over ranks.
FP8_GRAD_NORM_REL = 5e-2
MEMORY = ["--tiled-mlp-shards", "4", "--tiled-loss-shards", "4", "--offload-activations",
          "--recompute-granularity", "full", "--recompute-method", "uniform"]


def _job(name, workdir, world, sp, flags, script="pretrain_gpt.py"):
    """`torchrun` of `script` through the gloo launcher: `world` ranks, Ulysses SP `sp`."""
    program = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", LAUNCHER, str(REPO / script)]
    return Run(name, [*flags, "--ulysses-sp-size", str(sp)], workdir, env=ENV, program=program)


def _wave(runs):
    with concurrent.futures.ThreadPoolExecutor(PARALLEL_JOBS or len(runs)) as pool:
        list(pool.map(lambda run: run.start().wait(), runs))
    return {run.name: run for run in runs}


def _view(save: Path, iteration: int, where: Path) -> str:
    """A --load folder whose tracker names `iteration` of the checkpoints in `save` (the job
    saved later ones too)."""
    where.mkdir()
    name = f"iter_{iteration:07d}"
    (where / name).symlink_to(save / name, target_is_directory=True)
    (where / TRACKER).write_text(str(iteration))
    return str(where)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sp_model, corpus_prefix, sft_tokenizer):
    work = tmp_path_factory.mktemp("sp_runs")

    def packed(name):  # each job its own index cache: two jobs would write the same files
        return ["--data-path", corpus_prefix, "--split", "90,10,0", "--tokenizer-type",
                "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
                "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
                "--seq-length", str(PACKED_SEQ), "--data-cache-path", str(work / name / "cache")]

    def sft(name):
        return ["--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", sft_tokenizer,
                "--train-data-path", str(SFT_JSONL), "--valid-data-path", str(SFT_JSONL),
                "--seq-length", str(SFT_SEQ), "--data-cache-path", str(work / name / "cache")]

    def saving(name):
        return ["--save", str(work / name / "ckpt"), "--save-interval", str(HALF),
                "--ckpt-fully-parallel-save"]  # the default, said

    base = [*MODEL, *RUN, *MOCK]
    done = _wave([
        _job("sp1", work, 1, 1, base),
        _job("sp2", work, 2, 2, [*base, *saving("sp2")]),
        _job("sp4", work, 4, 4, base),
        _job("dp2_sp2", work, 4, 2, [*base, *saving("dp2_sp2")]),
        _job("packed_sp1", work, 1, 1, [*MODEL, *RUN, *packed("packed_sp1"),
                                        "--save", str(work / "packed_sp1" / "ckpt")]),
        _job("packed_sp2", work, 2, 2, [*MODEL, *RUN, *packed("packed_sp2")]),
        _job("sft_sp1", work, 1, 1, [*MODEL, *RUN, *sft("sft_sp1")]),
        _job("sft_sp2", work, 2, 2, [*MODEL, *RUN, *sft("sft_sp2")]),
        _job("memory_sp1", work, 1, 1, [*base, *MEMORY]),
        _job("memory_sp2", work, 2, 2, [*base, *MEMORY]),
        *([] if ON_CPU else [_job("fp8_sp1", work, 1, 1, [*base, *FP8]),
                             _job("fp8_sp2", work, 2, 2, [*base, *FP8])]),
        _job("dropout_sp2", work, 2, 2, [*base, *DROPOUT, *saving("dropout_sp2")]),
    ])
    half = {name: ["--load", _view(work / name / "ckpt", HALF, work / f"{name}_at_{HALF}")]
            for name in ("sp2", "dp2_sp2", "dropout_sp2")}

    passkey = ["--load", str(work / "packed_sp1" / "ckpt"), "--use-checkpoint-args",
               "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
               "--lengths", ",".join(map(str, PASSKEY_LENGTHS)), "--depths", "0,0.5,1",
               "--trials", "2", "--micro-batch-size", "2", "--seed", "7",
               "--distributed-backend", "gloo"]  # fp32, the default layers
    done.update(_wave([
        _job("sp2_to_sp1", work, 1, 1, [*base, *half["sp2"]]),
        _job("sp2_to_sp4", work, 4, 4, [*base, *half["sp2"]]),
        _job("dp2_sp2_to_sp2", work, 2, 2, [*base, *half["dp2_sp2"]]),
        _job("dropout_resumed", work, 2, 2, [*base, *DROPOUT, *half["dropout_sp2"]]),
        _job("passkey_sp1", work, 1, 1, [*passkey, "--output-dir", str(work / "passkey_sp1")],
             script="tools/eval_passkey.py"),
        _job("passkey_sp2", work, 2, 2, [*passkey, "--output-dir", str(work / "passkey_sp2")],
             script="tools/eval_passkey.py"),
    ]))
    done["work"] = work
    return done


def _trained(run, dp, sp, iterations=range(1, ITERS + 1)):
    """`run` exited 0 as the DP x SP job it was asked to be, logged each iteration once (rank
    0), and megatron-core's DDP went through the launcher's manager."""
    run.check()
    assert f"DP {dp} x Ulysses SP {sp};" in run.output, run.output[-3000:]
    assert sorted(run.iterations) == list(iterations), run.output[-3000:]
    assert run.output.count("lm loss:") == len(run.iterations), "more than one rank logged"
    entered = re.search(r"gloo_launcher: (\d+) bucket collective groups", run.output)
    assert entered and int(entered[1]) > 0, "megatron-core's DDP skipped the launcher's manager"
    if not ON_CPU:
        assert "attention backend te in transformer_engine layers" in run.output
    return run


def _compare(run, reference, name, grad_norm_rel=GRAD_NORM_REL):
    """lm loss and grad norm at each iteration `run` logged, and validation loss at each of
    its evaluations, against `reference` (relative, LOSS_REL and `grad_norm_rel`)."""
    got, expected = run.iterations, reference.iterations
    loss = {i: abs(got[i][0] - expected[i][0]) / abs(expected[i][0]) for i in got}
    norm = {i: abs(got[i][2] - expected[i][2]) / abs(expected[i][2]) for i in got}
    norm_ok = {i: abs(got[i][2] - expected[i][2]) <= grad_norm_rel * abs(expected[i][2]) + 1e-3
               for i in got}  # + the log's 3 decimals
    assert run.validation and run.validation.keys() <= reference.validation.keys(), name
    validation = {i: abs(v - reference.validation[i]) / abs(reference.validation[i])
                  for i, v in run.validation.items()}
    report(name, worst_loss_rel=max(loss.values()), worst_grad_norm_rel=max(norm.values()),
           worst_validation_rel=max(validation.values()))
    assert max(loss.values()) < LOSS_REL, (name, loss, got, expected)
    assert all(norm_ok.values()), (name, norm, got, expected)
    assert max(validation.values()) < LOSS_REL, (name, validation)
    assert all(not skipped for *_, skipped in got.values()), (name, got)


def test_sp1_trains(runs):
    sp1 = _trained(runs["sp1"], 1, 1)
    assert sp1.losses[ITERS] < sp1.losses[1], sp1.losses
    assert sorted(sp1.validation) == [HALF, ITERS]
    report("sp1", losses=sp1.losses, grad_norms={i: v[2] for i, v in sp1.iterations.items()})


@pytest.mark.parametrize("name, dp, sp", [("sp2", 1, 2), ("sp4", 1, 4), ("dp2_sp2", 2, 2)])
def test_sp_matches_sp1(runs, name, dp, sp):
    _compare(_trained(runs[name], dp, sp), _trained(runs["sp1"], 1, 1), f"{name} vs sp1")


def test_packed_documents_at_sp2_match_sp1(runs):
    sp1, sp2 = _trained(runs["packed_sp1"], 1, 1), _trained(runs["packed_sp2"], 1, 2)
    assert sp1.losses != runs["sp1"].losses  # the real data, not the mock
    _compare(sp2, sp1, "packed documents sp2 vs sp1")


def test_sft_at_sp2_matches_sp1(runs):
    sp1, sp2 = _trained(runs["sft_sp1"], 1, 1), _trained(runs["sft_sp2"], 1, 2)
    assert sp1.losses != runs["sp1"].losses  # the conversations, not the mock data
    _compare(sp2, sp1, "sft sp2 vs sp1")


@pytest.mark.skipif(ON_CPU, reason="FP8 needs Transformer Engine on a GPU")
def test_fp8_at_sp2_matches_fp8_at_sp1(runs):
    sp1, sp2 = _trained(runs["fp8_sp1"], 1, 1), _trained(runs["fp8_sp2"], 1, 2)
    assert sp1.losses != runs["sp1"].losses, "FP8 logged bf16's digits: it did not reach TE"
    _compare(sp2, sp1, "fp8_sp2_vs_sp1", grad_norm_rel=FP8_GRAD_NORM_REL)


def test_tiled_mlp_tiled_loss_and_offload_at_sp2_match_sp1(runs):
    # against SP 1 with the same features: tiling changes the GEMMs' shapes (bf16 rounding)
    sp1, sp2 = _trained(runs["memory_sp1"], 1, 1), _trained(runs["memory_sp2"], 1, 2)
    _compare(sp2, sp1, "memory features sp2 vs sp1")


@pytest.mark.parametrize("name, dp, sp", [("sp2_to_sp1", 1, 1), ("sp2_to_sp4", 1, 4),
                                          ("dp2_sp2_to_sp2", 1, 2)])
def test_checkpoint_loads_at_another_dp_x_sp(runs, name, dp, sp):
    """Saved at iteration 4 by one layout, loaded by another: iterations 5..8 and the
    validation at 8 as SP 1's uninterrupted run (the RNG states, per rank, are not carried
    over to another layout: a warning says so; there is no dropout here)."""
    run = _trained(runs[name], dp, sp, iterations=range(HALF + 1, ITERS + 1))
    assert f"loaded checkpoint from {runs['work']}" in run.output
    assert f"at iteration {HALF}" in run.output
    assert "RNG states are per rank and are not restored" in run.output
    assert sorted(run.validation) == [ITERS]
    _compare(run, _trained(runs["sp1"], 1, 1), f"checkpoint {name} vs sp1")


def test_dropout_at_sp2_resumes_bitwise(runs):
    dropout = _trained(runs["dropout_sp2"], 1, 2)
    resumed = _trained(runs["dropout_resumed"], 1, 2, iterations=range(HALF + 1, ITERS + 1))
    plain = runs["sp2"].losses
    assert all(dropout.losses[i] != plain[i] for i in plain), "dropout changed nothing"
    assert "RNG states are per rank" not in resumed.output  # same layout: restored
    # the logged digits (loss, loss scale, grad norm, skipped), exactly
    assert {i: dropout.iterations[i] for i in resumed.iterations} == resumed.iterations
    assert resumed.validation == {ITERS: dropout.validation[ITERS]}
    report("dropout sp2 resumed", losses=resumed.losses)


def test_eval_passkey_at_sp2_answers_as_sp1(runs):
    runs["passkey_sp1"].check()
    sp2 = runs["passkey_sp2"].check()
    assert "DP 1 x Ulysses SP 2;" in sp2.output and "| length | depth 0 |" in sp2.output
    got = json.loads((runs["work"] / "passkey_sp2" / "passkey.json").read_text())["records"]
    expected = json.loads((runs["work"] / "passkey_sp1" / "passkey.json").read_text())["records"]
    assert len(got) == len(PASSKEY_LENGTHS) * 3 * 2
    same_prompts = ("length", "depth", "trial", "key", "needle_position", "answer_tokens")
    assert [{k: r[k] for k in same_prompts} for r in got] == \
        [{k: r[k] for k in same_prompts} for r in expected]
    pairs = [(a, b) for r, e in zip(got, expected)
             for a, b in zip(r["predicted_tokens"], e["predicted_tokens"])]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    report("eval_passkey sp2 vs sp1", agreeing_answer_tokens=agree, tokens=len(pairs))
    assert agree >= PASSKEY_AGREE, (agree, got, expected)


class _RunOnCpu:
    """A pytest plugin for the CPU debugging run: lifts tests/conftest.py's no-CUDA skip."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            item.own_markers[:] = [m for m in item.own_markers if m.name != "skip"]


if __name__ == "__main__":
    os.environ["TRAINER_SP_ON_CPU"] = "1"
    if torch.cuda.is_available():
        sys.exit("the CPU debugging run is for machines without CUDA; on a GPU run pytest")
    sys.exit(pytest.main([__file__, "-p", "no:cacheprovider", *sys.argv[1:]],
                         plugins=[_RunOnCpu()]))
