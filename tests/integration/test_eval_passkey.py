"""tools/eval_passkey.py, as a user runs it, on a tiny random Llama (GQA, fp32, vocab 1000)
imported with tools/convert_hf.py and the bundled corpus's sentencepiece tokenizer (conftest):

- under torchrun at SP = 2 it prints a markdown table that equals passkey.json's accuracies and
  writes the heat map;
- SP = 1 (with DP = 2 and another micro batch) gives every trial's predicted tokens exactly as
  SP = 2 does, and they are the teacher-forced argmax of the original model in `transformers`;
- every prompt is exactly the length asked for, ends with the key's tokens after the question,
  holds the needle with the key at a place that moves down with the depth;
- the vocab-parallel argmax over TP = 2 equals the argmax of the whole vocabulary, ties and
  padded ids included;
- bad input exits 2 with one message naming the flag.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, TINY_VOCAB
from distributed import spawn
from test_convert_hf import checkpoint, save_random_llama  # noqa: F401 (a fixture: this hf_dir's)

import eval_passkey
from megatron_ulysses.errors import ConfigError
from megatron_ulysses.eval.greedy import vocab_parallel_argmax
from megatron_ulysses.eval.prompt import NEEDLE, PromptBuilder, make_key

TOOL = str(REPO_ROOT / "tools" / "eval_passkey.py")
LENGTHS, DEPTHS, TRIALS = (128, 320), (0.0, 0.5, 1.0), 2
ROW = re.compile(r"^\| (\d+) \|((?: [0-9.]+ \|)+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random Llama over the tokenizer's vocabulary (test_convert_hf's, vocab 1000)."""
    return save_random_llama(tmp_path_factory.mktemp("hf") / "llama", TINY_VOCAB)


def _flags(checkpoint, sp_model, out, *flags):
    return ["--load", str(checkpoint), "--use-checkpoint-args", "--tokenizer-type",
            "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model, "--lengths",
            ",".join(map(str, LENGTHS)), "--depths", ",".join(map(str, DEPTHS)), "--trials",
            str(TRIALS), "--output-dir", str(out), "--seed", "7", *flags]


def passkey(nproc, *flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    result = subprocess.run([*launcher, TOOL, *flags], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def sp2(checkpoint, sp_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp2")
    result = passkey(2, *_flags(checkpoint, sp_model, out, "--ulysses-sp-size", "2",
                                "--micro-batch-size", "2"))
    return result, json.loads((out / "passkey.json").read_text()), out


def test_sp2_prints_the_table_of_passkey_json_and_draws_the_heat_map(sp2):
    result, saved, out = sp2
    assert "Ulysses SP 2" in result.stdout
    assert saved["lengths"] == list(LENGTHS) and saved["depths"] == list(DEPTHS)
    assert saved["trials"] == TRIALS and len(saved["records"]) == len(LENGTHS) * len(DEPTHS) * 2
    for i, length in enumerate(LENGTHS):
        for j, depth in enumerate(DEPTHS):
            cell = [r for r in saved["records"] if r["length"] == length and r["depth"] == depth]
            assert sorted(r["trial"] for r in cell) == list(range(TRIALS))
            assert saved["accuracy"][i][j] == sum(r["correct"] for r in cell) / TRIALS
    for record in saved["records"]:
        assert record["correct"] == (record["predicted_tokens"] == record["answer_tokens"])
    rows = ROW.findall(result.stdout)  # printed once, by rank 0
    assert [int(length) for length, _ in rows] == list(LENGTHS)
    for (_, cells), accuracy, mean in zip(rows, saved["accuracy"], saved["mean"]):
        assert [float(c) for c in cells.strip(" |").split(" | ")] == \
            pytest.approx(accuracy + [mean], abs=5e-4)
    assert "| length | depth 0 | depth 0.5 | depth 1 | mean |" in result.stdout
    assert (out / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sp1_gives_sp2s_answers_which_are_the_original_models_argmax(sp2, checkpoint, sp_model,
                                                                     hf_dir, tmp_path):
    import transformers

    _, expected, _ = sp2
    # DP 2 x SP 1, 3 trials per forward: other batches, the other half of the trials per rank.
    passkey(2, *_flags(checkpoint, sp_model, tmp_path, "--micro-batch-size", "3"))
    got = json.loads((tmp_path / "passkey.json").read_text())
    assert got["records"] == expected["records"]

    tokenizer = _tokenizer(sp_model)
    builder = PromptBuilder(tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    answer_lengths = set()
    for record in expected["records"]:
        prompt = builder.build(record["length"], record["depth"], record["key"])
        with torch.no_grad():
            logits = model(torch.tensor([prompt.tokens])).logits[0]
        n = len(prompt.answer)
        answer_lengths.add(n)
        argmax = logits[record["length"] - n - 1:record["length"] - 1].argmax(-1).tolist()
        assert record["predicted_tokens"] == argmax, record
    assert len(answer_lengths) > 1  # the batches mix keys of different token counts


def _tokenizer(sp_model):
    from megatron_ulysses.data.tokenizers import build_tokenizer

    return build_tokenizer("GPTSentencePieceTokenizer", sp_model)


def test_prompts_have_the_exact_length_and_the_key_where_the_depth_says(sp_model, sp2):
    tokenizer = _tokenizer(sp_model)
    builder = PromptBuilder(tokenizer)
    question = builder.question
    for length in (120, 121, 128, 1000, 4096):
        for trial in range(3):
            starts = []
            for depth in [i / 10 for i in range(11)]:
                key = make_key(1, length, depth, trial)
                assert 10000 <= key <= 99999
                prompt = builder.build(length, depth, key)
                tokens, n = prompt.tokens, len(prompt.answer)
                assert len(tokens) == length
                assert tokens[-n:] == prompt.answer
                assert tokenizer.detokenize(prompt.answer).strip() == str(key)
                assert tokens[length - n - len(question):length - n] == question
                assert tokens[:len(builder.intro)] == builder.intro
                needle = tokenizer.detokenize(tokens[prompt.needle_start:prompt.needle_end])
                assert needle.strip() == NEEDLE.format(key=key)
                assert tokenizer.detokenize(tokens).count(str(key)) == 3  # needle x 2, answer
                starts.append((prompt.needle_start, prompt.needle_depth))
            assert starts[0] == (len(builder.intro), 0.0)  # depth 0: right after the intro
            assert starts[-1][1] == 1.0  # depth 1: right before the question
            depths = [d for _, d in starts]
            assert depths == sorted(depths) and len(set(depths)) >= 2, starts
            if length >= 1000:  # sentences are short against the filler: every depth differs
                assert len(set(depths)) == 11, starts
    with pytest.raises(ConfigError, match="--lengths: 40 tokens are too few"):
        builder.build(40, 0.5, 12345)
    # What the run recorded is what the prompts hold.
    _, saved, _ = sp2
    for record in saved["records"]:
        assert record["key"] == make_key(7, record["length"], record["depth"], record["trial"])
        prompt = builder.build(record["length"], record["depth"], record["key"])
        assert record["answer_tokens"] == prompt.answer
        assert record["needle_position"] == prompt.needle_start
    for length in LENGTHS:
        for trial in range(TRIALS):
            positions = [r["needle_position"] for r in saved["records"]
                         if r["length"] == length and r["trial"] == trial]
            assert positions == sorted(positions) and len(set(positions)) == len(DEPTHS)


def _argmax_case(rank, world):
    from megatron_ulysses import cpu_compat
    from megatron_ulysses.sp import parallel_state as ps

    cpu_compat.install()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        full = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
        full[0, 0, 3] = full[0, 0, 11] = 100.0  # a tie across the TP ranks: the lower id wins
        full[0, 1, 9] = full[0, 1, 10] = 100.0  # a tie on one rank
        full[1, :, 14] = 1000.0  # padded ids (>= 13) are not tokens
        local = full[..., rank * 8:(rank + 1) * 8]
        got = vocab_parallel_argmax(local, vocab_size=13)
        assert torch.equal(got, full[..., :13].argmax(-1)), got
        assert got[0, 0] == 3 and got[0, 1] == 9
    finally:
        ps.destroy_model_parallel()


def test_vocab_parallel_argmax_equals_the_whole_vocabularys():
    spawn(_argmax_case, 2)


@pytest.mark.parametrize("flags, message", [
    (["--ulysses-sp-size", "2", "--lengths", "128,321"],
     "--lengths: 321 is not divisible by --ulysses-sp-size (2)"),
    (["--depths", "0,1.5"], "--depths: 1.5 is outside [0, 1]"),
    (["--depths", "0,x"], "--depths: 'x' is not a number"),
    (["--lengths", "128,abc"], "--lengths: 'abc' is not an integer"),
    (["--lengths", "128,40"], "--lengths: 40 tokens are too few for the passkey prompt"),
    (["--trials", "0"], "--trials must be >= 1, got 0"),
    (["--seq-length", "128"], "--seq-length is set from each --lengths value"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type: the passkey prompt is text"),
    (["--ulysses-sp-size", "4"], "world size 1 is not divisible"),  # the trainer's rules
    (["--load", "MISSING"], "--use-checkpoint-args: no checkpoint at --load"),
    ([], "--load CKPT is required"),
])
def test_bad_input_is_one_message_naming_the_flag(flags, message, checkpoint, sp_model,
                                                  tmp_path, capsys, monkeypatch):
    argv = _flags(checkpoint, sp_model, tmp_path / "out")
    if not flags:
        del argv[:2]  # no --load
    argv += [str(tmp_path / "missing") if flag == "MISSING" else flag for flag in flags]
    monkeypatch.setattr(eval_passkey, "run", lambda plan: pytest.fail("the input was accepted"))
    assert eval_passkey.main(argv) == 2  # the later of a repeated flag wins, as in argparse
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("eval_passkey.py: error: "), errors
    assert message in errors[0]
    assert not (tmp_path / "out").exists()


def test_use_checkpoint_args_keeps_the_checkpoints_rows_at_another_tp(checkpoint, sp_model,
                                                                        tmp_path):
    # The import padded no rows at TP 1 (--make-vocab-size-divisible-by 1000), where TP 2
    # would pad to 2000: --use-checkpoint-args takes its padded vocab (as Megatron-LM's); a
    # --padded-vocab-size on the command line wins.
    argv = _flags(checkpoint, sp_model, tmp_path / "out", "--tensor-model-parallel-size", "2")
    rows = [eval_passkey.parse(argv + more, world_size=2).config.model.padded_vocab_size
            for more in ([], ["--padded-vocab-size", str(2 * TINY_VOCAB)])]
    assert rows == [TINY_VOCAB, 2 * TINY_VOCAB]


def test_cli_exits_2_without_a_traceback(checkpoint, sp_model, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, TOOL, *_flags(checkpoint, sp_model, tmp_path),
                             "--depths", "-0.5"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["eval_passkey.py: error: --depths: -0.5 is outside [0, 1] (0: the needle "
                      "right after the introduction, 1: right before the question)"]
