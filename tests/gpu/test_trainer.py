"""pretrain_gpt.py on one GPU as users run it: NCCL, bf16/fp16 through Float16Module,
megatron-core's optimizer (plain and distributed), Transformer Engine, checkpoints.

All runs start together (one process each, sharing the GPU) in two waves, the second resuming
from the first; each test then checks one property of their logs and checkpoints:

- `--deterministic-mode`: two identical runs log the same digits; a run resumed at iteration 4
  logs the uninterrupted run's digits from 5 on (train and validation loss, grad norm) and ends
  with bitwise-identical weights and optimizer state.
- The te, sdpa and local backends train the same model to the same losses (bf16 tolerance),
  also on packed documents (`--reset-attention-mask`: TE's THD path, SDPA per document); sdpa
  and local run in TE's layers, and SDPA in megatron-core's local ones too
  (`--transformer-impl local`); a checkpoint of TE attention resumes under SDPA.
- Full and selective recompute, TiledMLP + tiled loss + offload: same losses as plain training.
- Megatron-LM's default fusions (on in every te run) against none, and the cross-entropy fusion
  (native and TE): same losses.
- fp16 with the dynamic loss scale skips at most a few steps and the loss falls.
- Resuming a distributed-optimizer checkpoint without it is one clear error (its state keys
  differ), not a KeyError from megatron-core.
- SIGTERM with `--exit-signal-handler` saves and exits 0; evaluation and TensorBoard scalars.
"""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
REPORT = os.environ.get("GPU_TEST_REPORT")  # a JSON-lines file the run script collects

MODEL = [
    "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
    "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "1536",
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seq-length", "2048",
]
RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
       "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--train-iters", "8",
       "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1", "--num-workers", "0",
       "--bf16"]
MOCK = ["--mock-data", "--vocab-size", "2048"]
DETERMINISTIC = ["--deterministic-mode", "--use-distributed-optimizer"]
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--ulysses-attention-backend",
           "te"]

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: (\S+) \| loss scale: (\S+) "
                       r"\| grad norm: (\S+) \|.*number of skipped iterations:\s+(\d+)")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")
# Observed on the H200 (bf16): backends within 0.3% at iteration 1 and 1.5% over 8 iterations.
FIRST_TOL, ALL_TOL = 1e-2, 3e-2


def report(name: str, **values) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


class Run:
    """One `python pretrain_gpt.py` process (or `program`, a command line the flags follow: a
    torchrun job, another tool) and what it logged."""

    def __init__(self, name, flags, workdir, env=None, program=None):
        self.name, self.flags, self.dir, self.env = name, flags, workdir / name, env or {}
        self.program = program or [sys.executable, str(REPO / "pretrain_gpt.py")]
        self.dir.mkdir(parents=True, exist_ok=True)

    def start(self):
        env = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1",
                   **self.env)
        self.log = open(self.dir / "log.txt", "w")
        self.process = subprocess.Popen([*self.program, *self.flags], env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, cwd=REPO)
        return self

    def wait(self, timeout=480):
        self.process.wait(timeout=timeout)
        self.log.close()
        self.output = (self.dir / "log.txt").read_text()
        return self

    def check(self):
        assert self.process.returncode == 0, f"{self.name}:\n{self.output[-4000:]}"
        return self

    @property
    def iterations(self):
        """iteration -> (lm loss, loss scale, grad norm, skipped), as logged."""
        return {int(i): (float(l), float(s), float("nan") if g == "n/a" else float(g), int(k))
                for i, l, s, g, k in ITERATION.findall(self.output)}

    @property
    def losses(self):
        return {i: v[0] for i, v in self.iterations.items()}

    @property
    def validation(self):
        return {int(i): float(v) for i, v in VALIDATION.findall(self.output)}


def _wave(runs):
    for run in runs:
        run.start()
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        list(pool.map(Run.wait, runs))
    return {run.name: run for run in runs}


def packed_documents(corpus_prefix, sp_model, cache) -> list:
    """The bundled corpus as packed documents of 1024 tokens (real text, each document its own
    positions and attention), its index cache in `cache`."""
    return ["--data-path", corpus_prefix, "--split", "90,10,0", "--tokenizer-type",
            "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model, "--reset-position-ids",
            "--reset-attention-mask", "--eod-mask-loss", "--seq-length", "1024",
            "--data-cache-path", str(cache)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sp_model, corpus_prefix):
    work = tmp_path_factory.mktemp("gpu_runs")
    packed = packed_documents(corpus_prefix, sp_model, work / "cache")
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    first = [
        Run("te", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, "--ulysses-attention-backend", "te",
                   "--save", str(work / "ckpt_full"), "--tensorboard-dir", str(work / "tb")],
            work),
        Run("te_again", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, "--ulysses-attention-backend",
                         "te", "--save", str(work / "ckpt_half"), "--exit-interval", "4"], work),
        Run("sdpa", [*MODEL, *RUN, *MOCK, "--ulysses-attention-backend", "sdpa"], work),
        Run("local", [*MODEL, *RUN, *MOCK, "--ulysses-attention-backend", "local"], work),
        Run("local_layers", [*MODEL, *RUN, *MOCK, "--transformer-impl", "local"], work),
        # Megatron-LM's --attention-backend picks TE's kernels; TE's debug log names the one run
        Run("unfused_attention", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, "--attention-backend",
                                  "unfused"], work, env={"NVTE_DEBUG": "1",
                                                         "NVTE_DEBUG_LEVEL": "2"}),
        Run("packed_te", [*MODEL, *RUN, *packed, "--ulysses-attention-backend", "te"], work),
        Run("packed_sdpa", [*MODEL, *RUN, *packed, "--ulysses-attention-backend", "sdpa"], work),
        Run("full_recompute", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, *recompute,
                               "--ulysses-attention-backend", "te"], work),
        Run("selective_recompute", [*MODEL, *RUN, *MOCK, *DETERMINISTIC,
                                    "--recompute-granularity", "selective",
                                    "--ulysses-attention-backend", "te"], work),
        Run("memory_features", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, *recompute,
                                "--tiled-mlp-shards", "4", "--tiled-loss-shards", "4",
                                "--offload-activations", "--ulysses-attention-backend", "te"],
            work),
        Run("dropout", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, *DROPOUT], work),
        Run("dropout_half", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, *DROPOUT,
                             "--save", str(work / "ckpt_dropout"), "--exit-interval", "4"], work),
        Run("dropout_full_recompute", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, *DROPOUT,
                                       *recompute], work),
        Run("unfused", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, "--ulysses-attention-backend", "te",
                        "--no-rope-fusion", "--no-gradient-accumulation-fusion",
                        "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion"], work),
        Run("cross_entropy_fusion_te", [*MODEL, *RUN, *MOCK, *DETERMINISTIC,
                                        "--ulysses-attention-backend", "te",
                                        "--cross-entropy-loss-fusion",
                                        "--cross-entropy-fusion-impl", "te"], work),
        Run("cross_entropy_fusion_native", [*MODEL, *RUN, *MOCK, *DETERMINISTIC,
                                            "--ulysses-attention-backend", "te",
                                            "--cross-entropy-loss-fusion"], work),
        Run("fp16_plain_optimizer", [*MODEL, *[f for f in RUN if f != "--bf16"], "--fp16",
                                     *MOCK, "--ulysses-attention-backend", "te"], work),
        Run("fp16", [*MODEL, *[f for f in RUN if f != "--bf16"], "--fp16", *MOCK,
                     "--use-distributed-optimizer", "--ulysses-attention-backend", "te"], work),
    ]
    done = _wave(first)
    half = str(work / "ckpt_half")
    second = [
        Run("resumed", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, "--ulysses-attention-backend", "te",
                        "--load", half, "--save", str(work / "ckpt_resumed")], work),
        Run("resumed_plain_optimizer", [*MODEL, *RUN, *MOCK, "--deterministic-mode",
                                        "--ulysses-attention-backend", "te", "--load", half],
            work),
        Run("resumed_sdpa", [*MODEL, *RUN, *MOCK, "--use-distributed-optimizer",
                             "--ulysses-attention-backend", "sdpa", "--load", half], work),
        Run("dropout_resumed", [*MODEL, *RUN, *MOCK, *DETERMINISTIC, *DROPOUT,
                                "--load", str(work / "ckpt_dropout")], work),
    ]
    done.update(_wave(second))
    done["work"] = work
    return done


def _close(got, expected, name):
    assert got.keys() == expected.keys(), name
    first = min(expected)
    worst = max(abs(got[i] - expected[i]) / abs(expected[i]) for i in expected)
    report(name, first_rel=abs(got[first] - expected[first]) / abs(expected[first]),
           worst_rel=worst)
    assert got[first] == pytest.approx(expected[first], rel=FIRST_TOL), name
    for i in expected:
        assert got[i] == pytest.approx(expected[i], rel=ALL_TOL), (name, i)


def test_trains_with_te_bf16_distributed_optimizer(runs):
    te = runs["te"].check()
    assert sorted(te.losses) == list(range(1, 9))
    assert te.losses[8] < 0.7 * te.losses[1], te.losses
    assert sorted(te.validation) == [4, 8]
    assert "loaded checkpoint" not in te.output
    report("te", losses=te.losses)


def test_deterministic_mode_is_bitwise_run_to_run(runs):
    te, again = runs["te"].check(), runs["te_again"].check()
    assert sorted(again.iterations) == [1, 2, 3, 4]
    assert {i: te.iterations[i] for i in again.iterations} == again.iterations
    assert again.validation == {4: te.validation[4]}
    assert "exiting at iteration 4" in again.output


def test_resume_is_bitwise_exact(runs):
    te, resumed = runs["te"].check(), runs["resumed"].check()
    assert sorted(resumed.iterations) == [5, 6, 7, 8]
    assert {i: te.iterations[i] for i in resumed.iterations} == resumed.iterations
    assert resumed.validation == {8: te.validation[8]}
    full = _checkpoint_tensors(runs["work"] / "ckpt_full" / "iter_0000008")
    again = _checkpoint_tensors(runs["work"] / "ckpt_resumed" / "iter_0000008")
    assert full.keys() == again.keys()
    assert any("optimizer" in key for key in full), sorted(full)[:20]
    different = [k for k in full if not torch.equal(full[k], again[k])]
    assert not different, different[:10]
    report("resume_bitwise", tensors=len(full))


def _checkpoint_tensors(path: Path) -> dict:
    """Every tensor of a torch_dist checkpoint (model, optimizer state, RNG), by key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    single = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(single))
    state = torch.load(single, weights_only=False)  # written just above by this test
    return {k: v for k, v in _flatten(state) if isinstance(v, torch.Tensor)}


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), tree


def test_switching_the_optimizer_on_load_is_one_clear_error(runs):
    # The distributed optimizer's state keys differ from the plain mixed-precision optimizer's.
    plain = runs["resumed_plain_optimizer"]
    assert plain.process.returncode == 2, plain.output[-3000:]
    assert "--use-distributed-optimizer: checkpoint True, this run False" in plain.output
    assert "--no-load-optim" in plain.output and "Traceback" not in plain.output


@pytest.mark.parametrize("backend, layers", [("sdpa", "transformer_engine"),
                                             ("local", "transformer_engine"),
                                             ("local_layers", "local")])
def test_backends_agree(runs, backend, layers):
    run = runs[backend].check()
    attention = "sdpa" if backend == "local_layers" else backend
    assert f"attention backend {attention} in {layers} layers" in run.output
    _close(run.losses, runs["te"].check().losses, f"{backend} vs te")


def test_attention_backend_picks_te_kernels(runs):
    run = runs["unfused_attention"].check()
    assert "Running with UnfusedDotProductAttention backend" in run.output, run.output[-3000:]
    assert "Running with FusedAttention" not in run.output
    _close(run.losses, runs["te"].check().losses, "--attention-backend unfused vs te (fused)")


def test_te_attention_checkpoint_resumes_under_sdpa(runs):
    """TE's attention keeps an `_extra_state` SDPA has not: the checkpoint loads without it and
    training goes on from iteration 5 as the TE run did (bf16 tolerance)."""
    resumed = runs["resumed_sdpa"].check()
    assert "loaded checkpoint" in resumed.output
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    te = runs["te"].check().losses
    _close(resumed.losses, {i: te[i] for i in resumed.losses}, "te checkpoint resumed by sdpa")


def test_packed_documents_te_thd_and_sdpa_agree(runs):
    te, sdpa = runs["packed_te"].check(), runs["packed_sdpa"].check()
    assert "attention backend te" in te.output
    assert te.losses[8] < te.losses[1]
    _close(sdpa.losses, te.losses, "packed sdpa vs te (THD)")


@pytest.mark.parametrize("name", ["unfused", "cross_entropy_fusion_te",
                                  "cross_entropy_fusion_native"])
def test_fusions_keep_the_losses(runs, name):
    """te runs with Megatron-LM's default fusions (RoPE, gradient accumulation, SwiGLU, bias +
    dropout); these turn them off, or add the cross-entropy fusion."""
    _close(runs[name].check().losses, runs["te"].check().losses, f"{name} vs te")


@pytest.mark.parametrize("name", ["full_recompute", "selective_recompute", "memory_features"])
def test_recompute_and_memory_features_keep_the_losses(runs, name):
    _close(runs[name].check().losses, runs["te"].check().losses, f"{name} vs te")


def test_dropout_resume_and_recompute_replay_the_masks(runs):
    dropout, half = runs["dropout"].check(), runs["dropout_half"].check()
    resumed, recompute = runs["dropout_resumed"].check(), runs["dropout_full_recompute"].check()
    assert dropout.losses != runs["te"].check().losses  # dropout is on
    assert {i: dropout.iterations[i] for i in half.iterations} == half.iterations
    assert sorted(resumed.iterations) == [5, 6, 7, 8]
    assert {i: dropout.iterations[i] for i in resumed.iterations} == resumed.iterations
    assert resumed.validation == {8: dropout.validation[8]}
    # recompute draws the forward's masks again: the same digits as without recompute
    assert recompute.losses == dropout.losses
    report("dropout", losses=dropout.losses, recompute_losses=recompute.losses)


@pytest.mark.parametrize("name", ["fp16", "fp16_plain_optimizer"])
def test_fp16_dynamic_loss_scale(runs, name):
    fp16 = runs[name].check()
    iterations = fp16.iterations
    skipped = sum(v[3] for v in iterations.values())
    report(name, skipped=skipped, scales=[v[1] for v in iterations.values()],
           losses=fp16.losses)
    # The scaler starts high (2^20 / tokens per rank; Megatron-LM starts at 2^32) and backs off:
    # the H200 skips 4 of the 8 steps at 256 -> 32, then none. What has to hold: it backs off
    # on an overflow (never up within 8 steps), at least half the steps apply, the last one
    # does, and the applied steps train.
    scales = [v[1] for _, v in sorted(iterations.items())]
    assert scales == sorted(scales, reverse=True) and scales[-1] < scales[0], iterations
    assert skipped <= len(iterations) // 2 and not iterations[max(iterations)][3], iterations
    applied = [v[0] for _, v in sorted(iterations.items()) if not v[3]]
    assert applied[-1] < applied[0], iterations


def test_tensorboard_scalars(runs):
    import plot_run

    logged = plot_run.read_tensorboard(str(runs["work"] / "tb"))
    assert [i for i, _ in logged["loss"]] == list(range(1, 9))
    assert [i for i, _ in logged["val_loss"]] == [4, 8]
    assert {"lr", "throughput", "memory"} <= logged.keys()


def test_sigterm_saves_and_exits(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = Run("sigterm", [*MODEL, *RUN, *MOCK, "--train-iters", "100000", "--eval-iters", "0",
                          "--save", str(ckpt),
                          "--exit-signal-handler"], tmp_path).start()
    deadline = time.time() + 300
    while time.time() < deadline and run.process.poll() is None:
        text = (run.dir / "log.txt").read_text()
        if any(int(i) >= 2 for i, *_ in ITERATION.findall(text)):
            run.process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.5)
    run.wait().check()
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2 and (ckpt / f"iter_{saved:07d}").is_dir()
    assert f"exiting at iteration {saved}" in run.output
