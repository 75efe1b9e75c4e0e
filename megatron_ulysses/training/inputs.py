"""The run's inputs: the tokenizer and data files checked before any process group, and the
sequence-sharded train and validation batches (resumed where the run left them)."""

import functools

from ..data.batches import Batches
from ..data.datasets import SPLIT_NAMES, build_train_valid_test_datasets, check_data_path
from ..data.sft import check_sft_data_path
from ..data.sidecar import tokenizer_record
from ..data.tokenizers import build_tokenizer_from, check_for_training
from ..errors import ConfigError
from .batch_schedule import samples_after
from .config import RunConfig


def check_inputs(config: RunConfig):
    """Before any process group: a tokenizer file that does not load or has no EOD, damaged
    .idx/.bin files (--sft: bad JSONL lines), data whose tokenizer record names another
    tokenizer, and a --split that gives a split no documents
    (which megatron-core would try to fill forever). The only full read of the .idx files (and
    of --sft's JSONL files). Returns the tokenizer."""
    data = config.data
    try:
        tokenizer = build_tokenizer_from(data)
        check_for_training(tokenizer, data.tokenizer_type, data.tokenizer_model)
        check = (functools.partial(check_sft_data_path,
                                   prompt_format=data.sft_tokenizer_prompt_format)
                 if data.sft else functools.partial(
                     check_data_path, made_with=tokenizer_record(data, tokenizer)))
        if data.data_path:
            check(list(data.data_path), split=data.split)
        for name, words in zip(SPLIT_NAMES, data.data_path_per_split or ()):
            if words:
                check(words, flag=f"--{name}-data-path")
    except (ValueError, ImportError, OSError, RuntimeError) as error:
        raise ConfigError(str(error)) from None
    return tokenizer


def build_batches(config: RunConfig, tokenizer, iteration: int, consumed: int):
    """Train and validation batches; both resume where the run left them (as Megatron-LM).
    --skip-train: the validation batches from the split's start (the same for every
    checkpoint), one train batch's worth of train samples (never read)."""
    training = config.training
    gbs, eval_gbs = training.global_batch_size, training.eval_global_batch_size
    if training.skip_train:
        sizes, valid_consumed = [gbs, training.eval_iters * eval_gbs, 0], 0
    else:
        evaluations = training.evaluations_through(training.train_iters) + 1
        train_samples = samples_after(training.train_iters, training.batch_size_schedule, gbs)
        sizes = [train_samples, evaluations * training.eval_iters * eval_gbs, 0]
        valid_consumed = training.evaluations_through(iteration) * training.eval_iters * eval_gbs
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        tokenizer, config.model.seq_length, sizes,
        data_path=list(config.data.data_path) if config.data.data_path else None,
        split=config.data.split, mock_data=config.data.mock_data, seed=training.seed,
        data_cache_path=config.data.data_cache_path,
        reset_position_ids=config.data.reset_position_ids,
        eod_mask_loss=config.data.eod_mask_loss,
        data_path_per_split=config.data.data_path_per_split,
        mmap_bin_files=not config.data.no_mmap_bin_files, sft=config.data.sft,
    )
    mbs = training.micro_batch_size
    train = Batches(train_ds, consumed, mbs, config.data, tokenizer) if train_ds else None
    valid = None
    if valid_ds is not None and training.eval_iters > 0:
        valid = Batches(valid_ds, valid_consumed, training.eval_micro_batch_size, config.data,
                        tokenizer)
    return train, valid
