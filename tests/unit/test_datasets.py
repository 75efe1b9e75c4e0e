"""megatron-core GPT datasets over a preprocessed corpus, and the data-parallel sampler."""

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_ulysses.data.datasets import (
    PretrainingSampler,
    build_data_iterator,
    build_train_valid_test_datasets,
)
from megatron_ulysses.data.sharding import get_batch_for_sp_rank
from megatron_ulysses.data.tokenizers import build_tokenizer, padding_id

SEQ_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(sp_model):
    return build_tokenizer("GPTSentencePieceTokenizer", sp_model)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def train_dataset(corpus_prefix, tokenizer, cache_dir):
    train, valid, test = build_train_valid_test_datasets(
        tokenizer, SEQ_LEN, [200, 20, None], data_path=[corpus_prefix], split="90,10,0",
        data_cache_path=cache_dir,
    )
    assert test is None and len(valid) >= 20
    return train


def test_samples_are_shifted_windows(train_dataset, tokenizer):
    assert len(train_dataset) >= 200
    sample = train_dataset[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (SEQ_LEN,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    # Built without --reset-position-ids/--eod-mask-loss: plain positions and full loss.
    assert torch.equal(sample["position_ids"], torch.arange(SEQ_LEN))
    assert (sample["loss_mask"] == 1).all()
    # Packed documents: several EODs per window on this corpus.
    assert (sample["tokens"] == tokenizer.eod).sum() >= 1


def test_dataset_applies_megatron_resets(corpus_prefix, tokenizer, cache_dir, train_dataset):
    """With the flags, megatron-core's GPTDataset resets positions and masks the EOD loss; the SP
    loader then only pads and shards, and gives the same shards as applying them itself."""
    reset, _, _ = build_train_valid_test_datasets(
        tokenizer, SEQ_LEN, [200, 20, None], data_path=[corpus_prefix], split="90,10,0",
        data_cache_path=cache_dir, reset_position_ids=True, eod_mask_loss=True,
    )
    eod, pad = tokenizer.eod, padding_id(tokenizer)
    for index in range(3):
        sample, plain = reset[index], train_dataset[index]
        assert torch.equal(sample["tokens"], plain["tokens"])
        _, loss_mask, positions = _get_ltor_masks_and_position_ids(
            sample["tokens"], eod, True, False, True, False)
        assert torch.equal(sample["position_ids"], positions)
        assert torch.equal(sample["loss_mask"], loss_mask)
        assert not torch.equal(positions, plain["position_ids"])  # the window holds an EOD
    loader = torch.utils.data.DataLoader(reset, batch_size=2)
    plain_loader = torch.utils.data.DataLoader(train_dataset, batch_size=2)
    batch, plain = next(iter(loader)), next(iter(plain_loader))
    for sp_rank in range(3):  # SEQ_LEN 64 is padded to 66 for SP size 3
        from_dataset = get_batch_for_sp_rank(batch, sp_rank, 3, pad, eod,
                                             reset_attention_mask=True)
        from_loader = get_batch_for_sp_rank(plain, sp_rank, 3, pad, eod, reset_position_ids=True,
                                            reset_attention_mask=True, eod_mask_loss=True)
        twice = get_batch_for_sp_rank(batch, sp_rank, 3, pad, eod, reset_position_ids=True,
                                      reset_attention_mask=True, eod_mask_loss=True)
        for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens"):
            assert torch.equal(from_dataset[key], from_loader[key]), key
            assert torch.equal(from_dataset[key], twice[key]), key
    assert from_dataset["loss_mask"][:, -2:].eq(0).all()  # the 2 padding columns


def test_weighted_blend_and_mock_data(corpus_prefix, tokenizer):
    train, _, _ = build_train_valid_test_datasets(
        tokenizer, SEQ_LEN, [50, 5, 5], data_path=["0.7", corpus_prefix, "0.3", corpus_prefix],
        split="90,5,5",
    )
    assert len(train) == 50 and train[3]["tokens"].shape == (SEQ_LEN,)
    null = build_tokenizer("NullTokenizer", vocab_size=128)
    mock_train, _, _ = build_train_valid_test_datasets(null, 32, [10, 2, 2], mock_data=True)
    assert mock_train[0]["tokens"].max() <= null.eod


def test_data_source_errors_name_flags(corpus_prefix, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="--data-path.*--mock-data"):
        build_train_valid_test_datasets(tokenizer, SEQ_LEN, [1, 1, 1], data_path=[corpus_prefix],
                                        mock_data=True)
    with pytest.raises(FileNotFoundError, match="--data-path prefixes without .bin/.idx.*"
                       "build them with tools/preprocess_data.py"):
        build_train_valid_test_datasets(tokenizer, SEQ_LEN, [1, 1, 1],
                                        data_path=[str(tmp_path / "missing")])
    with pytest.raises(FileNotFoundError) as error:  # the file's name given for the prefix
        build_train_valid_test_datasets(tokenizer, SEQ_LEN, [1, 1, 1],
                                        data_path=[corpus_prefix + ".bin"])
    assert str(error.value).endswith(f"(give each prefix without its extension: "
                                     f"['{corpus_prefix}'])")


def test_sampler_splits_by_data_parallel_rank_only():
    def indices(dp_rank, consumed=0):
        return list(PretrainingSampler(40, consumed, 3, dp_rank, 2))

    rank0, rank1 = indices(0), indices(1)
    assert rank0[:2] == [[0, 1, 2], [6, 7, 8]] and rank1[:2] == [[3, 4, 5], [9, 10, 11]]
    flat0 = {i for batch in rank0 for i in batch}
    flat1 = {i for batch in rank1 for i in batch}
    assert not flat0 & flat1 and len(flat0 | flat1) == 36  # the last partial global batch dropped
    # Resume: after 2 global batches (12 samples) the stream continues where it stopped.
    assert indices(0, consumed=12) == rank0[2:]
    assert indices(1, consumed=12) == rank1[2:]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="consumed samples 10 >= dataset length 10"):
        PretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        PretrainingSampler(10, 0, 0, 0, 1)


def test_sp_group_shares_samples_and_dp_ranks_differ(train_dataset, tokenizer):
    dp_size, sp_size, micro_batch = 2, 2, 2
    # Rank layout: dp-major groups of sp_size ranks; each rank builds its own iterator.
    batches = {
        (dp, sp): next(build_data_iterator(train_dataset, 4, micro_batch, dp, dp_size))
        for dp in range(dp_size) for sp in range(sp_size)
    }
    for dp in range(dp_size):
        assert torch.equal(batches[(dp, 0)]["tokens"], batches[(dp, 1)]["tokens"])
    assert not torch.equal(batches[(0, 0)]["tokens"], batches[(1, 0)]["tokens"])
    assert torch.equal(batches[(1, 0)]["tokens"][0], train_dataset[6]["tokens"])

    # Each SP rank of DP rank 0 keeps its half; together they rebuild the sample.
    shards = [
        get_batch_for_sp_rank(batches[(0, sp)], sp, sp_size, padding_id(tokenizer), tokenizer.eod,
                              reset_position_ids=True, reset_attention_mask=True)
        for sp in range(sp_size)
    ]
    assert torch.equal(torch.cat([s["tokens"] for s in shards], 1), batches[(0, 0)]["tokens"])
    assert shards[0]["tokens"].shape == (micro_batch, SEQ_LEN // sp_size)


def test_empty_split_has_no_iterator():
    assert build_data_iterator(None, 0, 1, 0, 1) is None
