"""The data section: data sets, tokenizer and the sequence-sharded loader."""

from dataclasses import dataclass
from typing import Optional, Tuple

from ...data.datasets import parse_data_path, parse_split
from ...data.tokenizers import add_tokenizer_arguments, check_tokenizer_flags
from ...errors import ConfigError
from .checks import Context, check_output_dir, check_range, require


@dataclass(frozen=True)
class DataConfig:
    """Data sets, tokenizer and the sequence-sharded loader."""

    data_path: Optional[Tuple[str, ...]]
    split: str
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
    # The TOKENIZER_OPTIONS (data/tokenizers.py): build_tokenizer_from reads them by name.
    vocab_extra_ids: int
    tokenizer_special_tokens: Optional[Tuple[str, ...]]
    tiktoken_pattern: Optional[str]
    tiktoken_num_special_tokens: int
    tokenizer_hf_use_fast: bool
    tokenizer_hf_include_special_tokens: bool
    trust_remote_code: bool
    null_tokenizer_eod_id: Optional[int]
    null_tokenizer_pad_id: int


def add_arguments(parser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix, or weight prefix weight prefix ... for a blend")
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=2)
    add_tokenizer_arguments(g)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def check_values(args) -> None:
    check_range(args, "vocab_size", low=0, low_open=True, optional=True)
    check_range(args, "num_workers", low=0)


def validate(args, ctx: Context) -> None:
    """--mock-data or --data-path (whose .bin/.idx files must exist), --split, the tokenizer."""
    try:
        parse_split(args.split)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if args.mock_data:
        require(not args.data_path, "give --data-path or --mock-data, not both")
        if args.tokenizer_type is None:
            args.tokenizer_type = "NullTokenizer"
    else:
        require(bool(args.data_path), "give --data-path PREFIX (tools/preprocess_data.py "
                "writes one) or --mock-data")
        require(args.tokenizer_type is not None, "--data-path needs --tokenizer-type")
        try:  # the files' contents are checked by pretrain_gpt.py (check_data_path)
            parse_data_path(args.data_path)
        except (ValueError, OSError) as error:
            raise ConfigError(str(error)) from None
    if args.data_path is not None:
        args.data_path = tuple(args.data_path)
    if args.tokenizer_type == "NullTokenizer":
        require(args.vocab_size is not None and args.vocab_size > 0,
                "--tokenizer-type NullTokenizer (the --mock-data default) needs --vocab-size")
    try:
        check_tokenizer_flags(args)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_output_dir(args, "data_cache_path")
