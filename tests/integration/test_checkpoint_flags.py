"""The checkpoint flags (Megatron-LM's meanings): an async save with --save-retain-interval keeps
the right iterations and resumes as the uninterrupted run (pretrain_gpt.py); in-process: what
--no-save-optim / --no-save-rng write and a load then needs, --dist-ckpt-strictness raise_all;
and the parse-time rules (no-ops without --save, refusals naming the flag)."""

import os
import re

import pytest
from distributed import spawn
from launcher import pretrain
from test_cli import MODEL, RUN, losses

from megatron_ulysses.errors import ConfigError
from megatron_ulysses.training.arguments import build_parser, validate_args

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test


def _pretrain(*argv: str):
    return pretrain(1, argv)


def _run(*flags: str):
    return _pretrain(*MODEL, *RUN, "--mock-data", "--vocab-size", "256", "--eval-iters", "0",
                     "--train-iters", "6", *flags)


def _iterations(ckpt) -> list:
    return sorted(int(name[5:]) for name in os.listdir(ckpt) if name.startswith("iter_"))


def test_async_save_with_retain_interval_resumes_as_uninterrupted(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = losses(_run())
    saving = ["--save", ckpt, "--save-interval", "1", "--save-retain-interval", "2"]
    first = _run(*saving, "--exit-interval", "4", "--async-save", "--use-persistent-ckpt-worker")
    assert [i for i in losses(first)] == [1, 2, 3, 4]
    assert "started an async save of iteration 4" in first.stdout
    # iterations 1 and 3 were deleted by the next save (not multiples of 2), 4 is the latest
    assert _iterations(ckpt) == [2, 4] and not any(".tmp" in n for n in os.listdir(ckpt))
    resumed = losses(_run(*saving, "--load", ckpt))
    assert resumed == {5: full[5], 6: full[6]}
    assert _iterations(ckpt) == [2, 4, 6]


def _without(rank, world, root, full_root):
    from test_checkpointing import _build, _load, _save, _teardown

    build = _build(world, "--save", root, "--no-save-optim", "--no-save-rng")
    _save(root, build)
    _teardown()
    with pytest.raises(ConfigError, match="--no-save-optim.*--no-load-optim"):
        _load(root, _build(world))
    _teardown()
    (iteration, _), out = _load(root, _build(world, "--no-load-optim"))
    assert iteration == 3 and "it was saved with --no-save-rng" in out
    _teardown()
    _save(full_root, _build(world))  # with optimizer and RNG states
    _teardown()
    _load(full_root, _build(world, "--no-load-optim", "--dist-ckpt-strictness", "log_all"))
    _teardown()
    with pytest.raises(ConfigError, match="does not load .*--dist-ckpt-strictness is raise_all"):
        _load(full_root, _build(world, "--no-load-optim", "--dist-ckpt-strictness", "raise_all"))
    _teardown()


def test_no_save_optim_and_rng_and_strictness(tmp_path):
    spawn(_without, 1, str(tmp_path / "ckpt"), str(tmp_path / "full"))


ARGS = MODEL + RUN + ["--mock-data", "--vocab-size", "256", "--train-iters", "4"]


def _validate(*flags: str):
    """(RunConfig, the warnings) of ARGS + flags for one CPU process."""
    config = validate_args(build_parser().parse_args(ARGS + list(flags)), 1, False)
    return config, " ".join(config.warnings)


def test_save_flags_without_save_are_no_ops_with_one_warning():
    config, said = _validate("--save-interval", "100000")
    assert config.checkpoint.save is None and "--save-interval without --save" in said
    config, said = _validate("--save", "", "--save-interval", "2")
    assert config.checkpoint.save is None and "--save is empty" in said


def test_async_rules_follow_megatron_lm(tmp_path):
    config, said = _validate("--save", str(tmp_path), "--async-save")
    assert not config.checkpoint.async_save and "--use-persistent-ckpt-worker" in said
    config, said = _validate("--save", str(tmp_path), "--async-save",
                             "--use-persistent-ckpt-worker", "--ckpt-format", "torch")
    assert config.checkpoint.async_save and config.checkpoint.async_strategy == "mcore"
    assert "--async-strategy nvrx" in said and "--ckpt-format torch: " in said


@pytest.mark.parametrize("flags, message", [
    (["--save-interval", "2", "--save-retain-interval", "3"],
     "--save-retain-interval 3 must be a multiple of --save-interval 2"),
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor"),
    (["--non-persistent-save-interval", "5"], "--non-persistent-save-interval"),
    (["--verify-integrity"], r"--verify-integrity needs megatron-core>=0\.19"),
    (["--exit-on-missing-checkpoint", "--load", "{empty}"], "--exit-on-missing-checkpoint"),
])
def test_bad_checkpoint_flags_name_the_flag(flags, message, tmp_path):
    from megatron.core import dist_checkpointing

    if "--verify-integrity" in flags and "verify_integrity" in \
            dist_checkpointing.save.__code__.co_varnames:
        pytest.skip("megatron-core >= 0.19 has --verify-integrity")  # CI's 3.12 job
    flags = [str(tmp_path) if f == "{empty}" else f for f in flags]
    with pytest.raises(ConfigError, match=message):
        _validate("--save", str(tmp_path / "out"), *flags)


# --- --use-checkpoint-args and the tokenizer (Megatron-LM's load_args_from_checkpoint) ----------

NO_TOKENIZER = [*RUN, "--mock-data", "--eval-iters", "0", "--lr-warmup-iters", "0",
                "--lr-decay-iters", "2", "--seq-length", "64"]  # no model or tokenizer flags
NO_NEW_TOKENIZER = "--no-use-tokenizer-model-from-checkpoint-args"


def _padded_vocab(run) -> str:
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return re.search(r"padded vocab (\d+)", run.stdout).group(1)


def test_use_checkpoint_args_takes_the_checkpoints_tokenizer(sp_model, hf_dir, tmp_path):
    """A run saved with a tokenizer resumes with --use-checkpoint-args and no tokenizer flags:
    the same tokenizer and padded vocabulary (the load checks it against the checkpoint's);
    the checkpoint's tokenizer wins over the command line's, unless
    --no-use-tokenizer-model-from-checkpoint-args, which then needs the command line's."""
    from megatron_ulysses.training.arguments import parse_args
    from megatron_ulysses.training.checkpoint.load import read_checkpoint_args

    ckpt = str(tmp_path / "ckpt")
    sp = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model]
    first = _pretrain(*MODEL, *NO_TOKENIZER, *sp, "--train-iters", "1", "--save", ckpt,
                      "--save-interval", "1")
    saved = read_checkpoint_args(ckpt)
    assert (saved["tokenizer_type"], saved["tokenizer_model"]) == \
        ("GPTSentencePieceTokenizer", os.path.abspath(sp_model))
    assert saved["padded_vocab_size"] == int(_padded_vocab(first)) == 1024
    resumed = _pretrain(*NO_TOKENIZER, "--train-iters", "2", "--load", ckpt,
                        "--use-checkpoint-args", "--use-checkpoint-opt_param-scheduler")
    assert _padded_vocab(resumed) == _padded_vocab(first) and list(losses(resumed)) == [2]

    load = [*NO_TOKENIZER, "--train-iters", "2", "--load", ckpt, "--use-checkpoint-args"]
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir]
    config = parse_args(load + hf, world_size=1)  # the checkpoint's wins, said once
    assert (config.data.tokenizer_type, config.data.tokenizer_model) == \
        ("GPTSentencePieceTokenizer", os.path.abspath(sp_model))
    said = [w for w in config.warnings if "the checkpoint's tokenizer is used" in w]
    assert len(said) == 1 and "--tokenizer-type HuggingFaceTokenizer" in said[0] and \
        NO_NEW_TOKENIZER in said[0], config.warnings
    config = parse_args(load + hf + [NO_NEW_TOKENIZER], world_size=1)
    assert (config.data.tokenizer_type, config.data.tokenizer_model) == \
        ("HuggingFaceTokenizer", hf_dir) and config.warnings == ()
    with pytest.raises(ConfigError, match=f"^{NO_NEW_TOKENIZER}: the tokenizer comes from the "
                       "command line, which gives no --tokenizer-type; give it and its files "
                       ".*GPTSentencePieceTokenizer"):
        parse_args(load + [NO_NEW_TOKENIZER], world_size=1)
    with pytest.raises(ConfigError, match="GPTSentencePieceTokenizer needs --tokenizer-model"):
        parse_args(load + [NO_NEW_TOKENIZER, "--tokenizer-type", "GPTSentencePieceTokenizer"],
                   world_size=1)


@pytest.mark.parametrize("tokenizer, message", [
    (dict(tokenizer_model="{missing}"), "--tokenizer-model '.*gone.model', which does not "
     "exist here; give " + NO_NEW_TOKENIZER),
    (dict(tokenizer_model=42), "--tokenizer-model 42, which does not exist here"),
    (dict(tokenizer_type="x" * 10**6), "--tokenizer-type 'x{79}, which is not one of "
     "SentencePieceTokenizer, "),
    (dict(tokenizer_type="TikTokenizer", tiktoken_pattern="$(touch pwned)"),
     r"--tiktoken-pattern '\$\(touch pwned\)', not v1 or v2: no TikTokenizer run"),
])
def test_a_checkpoints_tokenizer_is_untrusted_input(tokenizer, message, sp_model, tmp_path,
                                                    monkeypatch):
    """Its type must be built here, its model a path that exists: one message naming the flag
    and Megatron-LM's way around (the command line's tokenizer); nothing is read or run."""
    from megatron_ulysses.training.checkpoint import load as checkpoint_load
    from megatron_ulysses.training.arguments import parse_args

    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
             "tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": sp_model,
             **tokenizer}
    if saved["tokenizer_model"] == "{missing}":
        saved["tokenizer_model"] = str(tmp_path / "gone.model")
    monkeypatch.setattr(checkpoint_load, "read_checkpoint_args", lambda root: saved)
    argv = [*NO_TOKENIZER, "--train-iters", "2", "--load", str(tmp_path),
            "--use-checkpoint-args"]
    with pytest.raises(ConfigError, match=f"^--use-checkpoint-args: the checkpoint at --load "
                       f".* was saved with .*{message}"):
        parse_args(argv, world_size=1)
    assert not os.path.exists("pwned")
    config = parse_args(argv + [NO_NEW_TOKENIZER, "--tokenizer-type", "NullTokenizer",
                                "--vocab-size", "64"], world_size=1)
    assert config.data.tokenizer_type == "NullTokenizer"
