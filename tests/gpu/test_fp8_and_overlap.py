"""Megatron-LM's GPU speed flags through pretrain_gpt.py on one GPU (`training/config/
performance.py`), each run one process, all started together in two waves:

- FP8 (`--fp8-format hybrid`, recipes delayed and tensorwise, Transformer Engine's layers and
  attention) tracks bf16's losses (FP8_TOL) over ITERS iterations of the bundled corpus
  (real text, the tests' sentencepiece tokenizer), and is not bf16 (some loss differs: the
  flags reached TE). FP8 at SP 2 against SP 1: tests/gpu/test_trainer_sp.py.
- The distributed optimizer with `--overlap-grad-reduce --overlap-param-gather` logs the digits
  of the run without the overlap (`--deterministic-mode`; one rank, so this checks the wiring
  of megatron-core's forward pre-hooks and the gather before each save, not the overlap).
- FP8 with `--fp8-param-gather` (FP8 weights all-gathered by the distributed optimizer) tracks
  bf16 the same way. (`--fp8-dot-product-attention` is refused: on the H100 TE 2.20.2 found no
  FP8 attention kernel for these inputs.)
- `--grad-reduce-in-bf16` and the precision-aware optimizer with half its states offloaded to
  the CPU (`--optimizer-cpu-offload --optimizer-offload-fraction 0.5`) track bf16 closer
  (CLOSE_TOL: only rounding differs).
- FP8 save + resume: a delayed-scaling run saved at HALF and resumed logs the uninterrupted
  run's digits after HALF (the amax histories and scales are TE's `_extra_state` in the
  checkpoint; without them the resumed scales would differ).
- Optimizer offload save + resume: the offloaded run (half its fp32 master weights and Adam
  moments in host memory, stepped by torch's AdamW on the CPU, the other half by TE's FusedAdam)
  saved at HALF and resumed logs the uninterrupted run's digits after HALF (megatron-core writes
  both halves' states, torch AdamW's per-parameter step included, into the distributed
  optimizer's checkpoint). megatron-core's HybridDeviceOptimizer needs CUDA (its copies run on
  CUDA streams), so this is GPU-only.
"""

import pytest
from test_trainer import Run, _wave, report

ITERS, HALF = 50, 25
OFFLOAD = ["--use-precision-aware-optimizer", "--optimizer-cpu-offload",
           "--optimizer-offload-fraction", "0.5"]
MODEL = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
         "--ffn-hidden-size", "1536", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--attention-dropout", "0",
         "--hidden-dropout", "0", "--seq-length", "2048"]
RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr",
       "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--train-iters",
       str(ITERS), "--log-interval", "1", "--num-workers", "0", "--eval-iters", "0", "--bf16",
       "--transformer-impl", "transformer_engine", "--ulysses-attention-backend", "te",
       "--use-distributed-optimizer", "--deterministic-mode"]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo",
       "max"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
# Against bf16 over ITERS iterations of real text the runs drift apart (each batch's loss is
# noisy and a small difference in the weights moves it), so "tracks" is: every iteration within
# EACH of bf16's and the mean of the last LAST iterations within MEAN. FP8 (e4m3 forward, e5m2
# backward) measured on the H100 at most 0.10 / 0.028 (delayed, param gather) and 0.052 / 0.007
# (tensorwise); bf16 grad reduce and the offloaded optimizer (rounding only) 0.039 / 0.0015 and
# 0.007 / 0.002.
LAST = 10
FP8_TOL = dict(each=0.15, mean=0.05)
CLOSE_TOL = dict(each=0.06, mean=0.01)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sp_model, corpus_prefix):
    work = tmp_path_factory.mktemp("perf_runs")
    half = str(work / "ckpt_fp8_half")

    def job(name, flags):  # real text; each job its own index cache
        data = ["--data-path", corpus_prefix, "--split", "98,2,0", "--tokenizer-type",
                "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
                "--data-cache-path", str(work / name / "cache")]
        return Run(name, [*flags, *data], work)

    done = _wave([
        job("bf16", [*MODEL, *RUN]),
        job("overlap", [*MODEL, *RUN, *OVERLAP, "--save", str(work / "ckpt_overlap"),
                        "--save-interval", str(HALF)]),
        job("fp8_delayed", [*MODEL, *RUN, *FP8, "--fp8-recipe", "delayed"]),
        job("fp8_tensorwise", [*MODEL, *RUN, *FP8, "--fp8-recipe", "tensorwise"]),
        job("fp8_param_gather", [*MODEL, *RUN, *FP8, "--fp8-param-gather"]),
        job("grad_reduce_in_bf16", [*MODEL, *RUN, "--grad-reduce-in-bf16"]),
        job("cpu_offload", [*MODEL, *RUN, *OFFLOAD]),
        job("cpu_offload_half", [*MODEL, *RUN, *OFFLOAD, "--save", str(work / "ckpt_offload"),
                                 "--exit-interval", str(HALF)]),
        job("fp8_half", [*MODEL, *RUN, *FP8, "--fp8-recipe", "delayed", "--save", half,
                         "--exit-interval", str(HALF)]),
    ])
    done.update(_wave([
        job("fp8_resumed", [*MODEL, *RUN, *FP8, "--fp8-recipe", "delayed", "--load", half]),
        job("cpu_offload_resumed", [*MODEL, *RUN, *OFFLOAD, "--load",
                                    str(work / "ckpt_offload")]),
    ]))
    return done


def _tracks_bf16(runs, name, tolerance):
    bf16, got = runs["bf16"].check().losses, runs[name].check().losses
    assert sorted(got) == sorted(bf16) == list(range(1, ITERS + 1))
    assert got != bf16, f"{name} logged bf16's digits: its flags did not reach megatron-core"
    each = max(abs(got[i] - bf16[i]) / bf16[i] for i in bf16)
    last = range(ITERS - LAST + 1, ITERS + 1)
    mean = abs(sum(got[i] for i in last) / sum(bf16[i] for i in last) - 1)
    report(f"{name}_vs_bf16", worst_rel=each, last_mean_rel=mean)
    assert each < tolerance["each"], (name, got, bf16)
    assert mean < tolerance["mean"], (name, got, bf16)
    assert got[ITERS] < 0.5 * got[1], (name, got)  # it learned


@pytest.mark.parametrize("name", ["fp8_delayed", "fp8_tensorwise", "fp8_param_gather"])
def test_fp8_tracks_bf16(runs, name):
    _tracks_bf16(runs, name, FP8_TOL)


@pytest.mark.parametrize("name", ["grad_reduce_in_bf16", "cpu_offload"])
def test_low_precision_reduce_and_offloaded_optimizer_track_bf16(runs, name):
    _tracks_bf16(runs, name, CLOSE_TOL)


def test_overlapped_param_gather_logs_the_digits_without_it(runs):
    plain, overlap = runs["bf16"].check(), runs["overlap"].check()
    assert overlap.iterations == plain.iterations
    assert len(plain.iterations) == ITERS


def test_fp8_checkpoint_resumes_the_run(runs):
    full, resumed = runs["fp8_delayed"].check(), runs["fp8_resumed"].check()
    runs["fp8_half"].check()
    after = {i: v for i, v in full.iterations.items() if i > HALF}
    assert resumed.iterations == after


def test_offloaded_optimizer_checkpoint_resumes_the_run(runs):
    full, resumed = runs["cpu_offload"].check(), runs["cpu_offload_resumed"].check()
    half = runs["cpu_offload_half"].check()
    assert sorted(half.iterations) == list(range(1, HALF + 1))
    assert {i: v for i, v in full.iterations.items() if i <= HALF} == half.iterations
    after = {i: v for i, v in full.iterations.items() if i > HALF}
    worst = max(abs(resumed.losses.get(i, float("inf")) - v[0]) for i, v in after.items())
    report("cpu_offload_resume", worst_abs_loss_diff=worst)
    assert sorted(resumed.iterations) == sorted(after)
    assert resumed.iterations == after  # loss, loss scale, grad norm, skipped: the same digits
