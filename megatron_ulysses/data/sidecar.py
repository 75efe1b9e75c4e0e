"""The tokenizer record ``<prefix>.tokenizer.json`` that tools/preprocess_data.py writes next to
a dataset: which tokenizer made its ids. merge_datasets.py compares the records of its inputs;
pretrain_gpt.py compares each ``--data-path`` record with the run's tokenizer, since ids of
another tokenizer of the same vocabulary size train silently on the wrong text."""

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Optional

# What identifies the tokenizer of a dataset (the model path may differ between copies).
TOKENIZER_IDENTITY = ("tokenizer_type", "tokenizer_model_sha256", "vocab_size")
# The files of a HuggingFace tokenizer directory that define it (not config.json nor weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")


def sidecar_path(prefix: str) -> str:
    return prefix + ".tokenizer.json"


def _file_sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.digest()


def _sha256(path: str) -> str:
    """Digest of a file (as ``sha256sum`` prints it), or of the names and digests of the
    ``TOKENIZER_FILES`` in a directory (a HuggingFace tokenizer)."""
    root = Path(path)
    if root.is_file():
        return _file_sha256(root).hex()
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (root / name).is_file():
            digest.update(name.encode() + b"\0" + _file_sha256(root / name))
    return digest.hexdigest()


def tokenizer_record(args, tokenizer) -> Dict:
    """What the sidecar says about the tokenizer that made a dataset: its type, files (one
    path, or GPT2BPETokenizer's vocab and merges joined by " + "), their digest, and the
    tokenizer options that differ from their defaults (TikTokenizer's pattern, ...)."""
    from .tokenizer_flags import TOKENIZER_OPTIONS, tokenizer_files, tokenizer_options

    paths = list(tokenizer_files(args).values())
    digests = [_sha256(path) for path in paths]
    options = {dest: value for dest, value in tokenizer_options(args).items()
               if value != TOKENIZER_OPTIONS[dest][0]}
    return {
        **({"tokenizer_options": options} if options else {}),
        "tokenizer_type": args.tokenizer_type,
        "tokenizer_model": " + ".join(os.path.abspath(p) for p in paths) or None,
        "tokenizer_model_sha256": (digests[0] if len(digests) == 1 else
                                   hashlib.sha256("".join(digests).encode()).hexdigest()
                                   if digests else None),
        "vocab_size": tokenizer.vocab_size,
    }


def write_sidecar(path: str, record: Dict) -> None:
    Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def read_sidecar(prefix: str, flag: str) -> Optional[Dict]:
    """The tokenizer record of a dataset, ``None`` for a dataset made without one (by
    Megatron-LM's preprocess_data.py). Raises ``ValueError`` for a damaged record."""
    path = sidecar_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        record, problem = None, f"({type(err).__name__}: {err})"
    else:
        problem = f"(needs keys {', '.join(TOKENIZER_IDENTITY)})"
    if not isinstance(record, dict) or not all(key in record for key in TOKENIZER_IDENTITY):
        raise ValueError(f"{flag} {prefix!r}: {path} is not a tokenizer record {problem}; "
                         f"delete it or re-create the dataset with tools/preprocess_data.py")
    return record


def same_tokenizer(first: Dict, second: Dict) -> bool:
    return all(first[key] == second[key] for key in TOKENIZER_IDENTITY) and \
        first.get("tokenizer_options", {}) == second.get("tokenizer_options", {})


def describe_tokenizer(record: Dict) -> str:
    model = record.get("tokenizer_model")
    sha = record["tokenizer_model_sha256"]
    model_text = f" {model} (sha256 {str(sha)[:12]})" if sha else ""
    options = "".join(f", --{dest.replace('_', '-')} {value}"
                      for dest, value in record.get("tokenizer_options", {}).items())
    return f"{record['tokenizer_type']}{model_text}, vocab size {record['vocab_size']}{options}"


def check_made_with(prefix: str, flag: str, run: Dict) -> None:
    """Raise ``ValueError`` where ``prefix``'s record names another tokenizer than ``run`` (the
    record of the run's tokenizer flags). Only what gives the ids their meaning is compared:
    type, files' digest, vocabulary size; the encoding options do not change a dataset's ids."""
    record = read_sidecar(prefix, flag)
    if record is None or all(record[key] == run[key] for key in TOKENIZER_IDENTITY):
        return
    raise ValueError(
        f"{flag} {prefix!r} was tokenized with {describe_tokenizer(record)}, but this run's "
        f"tokenizer is {describe_tokenizer(run)}: its ids would stand for other text. Give the "
        f"--tokenizer-type / --tokenizer-model / --vocab-size it was made with, re-create it with "
        f"tools/preprocess_data.py, or delete {sidecar_path(prefix)} to train on it anyway")
