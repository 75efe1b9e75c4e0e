"""Shared by the dataset tools: input errors reported as one line with exit status 2, outputs
written under temporary names, a check of ``.idx``/``.bin`` files made before megatron-core mmaps
them, and the tokenizer sidecar ``<prefix>.tokenizer.json`` that preprocess_data.py writes and
merge_datasets.py compares."""

import functools
import hashlib
import json
import os
import struct
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Tuple

import numpy

# megatron.core.datasets.indexed_dataset's .idx: magic, version <Q (1), dtype code <B, sequence
# count <Q, document count <Q; then int32 sequence lengths, int64 sequence byte offsets into the
# .bin, int64 document indices (first sequence of each document, then the sequence count) and,
# for multimodal data only, int8 sequence modes.
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_HEADER = struct.Struct("<9sQBQQ")
# What identifies the tokenizer of a dataset (the model path may differ between copies).
TOKENIZER_IDENTITY = ("tokenizer_type", "tokenizer_model_sha256", "vocab_size")


class ToolError(Exception):
    """A problem with the user's input or files: one ``error:`` line on stderr, exit status 2."""


def reports_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Turn a ``ToolError`` raised by a tool's ``main`` into its one-line message and status 2."""

    @functools.wraps(main)
    def wrapper(argv=None) -> int:
        try:
            return main(argv)
        except ToolError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return wrapper


def dataset_files(prefix: str) -> Tuple[str, str, str]:
    """``(bin, idx, tokenizer sidecar)`` paths of a dataset prefix."""
    return prefix + ".bin", prefix + ".idx", prefix + ".tokenizer.json"


class Staged:
    """``with Staged(paths) as staged``: write each path under ``staged.tmp[path]``; ``publish()``
    renames them all into place, and leaving the block removes whatever was not published."""

    def __init__(self, paths: Iterable[str]):
        self.tmp = {path: f"{path}.tmp{os.getpid()}" for path in paths}

    def __enter__(self) -> "Staged":
        return self

    def publish(self) -> None:
        for path, tmp in self.tmp.items():
            os.replace(tmp, path)

    def __exit__(self, *exc_info) -> None:
        for tmp in self.tmp.values():
            if os.path.exists(tmp):
                os.remove(tmp)


class DatasetInfo(NamedTuple):
    dtype: type
    sequences: int
    documents: int
    tokens: int


def check_dataset(prefix: str, flag: str) -> DatasetInfo:
    """Check that ``prefix.idx`` and ``prefix.bin`` agree with each other and with the index
    layout (megatron-core asserts, or fails inside numpy, on damaged files, and cannot mmap an
    empty ``.bin``). Raises a ``ToolError`` naming ``flag`` (the option that gave ``prefix``)."""
    from megatron.core.datasets.indexed_dataset import DType

    bin_path, idx_path, _ = dataset_files(prefix)

    def damaged(problem: str) -> ToolError:
        return ToolError(f"{flag} {prefix!r}: {problem}; re-create it with "
                         f"tools/preprocess_data.py or pass another {flag}")

    missing = [path for path in (idx_path, bin_path) if not os.path.isfile(path)]
    if missing:
        hint = " (give the prefix without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
        raise damaged(f"there is no {' and no '.join(missing)}{hint}")
    idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)
    with open(idx_path, "rb") as stream:
        header = stream.read(IDX_HEADER.size)
    if len(header) < IDX_HEADER.size:
        raise damaged(f"{idx_path} is truncated ({idx_size} bytes, shorter than the "
                      f"{IDX_HEADER.size}-byte header)")
    magic, version, code, sequences, doc_count = IDX_HEADER.unpack(header)
    if magic != IDX_MAGIC:
        raise damaged(f"{idx_path} is not a megatron-core index (starts with {magic!r}, not "
                      f"{IDX_MAGIC!r})")
    if version != 1 or code not in {dtype.value for dtype in DType}:
        raise damaged(f"{idx_path} has index version {version} and dtype code {code} "
                      f"(megatron-core reads version 1, codes 1-{len(DType)})")
    needed = IDX_HEADER.size + 12 * sequences + 8 * doc_count
    if idx_size not in (needed, needed + sequences):  # + sequences: multimodal modes
        raise damaged(f"{idx_path} is {idx_size} bytes but its header ({sequences} sequences, "
                      f"{doc_count} document indices) needs {needed}")
    itemsize = DType.size(code)
    offset = IDX_HEADER.size
    lengths = numpy.fromfile(idx_path, numpy.int32, sequences, offset=offset).astype(numpy.int64)
    pointers = numpy.fromfile(idx_path, numpy.int64, sequences, offset=offset + 4 * sequences)
    doc_indices = numpy.fromfile(idx_path, numpy.int64, doc_count, offset=offset + 12 * sequences)
    starts = (numpy.cumsum(lengths) - lengths) * itemsize
    if (doc_count == 0 or doc_indices[0] != 0 or doc_indices[-1] != sequences
            or (numpy.diff(doc_indices) < 0).any() or (lengths < 0).any()
            or (pointers != starts).any()):
        raise damaged(f"{idx_path} has inconsistent document indices, sequence lengths or "
                      f"sequence offsets")
    tokens = int(lengths.sum())
    if bin_size != tokens * itemsize:
        raise damaged(f"{bin_path} is {bin_size} bytes but {idx_path} says {tokens} tokens x "
                      f"{itemsize} bytes = {tokens * itemsize}")
    if tokens == 0:
        raise damaged(f"it holds no tokens ({doc_count - 1} documents; megatron-core cannot read "
                      f"an empty .bin)")
    return DatasetInfo(DType.dtype_from_code(code), sequences, doc_count - 1, tokens)


def load_tokenizer(args):
    """``build_tokenizer`` for a tool's ``--tokenizer-type/--tokenizer-model/--vocab-size``."""
    from megatron_ulysses.data.tokenizers import build_tokenizer

    try:
        return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    except (ValueError, ImportError, OSError, RuntimeError) as err:
        raise ToolError(f"cannot build the tokenizer (--tokenizer-type {args.tokenizer_type}, "
                        f"--tokenizer-model {args.tokenizer_model!r}, --vocab-size "
                        f"{args.vocab_size}): {err}") from None


def _sha256(path: str) -> str:
    """Digest of a file (as ``sha256sum`` prints it), or of the names and contents of the files
    under a directory (a HuggingFace tokenizer)."""
    root = Path(path)
    if root.is_file():
        return hashlib.sha256(root.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def tokenizer_record(args, tokenizer) -> Dict:
    """What the sidecar says about the tokenizer that made a dataset."""
    model = None if args.tokenizer_type == "NullTokenizer" else args.tokenizer_model
    return {
        "tokenizer_type": args.tokenizer_type,
        "tokenizer_model": None if model is None else os.path.abspath(model),
        "tokenizer_model_sha256": None if model is None else _sha256(model),
        "vocab_size": tokenizer.vocab_size,
    }


def write_sidecar(path: str, record: Dict) -> None:
    Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def read_sidecar(prefix: str, flag: str) -> Optional[Dict]:
    """The tokenizer record of a dataset, ``None`` for a dataset made without one."""
    path = dataset_files(prefix)[2]
    if not os.path.exists(path):
        return None
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        record, problem = None, f"({type(err).__name__}: {err})"
    else:
        problem = f"(needs keys {', '.join(TOKENIZER_IDENTITY)})"
    if not isinstance(record, dict) or not all(key in record for key in TOKENIZER_IDENTITY):
        raise ToolError(f"{flag} {prefix!r}: {path} is not a tokenizer record {problem}; delete "
                        f"it or re-create the dataset with tools/preprocess_data.py")
    return record


def same_tokenizer(first: Dict, second: Dict) -> bool:
    return all(first[key] == second[key] for key in TOKENIZER_IDENTITY)


def describe_tokenizer(record: Dict) -> str:
    model = record.get("tokenizer_model")
    sha = record["tokenizer_model_sha256"]
    model_text = f" {model} (sha256 {str(sha)[:12]})" if sha else ""
    return f"{record['tokenizer_type']}{model_text}, vocab size {record['vocab_size']}"
