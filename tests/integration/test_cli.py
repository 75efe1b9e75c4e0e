"""pretrain_gpt.py end to end, as a user runs it: its ranks as torchrun starts them (forked by
tests/helpers/launcher.py), real preprocessed data, checkpoints.

- SP = 1, SP = 2 and DP = 2 x SP = 2 give the same `lm loss` at every iteration (RoPE, GQA,
  packed documents with reset attention, a sequence length SP must pad).
- A run stopped at iteration 4 and resumed (past the debris of a crashed save) equals the
  uninterrupted run; so does resuming the same checkpoint at another SP, DP and TP size
  (SP 2 x DP 1 -> SP 1 x DP 2, TP 1 -> TP 2 x SP 2) and one saved at TP 2 x SP 2 at TP 1 x DP 2
  (weights and Adam moments resharded); the stopped run (TiledMLP, tiled loss, offload), the
  resumed one (selective recompute) and one at TP 2 x SP 2 with --sequence-parallel give the
  same losses.
- SIGTERM with --exit-signal-handler saves a checkpoint and exits cleanly; a NaN gradient stops
  the run before its update, with one message (unless --no-check-for-nan-in-loss-and-grad).
- Bad configurations fail with one message naming the flag, before any process group exists.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from unittest import mock

import launcher
import plot_run
import pytest
import torch
from conftest import CORPUS, REPO_ROOT

from megatron_ulysses.training import arguments
from megatron_ulysses.training.arguments import ConfigError, parse_args
from megatron_ulysses.training.config import model as model_section

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
]
RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
       "--lr-warmup-iters", "2", "--log-interval", "1", "--num-workers", "0"]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: (\S+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def launch(nproc: int, *flags: str, run=RUN):
    """pretrain_gpt.py on `nproc` ranks as torchrun starts them (tests/helpers/launcher.py)."""
    return launcher.pretrain(nproc, [*MODEL, *run, *flags])


def losses(result) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = {int(i): float(v) for i, v in ITERATION.findall(result.stdout)}
    lines = [line for line in result.stdout.splitlines() if ITERATION.search(line)]
    assert len(lines) == len(found), "an iteration was logged by more than one rank"
    return found


def validation(result) -> dict:
    return {int(i): float(v) for i, v in VALIDATION.findall(result.stdout)}


@pytest.fixture(scope="module")
def data_flags(corpus_prefix, sp_model, tmp_path_factory):
    # A weighted blend (of the same corpus twice), as Megatron-LM users write them.
    return ["--data-path", "0.6", corpus_prefix, "0.4", corpus_prefix, "--split", "90,10,0",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
            "--data-cache-path", str(tmp_path_factory.mktemp("index_cache")),
            "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def test_sp_and_dp_x_sp_match_sp1_every_iteration(data_flags):
    # 63 tokens: SP 2 pads every sequence to 64 (pad id, loss mask 0).
    flags = [*data_flags, "--train-iters", "10", "--eval-interval", "5", "--eval-iters", "2",
             "--seq-length", "63"]
    reference = launch(1, *flags)
    expected = losses(reference)
    assert sorted(expected) == list(range(1, 11))
    assert expected[10] < expected[1], "the loss did not fall"
    for nproc, sp in ((2, 2), (4, 2)):
        result = launch(nproc, *flags, "--ulysses-sp-size", str(sp))
        assert f"Ulysses SP {sp}" in result.stdout
        got = losses(result)
        assert got.keys() == expected.keys()
        for iteration, loss in expected.items():
            assert got[iteration] == pytest.approx(loss, rel=2e-6), (nproc, sp, iteration)
        assert validation(result) == pytest.approx(validation(reference), rel=2e-6)
        assert len(validation(result)) == 2


def test_gpt2_bpe_data_as_megatron_lm_makes_it(gpt2_files, tmp_path):
    """Megatron-LM's GPT-2 recipe: preprocess_data.py and pretrain_gpt.py with
    --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file; SP 2 equals SP 1."""
    vocab_file, merge_file = gpt2_files
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
            "--merge-file", merge_file]
    prefix = tmp_path / "gpt2"
    made = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(CORPUS),
                           "--output-prefix", str(prefix), "--append-eod", "--workers", "2",
                           *gpt2], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    record = json.loads((tmp_path / "gpt2_text_document.tokenizer.json").read_text())
    assert record["tokenizer_model"] == f"{vocab_file} + {merge_file}"
    flags = ["--data-path", f"{prefix}_text_document", "--split", "90,10,0", *gpt2,
             "--train-iters", "4", "--eval-iters", "0", "--data-cache-path",
             str(tmp_path / "cache")]
    expected = losses(launch(1, *flags))
    assert sorted(expected) == [1, 2, 3, 4]
    assert losses(launch(2, *flags, "--ulysses-sp-size", "2")) == pytest.approx(expected,
                                                                                 rel=2e-6)
    wrong = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *MODEL, *RUN,
                            *flags, "--tokenizer-model", vocab_file],
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2, wrong.stdout[-3000:] + wrong.stderr[-3000:]
    assert wrong.stderr.strip() == ("pretrain_gpt.py: error: --tokenizer-model is not used by "
                                    "--tokenizer-type GPT2BPETokenizer; drop it, or give the "
                                    "type that uses it")


def test_resume_equals_uninterrupted_also_at_another_sp_dp_and_tp_size(tmp_path):
    flags = ["--mock-data", "--vocab-size", "256", "--train-iters", "8", "--eval-iters", "0"]
    full = losses(launch(2, *flags, "--ulysses-sp-size", "2"))
    # TP 2 x SP 2 with sequence parallelism; the same padded vocab (3 x 128) as TP 1. It saves
    # iteration 4 on its way; its tracker set back to 4, it is a run stopped there.
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
           "--make-vocab-size-divisible-by", "64"]
    tp_ckpt = tmp_path / "tp2"
    tensor_parallel = losses(launch(4, *flags, "--ulysses-sp-size", "2", *tp2, "--save",
                                    str(tp_ckpt), "--save-interval", "4"))
    assert tensor_parallel == pytest.approx(full, rel=2e-6)
    (tp_ckpt / "latest_checkpointed_iteration.txt").write_text("4")

    # The ALST memory features change memory, not numerics: the run stopped at iteration 4
    # uses them, the one that resumes it selective recompute.
    ckpt = tmp_path / "ckpt"
    memory = losses(launch(2, *flags, "--ulysses-sp-size", "2", "--tiled-mlp-shards", "2",
                           "--tiled-loss-shards", "3", "--recompute-granularity", "full",
                           "--recompute-method", "uniform", "--offload-activations",
                           "--save", str(ckpt), "--exit-interval", "4"))
    assert sorted(memory) == [1, 2, 3, 4]
    assert memory == pytest.approx({i: full[i] for i in memory}, rel=2e-6)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(os.listdir(ckpt)) == [".lock", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]

    crashed = ckpt / "iter_0000008.tmp.123-4567"  # what a crash in the middle of a save leaves
    crashed.mkdir()
    (crashed / "half_written").write_bytes(b"\0" * 10)

    other_sp = losses(launch(2, *flags, "--load", str(ckpt)))  # SP 2 x DP 1 -> SP 1 x DP 2
    # TP 2 x SP 2 -> TP 1 x DP 2: the weights and Adam moments resharded, the RNG states seeded.
    from_tp2 = launch(2, *flags, "--load", str(tp_ckpt))
    assert ("it was saved at world 4 = TP 2 x PP 1 x DP 1 x Ulysses SP 2, this run is world 2 = "
            "TP 1 x PP 1 x DP 2 x Ulysses SP 1: RNG states are per rank and are not restored"
            in from_tp2.stdout), from_tp2.stdout[-3000:]
    # TP 1 x SP 2 -> TP 2 x SP 2 (and selective recompute)
    selective = losses(launch(4, *flags, "--ulysses-sp-size", "2", *tp2,
                              "--recompute-granularity", "selective", "--recompute-modules",
                              "core_attn", "mlp", "--load", str(ckpt), "--save", str(ckpt)))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert sorted(os.listdir(ckpt)) == [".lock", "iter_0000004", "iter_0000008",
                                        "latest_checkpointed_iteration.txt"]
    for run in (selective, other_sp, losses(from_tp2)):
        assert sorted(run) == [5, 6, 7, 8]
        for iteration in run:
            assert run[iteration] == pytest.approx(full[iteration], rel=2e-6)


@pytest.mark.parametrize("nproc, sp", [(1, 1), (2, 2)])
def test_resume_is_exact_with_dropout_and_resumes_validation(tmp_path, nproc, sp):
    # Dropout on: the resumed run must draw the same masks (each rank's RNG states restored, the
    # data loader not drawing from them) and continue the validation iterator where the first
    # run left it. At SP 2 each rank has its own dropout stream.
    flags = ["--mock-data", "--vocab-size", "256", "--train-iters", "6", "--eval-interval", "2",
             "--eval-iters", "1", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
             "--ulysses-sp-size", str(sp)]
    # The uninterrupted run saves iteration 3 on its way (the save must not disturb it either);
    # its tracker set back to 3, as a user picks an older checkpoint, is a run stopped there.
    ckpt = tmp_path / "ckpt"
    full = launch(nproc, *flags, "--save", str(ckpt), "--save-interval", "3")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = launch(nproc, *flags, "--load", str(ckpt))
    expected, got = losses(full), losses(resumed)
    assert sorted(got) == [4, 5, 6]
    assert {i: expected[i] for i in got} == got  # the logged digits, exactly
    assert validation(resumed) == {i: validation(full)[i] for i in (4, 6)}
    assert len(set(validation(full).values())) == 3  # each evaluation reads other samples


def test_resume_with_another_lr_schedule_needs_a_flag_that_says_which(tmp_path):
    # As Megatron-LM: a schedule that differs from the checkpoint's is an error unless
    # --override-opt_param-scheduler (the flags) or --use-checkpoint-opt_param-scheduler says.
    flags = ["--mock-data", "--vocab-size", "256", "--eval-iters", "0",
             "--lr-decay-style", "constant"]
    ckpt = tmp_path / "ckpt"
    losses(launch(1, *flags, "--train-iters", "4", "--save", str(ckpt)))
    longer = [*flags, "--train-iters", "8", "--load", str(ckpt)]
    refused = launch(1, *longer)
    assert refused.returncode != 0
    assert "--override-opt_param-scheduler" in refused.stderr
    assert "megatron_ulysses/" not in refused.stderr  # a message, not a traceback from our code
    overridden = launch(1, *longer, "--override-opt_param-scheduler")
    assert sorted(losses(overridden)) == [5, 6, 7, 8]
    rates = [float(r) for r in re.findall(r"learning rate: (\S+) \|", overridden.stdout)]
    assert rates == [1e-3] * 4  # the flags' constant --lr, not the finished schedule's 0


def test_sigterm_saves_a_checkpoint_and_exits(tmp_path):
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *MODEL, *RUN, "--mock-data",
               "--vocab-size", "256", "--train-iters", "100000", "--eval-iters", "0",
               "--save", str(ckpt), "--exit-signal-handler", "--tensorboard-dir",
               str(tmp_path / "tb")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    for line in process.stdout:
        if ITERATION.search(line) and int(ITERATION.search(line).group(1)) >= 2:
            process.send_signal(signal.SIGTERM)
            break
        assert time.time() < deadline, "no training progress"
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output[-3000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2 and (ckpt / f"iter_{saved:07d}").is_dir()
    assert f"exiting at iteration {saved} (SIGTERM received)" in output
    logged = plot_run.read_tensorboard(str(tmp_path / "tb"))
    assert [i for i, _ in logged["loss"]] == list(range(1, saved + 1))
    assert {"lr", "throughput", "memory"} <= logged.keys()


def _checkpoint_tensors(path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path) + ".pt")
    state = torch.load(str(path) + ".pt", weights_only=False)  # written just above

    def flatten(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flatten(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor):
                yield prefix + key, value
    return dict(flatten(state))


def test_fully_parallel_save_spreads_the_writes_and_saves_the_same_tensors(tmp_path):
    """--ckpt-fully-parallel-save (the default): at DP 2 both ranks write about half of the
    replicated weights and Adam state; the tensors equal those of a save by the first replica."""
    flags = ["--mock-data", "--vocab-size", "256", "--train-iters", "3", "--eval-iters", "0"]
    sizes, tensors = {}, {}
    for mode in ("--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save"):
        ckpt = tmp_path / mode
        losses(launch(2, *flags, mode, "--save", str(ckpt)))
        files = {f.name: f.stat().st_size for f in (ckpt / "iter_0000003").glob("__*_0.distcp")}
        sizes[mode] = [files["__0_0.distcp"], files["__1_0.distcp"]]
        tensors[mode] = _checkpoint_tensors(ckpt / "iter_0000003")
    spread, first = sizes["--ckpt-fully-parallel-save"], sizes["--no-ckpt-fully-parallel-save"]
    assert min(spread) > 0.3 * sum(spread), spread
    assert first[1] < 0.1 * sum(first), first
    same, other = tensors["--ckpt-fully-parallel-save"], tensors["--no-ckpt-fully-parallel-save"]
    assert same.keys() == other.keys() and len(same) > 20
    assert [k for k in same if not torch.equal(same[k], other[k])] == []


def test_exit_duration_saves_and_exits_on_every_rank_at_once(tmp_path):
    """--exit-duration-in-mins (Megatron-LM's, for a job's time limit): past it, every rank
    stops after the same iteration and a checkpoint is saved; the run resumes from it."""
    ckpt = tmp_path / "ckpt"
    flags = ["--mock-data", "--vocab-size", "256", "--eval-iters", "0", "--save", str(ckpt),
             "--ulysses-sp-size", "2", "--train-iters", "50"]
    stopped = launch(2, *flags, "--exit-duration-in-mins", "1e-9")
    assert sorted(losses(stopped)) == [1]
    assert "exiting at iteration 1 (--exit-duration-in-mins 1e-09 passed)" in stopped.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    resumed = launch(2, *flags, "--load", str(ckpt), "--exit-interval", "3")
    assert sorted(losses(resumed)) == [2, 3]


def test_a_nan_gradient_stops_the_run_before_its_update(tmp_path):
    # --lr 1e30: the first update blows the weights up; the second step's loss is still finite
    # but its gradients are not (as in a bf16 run whose grad norm turns NaN).
    blow_up = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e30",
               "--lr-warmup-iters", "0", "--log-interval", "1", "--num-workers", "0"]
    flags = ["--mock-data", "--vocab-size", "256", "--train-iters", "4", "--eval-iters", "0",
             "--ulysses-sp-size", "2"]
    ckpt = tmp_path / "ckpt"
    stopped = launch(2, *flags, "--save", str(ckpt), "--save-interval", "1", run=blow_up)
    assert stopped.returncode != 0
    errors = [line for line in stopped.stderr.splitlines() if "pretrain_gpt.py: error" in line]
    assert len(errors) == 1, stopped.stderr[-3000:]  # said once, by rank 0
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert f"iteration {saved + 1}: " in errors[0] and "hold NaN or Inf" in errors[0]
    assert "--no-check-for-nan-in-loss-and-grad" in errors[0] and str(ckpt) in errors[0]
    assert max(losses_of(stopped.stdout)) == saved  # no NaN update was logged or saved

    trained_on = launch(2, *flags, "--no-check-for-nan-in-loss-and-grad", run=blow_up)
    assert sorted(losses(trained_on)) == [1, 2, 3, 4]
    assert "grad norm: nan" in trained_on.stdout


def losses_of(stdout: str) -> dict:
    return {int(i): float(v) for i, v in ITERATION.findall(stdout)}


def test_skip_train_evaluates_a_checkpoint_as_its_training_did(data_flags, tmp_path):
    # --skip-train reads the validation batches from the split's start, as the first evaluation
    # of a training run does: the same loss, at SP 1 and SP 2, without --lr or --train-iters.
    ckpt = tmp_path / "ckpt"
    trained = launch(1, *data_flags, "--train-iters", "4", "--eval-interval", "4",
                     "--eval-iters", "2", "--save", str(ckpt))
    expected = validation(trained)
    assert list(expected) == [4]
    for nproc, sp in ((1, 1), (2, 2)):
        command = [flag for flag in RUN if flag not in ("--lr", "1e-3")]
        result = launch(nproc, *data_flags, "--eval-iters", "2", "--skip-train", "--load",
                        str(ckpt), "--ulysses-sp-size", str(sp), run=command)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert validation(result) == pytest.approx(expected, rel=2e-6), sp
        assert not ITERATION.search(result.stdout), "it trained"


BASE = [*MODEL, "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
        "--vocab-size", "64"]


@pytest.mark.parametrize("argv, world, message", [
    (["--ulysses-sp-size", "3"], 4, "world size 4 is not divisible"),
    (["--ulysses-sp-size", "16"], 16, "--num-attention-heads (8) / --tensor-model-parallel-size "
     "(1) = 8 query heads per tensor-parallel rank, fewer than --ulysses-sp-size (16): every SP "
     "rank needs at least one head; the largest --ulysses-sp-size that works is 8"),
    (["--ulysses-sp-size", "8", "--tensor-model-parallel-size", "2"], 16,
     "4 query heads per tensor-parallel rank, fewer than --ulysses-sp-size (8): every SP rank "
     "needs at least one head; the largest --ulysses-sp-size that works is 4"),
    (["--global-batch-size", "3"], 2, "--global-batch-size (3) must be a positive multiple"),
    (["--bf16"], 1, "--bf16/--fp16 need CUDA"),
    (["--offload-activations"], 1, "--offload-activations needs --recompute-granularity full"),
    (["--exit-signal-handler", "--exit-signal", "SIGUSR1"], 1,
     "--exit-signal SIGUSR1: only SIGTERM is handled here"),
    (["--data-path", "x"], 1, "give one data source: --data-path"),
    (["--train-data-path", "x", "--split", "50,50,0"], 1,
     "--split 50,50,0 divides --data-path's documents; with --train/valid/test-data-path each "
     "split has its own data: drop --split"),
    (["--ulysses-sp-size", "0"], 1, "--ulysses-sp-size must be >= 1"),
    (["--skip-train", "--eval-iters", "0"], 1, "--skip-train evaluates --eval-iters batches"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp",
      "--tiled-mlp-shards", "2"], 1, "drop mlp from --recompute-modules"),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm"], 1,
     "--recompute-modules layernorm needs Transformer Engine"),
    (["--ulysses-sp-size", "2", "--seq-length", "63", "--position-embedding-type",
      "learned_absolute", "--max-position-embeddings", "63"], 2,
     "--max-position-embeddings (63) must be >= --seq-length (63) padded to a multiple of "
     "--ulysses-sp-size (2), 64"),
])
def test_bad_configuration_names_the_flag(argv, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(BASE + argv, world_size=world)


def test_megatron_lm_compatibility_flags():
    args = parse_args(BASE + ["--use-mcore-models", "--log-throughput", "--use-flash-attn",
                              "--transformer-impl", "local", "--lr-warmup-fraction", "0.5",
                              "--ckpt-format", "torch_dist",
                              "--no-create-attention-mask-in-dataloader"], world_size=1)
    assert (args.model.transformer_impl, args.model.ulysses_attention_backend) == ("local", "sdpa")
    old_rope = parse_args([*BASE, "--position-embedding-type", "learned_absolute",
                           "--use-rotary-position-embeddings", "--no-position-embedding"],
                          world_size=1)
    assert old_rope.model.position_embedding_type == "rope"
    with pytest.raises(ConfigError, match="--no-position-embedding leaves no position "
                       "information with --position-embedding-type learned_absolute"):
        parse_args([*BASE, "--position-embedding-type", "learned_absolute",
                    "--no-position-embedding"], world_size=1)
    local = parse_args(BASE + ["--attention-backend", "local"], world_size=1).model
    assert (local.ulysses_attention_backend, local.attention_backend) == ("local", "local")
    with pytest.raises(ConfigError, match="--attention-backend fused runs "
                       "--ulysses-attention-backend te, not sdpa; drop one of the two"):
        parse_args(BASE + ["--attention-backend", "fused", "--ulysses-attention-backend",
                           "sdpa"], world_size=1)
    # Without --save the exits stop the run unsaved, as Megatron-LM's checkpoint_and_decide_exit
    exits = parse_args(BASE + ["--exit-duration-in-mins", "10", "--exit-signal-handler"],
                       world_size=1)
    assert (exits.training.exit_duration_in_mins, exits.training.exit_signal_handler) == (10, True)
    assert any("--exit-signal-handler and --exit-duration-in-mins without --save: the run "
               "stops without saving" in warning for warning in exits.warnings), exits.warnings
    # half of --lr-decay-iters = --train-iters 2, in samples of the global batch (1)
    assert args.optimizer.lr_warmup_steps == 1
    i = BASE.index("--train-iters")
    argv = BASE[:i] + BASE[i + 2:] + ["--train-samples", "10", "--global-batch-size", "5"]
    assert parse_args(argv, world_size=1).training.train_iters == 2
    with pytest.raises(ConfigError, match="one of --train-iters and --train-samples"):
        parse_args(BASE + ["--train-samples", "10"], world_size=1)
    with pytest.raises(ConfigError, match="--lr-warmup-fraction or --lr-warmup-iters"):
        parse_args(BASE + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"],
                   world_size=1)


@pytest.mark.parametrize("argv, layers, attention", [
    ([], "transformer_engine", "te"),
    (["--ulysses-attention-backend", "sdpa"], "transformer_engine", "sdpa"),
    (["--ulysses-attention-backend", "local"], "transformer_engine", "local"),
    (["--transformer-impl", "local"], "local", "sdpa"),
    (["--transformer-impl", "local", "--ulysses-attention-backend", "local"], "local", "local"),
])
def test_transformer_impl_picks_the_layers_and_the_backend_the_attention(argv, layers,
                                                                          attention):
    """Where TE and CUDA are (as on a GPU node), TE's layers are the default around any
    attention backend; without them, the local layers around SDPA."""
    with mock.patch.object(model_section, "te_available", return_value=True), \
            mock.patch.object(model_section, "resolve_backend", side_effect=lambda name: name):
        args = arguments.build_parser().parse_args(BASE + argv)
        model = arguments.validate_args(args, world_size=1, cuda=True).model
    assert (model.transformer_impl, model.ulysses_attention_backend) == (layers, attention)
    cpu = parse_args(BASE + argv, world_size=1).model
    assert cpu.transformer_impl == "local"


def test_te_attention_needs_te_layers():
    argv = BASE + ["--transformer-impl", "local", "--ulysses-attention-backend", "te"]
    with mock.patch.object(model_section, "te_available", return_value=True), \
            mock.patch.object(model_section, "resolve_backend", side_effect=lambda name: name), \
            pytest.raises(ConfigError, match="--ulysses-attention-backend te runs in Transformer "
                          "Engine's layers: drop --transformer-impl local"):
        arguments.validate_args(arguments.build_parser().parse_args(argv), 1, cuda=True)


def test_heads_and_kv_groups_that_do_not_divide_sp_are_accepted():
    # 12 heads / 3 kv groups: at SP 8, 2 heads on ranks 0-3, 1 on ranks 4-7.
    for sp in (2, 8):
        argv = BASE + ["--num-attention-heads", "12", "--hidden-size", "96",
                       "--group-query-attention", "--num-query-groups", "3",
                       "--ulysses-sp-size", str(sp)]
        assert parse_args(argv, world_size=sp).dims.sp == sp


def test_unknown_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + ["--ulysses-sp"], world_size=1)
    assert exit_info.value.code == 2
    assert "--ulysses-sp" in capsys.readouterr().err


def test_cli_exits_nonzero_before_any_collective():
    start = time.time()
    result = launch(2, "--mock-data", "--vocab-size", "64", "--train-iters", "2",
                    "--ulysses-sp-size", "16")
    assert result.returncode != 0
    assert "pretrain_gpt.py: error: world size 2 is not divisible" in result.stderr
    assert "--ulysses-sp-size (16)" in result.stderr
    assert result.stderr.count("pretrain_gpt.py: error:") == 1  # rank 0 only
    assert time.time() - start < 120


def test_missing_data_prefix_is_reported_before_training(tmp_path, sp_model):
    result = launch(2, "--data-path", "0.5", str(tmp_path / "absent"), "0.5",
                    str(tmp_path / "absent2"), "--tokenizer-type", "GPTSentencePieceTokenizer",
                    "--tokenizer-model", sp_model, "--train-iters", "2")
    assert result.returncode != 0
    assert "--data-path prefixes without .bin/.idx files" in result.stderr
    assert str(tmp_path / "absent2") in result.stderr
    assert "megatron_ulysses/" not in result.stderr  # a message, not a traceback from our code
