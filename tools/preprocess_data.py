"""Tokenize a jsonl corpus into megatron-core ``IndexedDataset`` files (Megatron-LM interface).

Writes ``{output_prefix}_{key}_document.bin/.idx`` per ``--json-keys`` key
(``..._sentence`` with ``--split-sentences``: one sequence per sentence), byte for byte what
Megatron-LM's tools/preprocess_data.py writes. Lines that cannot be used (invalid JSON, not
UTF-8, missing key, empty text, a lone surrogate, for ``NullTokenizer`` anything but ids in
``[0, --vocab-size)``) are skipped and reported with their 1-based line number; the output order
never depends on ``--workers``. ``--partitions N`` gives Megatron-LM's document order (lines dealt
round robin to N partitions, written partition after partition; in input order with
``--keep-sequential-samples``) without its partition files. ``{prefix}.tokenizer.json`` next to
each dataset records the tokenizer, so that merge_datasets.py can refuse to mix tokenizers.
"""

import argparse
import codecs
import contextlib
import glob
import gzip
import itertools
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

from megatron_ulysses.data.tokenizer_flags import add_tokenizer_arguments  # noqa: E402
from megatron_ulysses.data.tokenizers import check_for_training  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _indexed import (  # noqa: E402
    Staged,
    ToolError,
    dataset_files,
    exit_if_terminated,
    exit_on_sigterm,
    load_tokenizer,
    reports_errors,
)
from megatron_ulysses.data.sidecar import tokenizer_record, write_sidecar  # noqa: E402

# Skipped lines listed individually in the final summary; all of them go to stderr as they occur.
SUMMARY_LIST_LIMIT = 20
# Megatron-LM splits sentences in chunks of this many characters (punkt's cost grows with length).
SPLIT_CHUNK_CHARS = 1_000_000
NLTK_MISSING = ("--split-sentences needs nltk (>= 3.9) and its punkt_tab data for --lang {lang} "
                "({problem}): pip install nltk && python -m nltk.downloader punkt_tab (set "
                "NLTK_DATA where the data is), or drop --split-sentences")

Line = Tuple[Tuple[str, int], bytes]  # ((input file, 1-based line number), raw bytes)


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
    splitter = None

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = load_tokenizer(self.args)
        if self.args.split_sentences:
            Encoder.splitter = sentence_splitter(self.args.lang, self.args.keep_newlines)

    def sentences(self, text: str) -> List[str]:
        """``text`` itself, or its sentences with ``--split-sentences``."""
        if self.splitter is None:
            return [text]
        return [sentence for start in range(0, len(text), SPLIT_CHUNK_CHARS)
                for sentence in self.splitter.tokenize(text[start:start + SPLIT_CHUNK_CHARS])]

    def encode(self, line: Line) -> Tuple[Tuple[str, int], Optional[Dict], str, int]:
        """``(where, (ids, sentence lengths) per key or None, skip reason, input bytes)``;
        sentences without tokens are dropped and EOD counts in the last one, as in
        Megatron-LM."""
        where, raw = line
        texts, reason = parse_json_line(raw, self.args.json_keys)
        if texts is None:
            return where, None, reason, len(raw)
        docs = {}
        for key, text in texts.items():
            if self.args.tokenizer_type == "NullTokenizer":
                reason = null_tokenizer_problem(text, self.args.vocab_size)
                if reason:
                    return where, None, f"key {key!r}: {reason}", len(raw)
            ids: List[int] = []
            lengths = []
            for sentence in self.sentences(text):
                sentence_ids = self.tokenizer.tokenize(sentence)
                ids += sentence_ids
                lengths += [len(sentence_ids)] if sentence_ids else []
            if not ids:
                return where, None, f"text in key {key!r} has no tokens", len(raw)
            if self.args.append_eod:
                ids.append(self.tokenizer.eod)
                lengths[-1] += 1
            docs[key] = (ids, lengths)
        return where, docs, "", len(raw)


def sentence_splitter(lang: str, keep_newlines: bool):
    """nltk punkt's sentence splitter for ``lang`` (what Megatron-LM loads); with
    ``keep_newlines`` the whitespace after a sentence stays in it, so newlines survive."""
    try:
        from nltk.tokenize import punkt
    except ImportError as err:
        raise ToolError(NLTK_MISSING.format(lang=lang, problem=f"no nltk: {err}")) from None
    try:
        params = punkt.PunktTokenizer(lang)._params
    except (LookupError, AttributeError, OSError) as err:  # AttributeError: nltk < 3.9
        problem = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ToolError(NLTK_MISSING.format(lang=lang, problem=problem)) from None

    class KeepNewlines(punkt.PunktLanguageVars):
        # punkt's sentence-end context with the whitespace after the end inside the match
        # (\s* where punkt has \s+ before the next token), as Megatron-LM's --keep-newlines.
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # the whitespace after it, kept in the sentence
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or the next token
            ))"""

    lang_vars = KeepNewlines() if keep_newlines else punkt.PunktLanguageVars()
    return punkt.PunktSentenceTokenizer(train_text=params, lang_vars=lang_vars)


def numbered_lines(path: str) -> Iterator[Line]:
    """Lines of ``path`` (a UTF-8 byte order mark before the first dropped); a file that cannot
    be read to its end (a corrupt or truncated ``.gz``) raises one ``ToolError``."""
    line_no = 0
    try:
        with open_input(path) as stream:
            for line_no, raw in enumerate(stream, start=1):
                if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8):]
                yield (path, line_no), raw
    except (OSError, EOFError, zlib.error) as err:
        hint = ("it is corrupt, truncated or not gzip: re-compress or re-download it, or pass "
                "the uncompressed file as --input") if path.endswith(".gz") else "check the file"
        raise ToolError(f"--input {path!r} cannot be read at line {line_no + 1} "
                        f"({type(err).__name__}: {err}); {hint}") from None


def input_files(args: argparse.Namespace) -> List[str]:
    """``--input``: one file, or with ``--partitions`` > 1 a glob pattern (Megatron-LM's), its
    files in sorted order."""
    if args.partitions == 1:
        return [args.input]
    paths = sorted(path for path in glob.glob(args.input) if os.path.isfile(path))
    if not paths:
        raise ToolError(f"--input {args.input!r} matches no file")
    return paths


def ordered_lines(args: argparse.Namespace, paths: List[str]) -> Iterator[Line]:
    """The lines of ``paths`` in Megatron-LM's output order: with ``--partitions N`` line i goes
    to partition i mod N and the partitions are written one after another (one read of the
    input per partition); ``--keep-sequential-samples`` gives contiguous partitions, which is
    the input order."""
    passes = 1 if args.keep_sequential_samples else args.partitions
    for partition in range(passes):
        index = 0
        for path in paths:
            for line in numbered_lines(path):
                if index % passes == partition:
                    yield line
                index += 1


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="jsonl file, optionally .gz compressed (a glob with --partitions)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group.add_argument("--split-sentences", action="store_true",
                       help="one sequence per sentence (nltk punkt); output ..._sentence")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep the newlines between split sentences")
    group = parser.add_argument_group("tokenizer")
    add_tokenizer_arguments(group, type_required=True)
    group.add_argument("--append-eod", action="store_true", help="append EOD to every document")
    group.add_argument("--lang", default="english", help="--split-sentences' punkt language")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True)
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="Megatron-LM's document order of that many partitions (see above)")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="with --partitions: keep the input order")
    group.add_argument("--find-optimal-num-workers", action="store_true",
                       help="only time --max-documents lines with each of --workers-to-check "
                       "(tokenizer start included), print the fastest; writes nothing")
    group.add_argument("--workers-to-check", nargs="+", type=int, default=[16, 32, 64])
    group.add_argument("--max-documents", type=int, default=100_000,
                       help="lines per --find-optimal-num-workers run")
    group.add_argument("--chunk-size", type=int, default=64, help="lines per worker task")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between logs")
    args = parser.parse_args(argv)
    for flag, value in (("--workers", args.workers), ("--chunk-size", args.chunk_size),
                        ("--log-interval", args.log_interval), ("--partitions", args.partitions),
                        ("--max-documents", args.max_documents),
                        ("--workers-to-check", min(args.workers_to_check))):
        if value < 1:
            parser.error(f"{flag} must be >= 1 (got {value})")
    if args.partitions == 1 and not os.path.isfile(args.input):
        matches = [path for path in glob.glob(args.input) if os.path.isfile(path)]
        parser.error(f"--input {args.input!r} is not a file" + (
            f" (it matches {len(matches)} file{'s' * (len(matches) > 1)}: a glob pattern is read "
            "with --partitions 2 or more, as in Megatron-LM)" if matches else ""))
    return args


def output_prefix_for_key(args: argparse.Namespace, key: str) -> str:
    level = "sentence" if args.split_sentences else "document"
    return f"{args.output_prefix}_{key}_{level}"


@contextlib.contextmanager
def encoded(encoder: Encoder, lines: Iterator[Line], workers: int, chunk_size: int):
    """``encoder.encode`` of ``lines`` in order, by a pool of ``workers`` processes (none for
    one); leaving the block stops the pool."""
    pool = None
    try:
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
            results = pool.imap(encoder.encode, lines, chunk_size)
        else:
            results = map(encoder.encode, lines)
        yield results
    finally:
        # Every result has been consumed unless we are unwinding an error, so nothing is lost.
        if pool is not None:
            pool.terminate()
            pool.join()
        else:  # a SIGTERM inside Pool() leaves the workers it had forked, idle, holding stderr
            for child in multiprocessing.active_children():
                child.kill()


def add_documents(args: argparse.Namespace, encoder: Encoder, builders: Dict, paths: List[str],
                  start: float) -> Tuple[int, int, List[Tuple[Tuple[str, int], str]]]:
    """Tokenize ``paths`` into ``builders`` (one per key); ``(documents, tokens, skipped)``."""
    num_docs = num_tokens = num_bytes = 0
    skipped: List[Tuple[Tuple[str, int], str]] = []
    with encoded(encoder, ordered_lines(args, paths), args.workers, args.chunk_size) as results:
        for (path, line_no), docs, reason, size in results:
            exit_if_terminated()
            num_bytes += size
            if docs is None:
                skipped.append(((path, line_no), reason))
                print(f"{path}:{line_no}: skipped line {line_no}: {reason}", file=sys.stderr)
                continue
            for key, (ids, lengths) in docs.items():
                builders[key].add_document(ids, lengths)
            num_docs += 1
            num_tokens += sum(len(ids) for ids, _ in docs.values())
            if num_docs % args.log_interval == 0:
                elapsed = max(time.time() - start, 1e-9)
                print(
                    f"processed {num_docs} documents, {num_tokens} tokens "
                    f"({num_docs / elapsed:.1f} docs/s, {num_tokens / elapsed:.0f} tokens/s, "
                    f"{num_bytes / elapsed / 1024 ** 2:.2f} MB/s)",
                    file=sys.stderr,
                )
    return num_docs, num_tokens, skipped


def report_optimal_workers(args: argparse.Namespace, encoder: Encoder, paths: List[str]) -> int:
    """Megatron-LM's --find-optimal-num-workers: lines per second of each --workers-to-check
    over the first --max-documents lines (in output order), fastest first."""
    speeds = []
    for workers in args.workers_to_check:
        start = time.time()
        lines = itertools.islice(ordered_lines(args, paths), args.max_documents)
        with encoded(encoder, lines, workers, args.chunk_size) as results:
            count = sum(1 for _ in results)
        speeds.append((count / max(time.time() - start, 1e-9), workers))
        print(f"{workers} workers: {speeds[-1][0]:.1f} docs/s over {count} lines", file=sys.stderr)
    speeds.sort(reverse=True)
    for rank, (speed, workers) in enumerate(speeds, start=1):
        print(f"{rank}. {workers} workers: {speed:.1f} docs/s")
    print(f"The most optimal num of workers is {speeds[0][1]} ({speeds[0][0]:.1f} docs/s); "
          f"nothing was written, run again with --workers {speeds[0][1]}")
    return 0


def print_summary(args: argparse.Namespace, paths: List[str], num_docs: int, num_tokens: int,
                  skipped: List[Tuple[Tuple[str, int], str]], elapsed: float) -> None:
    print(
        f"done: {num_docs} documents, {num_tokens} tokens, {len(skipped)} skipped lines, "
        f"{elapsed:.1f}s ({num_tokens / elapsed:.0f} tokens/s) -> "
        + ", ".join(output_prefix_for_key(args, key) for key in args.json_keys),
        file=sys.stderr,
    )
    if skipped:
        skipped = sorted(skipped, key=lambda item: (paths.index(item[0][0]), item[0][1]))
        listed = "; ".join(f"line {no}: {reason}" if len(paths) == 1 else
                           f"{path}:{no}: {reason}"
                           for (path, no), reason in skipped[:SUMMARY_LIST_LIMIT])
        more = len(skipped) - SUMMARY_LIST_LIMIT
        if more > 0:
            listed += f"; ... and {more} more (listed above)"
        print(f"skipped lines: {listed}", file=sys.stderr)


@reports_errors
def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    exit_on_sigterm()
    # Imported after argument checks: importing megatron.core takes seconds.
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    paths = input_files(args)
    encoder = Encoder(args)
    encoder.initializer()
    if args.append_eod:
        try:
            check_for_training(encoder.tokenizer, args.tokenizer_type, args.tokenizer_model)
        except ValueError as err:
            raise ToolError(f"--append-eod: {err}") from None
    if args.find_optimal_num_workers:
        return report_optimal_workers(args, encoder, paths)
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    record = tokenizer_record(args, encoder.tokenizer)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)

    # Write under temporary names so that an interrupted or failed run never leaves a readable
    # partial dataset, nor any temporary file.
    files = {key: dataset_files(output_prefix_for_key(args, key)) for key in args.json_keys}
    start = time.time()
    with Staged(path for paths_of_key in files.values() for path in paths_of_key) as staged:
        builders = {key: IndexedDatasetBuilder(staged.tmp[bin_path], dtype=dtype)
                    for key, (bin_path, _, _) in files.items()}
        num_docs, num_tokens, skipped = add_documents(args, encoder, builders, paths, start)
        for key, (_, idx_path, sidecar_path) in files.items():
            builders[key].finalize(staged.tmp[idx_path])
            write_sidecar(staged.tmp[sidecar_path], record)
        if num_docs > 0:
            staged.publish()

    if num_docs == 0:
        print(
            f"error: no usable documents in --input {args.input!r} for --json-keys "
            f"{' '.join(args.json_keys)} ({len(skipped)} skipped lines); nothing written",
            file=sys.stderr,
        )
        return 2
    print_summary(args, paths, num_docs, num_tokens, skipped, max(time.time() - start, 1e-9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
