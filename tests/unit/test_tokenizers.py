"""Tokenizers: Megatron-LM special-id semantics, errors naming flags, and the trainer tool."""

import json
import sys
from pathlib import Path

import pytest
import sentencepiece
import train_tokenizer
from conftest import CORPUS, TINY_VOCAB

from megatron_ulysses.data.tokenizers import (
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    check_for_training,
    padding_id,
)

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test


def is_megatron_core_tokenizer(tokenizer) -> bool:
    return type(tokenizer).__module__.startswith("megatron.core.tokenizers.")


def test_gpt_sentencepiece_ids_follow_megatron(sp_model):
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    processor = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    assert is_megatron_core_tokenizer(tokenizer)
    assert tokenizer.vocab_size == TINY_VOCAB
    assert tokenizer.eod == tokenizer.eos == train_tokenizer.EOS_ID
    assert (tokenizer.bos, tokenizer.pad) == (train_tokenizer.BOS_ID, train_tokenizer.PAD_ID)
    text = "The baker starts work long before the town is awake."
    ids = tokenizer.tokenize(text)
    assert ids == processor.encode_as_ids(text)
    assert tokenizer.detokenize(ids) == text
    assert padding_id(tokenizer) == train_tokenizer.PAD_ID
    check_for_training(tokenizer, "GPTSentencePieceTokenizer", sp_model)


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
    assert tokenizer.tokenize(" 3\t1  4\n") == [3, 1, 4]  # any whitespace, as preprocess checks
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(NotImplementedError):
        tokenizer.pad
    assert padding_id(tokenizer) == 100
    check_for_training(tokenizer, "NullTokenizer")


def test_unique_identifiers_tell_tokenizers_apart(sp_model):
    """megatron-core's datasets name their index caches by these: the two sentencepiece types
    give other ids for the same model, so they must not share caches."""
    gpt = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    megatron_lm = build_tokenizer("SentencePieceTokenizer", sp_model)
    extra = build_tokenizer("SentencePieceTokenizer", sp_model, vocab_extra_ids=2)
    assert gpt.unique_identifiers["tokenizer_path"] == sp_model
    assert gpt.unique_identifiers["class"].endswith("GPTTokenizer")
    assert megatron_lm.unique_identifiers["class"].endswith("tokenizers.SentencePieceTokenizer")
    assert megatron_lm.unique_identifiers["tokenizer_path"] == sp_model
    described = {json.dumps(t.unique_identifiers) for t in (gpt, megatron_lm, extra)}
    assert len(described) == 3
    assert build_tokenizer("NullTokenizer", vocab_size=7).unique_identifiers != \
        build_tokenizer("NullTokenizer", vocab_size=8).unique_identifiers
    # Why SentencePieceTokenizer is ours: megatron-core's sentencepiece eod is the model's eos.
    assert gpt.eod == gpt.eos != megatron_lm.eod


def test_huggingface_is_megatron_cores_without_added_special_tokens(hf_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_dir)
    assert is_megatron_core_tokenizer(tokenizer)
    assert tokenizer.vocab_size == len(reference) == 300
    assert tokenizer.eod == reference.eos_token_id == reference.convert_tokens_to_ids("</s>")
    assert (tokenizer.bos, tokenizer.pad) == (reference.bos_token_id, reference.pad_token_id)
    assert padding_id(tokenizer) == reference.pad_token_id
    text = "The baker starts work long before the town is awake."
    assert reference(text).input_ids[0] == reference.bos_token_id
    assert tokenizer.tokenize(text) == reference(text, add_special_tokens=False).input_ids
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == reference.decode(
        reference(text, add_special_tokens=False).input_ids)
    check_for_training(tokenizer, "HuggingFaceTokenizer", hf_dir)


def test_huggingface_include_special_tokens_adds_the_bos(hf_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_dir,
                                tokenizer_hf_include_special_tokens=True)
    text = "The baker starts work long before the town is awake."
    assert tokenizer.tokenize(text) == reference(text).input_ids
    assert tokenizer.tokenize(text)[0] == reference.bos_token_id


def test_huggingface_garbage_directory_names_flag(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="--tokenizer-model .* is not a HuggingFace tokenizer"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_not_a_sentencepiece_model_names_flag(tmp_path, tokenizer_type):
    (tmp_path / "x.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match=f"--tokenizer-model .*x.model.* is not a sentencepiece "
                                         f"model .*--tokenizer-type {tokenizer_type}"):
        build_tokenizer(tokenizer_type, str(tmp_path / "x.model"))
    with pytest.raises(ValueError, match="is a directory"):
        build_tokenizer(tokenizer_type, str(tmp_path))


def test_unknown_type_names_flag_and_choices():
    with pytest.raises(ValueError, match="--tokenizer-type 'BertWordPieceCase'.*TikTokenizer"):
        build_tokenizer("BertWordPieceCase", vocab_file="vocab.txt")


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                                            "Llama2Tokenizer", "TikTokenizer"])
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


# ------------------------------------------------------------------ GPT2BPETokenizer


def _bytes_to_unicode():
    """GPT-2's byte -> printable character table (openai/gpt-2, encoder.py)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def reference_gpt2_encode(text, vocab_file, merge_file):
    """GPT-2's encoder as OpenAI wrote it (and Megatron-LM copied it): regex split, bytes to
    characters, then the lowest-ranked merge first until none applies."""
    import regex

    encoder = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    lines = Path(merge_file).read_text(encoding="utf-8").split("\n")[1:-1]
    ranks = {tuple(line.split()): i for i, line in enumerate(lines)}
    byte_encoder = _bytes_to_unicode()
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                            r"""|\s+(?!\S)|\s+""")
    ids = []
    for piece in pattern.findall(text):
        word = tuple(byte_encoder[b] for b in piece.encode("utf-8"))
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        ids.extend(encoder[token] for token in word)
    return ids


GPT2_TEXTS = [
    "Hello world, it's 2026: the model's context is 131072 tokens.",
    "  leading spaces,\ttabs and\nnew lines  \n\n",
    "naïve café — déjà vu ½ ∑ 東京 🙂",
    "literal <|endoftext|> stays text, as in Megatron-LM",
]


def test_gpt2_bpe_matches_the_reference_encoder(gpt2_files):
    vocab_file, merge_file = gpt2_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    assert tokenizer.vocab_size == len(vocab)
    assert tokenizer.eod == vocab["<|endoftext|>"]
    check_for_training(tokenizer, "GPT2BPETokenizer")
    corpus = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:20]]
    for text in GPT2_TEXTS + corpus:
        ids = tokenizer.tokenize(text)
        assert ids == reference_gpt2_encode(text, vocab_file, merge_file), text
        assert tokenizer.detokenize(ids) == text
    assert tokenizer.eod not in tokenizer.tokenize(GPT2_TEXTS[-1])


def test_gpt2_bpe_bad_files_name_the_flag(gpt2_files, tmp_path):
    vocab_file, merge_file = gpt2_files
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file)
    with pytest.raises(ValueError, match="--vocab-file .*nope.* does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope"),
                        merge_file=merge_file)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="--vocab-file .*bad.json.* is not GPT-2's vocab.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "bad.json"),
                        merge_file=merge_file)
    (tmp_path / "bad.txt").write_text("#version: 0.2\nĠ t\nnot-a-pair\n")
    with pytest.raises(ValueError, match="--merge-file .*bad.txt.* line 3 .*not a merge"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file,
                        merge_file=str(tmp_path / "bad.txt"))
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    eod = vocab.pop("<|endoftext|>")
    vocab = {token: i - (i > eod) for token, i in vocab.items()}
    (tmp_path / "no_eod.json").write_text(json.dumps(vocab))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "no_eod.json"),
                                merge_file=merge_file)
    with pytest.raises(ValueError, match="--vocab-file .*no_eod.json.* has no <\\|endoftext\\|>"):
        check_for_training(tokenizer, "GPT2BPETokenizer")
