"""Tokenizers: Megatron-LM special-id semantics, errors naming flags, and the trainer tool."""

import sys
from pathlib import Path

import pytest
import sentencepiece
import train_tokenizer
from conftest import CORPUS, TINY_VOCAB

from megatron_ulysses.data.tokenizers import (
    GPTSentencePieceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    padding_id,
)

def test_gpt_sentencepiece_ids_follow_megatron(sp_model):
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    processor = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    assert isinstance(tokenizer, GPTSentencePieceTokenizer)
    assert tokenizer.vocab_size == TINY_VOCAB
    assert tokenizer.eod == tokenizer.eos == train_tokenizer.EOS_ID
    assert (tokenizer.bos, tokenizer.pad) == (train_tokenizer.BOS_ID, train_tokenizer.PAD_ID)
    text = "The baker starts work long before the town is awake."
    ids = tokenizer.tokenize(text)
    assert ids == processor.encode_as_ids(text)
    assert tokenizer.detokenize(ids) == text
    assert padding_id(tokenizer) == train_tokenizer.PAD_ID


def test_sentencepiece_adds_megatron_special_tokens(sp_model):
    tokenizer = build_tokenizer("SentencePieceTokenizer", sp_model, vocab_extra_ids=2)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    # <CLS> <SEP> <EOD> <MASK> are appended; pad/bos/eos reuse the model's pieces; then extras.
    assert (tokenizer.cls, tokenizer.sep, tokenizer.eod, tokenizer.mask) == tuple(
        range(TINY_VOCAB, TINY_VOCAB + 4)
    )
    assert (tokenizer.pad, tokenizer.bos, tokenizer.eos) == (3, 1, 2)
    assert tokenizer.additional_special_tokens_ids == [TINY_VOCAB + 4, TINY_VOCAB + 5]
    assert tokenizer.vocab_size == TINY_VOCAB + 6
    processor = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    ids = tokenizer.tokenize("The river<EOD>The sea")
    assert ids == processor.encode_as_ids("The river") + [tokenizer.eod] + processor.encode_as_ids(
        "The sea"
    )
    assert tokenizer.detokenize(ids) == "The river <EOD> The sea"


def test_null_tokenizer_matches_megatron():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.eod == 100 and tokenizer.eos == 100
    assert tokenizer.vocab_size == 101
    assert tokenizer.tokenize("3 1 4") == [3, 1, 4]
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(NotImplementedError):
        tokenizer.pad
    assert padding_id(tokenizer) == 100


def test_unique_identifiers_describe_the_tokenizer(sp_model):
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    assert tokenizer.unique_identifiers["class"] == "GPTSentencePieceTokenizer"
    assert tokenizer.unique_identifiers["tokenizer_path"] == [sp_model]
    assert sp_model in tokenizer.unique_description


def test_unknown_type_names_flag_and_choices():
    with pytest.raises(ValueError, match="--tokenizer-type 'GPT2BPETokenizer'.*NullTokenizer"):
        build_tokenizer("GPT2BPETokenizer", "vocab.json")


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "HuggingFaceTokenizer"])
def test_missing_model_names_flag(tmp_path, tokenizer_type):
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer(tokenizer_type)
    with pytest.raises(ValueError, match="--tokenizer-model .*nope.* does not exist"):
        build_tokenizer(tokenizer_type, str(tmp_path / "nope"))


def test_null_tokenizer_needs_vocab_size():
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_huggingface_without_transformers_names_flags(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="--tokenizer-type HuggingFaceTokenizer.*transformers"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def test_train_tokenizer_is_deterministic(sp_model, tmp_path):
    prefix = str(tmp_path / "again")
    assert train_tokenizer.main(
        ["--input", str(CORPUS), "--output-prefix", prefix, "--vocab-size", str(TINY_VOCAB)]
    ) == 0
    assert Path(prefix + ".model").read_bytes() == Path(sp_model).read_bytes()
    assert len(Path(prefix + ".vocab").read_text(encoding="utf-8").splitlines()) == TINY_VOCAB


def test_train_tokenizer_unigram_and_txt_input(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat on the log\n" * 50, encoding="utf-8")
    prefix = str(tmp_path / "uni")
    assert train_tokenizer.main(
        ["--input", str(corpus), "--output-prefix", prefix, "--vocab-size", "20",
         "--model-type", "unigram"]
    ) == 0
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", prefix + ".model")
    assert tokenizer.vocab_size == 20
    assert tokenizer.detokenize(tokenizer.tokenize("the cat sat")) == "the cat sat"


def test_train_tokenizer_reports_vocab_too_large(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("tiny corpus\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="--vocab-size 5000"):
        train_tokenizer.main(
            ["--input", str(corpus), "--output-prefix", str(tmp_path / "x"), "--vocab-size", "5000"]
        )
