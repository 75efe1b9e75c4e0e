"""Llama2Tokenizer, TikTokenizer and the tokenizer option flags (Megatron-LM's meanings)."""

import argparse
import base64
import json
import sys

import pytest
import sentencepiece

from megatron_ulysses.data.tokenizer_flags import (
    TOKENIZER_OPTIONS,
    add_tokenizer_arguments,
    check_tokenizer_flags,
)
from megatron_ulysses.data.tokenizers import (
    build_tokenizer,
    build_tokenizer_from,
    check_for_training,
    padding_id,
)

TEXTS = ["The baker starts work long before the town is awake.",
         "  the   end\n\nand then, 1234 more: caf\u00e9 THE end!"]


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_tokenizer_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_spell_megatron_lm_and_default_to_its_values():
    args = parse("--tokenizer-type", "TikTokenizer")
    assert {dest: getattr(args, dest) for dest in TOKENIZER_OPTIONS} == {
        dest: default for dest, (default, _) in TOKENIZER_OPTIONS.items()}
    args = parse("--tiktoken-special-tokens", "<s>", "</s>", "--tokenizer-hf-no-use-fast",
                 "--tokenizer-hf-include-special-tokens", "--tiktoken-pattern", "v1")
    assert args.tokenizer_special_tokens == ["<s>", "</s>"]
    assert (args.tokenizer_hf_use_fast, args.tokenizer_hf_include_special_tokens) == (False, True)
    assert args.tiktoken_pattern == "v1"
    args = parse("--tokenizer-hf-use-fast", "--tokenizer-hf-no-include-special-tokens")
    assert (args.tokenizer_hf_use_fast, args.tokenizer_hf_include_special_tokens) == (True, False)


def test_the_help_of_each_on_off_pair_says_which_is_the_default():
    parser = argparse.ArgumentParser()
    add_tokenizer_arguments(parser)
    helps = {action.option_strings[0]: action.help for action in parser._actions
             if action.option_strings}
    assert helps["--tokenizer-hf-use-fast"] == (
        "HuggingFaceTokenizer: the fast (Rust) tokenizer (the default)")
    assert helps["--tokenizer-hf-no-use-fast"] == (
        "HuggingFaceTokenizer: the slow (Python) tokenizer")
    assert helps["--tokenizer-hf-include-special-tokens"] == (
        "HuggingFaceTokenizer: add the special tokens (BOS, EOS) when encoding")
    assert helps["--tokenizer-hf-no-include-special-tokens"] == (
        "HuggingFaceTokenizer: add no special tokens when encoding (the default)")


@pytest.mark.parametrize("argv, named", [
    (["--tiktoken-num-special-tokens", "5"], "--tiktoken-num-special-tokens"),
    (["--tokenizer-hf-no-use-fast"], "--tokenizer-hf-no-use-fast"),
    (["--null-tokenizer-eod-id", "3", "--vocab-extra-ids", "2"],
     "--vocab-extra-ids and --null-tokenizer-eod-id"),
])
def test_an_option_of_another_type_is_refused(sp_model, argv, named):
    args = parse("--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
                 *argv)
    with pytest.raises(ValueError, match=f"^{named} (is|are) not used by --tokenizer-type "
                                         "GPTSentencePieceTokenizer"):
        check_tokenizer_flags(args)


def test_llama2_puts_bos_before_every_text(sp_model):
    processor = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tokenizer = build_tokenizer_from(parse("--tokenizer-type", "Llama2Tokenizer",
                                           "--tokenizer-model", sp_model))
    assert tokenizer.vocab_size == processor.get_piece_size()
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (
        processor.bos_id(), processor.eos_id(), processor.eos_id(), processor.pad_id())
    for text in TEXTS:
        assert tokenizer.tokenize(text) == [processor.bos_id()] + processor.encode_as_ids(text)
    assert tokenizer.detokenize(tokenizer.tokenize(TEXTS[0])) == TEXTS[0]
    assert padding_id(tokenizer) == processor.pad_id()
    check_for_training(tokenizer, "Llama2Tokenizer", sp_model)
    # Its own dataset caches: its ids differ from GPTSentencePieceTokenizer's for the same model.
    assert tokenizer.unique_identifiers["class"].endswith("tokenizers.Llama2Tokenizer")


def test_llama2_without_bos_piece_names_the_flag(tmp_path):
    prefix = tmp_path / "nobos"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20), model_prefix=str(prefix), vocab_size=40,
        bos_id=-1, eos_id=1, unk_id=0, pad_id=-1, minloglevel=2)
    with pytest.raises(ValueError, match="nobos.model.* has no BOS piece.*Llama2Tokenizer"):
        build_tokenizer("Llama2Tokenizer", str(prefix) + ".model")


def test_null_tokenizer_eod_and_pad_ids():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100, null_tokenizer_eod_id=7,
                                null_tokenizer_pad_id=9)
    assert (tokenizer.eod, tokenizer.eos, tokenizer.pad, tokenizer.vocab_size) == (7, 7, 9, 101)
    assert padding_id(tokenizer) == 9
    assert tokenizer.unique_identifiers != build_tokenizer("NullTokenizer",
                                                           vocab_size=100).unique_identifiers
    with pytest.raises(ValueError, match=r"--null-tokenizer-eod-id 101 is outside .*\[0, 101\)"):
        build_tokenizer("NullTokenizer", vocab_size=100, null_tokenizer_eod_id=101)


# TikTokenizer: a byte-level vocabulary and an independent rank-merging encoder.
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"an", b"nd", b"and", b" a", b" and",
          b"er", b"en", b" e", b"ak", b"ake", b"12", b"34", b"\xc3\xa9", b"caf", b"TH"]


@pytest.fixture(scope="module")
def tiktoken_vocab(tmp_path_factory):
    pytest.importorskip("tiktoken")
    tokens = [bytes([i]) for i in range(256)] + MERGES
    entries = [{"rank": rank, "token_bytes": base64.b64encode(token).decode(),
                "token_str": token.decode("utf-8", errors="replace")}
               for rank, token in enumerate(tokens)]
    path = tmp_path_factory.mktemp("tiktoken") / "vocab.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return str(path), {token: rank for rank, token in enumerate(tokens)}


def reference_encode(text, ranks, pattern, shift):
    """Split by the pattern, then merge each piece's bytes, lowest-ranked pair first."""
    import regex

    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as library

    regexp = {"v1": library._PATTERN_TIKTOKEN_V1, "v2": library._PATTERN_TIKTOKEN_V2}[pattern]
    ids = []
    for piece in regex.findall(regexp, text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while True:
            pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:]))
                     if a + b in ranks]
            if not pairs:
                break
            i = min(pairs)[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[part] + shift for part in parts]
    return ids


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_ids_match_the_reference_encoder(tiktoken_vocab, pattern):
    path, ranks = tiktoken_vocab
    tokenizer = build_tokenizer_from(parse(
        "--tokenizer-type", "TikTokenizer", "--tokenizer-model", path, "--tiktoken-pattern",
        pattern, "--tiktoken-num-special-tokens", "10", "--vocab-size", str(10 + len(ranks))))
    assert tokenizer.vocab_size == 10 + len(ranks)
    assert (tokenizer.eod, tokenizer.bos, tokenizer.pad) == (2, 1, 4)  # </s>, <s>, <pad>
    for text in TEXTS:
        expected = reference_encode(text, ranks, pattern, 10)
        assert tokenizer.tokenize(text) == expected
        assert max(expected) >= 256 + 10  # merges were used
    # Special tokens written in the text are encoded as such (megatron-core's tiktoken).
    assert tokenizer.tokenize("the</s>the") == [ranks[b"the"] + 10, 2, ranks[b"the"] + 10]
    check_for_training(tokenizer, "TikTokenizer", path)


def test_tiktoken_special_tokens_order_and_vocab_cut(tiktoken_vocab):
    path, ranks = tiktoken_vocab
    special = ["</s>", "<s>", "<unk>", "<mask>", "<pad>", "<cls>", "<sep>", "<tool>"]
    tokenizer = build_tokenizer("TikTokenizer", path, vocab_size=8 + 256 + 3,
                                tokenizer_special_tokens=special, tiktoken_num_special_tokens=8)
    assert (tokenizer.eod, tokenizer.bos, tokenizer.vocab_size) == (0, 1, 267)
    # The vocabulary is cut to its first 259 ranks: "the" (rank 258) stays whole, "th" is one id.
    assert tokenizer.tokenize("the") == [258 + 8]
    assert tokenizer.tokenize(" the") == [ord(" ") + 8, 258 + 8]
    assert tokenizer.tokenize("<tool>") == [7]


@pytest.mark.parametrize("options, message", [
    (dict(tokenizer_special_tokens=["<s>", "</s>", "<unk>"]),
     "--tokenizer-special-tokens <s> </s> <unk> must hold each of .*missing: <mask> <pad>"),
    (dict(tiktoken_num_special_tokens=5), "--tiktoken-num-special-tokens 5 must be at least the 7"),
    (dict(vocab_size=2000), "has 277 ranks, fewer than --vocab-size 2000 .* --vocab-size 1277"),
])
def test_tiktoken_bad_options_name_the_flag(tiktoken_vocab, options, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer("TikTokenizer", tiktoken_vocab[0], **{"vocab_size": 1277, **options})


def test_tiktoken_not_a_vocabulary_names_the_flag(tiktoken_vocab, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"rank": 0, "token_bytes": "AA==", "token_str": "x"}, {"a": 1}]),
                   encoding="utf-8")
    with pytest.raises(ValueError, match="bad.json.* is not a tiktoken vocabulary"):
        build_tokenizer("TikTokenizer", str(bad), vocab_size=1010)


def test_tiktoken_missing_package_says_what_to_install(tiktoken_vocab, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # what `import tiktoken` sees without it
    with pytest.raises(ImportError, match="TikTokenizer needs the 'tiktoken' package .*pip"):
        build_tokenizer("TikTokenizer", tiktoken_vocab[0])
