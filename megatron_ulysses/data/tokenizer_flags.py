"""Megatron-LM's tokenizer flags (pretrain_gpt.py's and the tools'), the files each
``--tokenizer-type`` needs, and their checks: errors name the flag."""

import os
from typing import Any, Dict, Optional

from ..errors import flag_name

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "SFTTokenizer",
)

# The tokenizer flags beyond the files: dest -> (default, the one --tokenizer-type reading it).
TOKENIZER_OPTIONS = {
    "vocab_extra_ids": (0, "SentencePieceTokenizer"),
    "tokenizer_special_tokens": (None, "TikTokenizer"),
    "tiktoken_pattern": (None, "TikTokenizer"),
    "tiktoken_num_special_tokens": (1000, "TikTokenizer"),
    "tokenizer_hf_use_fast": (True, "HuggingFaceTokenizer"),
    "tokenizer_hf_include_special_tokens": (False, "HuggingFaceTokenizer"),
    "trust_remote_code": (False, "HuggingFaceTokenizer"),
    "null_tokenizer_eod_id": (None, "NullTokenizer"),
    "null_tokenizer_pad_id": (-1, "NullTokenizer"),
}
# What TikTokenizer's special tokens must hold (megatron-core's tiktoken library).
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")


def add_tokenizer_arguments(group, type_required: bool = False, type_help: str = None) -> None:
    """Megatron-LM's tokenizer flags, for pretrain_gpt.py and the tools."""
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                       required=type_required, help=type_help)
    group.add_argument("--tokenizer-model", default=None,
                       help="sentencepiece .model file / HuggingFace tokenizer directory")
    group.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    _add_option_arguments(group)


def _add_option_arguments(group) -> None:
    """The ``TOKENIZER_OPTIONS`` flags, Megatron-LM's spellings (both of a renamed pair)."""
    default = {dest: value for dest, (value, _) in TOKENIZER_OPTIONS.items()}
    group.add_argument("--vocab-extra-ids", type=int, default=default["vocab_extra_ids"],
                       help="SentencePieceTokenizer: <extra_id_i> tokens added")
    group.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", nargs="+",
                       dest="tokenizer_special_tokens", default=None,
                       help="TikTokenizer: its special tokens, ids 0.. in this order; must hold "
                       + " ".join(TIKTOKEN_SPECIAL_TOKENS) + " (the default list)")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None,
                       help="TikTokenizer: the pre-tokenizer regex (default v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int,
                       default=default["tiktoken_num_special_tokens"],
                       help="TikTokenizer: ids below this are special tokens (filled with "
                       "<SPECIAL_i>); the vocabulary's ranks start here")
    for flag, dest, value, meaning in (
            ("--tokenizer-hf-no-use-fast", "tokenizer_hf_use_fast", False,
             "the slow (Python) tokenizer"),
            ("--tokenizer-hf-use-fast", "tokenizer_hf_use_fast", True,
             "the fast (Rust) tokenizer"),
            ("--tokenizer-hf-include-special-tokens", "tokenizer_hf_include_special_tokens",
             True, "add the special tokens (BOS, EOS) when encoding"),
            ("--tokenizer-hf-no-include-special-tokens", "tokenizer_hf_include_special_tokens",
             False, "add no special tokens when encoding")):
        group.add_argument(flag, dest=dest, action="store_true" if value else "store_false",
                           default=default[dest],
                           help=f"HuggingFaceTokenizer: {meaning}"
                           + (" (the default)" if value == default[dest] else ""))
    group.add_argument("--trust-remote-code", action="store_true",
                       help="HuggingFaceTokenizer: run the tokenizer directory's own code")
    group.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                       help="NullTokenizer: the eod id (default --vocab-size)")
    group.add_argument("--null-tokenizer-pad-id", type=int,
                       default=default["null_tokenizer_pad_id"],
                       help="NullTokenizer: the pad id (default -1: none, eod pads)")


def tokenizer_options(config: Any) -> Dict[str, Any]:
    """The ``TOKENIZER_OPTIONS`` of ``config`` (attributes), their defaults where it has none."""
    return {dest: getattr(config, dest, default)
            for dest, (default, _) in TOKENIZER_OPTIONS.items()}


def files_of(tokenizer_type: str, tokenizer_model: Optional[str], vocab_file: Optional[str],
              merge_file: Optional[str]) -> Dict[str, Optional[str]]:
    """``{flag: path}`` of the files that define a ``tokenizer_type`` tokenizer."""
    if tokenizer_type == "NullTokenizer":
        return {}
    if tokenizer_type == "GPT2BPETokenizer":
        return {"--vocab-file": vocab_file, "--merge-file": merge_file}
    return {"--tokenizer-model": tokenizer_model}


def tokenizer_files(config: Any) -> Dict[str, Optional[str]]:
    """``{flag: path}`` of the files that define the tokenizer of ``config`` (flags as
    attributes: an argparse namespace, ``DataConfig``)."""
    return files_of(config.tokenizer_type, config.tokenizer_model, config.vocab_file,
                     config.merge_file)


def check_files(tokenizer_type: str, files: Dict[str, Optional[str]]) -> None:
    """Each of ``files`` (``{flag: path}``) is given and exists; ``ValueError`` naming it."""
    for flag, path in files.items():
        if path is None:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
        if not os.path.exists(path):
            raise ValueError(f"{flag} {path!r} does not exist (needed by --tokenizer-type "
                             f"{tokenizer_type}; only local files are used)")


def check_tokenizer_flags(config: Any) -> None:
    """The files ``--tokenizer-type`` needs are given and exist, and no other type's files are
    given with GPT2BPETokenizer nor its files with another type (which reads the wrong files);
    ``--tokenizer-model`` with NullTokenizer stays ignored, as in Megatron-LM. Raises
    ``ValueError`` naming the flags."""
    files = tokenizer_files(config)
    check_files(config.tokenizer_type, files)
    unused = [flag for flag, value in (("--vocab-file", config.vocab_file),
                                       ("--merge-file", config.merge_file),
                                       ("--tokenizer-model", config.tokenizer_model))
              if value is not None and flag not in files
              and not (flag == "--tokenizer-model" and config.tokenizer_type == "NullTokenizer")]
    # Megatron-LM's Llama examples pass --tiktoken-pattern with NullTokenizer: the caller warns.
    unused += [_flag(dest, value) for dest, value in tokenizer_options(config).items()
               if value != TOKENIZER_OPTIONS[dest][0] and dest != "tiktoken_pattern"
               and TOKENIZER_OPTIONS[dest][1] != config.tokenizer_type]
    if unused:
        raise ValueError(f"{' and '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used "
                         f"by --tokenizer-type {config.tokenizer_type}; drop "
                         f"{'it' if len(unused) == 1 else 'them'}, or give the type that uses "
                         f"{'it' if len(unused) == 1 else 'them'}")


def _flag(dest: str, value: Any) -> str:
    """The flag that set ``dest`` to ``value`` (``--tokenizer-hf-no-use-fast`` for False)."""
    if value is False and TOKENIZER_OPTIONS[dest][0] is True:
        return flag_name(dest).replace("-hf-", "-hf-no-")
    return flag_name(dest)
