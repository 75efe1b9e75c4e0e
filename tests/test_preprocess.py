"""tools/preprocess_data.py, merge_datasets.py and inspect_dataset.py against megatron-core's
``IndexedDataset`` reader."""

import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sentencepiece
from megatron.core.datasets.indexed_dataset import IndexedDataset

import inspect_dataset
import merge_datasets
import preprocess_data
import train_tokenizer
from conftest import REPO_ROOT

TEXTS = [
    "The river does not hurry, yet it reaches the sea.",
    "A clock is a patient machine made of many small parts.",
    "Bread needs flour, water, salt and time.\n\nThe baker starts work early.",
    "Bees carry pollen from one flower to the next.",
]


def write_jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def preprocess(input_path: Path, prefix: Path, sp_model: str, *extra: str) -> int:
    return preprocess_data.main([
        "--input", str(input_path), "--output-prefix", str(prefix),
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model, *extra,
    ])


def read_documents(prefix: str) -> list:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("append_eod", [True, False])
def test_round_trip_gives_sentencepiece_ids(tmp_path, sp_model, append_eod):
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    flags = ["--append-eod"] if append_eod else []
    assert preprocess(source, tmp_path / "out", sp_model, *flags) == 0
    processor = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    eod = [processor.eos_id()] if append_eod else []
    expected = [processor.encode_as_ids(text) + eod for text in TEXTS]
    assert read_documents(str(tmp_path / "out_text_document")) == expected
    assert not list(tmp_path.glob("*.tmp*"))


def test_bad_lines_are_reported_with_line_numbers(tmp_path, sp_model, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_bytes(
        b'{"text": "A good first line."}\n'  # 1
        b'{"text": "broken json\n'  # 2
        b'{"body": "no text key"}\n'  # 3
        b'{"text": "bad byte \xff here"}\n'  # 4
        b'{"text": "   "}\n'  # 5
        b"\n"  # 6
        b'{"text": 7}\n'  # 7
        b'{"text": "A good last line."}\n'  # 8
    )
    assert preprocess(source, tmp_path / "out", sp_model) == 0
    err = capsys.readouterr().err
    for line_no, reason in [
        (2, "invalid JSON"), (3, "missing key 'text'"), (4, "not valid UTF-8"),
        (5, "empty text in key 'text'"), (6, "empty line"),
        (7, "key 'text' is not a string (got int)"),
    ]:
        assert f"bad.jsonl:{line_no}: skipped line {line_no}: {reason}" in err
        assert f"line {line_no}: {reason}" in err.split("skipped lines:")[1]
    assert "done: 2 documents" in err and "6 skipped lines" in err
    assert len(read_documents(str(tmp_path / "out_text_document"))) == 2


def test_only_bad_lines_fails_without_output(tmp_path, sp_model, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text("not json\n", encoding="utf-8")
    assert preprocess(source, tmp_path / "out", sp_model) == 1
    assert "no usable documents in --input" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


def test_gzip_input_matches_plain(tmp_path, sp_model):
    plain = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    packed = tmp_path / "docs.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert preprocess(plain, tmp_path / "plain", sp_model, "--append-eod") == 0
    assert preprocess(packed, tmp_path / "packed", sp_model, "--append-eod") == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"plain_text_document{suffix}").read_bytes() == (
            tmp_path / f"packed_text_document{suffix}"
        ).read_bytes()


def test_two_workers_write_identical_files(tmp_path, sp_model):
    texts = [f"Document {i}: " + TEXTS[i % len(TEXTS)] * (1 + i % 3) for i in range(60)]
    source = write_jsonl(tmp_path / "docs.jsonl", texts)
    assert preprocess(source, tmp_path / "w1", sp_model, "--append-eod", "--workers", "1") == 0
    assert preprocess(
        source, tmp_path / "w2", sp_model, "--append-eod", "--workers", "2", "--chunk-size", "7"
    ) == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{suffix}").read_bytes() == (
            tmp_path / f"w2_text_document{suffix}"
        ).read_bytes()


def test_split_sentences_is_refused(tmp_path, sp_model, capsys):
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    with pytest.raises(SystemExit):
        preprocess(source, tmp_path / "out", sp_model, "--split-sentences")
    assert "--split-sentences/--keep-newlines are not supported" in capsys.readouterr().err


def test_command_line_from_repo_root(tmp_path, sp_model):
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    result = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(source),
         "--output-prefix", str(tmp_path / "cli"), "--tokenizer-type",
         "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model, "--log-interval", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "processed 2 documents" in result.stderr
    assert len(read_documents(str(tmp_path / "cli_text_document"))) == len(TEXTS)


def test_sigterm_leaves_no_temporary_files(tmp_path):
    ids = " ".join(str(i) for i in range(200))
    source = write_jsonl(tmp_path / "big.jsonl", [ids] * 100_000)
    process = subprocess.Popen(
        [sys.executable, "tools/preprocess_data.py", "--input", str(source), "--output-prefix",
         str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
         "--workers", "2"],
        cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 60
    while not list(tmp_path.glob("out*.tmp*")) and process.poll() is None:
        assert time.time() < deadline, "preprocess_data.py wrote no temporary file"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert not list(tmp_path.glob("*.tmp*"))
    assert not list(tmp_path.glob("out*"))


def _sigterm_disposition():
    return signal.getsignal(signal.SIGTERM)


def test_pool_workers_are_forked_with_the_default_sigterm(monkeypatch):
    """The tools' SIGTERM handler (cleanup, exit 143) is not inherited by pool workers: a
    Python handler cannot stop a worker blocked in C, and Pool.terminate() would wait forever
    (seen once in CI: a worker stuck on a futex after fork)."""
    import multiprocessing

    import _indexed

    monkeypatch.setattr(_indexed, "_TERMINATED", [])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        _indexed.exit_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is _indexed._terminate
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply(_sigterm_disposition) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_tokenizer_trains_on_long_lines(tmp_path):
    words = ["alpha", "bravo", "charlie", "délta", "echo", "foxtrot"]
    documents = [" ".join(words[(i + n) % len(words)] for i in range(7500)) for n in range(3)]
    assert all(len(doc.encode("utf-8")) > 1.3 * train_tokenizer.MAX_SENTENCE_BYTES
               for doc in documents)
    source = write_jsonl(tmp_path / "long.jsonl", documents + ["xyz"])
    prefix = tmp_path / "long_sp"
    assert train_tokenizer.main(["--input", str(source), "--output-prefix", str(prefix),
                                 "--vocab-size", "60"]) == 0
    processor = sentencepiece.SentencePieceProcessor(model_file=str(prefix) + ".model")
    pieces = {processor.id_to_piece(i) for i in range(processor.get_piece_size())}
    assert {"\u2581" + word for word in words} <= pieces


def test_split_long_line_keeps_characters_whole():
    pieces = list(train_tokenizer.split_long_line("ab cd\u00e9\u00e9\u00e9 " + "x" * 7, 5))
    assert pieces == ["ab", "cd\u00e9", "\u00e9\u00e9", "xxxxx", "xx"]


def test_merge_concatenates_documents(tmp_path, sp_model):
    first = write_jsonl(tmp_path / "a.jsonl", TEXTS[:2])
    second = write_jsonl(tmp_path / "b.jsonl", TEXTS[2:])
    assert preprocess(first, tmp_path / "a", sp_model, "--append-eod") == 0
    assert preprocess(second, tmp_path / "b", sp_model, "--append-eod") == 0
    assert merge_datasets.main([
        "--input", str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document"),
        "--output-prefix", str(tmp_path / "merged"),
    ]) == 0
    assert read_documents(str(tmp_path / "merged")) == (
        read_documents(str(tmp_path / "a_text_document"))
        + read_documents(str(tmp_path / "b_text_document"))
    )


def test_inspect_prints_stats_and_decodes(tmp_path, sp_model, capsys):
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    assert preprocess(source, tmp_path / "out", sp_model) == 0
    capsys.readouterr()
    assert inspect_dataset.main([
        "--data-prefix", str(tmp_path / "out_text_document"), "--sample", "1",
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
    ]) == 0
    out = capsys.readouterr().out
    lengths = [len(doc) for doc in read_documents(str(tmp_path / "out_text_document"))]
    assert f"documents: {len(TEXTS)}" in out
    assert f"tokens:    {sum(lengths)}" in out
    assert f"max {max(lengths)}" in out
    assert f"text: {TEXTS[1]}" in out
