"""Tokenize a jsonl corpus into megatron-core ``IndexedDataset`` files (Megatron-LM interface).

Writes ``{output_prefix}_{key}_document.bin/.idx`` per ``--json-keys`` key. Lines that cannot be
used (invalid JSON, not UTF-8, missing key, empty text, a lone surrogate, for ``NullTokenizer``
anything but ids in ``[0, --vocab-size)``) are skipped and reported with their 1-based line
number; the output order never depends on ``--workers``. ``{prefix}.tokenizer.json`` next to each
dataset records the tokenizer, so that merge_datasets.py can refuse to mix tokenizers.
"""

import argparse
import gzip
import json
import multiprocessing
import os
import re
import sys
import time
import zlib
from pathlib import Path
from typing import BinaryIO, Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ulysses.data.tokenizers import (  # noqa: E402
    add_tokenizer_arguments, check_for_training)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _indexed import (  # noqa: E402
    Staged,
    ToolError,
    dataset_files,
    exit_if_terminated,
    exit_on_sigterm,
    load_tokenizer,
    reports_errors,
    tokenizer_record,
    write_sidecar,
)

# Skipped lines listed individually in the final summary; all of them go to stderr as they occur.
SUMMARY_LIST_LIMIT = 20


def open_input(path: str) -> BinaryIO:
    """Binary reader for ``.jsonl``/``.txt`` or their ``.gz`` versions (bytes, so that invalid
    UTF-8 is reported per line instead of aborting the whole read)."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def parse_json_line(raw: bytes, json_keys: List[str]) -> Tuple[Optional[Dict[str, str]], str]:
    """``(texts per key, "")`` for a usable line, else ``(None, reason)``."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not valid UTF-8 ({err.reason} at byte {err.start})"
    if not line.strip():
        return None, "empty line"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return None, f"invalid JSON ({err.msg} at column {err.colno})"
    if not isinstance(record, dict):
        return None, f"JSON value is a {type(record).__name__}, not an object"
    texts = {}
    for key in json_keys:
        if key not in record:
            return None, f"missing key {key!r} (set --json-keys)"
        if not isinstance(record[key], str):
            return None, f"key {key!r} is not a string (got {type(record[key]).__name__})"
        if not record[key].strip():
            return None, f"empty text in key {key!r}"
        try:
            record[key].encode("utf-8")
        except UnicodeEncodeError as err:  # JSON escapes such as "\ud800" decode to lone surrogates
            return None, (f"key {key!r} holds a lone surrogate "
                          f"({record[key][err.start]!r} at character {err.start})")
        texts[key] = record[key]
    return texts, ""


def null_tokenizer_problem(text: str, vocab_size: int) -> str:
    """Why ``text`` is not NullTokenizer input (whitespace-separated ids below ``vocab_size``),
    "" when it is."""
    for word in text.split():
        if not re.fullmatch(r"[+-]?[0-9]+", word):
            return f"NullTokenizer text must be whitespace-separated integers, got {word[:20]!r}"
        if not 0 <= int(word) < vocab_size:
            return f"token id {int(word)} is outside [0, {vocab_size}) (raise --vocab-size)"
    return ""


class Encoder:
    """Tokenizes lines in pool workers. The tokenizer is a class attribute built once per process
    by ``initializer``, so it is never pickled along with each task."""

    tokenizer = None

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = load_tokenizer(self.args)

    def encode(self, numbered_line: Tuple[int, bytes]) -> Tuple[int, Optional[Dict], str, int]:
        """``(line_no, ids per key or None, skip reason, input bytes)``."""
        line_no, raw = numbered_line
        texts, reason = parse_json_line(raw, self.args.json_keys)
        if texts is None:
            return line_no, None, reason, len(raw)
        ids = {}
        for key, text in texts.items():
            if self.args.tokenizer_type == "NullTokenizer":
                reason = null_tokenizer_problem(text, self.args.vocab_size)
                if reason:
                    return line_no, None, f"key {key!r}: {reason}", len(raw)
            ids[key] = self.tokenizer.tokenize(text)
            if not ids[key]:
                return line_no, None, f"text in key {key!r} has no tokens", len(raw)
            if self.args.append_eod:
                ids[key].append(self.tokenizer.eod)
        return line_no, ids, "", len(raw)


def numbered_lines(path: str) -> Iterator[Tuple[int, bytes]]:
    """Lines of ``path``; a file that cannot be read to its end (a corrupt or truncated ``.gz``)
    raises one ``ToolError``."""
    line_no = 0
    try:
        with open_input(path) as stream:
            for line_no, raw in enumerate(stream, start=1):
                yield line_no, raw
    except (OSError, EOFError, zlib.error) as err:
        hint = ("it is corrupt, truncated or not gzip: re-compress or re-download it, or pass "
                "the uncompressed file as --input") if path.endswith(".gz") else "check the file"
        raise ToolError(f"--input {path!r} cannot be read at line {line_no + 1} "
                        f"({type(err).__name__}: {err}); {hint}") from None


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, optionally .gz compressed")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group.add_argument("--split-sentences", action="store_true", help="not supported")
    group.add_argument("--keep-newlines", action="store_true", help="not supported")
    group = parser.add_argument_group("tokenizer")
    add_tokenizer_arguments(group, type_required=True)
    group.add_argument("--append-eod", action="store_true", help="append EOD to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True)
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--chunk-size", type=int, default=64, help="lines per worker task")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between logs")
    args = parser.parse_args(argv)
    if args.split_sentences or args.keep_newlines:
        parser.error(
            "--split-sentences/--keep-newlines are not supported (they need nltk); documents are "
            "stored whole, drop the flag"
        )
    for flag, value in (("--workers", args.workers), ("--chunk-size", args.chunk_size),
                        ("--log-interval", args.log_interval)):
        if value < 1:
            parser.error(f"{flag} must be >= 1 (got {value})")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input!r} is not a file")
    return args


def output_prefix_for_key(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def add_documents(args: argparse.Namespace, encoder: Encoder, builders: Dict,
                  start: float) -> Tuple[int, int, List[Tuple[int, str]]]:
    """Tokenize ``--input`` into ``builders`` (one per key); ``(documents, tokens, skipped)``."""
    pool = None
    if args.workers > 1:
        pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
        results = pool.imap(encoder.encode, numbered_lines(args.input), args.chunk_size)
    else:
        results = map(encoder.encode, numbered_lines(args.input))

    num_docs = num_tokens = num_bytes = 0
    skipped: List[Tuple[int, str]] = []
    try:
        for line_no, ids, reason, size in results:
            exit_if_terminated()
            num_bytes += size
            if ids is None:
                skipped.append((line_no, reason))
                print(f"{args.input}:{line_no}: skipped line {line_no}: {reason}", file=sys.stderr)
                continue
            for key, doc_ids in ids.items():
                builders[key].add_document(doc_ids, [len(doc_ids)])
            num_docs += 1
            num_tokens += sum(len(doc_ids) for doc_ids in ids.values())
            if num_docs % args.log_interval == 0:
                elapsed = max(time.time() - start, 1e-9)
                print(
                    f"processed {num_docs} documents, {num_tokens} tokens "
                    f"({num_docs / elapsed:.1f} docs/s, {num_tokens / elapsed:.0f} tokens/s, "
                    f"{num_bytes / elapsed / 1024 ** 2:.2f} MB/s)",
                    file=sys.stderr,
                )
    finally:
        # Every result has been consumed unless we are unwinding an error, so nothing is lost.
        if pool is not None:
            pool.terminate()
            pool.join()
    return num_docs, num_tokens, skipped


@reports_errors
def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    exit_on_sigterm()
    # Imported after argument checks: importing megatron.core takes seconds.
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    encoder = Encoder(args)
    encoder.initializer()
    if args.append_eod:
        try:
            check_for_training(encoder.tokenizer, args.tokenizer_type, args.tokenizer_model)
        except ValueError as err:
            raise ToolError(f"--append-eod: {err}") from None
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    record = tokenizer_record(args, encoder.tokenizer)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)

    # Write under temporary names so that an interrupted or failed run never leaves a readable
    # partial dataset, nor any temporary file.
    files = {key: dataset_files(output_prefix_for_key(args.output_prefix, key))
             for key in args.json_keys}
    start = time.time()
    with Staged(path for paths in files.values() for path in paths) as staged:
        builders = {key: IndexedDatasetBuilder(staged.tmp[bin_path], dtype=dtype)
                    for key, (bin_path, _, _) in files.items()}
        num_docs, num_tokens, skipped = add_documents(args, encoder, builders, start)
        for key, (_, idx_path, sidecar_path) in files.items():
            builders[key].finalize(staged.tmp[idx_path])
            write_sidecar(staged.tmp[sidecar_path], record)
        if num_docs > 0:
            staged.publish()

    elapsed = max(time.time() - start, 1e-9)
    print(
        f"done: {num_docs} documents, {num_tokens} tokens, {len(skipped)} skipped lines, "
        f"{elapsed:.1f}s ({num_tokens / elapsed:.0f} tokens/s) -> "
        + ", ".join(output_prefix_for_key(args.output_prefix, key) for key in args.json_keys),
        file=sys.stderr,
    )
    if skipped:
        listed = "; ".join(f"line {no}: {reason}" for no, reason in skipped[:SUMMARY_LIST_LIMIT])
        more = len(skipped) - SUMMARY_LIST_LIMIT
        if more > 0:
            listed += f"; ... and {more} more (listed above)"
        print(f"skipped lines: {listed}", file=sys.stderr)
    if num_docs == 0:
        print(
            f"error: no usable documents in --input {args.input!r} for --json-keys "
            f"{' '.join(args.json_keys)}; nothing written",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
