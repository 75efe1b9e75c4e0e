"""Bad inputs to tools/preprocess_data.py, merge_datasets.py and inspect_dataset.py: each gives one
``error:`` line naming the problem and the flag that fixes it, exit status 2, no traceback, and
leaves no output or temporary file behind (an input file is never overwritten)."""

import gzip
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

import inspect_dataset
import merge_datasets
import preprocess_data
from _indexed import dataset_files
from conftest import REPO_ROOT

TEXTS = ["The river does not hurry, yet it reaches the sea.",
         "Bees carry pollen from one flower to the next."]
SP = ["--tokenizer-type", "GPTSentencePieceTokenizer"]
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
NOISE = numpy.random.default_rng(0).bytes(500)  # neither gzip nor index magic


def run_tool(main, argv, capsys):
    """``(exit status, stderr)`` of a tool's ``main``, whether it returns or exits."""
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as err:
        code = err.code
    return code, capsys.readouterr().err


def assert_one_error(err: str, words) -> None:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    for word in words:
        assert word in errors[0], (word, errors[0])


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def files_of(prefix: Path):
    return [Path(path) for path in dataset_files(str(prefix))]


def copy_dataset(prefix: Path, to: Path, sidecar: bool = True) -> Path:
    to.parent.mkdir(parents=True, exist_ok=True)
    for source, target in zip(files_of(prefix), files_of(to)):
        if source.exists() and (sidecar or source.suffix != ".json"):
            shutil.copyfile(source, target)
    return to


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, sp_model):
    """Small datasets by prefix name: ``sp`` (GPTSentencePieceTokenizer), ``sp_other_type``
    (SentencePieceTokenizer, same model), ``null`` (NullTokenizer, 1000 ids, uint16 like
    ``sp``), ``null_eod5`` (the same with --null-tokenizer-eod-id 5), ``null_int32`` (70000 ids);
    ``*_bare`` are copies without the tokenizer sidecar."""
    root = tmp_path_factory.mktemp("datasets")
    text = write_lines(root / "text.jsonl", [json.dumps({"text": t}) for t in TEXTS])
    ids = write_lines(root / "ids.jsonl", [json.dumps({"text": "1 2 3"}), '{"text": "4 999"}'])
    made = {}
    for name, source, flags in [
        ("sp", text, SP + ["--tokenizer-model", sp_model]),
        ("sp_other_type", text, ["--tokenizer-type", "SentencePieceTokenizer",
                                 "--tokenizer-model", sp_model]),
        ("null", ids, NULL),
        ("null_eod5", ids, NULL + ["--null-tokenizer-eod-id", "5"]),
        ("null_int32", ids, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000"]),
    ]:
        assert preprocess_data.main(["--input", str(source), "--output-prefix", str(root / name),
                                     "--append-eod", *flags]) == 0
        made[name] = root / f"{name}_text_document"
        made[name + "_bare"] = copy_dataset(made[name], root / f"{name}_bare", sidecar=False)
    return made


# ---------------------------------------------------------------- preprocess_data.py: bad lines


@pytest.mark.parametrize("lines, flags, skipped", [
    pytest.param([r'{"text": "A \ud800 lone high surrogate."}',
                  r'{"text": "A \udc80 lone low one."}'], SP,
                 {1: "key 'text' holds a lone surrogate ('\\ud800' at character 2)",
                  2: "key 'text' holds a lone surrogate ('\\udc80' at character 2)"},
                 id="lone-surrogates"),
    pytest.param(['{"text": "1 two 3"}', '{"text": "1.5"}', '{"text": "0x10"}'], NULL,
                 {1: "key 'text': NullTokenizer text must be whitespace-separated integers, "
                     "got 'two'",
                  2: "key 'text': NullTokenizer text must be whitespace-separated integers, "
                     "got '1.5'",
                  3: "key 'text': NullTokenizer text must be whitespace-separated integers, "
                     "got '0x10'"}, id="null-not-integers"),
    pytest.param(['{"text": "5 1000"}', '{"text": "-1 4"}'], NULL,
                 {1: "key 'text': token id 1000 is outside [0, 1000) (raise --vocab-size)",
                  2: "key 'text': token id -1 is outside [0, 1000) (raise --vocab-size)"},
                 id="null-out-of-range"),
])
def test_unusable_lines_are_skipped_by_line_number(tmp_path, sp_model, capsys, lines, flags,
                                                   skipped):
    good = {"GPTSentencePieceTokenizer": TEXTS[0], "NullTokenizer": "0 7 999"}[flags[1]]
    source = write_lines(tmp_path / "in.jsonl", lines + [json.dumps({"text": good})])
    code, err = run_tool(preprocess_data.main, [
        "--input", source, "--output-prefix", tmp_path / "out" / "x", *flags,
        "--tokenizer-model", sp_model,
    ], capsys)
    assert code == 0, err
    assert "Traceback" not in err
    for line_no, reason in skipped.items():
        assert f"in.jsonl:{line_no}: skipped line {line_no}: {reason}" in err, err
    assert "done: 1 documents" in err and f"{len(skipped)} skipped lines" in err
    assert sorted(os.listdir(tmp_path / "out")) == [
        "x_text_document.bin", "x_text_document.idx", "x_text_document.tokenizer.json"]


# ------------------------------------------------------------- preprocess_data.py: fatal errors


def gzip_bytes(count: int) -> bytes:
    return gzip.compress("".join(json.dumps({"text": f"{TEXTS[i % 2]} {i}"}) + "\n"
                                 for i in range(count)).encode())


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("name, data, flags, words", [
    pytest.param("in.jsonl.gz", NOISE, SP,
                 ["--input", "in.jsonl.gz", "cannot be read at line 1", "BadGzipFile",
                  "corrupt, truncated or not gzip"], id="random-bytes-gz"),
    pytest.param("in.jsonl.gz", gzip_bytes(3000)[:-200], SP,
                 ["--input", "in.jsonl.gz", "cannot be read at line", "EOFError",
                  "corrupt, truncated or not gzip"], id="truncated-gz"),
    pytest.param("in.jsonl.gz", b'{"text": "plain, not gzip"}\n', SP,
                 ["--input", "cannot be read at line 1", "Not a gzipped file"], id="plain-as-gz"),
    pytest.param("in.jsonl", b'{"text": "1 2"}\n', ["--tokenizer-type", "NullTokenizer"],
                 ["--tokenizer-type NullTokenizer", "--vocab-size None",
                  "needs a positive --vocab-size"], id="null-without-vocab-size"),
    pytest.param("in.jsonl", b'{"text": "x"}\n', SP + ["--tokenizer-model", "missing.model"],
                 ["--tokenizer-model 'missing.model'", "does not exist"], id="missing-model"),
    pytest.param("in.jsonl", b'{"text": "x"}\n', SP + ["--tokenizer-model", "in.jsonl"],
                 ["--tokenizer-model", "in.jsonl", "could not parse ModelProto"],
                 id="model-not-sentencepiece"),
])
def test_fatal_input_errors_leave_nothing_behind(tmp_path, monkeypatch, sp_model, capsys, name,
                                                 data, flags, words, workers):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(data)
    model = [] if "--tokenizer-model" in flags or "NullTokenizer" in flags else [
        "--tokenizer-model", sp_model]
    code, err = run_tool(preprocess_data.main, [
        "--input", name, "--output-prefix", tmp_path / "out" / "x", "--workers", workers,
        "--chunk-size", "16", *flags, *model,
    ], capsys)
    assert code == 2, err
    assert_one_error(err, words)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_preprocess_records_its_tokenizer(datasets, sp_model):
    record = json.loads(Path(dataset_files(str(datasets["sp"]))[2]).read_text())
    assert record == {
        "tokenizer_type": "GPTSentencePieceTokenizer",
        "tokenizer_model": os.path.abspath(sp_model),
        "tokenizer_model_sha256": hashlib.sha256(Path(sp_model).read_bytes()).hexdigest(),
        "vocab_size": 1000,
    }
    record = json.loads(Path(dataset_files(str(datasets["null"]))[2]).read_text())
    assert record == {"tokenizer_type": "NullTokenizer", "tokenizer_model": None,
                      "tokenizer_model_sha256": None, "vocab_size": 1001}


def test_command_line_error_is_one_line(tmp_path):
    (tmp_path / "in.jsonl.gz").write_bytes(b"\x1f\x8b not really gzip")
    result = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "in.jsonl.gz"),
         "--output-prefix", str(tmp_path / "x"), *NULL],
        cwd=REPO_ROOT, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 2
    assert_one_error(result.stderr, ["--input", "gzip"])
    assert os.listdir(tmp_path) == ["in.jsonl.gz"]


# ------------------------------------------------------- merge_datasets.py: output aliases input


@pytest.mark.parametrize("inputs, output", [
    (["d/a"], "./d/a"),
    (["./d/a"], "d/a"),
    (["d/a"], "d/../d/a"),
    (["d/a"], "link/a"),  # link -> d
    (["d/b", "d/a"], "alias"),  # alias.idx -> d/a.idx
])
def test_merge_never_writes_over_an_input(tmp_path, monkeypatch, capsys, datasets, inputs,
                                          output):
    monkeypatch.chdir(tmp_path)
    copy_dataset(datasets["sp"], tmp_path / "d" / "a")
    copy_dataset(datasets["sp"], tmp_path / "d" / "b")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    (tmp_path / "alias.idx").symlink_to(tmp_path / "d" / "a.idx")
    before = {path: path.read_bytes() for path in (tmp_path / "d").iterdir()}
    code, err = run_tool(merge_datasets.main, ["--input", *inputs, "--output-prefix", output],
                         capsys)
    assert code == 2
    assert_one_error(err, [f"--output-prefix {output!r} would overwrite the input file",
                           "choose an --output-prefix"])
    assert {path: path.read_bytes() for path in (tmp_path / "d").iterdir()} == before


# ---------------------------------------------- merge/inspect: damaged or empty .idx/.bin files


def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def overwrite(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def make_empty(prefix: Path) -> None:
    for path in files_of(prefix):
        path.unlink(missing_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=numpy.uint16)
    builder.finalize(str(prefix) + ".idx")


DAMAGE = {
    "idx-truncated-header": (lambda p: truncate(p.with_suffix(".idx"), 20),
                             [".idx is truncated (20 bytes, shorter than the 34-byte header)"]),
    "idx-truncated-arrays": (lambda p: truncate(p.with_suffix(".idx"), 60),
                             [".idx is 60 bytes but its header (2 sequences, 3 document indices) "
                              "needs 82"]),
    "idx-random-bytes": (lambda p: p.with_suffix(".idx").write_bytes(NOISE),
                         [".idx is not a megatron-core index (starts with"]),
    "idx-bad-version": (lambda p: p.with_suffix(".idx").write_bytes(
        b"MMIDIDX\x00\x00" + bytes([7]) + bytes(7) + bytes([4]) + bytes(16)),
        ["has index version 7 and dtype code 4"]),
    "idx-bad-offset": (lambda p: overwrite(p.with_suffix(".idx"), 34 + 2 * 4 + 8,
                                           struct.pack("<q", 10 ** 9)),  # 2nd sequence pointer
                       ["has inconsistent document indices, sequence lengths or sequence offsets"]),
    "bin-short": (lambda p: truncate(p.with_suffix(".bin"), 10),
                  [".bin is 10 bytes but", ".idx says", "tokens x 2 bytes"]),
    "bin-missing": (lambda p: p.with_suffix(".bin").unlink(), ["there is no", ".bin"]),
    "no-documents": (make_empty, ["holds no tokens (0 documents"]),
}


def damaged_copy(datasets, tmp_path: Path, damage: str) -> Path:
    prefix = copy_dataset(datasets["sp"], tmp_path / "in" / "bad")
    DAMAGE[damage][0](prefix)
    return prefix


@pytest.mark.parametrize("damage", DAMAGE)
def test_inspect_refuses_damaged_dataset(tmp_path, capsys, datasets, damage):
    prefix = damaged_copy(datasets, tmp_path, damage)
    code, err = run_tool(inspect_dataset.main, ["--data-prefix", prefix], capsys)
    assert code == 2
    assert_one_error(err, [f"--data-prefix {str(prefix)!r}", *DAMAGE[damage][1],
                           "re-create it with tools/preprocess_data.py or give another "
                           "--data-prefix"])


@pytest.mark.parametrize("damage", DAMAGE)
def test_merge_refuses_damaged_input(tmp_path, capsys, datasets, damage):
    prefix = damaged_copy(datasets, tmp_path, damage)
    code, err = run_tool(merge_datasets.main, [
        "--input", datasets["sp"], prefix, "--output-prefix", tmp_path / "out" / "merged"], capsys)
    assert code == 2
    assert_one_error(err, [f"--input {str(prefix)!r}", *DAMAGE[damage][1],
                           "give another --input"])
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


@pytest.mark.parametrize("argv, words", [
    (["--sample", "2"], ["--sample 2 is outside [0, 2)"]),
    (["--sample", "0", *NULL[:2], "--vocab-size", "5"],
     ["holds token id", "has 6 ids", "--tokenizer-type/--tokenizer-model/--vocab-size"]),
    (["--sample", "0", *NULL[:2]], ["--vocab-size None", "needs a positive --vocab-size"]),
])
def test_inspect_refuses_bad_flags(capsys, datasets, argv, words):
    code, err = run_tool(inspect_dataset.main, ["--data-prefix", datasets["sp"], *argv], capsys)
    assert code == 2
    assert_one_error(err, words)


# ------------------------------------------------------------ merge_datasets.py: tokenizers


@pytest.mark.parametrize("names, code, named, words", [
    (["sp", "null"], 2, [0, 1], ["were made by different tokenizers", "GPTSentencePieceTokenizer",
                                 "vocab size 1000 vs NullTokenizer, vocab size 1001",
                                 "--tokenizer-type/--tokenizer-model/--vocab-size"]),
    (["sp", "sp_other_type"], 2, [0, 1], ["different tokenizers", "vs SentencePieceTokenizer"]),
    (["null", "null_eod5"], 2, [0, 1], ["different tokenizers", "vocab size 1001 vs Null",
                                        "vocab size 1001, --null-tokenizer-eod-id 5"]),
    (["null", "sp_bare", "null_int32"], 2, [0, 2], ["different tokenizers", "vocab size 70001"]),
    (["sp_bare", "null_int32_bare"], 2, [0, 1], ["different token dtypes", ": uint16", ": int32",
                                                 "--tokenizer-type/--tokenizer-model"]),
    (["sp", "broken_sidecar"], 2, [1], ["tokenizer.json is not a tokenizer record", "delete it"]),
    (["sp_bare", "null_bare"], 0, [], []),  # no sidecars: only the dtypes can be compared
    (["sp", "sp_bare"], 0, [], []),
    (["sp", "sp"], 0, [], []),
])
def test_merge_checks_tokenizers(tmp_path, capsys, datasets, names, code, named, words):
    broken = copy_dataset(datasets["sp"], tmp_path / "broken_sidecar")
    Path(dataset_files(str(broken))[2]).write_text("{not json")
    prefixes = [broken if name == "broken_sidecar" else datasets[name] for name in names]
    output = tmp_path / "out" / "merged"
    got, err = run_tool(merge_datasets.main, ["--input", *prefixes, "--output-prefix", output],
                        capsys)
    assert got == code, err
    if code:
        assert_one_error(err, [str(prefixes[i]) for i in named] + words)
        assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
        return
    sidecars = [Path(dataset_files(str(prefix))[2]) for prefix in prefixes + [output]]
    if all(path.exists() for path in sidecars[:-1]):
        assert sidecars[-1].read_text() == sidecars[0].read_text()
    else:
        assert not sidecars[-1].exists()
    assert sorted(os.listdir(tmp_path / "out")) == sorted(p.name for p in files_of(output)
                                                          if p.exists())


# ------------------------------------------------------------ HuggingFace tokenizer directories


def save_hf_tokenizer(path: Path, **special_tokens) -> Path:
    """A word-level HuggingFace tokenizer over the words of ``TEXTS``, saved to ``path``."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({word for text in TEXTS for word in text.replace(",", " ").split()})
    vocab = {word: i for i, word in enumerate(["<unk>", "</s>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                            **special_tokens).save_pretrained(str(path))
    return path


def test_append_eod_needs_an_eod_id(tmp_path, capsys):
    model = save_hf_tokenizer(tmp_path / "no_eos")
    source = write_lines(tmp_path / "docs.jsonl", [json.dumps({"text": t}) for t in TEXTS])
    code, err = run_tool(preprocess_data.main, [
        "--input", source, "--output-prefix", tmp_path / "out" / "x", "--append-eod",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model], capsys)
    assert code == 2
    assert_one_error(err, ["--append-eod", f"--tokenizer-model {str(model)!r}",
                           "no end-of-document id"])
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_hf_tokenizer_hash_covers_only_tokenizer_files(tmp_path, capsys):
    source = write_lines(tmp_path / "docs.jsonl", [json.dumps({"text": t}) for t in TEXTS])
    prefixes = []
    for name, config in (("a", {"hidden_size": 8}), ("b", {"hidden_size": 16})):
        model = save_hf_tokenizer(tmp_path / name, eos_token="</s>")
        (model / "config.json").write_text(json.dumps(config))
        if name == "b":
            (model / "model.safetensors").write_bytes(NOISE * 1000)
        code, err = run_tool(preprocess_data.main, [
            "--input", source, "--output-prefix", tmp_path / name, "--append-eod",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model], capsys)
        assert code == 0, err
        prefixes.append(tmp_path / f"{name}_text_document")
    first, second = (json.loads(Path(dataset_files(str(p))[2]).read_text()) for p in prefixes)
    assert first["tokenizer_model_sha256"] == second["tokenizer_model_sha256"]
    code, err = run_tool(merge_datasets.main, ["--input", *prefixes, "--output-prefix",
                                               tmp_path / "merged"], capsys)
    assert code == 0, err
