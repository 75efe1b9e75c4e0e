"""The data section: data sets, tokenizer and the sequence-sharded loader."""

import json
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from ...data.datasets import SPLIT_NAMES, parse_data_path, parse_split, unquote
from ...data.sft import DEFAULT_PROMPT_FORMAT, PROMPT_FORMATS
from ...data.tokenizer_flags import add_tokenizer_arguments, check_tokenizer_flags
from ...errors import ConfigError
from .checks import Context, check_output_dir, check_range, ignore_without, require
from .fields import add_flags, flag, off_without



def _split_path(name: str):
    return flag(None, f"the {name} split's own data (as --data-path), instead of --data-path "
                "and --split", nargs="*")


@dataclass(frozen=True)
class DataConfig:
    """Data sets, tokenizer and the sequence-sharded loader."""

    data_path: Optional[Tuple[str, ...]] = flag(
        None, "prefix, or weight prefix weight prefix ... for a blend", nargs="*")
    train_data_path: Optional[Tuple[str, ...]] = _split_path("train")
    valid_data_path: Optional[Tuple[str, ...]] = _split_path("valid")
    test_data_path: Optional[Tuple[str, ...]] = _split_path("test")
    data_args_path: ClassVar[Optional[str]] = flag(
        None, "a file holding --data-path's words (prefixes and blend weights)", kept=False)
    per_split_data_args_path: ClassVar[Optional[str]] = flag(
        None, "a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} of "
        "--train/valid/test-data-path's words", kept=False)
    split: str = flag(
        "969,30,1", "train,valid,test weights of --data-path's documents (one pair of "
        "surrounding quotes is ignored, as Megatron-LM reads only the digits)")
    no_mmap_bin_files: bool = flag(
        False, "read the .bin files with file reads instead of mmap")
    mock_data: bool = flag(False)
    data_cache_path: Optional[str] = flag(None)
    num_workers: int = flag(2)
    reset_position_ids: bool = flag(False)
    reset_attention_mask: bool = flag(False)
    eod_mask_loss: bool = flag(False)
    sft: bool = flag(False, "fine-tune on the JSONL conversations of --data-path, packed into "
                     "--seq-length (docs/training.md)")
    sft_tokenizer_prompt_format: str = flag(
        DEFAULT_PROMPT_FORMAT, "SFTTokenizer's prompt format; chat-template (ours): the "
        "tokenizer's chat template, the loss on the assistant turns only",
        choices=tuple(PROMPT_FORMATS),
        needs="--tokenizer-type SFTTokenizer")
    # The tokenizer flags (data/tokenizer_flags.py, shared with the tools); build_tokenizer_from
    # reads the TOKENIZER_OPTIONS by name.
    tokenizer_type: str
    tokenizer_model: Optional[str]
    vocab_size: Optional[int]
    vocab_file: Optional[str]
    merge_file: Optional[str]
    vocab_extra_ids: int
    tokenizer_special_tokens: Optional[Tuple[str, ...]]
    tiktoken_pattern: Optional[str]
    tiktoken_num_special_tokens: int
    tokenizer_hf_use_fast: bool
    tokenizer_hf_include_special_tokens: bool
    trust_remote_code: bool
    null_tokenizer_eod_id: Optional[int]
    null_tokenizer_pad_id: int

    @property
    def data_path_per_split(self):
        """--train/valid/test-data-path as the dataset builder takes them (None: not given)."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return [list(words) if words else None for words in paths] if any(paths) else None


def add_arguments(parser) -> None:
    add_tokenizer_arguments(add_flags(parser, DataConfig, "data"), type_help="default "
                            "GPT2BPETokenizer (as Megatron-LM's pretrain_gpt.py); NullTokenizer "
                            "with --mock-data and no --vocab-file")


def _read_data_args(args) -> None:
    """--data-args-path / --per-split-data-args-path: the data paths from a file, as
    Megatron-LM reads them (whitespace-separated words; JSON per split)."""
    for option, path, given in (("--data-args-path", args.data_args_path, args.data_path),
                              ("--per-split-data-args-path", args.per_split_data_args_path,
                               any(getattr(args, f"{name}_data_path") for name in SPLIT_NAMES))):
        if path is None:
            continue
        require(not given, f"give {option} or the data paths it holds, not both")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"{option} {path}: cannot read it ({error})") from None
        if option == "--data-args-path":
            args.data_path = text.split()
            continue
        try:
            splits = json.loads(text)
            for name in SPLIT_NAMES:
                words = splits.get(name)
                setattr(args, f"{name}_data_path", words.split() if isinstance(words, str)
                        else [str(word) for word in words] if words else None)
        except (ValueError, AttributeError) as error:
            raise ConfigError(f"{option} {path}: not a JSON object of the train, valid and test "
                              f"paths ({error})") from None


def _check_sft(args, ctx: Context) -> None:
    """--sft: JSONL data, SFTTokenizer, positions and attention restarted by the dataset."""
    if args.tokenizer_type != "SFTTokenizer":
        ignore_without(args, ctx, "--tokenizer-type SFTTokenizer",
                       off_without(DataConfig, "--tokenizer-type SFTTokenizer"))
    if not args.sft:
        return
    require(not args.mock_data, "--sft reads JSONL conversations from --data-path (or "
            "--train/valid/test-data-path); drop --mock-data")
    require(args.tokenizer_type == "SFTTokenizer",
            f"--sft needs --tokenizer-type SFTTokenizer (got {args.tokenizer_type}) with a "
            "HuggingFace tokenizer directory as --tokenizer-model, as in Megatron-LM")
    given = [flag for flag, on in (("--reset-position-ids", args.reset_position_ids),
                                   ("--reset-attention-mask", args.reset_attention_mask)) if on]
    require(not given, f"--sft restarts positions and attention at every conversation itself; "
            f"drop {' and '.join(given)}")
    if args.eod_mask_loss:
        ctx.warnings.append("--eod-mask-loss has no effect with --sft (as in Megatron-LM): the "
                            "prompt format decides which tokens are in the loss")


def check_values(args) -> None:
    check_range(args, "vocab_size", low=0, low_open=True, optional=True)
    check_range(args, "num_workers", low=0)


def validate(args, ctx: Context) -> None:
    """One data source: --mock-data, --data-path or --train/valid/test-data-path (whose
    .bin/.idx files must exist); --split; the tokenizer (Megatron-LM's pretrain_gpt.py default
    GPT2BPETokenizer, except for mock data without --vocab-file: NullTokenizer)."""
    args.split = unquote(args.split)
    try:
        parse_split(args.split)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _read_data_args(args)
    per_split = {name: getattr(args, f"{name}_data_path") for name in SPLIT_NAMES}
    split_default = DataConfig.__dataclass_fields__["split"].metadata["flag"].default
    require(not any(per_split.values()) or args.split == split_default,
            f"--split {args.split} divides --data-path's documents; with --train/valid/test-data-"
            "path each split has its own data: drop --split (Megatron-LM refuses the two "
            "together too)")
    sources = [flag for flag, given in (("--mock-data", args.mock_data),
                                        ("--data-path", bool(args.data_path)),
                                        ("--train/valid/test-data-path", any(per_split.values())))
               if given]
    require(len(sources) == 1, "give one data source: --data-path PREFIX (tools/"
            "preprocess_data.py writes one), --train-data-path/--valid-data-path/--test-data-"
            "path, or --mock-data" + (f"; not both {' and '.join(sources)}" if sources else ""))
    if args.tokenizer_type is None:
        args.tokenizer_type = ("NullTokenizer" if args.mock_data and args.vocab_file is None
                               else "GPT2BPETokenizer")
    _check_sft(args, ctx)
    try:  # the files' contents are checked by pretrain_gpt.py (check_data_path)
        for option, words in [("--data-path", args.data_path)] + [
                (f"--{name}-data-path", words) for name, words in per_split.items()]:
            if words:
                parse_data_path(words, option, jsonl=args.sft)
                setattr(args, option[2:].replace("-", "_"), tuple(words))
    except (ValueError, OSError) as error:
        raise ConfigError(str(error)) from None
    if args.tokenizer_type == "NullTokenizer":
        require(args.vocab_size is not None and args.vocab_size > 0,
                "--tokenizer-type NullTokenizer (the --mock-data default) needs --vocab-size")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        ctx.warnings.append(f"--tiktoken-pattern {args.tiktoken_pattern} is ignored: only "
                            f"TikTokenizer reads it, not {args.tokenizer_type} (as in Megatron-LM)")
    try:
        check_tokenizer_flags(args)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_output_dir(args, "data_cache_path")
