"""Tokenize a jsonl corpus into megatron-core ``IndexedDataset`` files (Megatron-LM interface).

Writes ``{output_prefix}_{key}_document.bin/.idx`` per ``--json-keys`` key. Lines that cannot be
used (invalid JSON, not UTF-8, missing key, empty text) are skipped and reported with their
1-based line number; the output order never depends on ``--workers``.
"""

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import BinaryIO, Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ulysses.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

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
        texts[key] = record[key]
    return texts, ""


class Encoder:
    """Tokenizes lines in pool workers. The tokenizer is a class attribute built once per process
    by ``initializer``, so it is never pickled along with each task."""

    tokenizer = None

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer(
            self.args.tokenizer_type, self.args.tokenizer_model, self.args.vocab_size
        )

    def encode(self, numbered_line: Tuple[int, bytes]) -> Tuple[int, Optional[Dict], str, int]:
        """``(line_no, ids per key or None, skip reason, input bytes)``."""
        line_no, raw = numbered_line
        texts, reason = parse_json_line(raw, self.args.json_keys)
        if texts is None:
            return line_no, None, reason, len(raw)
        ids = {}
        for key, text in texts.items():
            ids[key] = self.tokenizer.tokenize(text)
            if not ids[key]:
                return line_no, None, f"text in key {key!r} has no tokens", len(raw)
            if self.args.append_eod:
                ids[key].append(self.tokenizer.eod)
        return line_no, ids, "", len(raw)


def numbered_lines(path: str) -> Iterator[Tuple[int, bytes]]:
    with open_input(path) as stream:
        yield from enumerate(stream, start=1)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, optionally .gz compressed")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group.add_argument("--split-sentences", action="store_true", help="not supported")
    group.add_argument("--keep-newlines", action="store_true", help="not supported")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None, help="sentencepiece model / HF dir")
    group.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
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


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    # Imported after argument checks: importing megatron.core takes seconds.
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    encoder = Encoder(args)
    encoder.initializer()
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)

    # Write under temporary names so an interrupted run never leaves a readable partial dataset.
    final_paths = {
        key: (get_bin_path(output_prefix_for_key(args.output_prefix, key)),
              get_idx_path(output_prefix_for_key(args.output_prefix, key)))
        for key in args.json_keys
    }
    tmp_suffix = f".tmp{os.getpid()}"
    builders = {
        key: IndexedDatasetBuilder(bin_path + tmp_suffix, dtype=dtype)
        for key, (bin_path, _) in final_paths.items()
    }

    pool = None
    if args.workers > 1:
        pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
        results = pool.imap(encoder.encode, numbered_lines(args.input), args.chunk_size)
    else:
        results = map(encoder.encode, numbered_lines(args.input))

    start = time.time()
    num_docs = num_tokens = num_bytes = 0
    skipped: List[Tuple[int, str]] = []
    try:
        for line_no, ids, reason, size in results:
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

    for key, (bin_path, idx_path) in final_paths.items():
        builders[key].finalize(idx_path + tmp_suffix)
        for path in (bin_path, idx_path):
            if num_docs > 0:
                os.replace(path + tmp_suffix, path)
            else:
                os.remove(path + tmp_suffix)

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
