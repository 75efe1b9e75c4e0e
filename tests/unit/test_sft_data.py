"""--sft's data: the loss mask of Megatron-LM's prompt formats against hand-computed ones on the
fixture, packing and truncation, each bad JSONL line's message, the packed segments through the
SP padding, and the flags' rules."""

import json

import pytest
import torch
from sft_data import SFT_JSONL

from megatron_ulysses.data.datasets import DataError
from megatron_ulysses.data.sft import SFTTokenizer, check_sft_data_path, pack, split_conversations
from megatron_ulysses.data.sharding import get_batch_for_sp_rank
from megatron_ulysses.errors import ConfigError
from megatron_ulysses.training.arguments import parse_args


def _sample(tokenizer, line: int, seq_length: int):
    messages = json.loads(SFT_JSONL.read_text().splitlines()[line])["messages"]
    return pack((tokenizer.tokenize_conversation(c) for c in split_conversations(messages)),
                seq_length, tokenizer.pad)


def _words(tokenizer, ids):
    return tokenizer.tokenizer.convert_ids_to_tokens([int(i) for i in ids])


# Line 1 as nemotron-h-aligned: two conversations of 17 and 19 tokens.
CONV1 = ["<SPECIAL_10>", "System", "\n", "be", "brief", "\n", "<SPECIAL_11>", "User", "\n", "hi",
         "there", "\n", "<SPECIAL_11>", "Assistant", "\n", "hello", "\n"]
CONV2 = ["<SPECIAL_10>", "System", "\n", "be", "kind", "\n", "<SPECIAL_11>", "User", "\n", "how",
         "are", "you", "\n", "<SPECIAL_11>", "Assistant", "\n", "fine", "thanks", "\n"]


def test_loss_mask_is_the_assistant_turns(sft_tokenizer):
    tokenizer = SFTTokenizer(sft_tokenizer, "nemotron-h-aligned")
    sample = _sample(tokenizer, 0, 40)
    assert _words(tokenizer, sample["tokens"]) == CONV1 + CONV2 + ["<SPECIAL_233>"] * 4
    # label i is token i + 1: "hello \n" (15, 16) and "fine thanks \n" (17 + 16 .. 18)
    expected = torch.zeros(40)
    expected[[14, 15, 32, 33, 34]] = 1
    assert torch.equal(sample["loss_mask"], expected)
    assert _words(tokenizer, sample["labels"][[14, 15, 32, 33, 34]]) == \
        ["hello", "\n", "fine", "thanks", "\n"]
    assert sample["position_ids"].tolist() == list(range(17)) + list(range(23))
    assert sample["cu_seqlens"][:3].tolist() == [0, 17, 40]
    assert (sample["cu_seqlens"][3:] == 40).all() and sample["cu_seqlens"].shape == (41,)


def test_overflowing_conversation_is_cut_and_the_rest_dropped(sft_tokenizer):
    tokenizer = SFTTokenizer(sft_tokenizer, "nemotron-h-aligned")
    sample = _sample(tokenizer, 0, 20)
    assert _words(tokenizer, sample["tokens"]) == CONV1 + CONV2[:3]
    assert sample["loss_mask"].nonzero().flatten().tolist() == [14, 15]
    assert sample["cu_seqlens"][:3].tolist() == [0, 17, 20]
    assert sample["position_ids"].tolist() == list(range(17)) + [0, 1, 2]


def test_other_formats(sft_tokenizer):
    nano = SFTTokenizer(sft_tokenizer, "nemotron-nano-v2")
    tokens, targets = nano.tokenize_conversation(
        [{"role": "user", "content": "hi /think"}, {"role": "assistant", "content": "hello"}])
    assert _words(nano, tokens) == ["<SPECIAL_11>", "User", "\n", "hi", "\n", "<SPECIAL_11>",
                                    "Assistant", "\n", "hello", "\n", "<SPECIAL_12>", "\n"]
    assert targets == [-100] * 8 + tokens[8:]  # the assistant prefix is not trained on
    assert nano.pad == 0  # <unk>
    # identity and default (the tokenizer's chat template) put every token in the loss
    default = SFTTokenizer(sft_tokenizer, "default")
    tokens, targets = default.tokenize_conversation(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert _words(default, tokens) == ["user:", "hi", "\n", "assistant:", "hello", "\n"]
    assert targets == tokens and default.pad == 2  # its <pad>


def test_packed_segments_survive_sp_padding(sft_tokenizer):
    tokenizer = SFTTokenizer(sft_tokenizer, "nemotron-h-aligned")
    batch = {key: torch.stack([a, b]) for (key, a), b in zip(
        _sample(tokenizer, 0, 39).items(), _sample(tokenizer, 3, 39).values())}
    shard = get_batch_for_sp_rank(batch, 1, 2, tokenizer.pad, tokenizer.eod)
    # row 0: 17 + 22 (last conversation and its padding), SP pad 1; row 1 starts at 40
    assert shard["cu_seqlens"].tolist()[:4] == [0, 17, 39, 40]
    assert shard["tokens"].shape == (2, 20) and shard["max_seqlen"] == 22


@pytest.mark.parametrize("line, fmt, problem", [
    ("not json", "identity", "line 2 is not JSON"),
    ('{"text": "a"}', "identity", 'line 2 has no "messages" list'),
    ('{"messages": [{"role": "bot", "content": "a"}]}', "identity", "line 2 message 1"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "nemotron-h-aligned",
     "line 2 conversation 1 has no assistant turn"),
    ('{"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]}',
     "nemotron-h-aligned", "line 2 conversation 1 has an assistant "
     "turn (message 2) that follows no user or tool turn"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}',
     "nemotron-nano-v2", "line 2 conversation 1 has an empty "
     "assistant turn (message 2)"),
])
def test_bad_line_is_named(tmp_path, line, fmt, problem):
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text(SFT_JSONL.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(DataError) as error:
        check_sft_data_path([str(path)], fmt)
    assert str(error.value).startswith(f"--data-path {str(path)!r} {problem}"), error.value
    assert '{"messages": [{"role"' in str(error.value)


def test_no_assistant_is_fine_where_every_token_trains(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    check_sft_data_path([str(path)], "identity", split="1,0,0")
    with pytest.raises(DataError, match="gives the train split 0 of the 1 documents"):
        check_sft_data_path([str(path)], "identity", split="1,1,0")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no samples"):
        check_sft_data_path([str(tmp_path / "empty.jsonl")], "identity")


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-4"]


@pytest.mark.parametrize("extra, said", [
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--sft needs --tokenizer-type SFTTokenizer"),
    (["--tokenizer-type", "SFTTokenizer", "--reset-attention-mask"],
     "drop --reset-attention-mask"),
])
def test_sft_flag_rules(sft_tokenizer, extra, said):
    with pytest.raises(ConfigError, match=said):
        parse_args(BASE + ["--sft", "--data-path", str(SFT_JSONL), "--tokenizer-model",
                           sft_tokenizer] + extra, world_size=1)


def test_sft_reads_no_mock_data(sft_tokenizer):
    with pytest.raises(ConfigError, match="--sft reads JSONL conversations .* drop --mock-data"):
        parse_args(BASE + ["--sft", "--mock-data", "--tokenizer-type", "SFTTokenizer",
                           "--tokenizer-model", sft_tokenizer], world_size=1)


def test_sft_flags_parse(sft_tokenizer):
    config = parse_args(BASE + ["--sft", "--data-path", str(SFT_JSONL), "--tokenizer-type",
                                "SFTTokenizer", "--tokenizer-model", sft_tokenizer,
                                "--sft-tokenizer-prompt-format", "identity"], world_size=1)
    assert config.data.sft and config.data.sft_tokenizer_prompt_format == "identity"
    assert config.data.data_path == (str(SFT_JSONL),)
    assert config.warnings == ()


def test_sft_warnings(sft_tokenizer):
    config = parse_args(BASE + ["--sft", "--data-path", str(SFT_JSONL), "--tokenizer-type",
                                "SFTTokenizer", "--tokenizer-model", sft_tokenizer,
                                "--eod-mask-loss"], world_size=1)
    assert any(w.startswith("--eod-mask-loss has no effect with --sft") for w in config.warnings)
    config = parse_args(BASE + ["--mock-data", "--vocab-size", "64",
                                "--sft-tokenizer-prompt-format", "identity"], world_size=1)
    assert config.data.sft_tokenizer_prompt_format == "nemotron-h-aligned"
    assert any(w.startswith("--sft-tokenizer-prompt-format has no effect without "
                            "--tokenizer-type SFTTokenizer") for w in config.warnings)
