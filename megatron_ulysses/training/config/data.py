"""The data section: data sets, tokenizer and the sequence-sharded loader."""

import json
from dataclasses import dataclass
from typing import Optional, Tuple

from ...data.datasets import SPLIT_NAMES, parse_data_path, parse_split, unquote
from ...data.sft import DEFAULT_PROMPT_FORMAT, PROMPT_FORMATS
from ...data.tokenizer_flags import add_tokenizer_arguments, check_tokenizer_flags
from ...errors import ConfigError
from .checks import Context, check_output_dir, check_range, ignore_without, require


@dataclass(frozen=True)
class DataConfig:
    """Data sets, tokenizer and the sequence-sharded loader."""

    data_path: Optional[Tuple[str, ...]]
    train_data_path: Optional[Tuple[str, ...]]
    valid_data_path: Optional[Tuple[str, ...]]
    test_data_path: Optional[Tuple[str, ...]]
    split: str
    no_mmap_bin_files: bool
    mock_data: bool
    data_cache_path: Optional[str]
    num_workers: int
    tokenizer_type: str
    tokenizer_model: Optional[str]
    vocab_size: Optional[int]
    vocab_file: Optional[str]
    merge_file: Optional[str]
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool
    sft: bool
    sft_tokenizer_prompt_format: str
    # The TOKENIZER_OPTIONS (data/tokenizer_flags.py): build_tokenizer_from reads them by name.
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
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix, or weight prefix weight prefix ... for a blend")
    for name in SPLIT_NAMES:
        g.add_argument(f"--{name}-data-path", nargs="*", default=None,
                       help=f"the {name} split's own data (as --data-path), instead of "
                       "--data-path and --split")
    g.add_argument("--data-args-path", default=None,
                   help="a file holding --data-path's words (prefixes and blend weights)")
    g.add_argument("--per-split-data-args-path", default=None,
                   help="a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} of "
                   "--train/valid/test-data-path's words")
    g.add_argument("--split", type=str, default="969,30,1",
                   help="train,valid,test weights of --data-path's documents (one pair of "
                   "surrounding quotes is ignored, as Megatron-LM reads only the digits)")
    g.add_argument("--no-mmap-bin-files", action="store_true",
                   help="read the .bin files with file reads instead of mmap")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=2)
    add_tokenizer_arguments(g, type_help="default GPT2BPETokenizer (as Megatron-LM's "
                            "pretrain_gpt.py); NullTokenizer with --mock-data and no --vocab-file")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--sft", action="store_true", help="fine-tune on the JSONL conversations "
                   "of --data-path, packed into --seq-length (docs/training.md)")
    g.add_argument("--sft-tokenizer-prompt-format", choices=tuple(PROMPT_FORMATS),
                   default=DEFAULT_PROMPT_FORMAT, help="SFTTokenizer's prompt format; "
                   "chat-template (ours, named for apply_chat_template, which renders it): "
                   "the tokenizer's chat template as default, the loss on the assistant turns "
                   "only (docs/training.md)")


def _read_data_args(args) -> None:
    """--data-args-path / --per-split-data-args-path: the data paths from a file, as
    Megatron-LM reads them (whitespace-separated words; JSON per split)."""
    for flag, path, given in (("--data-args-path", args.data_args_path, args.data_path),
                              ("--per-split-data-args-path", args.per_split_data_args_path,
                               any(getattr(args, f"{name}_data_path") for name in SPLIT_NAMES))):
        if path is None:
            continue
        require(not given, f"give {flag} or the data paths it holds, not both")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"{flag} {path}: cannot read it ({error})") from None
        if flag == "--data-args-path":
            args.data_path = text.split()
            continue
        try:
            splits = json.loads(text)
            for name in SPLIT_NAMES:
                words = splits.get(name)
                setattr(args, f"{name}_data_path", words.split() if isinstance(words, str)
                        else [str(word) for word in words] if words else None)
        except (ValueError, AttributeError) as error:
            raise ConfigError(f"{flag} {path}: not a JSON object of the train, valid and test "
                              f"paths ({error})") from None


def _check_sft(args, ctx: Context) -> None:
    """--sft: JSONL data, SFTTokenizer, positions and attention restarted by the dataset."""
    if args.tokenizer_type != "SFTTokenizer":
        ignore_without(args, ctx, "--tokenizer-type SFTTokenizer", (
            ("--sft-tokenizer-prompt-format", "sft_tokenizer_prompt_format",
             DEFAULT_PROMPT_FORMAT),))
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
        for flag, words in [("--data-path", args.data_path)] + [
                (f"--{name}-data-path", words) for name, words in per_split.items()]:
            if words:
                parse_data_path(words, flag, jsonl=args.sft)
                setattr(args, flag[2:].replace("-", "_"), tuple(words))
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
