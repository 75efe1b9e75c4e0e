"""tools/preprocess_data.py, merge_datasets.py and inspect_dataset.py against megatron-core's
``IndexedDataset`` reader."""

import gzip
import itertools
import json
import os
import re
import signal
import socket
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
    assert preprocess(source, tmp_path / "out", sp_model) == 2
    err = capsys.readouterr().err
    assert "no usable documents in --input" in err and "1 skipped lines" in err
    assert "done:" not in err
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


def test_split_sentences_without_nltk_says_what_to_install(tmp_path, sp_model, capsys,
                                                         monkeypatch):
    monkeypatch.setitem(sys.modules, "nltk", None)  # what `import nltk` sees without nltk
    monkeypatch.setitem(sys.modules, "nltk.tokenize", None)
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    assert preprocess(source, tmp_path / "out", sp_model, "--split-sentences") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --split-sentences needs nltk")
    assert "pip install nltk && python -m nltk.downloader punkt_tab" in err[0]
    assert not list(tmp_path.glob("out*"))


class PeriodSplitter:
    """Stands in for nltk punkt (not installed here): a sentence ends at '.' and a space."""

    @staticmethod
    def tokenize(text):
        return re.split(r"(?<=\.) ", text)


def test_split_sentences_stores_one_sequence_per_sentence(tmp_path, sp_model, monkeypatch):
    monkeypatch.setattr(preprocess_data, "sentence_splitter", lambda lang, keep: PeriodSplitter())
    texts = [TEXTS[0] + " " + TEXTS[1], TEXTS[3], " ".join([TEXTS[1], TEXTS[3], TEXTS[0]])]
    source = write_jsonl(tmp_path / "docs.jsonl", texts)
    assert preprocess(source, tmp_path / "out", sp_model, "--split-sentences", "--append-eod") == 0
    assert not list(tmp_path.glob("out_text_document*"))
    dataset = IndexedDataset(str(tmp_path / "out_text_sentence"))
    processor = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    sentences = [[processor.encode_as_ids(s) for s in PeriodSplitter.tokenize(t)] for t in texts]
    for doc in sentences:
        doc[-1] = doc[-1] + [processor.eos_id()]  # EOD counts in the last sentence
    assert [dataset[i].tolist() for i in range(len(dataset))] == [s for d in sentences for s in d]
    assert dataset.document_indices.tolist() == [0, *itertools.accumulate(map(len, sentences))]
    assert list(map(len, sentences)) == [2, 1, 3]


@pytest.mark.parametrize("flags, order", [
    (["--partitions", "2"], [0, 2, 4, 6, 1, 3, 5]),  # lines dealt round robin, then concatenated
    (["--partitions", "3"], [0, 3, 6, 1, 4, 2, 5]),
    (["--partitions", "3", "--keep-sequential-samples"], [0, 1, 2, 3, 4, 5, 6]),
])
def test_partitions_give_megatron_lm_document_order(tmp_path, sp_model, flags, order):
    texts = [f"Document {i}: " + TEXTS[i % len(TEXTS)] for i in range(7)]
    write_jsonl(tmp_path / "a.jsonl", texts[:3])  # the glob's files are read in sorted order
    write_jsonl(tmp_path / "b.jsonl", texts[3:])
    whole = write_jsonl(tmp_path / "whole.jsonl", [texts[i] for i in order])
    assert preprocess(tmp_path / "[ab].jsonl", tmp_path / "parts", sp_model, *flags,
                      "--workers", "2", "--chunk-size", "2") == 0
    assert preprocess(whole, tmp_path / "whole", sp_model) == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"parts_text_document{suffix}").read_bytes() == (
            tmp_path / f"whole_text_document{suffix}").read_bytes()


def test_find_optimal_num_workers_times_and_writes_nothing(tmp_path, sp_model, capsys):
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS * 3)
    assert preprocess(source, tmp_path / "out", sp_model, "--find-optimal-num-workers",
                      "--workers-to-check", "1", "2", "--max-documents", "5") == 0
    captured = capsys.readouterr()
    assert "1 workers: " in captured.err and "2 workers: " in captured.err
    assert captured.err.count("over 5 lines") == 2
    assert re.search(r"The most optimal num of workers is [12] ", captured.out)
    assert not list(tmp_path.glob("out*"))


def test_byte_order_mark_keeps_the_first_document(tmp_path, sp_model, capsys):
    plain = write_jsonl(tmp_path / "plain.jsonl", TEXTS)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert preprocess(marked, tmp_path / "marked", sp_model) == 0
    assert "skipped" not in capsys.readouterr().err.split("done:")[0]
    assert preprocess(plain, tmp_path / "plain", sp_model) == 0
    assert read_documents(str(tmp_path / "marked_text_document")) == read_documents(
        str(tmp_path / "plain_text_document"))


def test_stale_temporary_files_of_dead_runs_are_removed(tmp_path, sp_model, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    target = tmp_path / "out_text_document.bin"
    stale = tmp_path / f"{target.name}.tmp{dead.pid}.{host}"
    running = tmp_path / f"{target.name}.tmp{os.getppid()}.{host}"  # a live process's
    elsewhere = tmp_path / f"{target.name}.tmp{dead.pid}.other-host"  # maybe live there
    for path in (stale, running, elsewhere):
        path.write_bytes(b"partial")
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    assert preprocess(source, tmp_path / "out", sp_model) == 0
    assert not stale.exists() and running.exists() and elsewhere.exists()
    assert f"removed {stale}: a temporary file of a run (pid {dead.pid})" in \
        capsys.readouterr().err


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


def test_a_glob_input_names_the_partitions_it_needs(tmp_path, sp_model, capsys):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"text": "one line"}\n')
    with pytest.raises(SystemExit) as exit_:
        preprocess_data.main(["--input", str(tmp_path / "*.jsonl"), "--output-prefix",
                              str(tmp_path / "out"), "--tokenizer-type",
                              "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--input '{tmp_path / '*.jsonl'}' is not a file (it matches 2 files: a glob pattern " \
           "is read with --partitions 2 or more, as in Megatron-LM)" in err, err
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl"]
