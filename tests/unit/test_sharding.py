"""Sequence sharding: shards reassemble the full batch, positions and cu_seqlens are global and
match Megatron-LM's reset semantics."""

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_ulysses.data.sharding import (
    SEQUENCE_KEYS,
    apply_resets,
    document_boundaries,
    get_batch_for_sp_rank,
    pad_to_multiple,
    shard_for_sp_rank,
)

pytestmark = pytest.mark.core_version  # megatron-core's version changes what these test

EOD, PAD = 1, 0


def make_batch(batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """A packed GPTDataset-like batch ``[b, s]`` with EODs inside (ids 2..9, EOD = 1)."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(2, 10, (batch_size, seq_len + 1), generator=generator)
    text[torch.rand(text.shape, generator=generator) < 0.2] = EOD
    return {
        "tokens": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "loss_mask": torch.ones(batch_size, seq_len),
        "position_ids": torch.arange(seq_len).repeat(batch_size, 1),
    }


def gather_shards(batch: dict, sp_size: int, **kwargs) -> list:
    return [
        get_batch_for_sp_rank(batch, rank, sp_size, PAD, EOD, **kwargs) for rank in range(sp_size)
    ]


@pytest.mark.parametrize("seq_len", [16, 15])
@pytest.mark.parametrize("sp_size", [1, 2, 4])
@pytest.mark.parametrize("resets", [False, True])
def test_shards_concatenate_to_the_unsharded_batch(seq_len, sp_size, resets):
    batch = make_batch(2, seq_len)
    flags = dict(reset_position_ids=resets, reset_attention_mask=resets, eod_mask_loss=resets)
    full = get_batch_for_sp_rank(batch, 0, 1, PAD, EOD, **flags)
    shards = gather_shards(batch, sp_size, **flags)
    padded_len = -(-seq_len // sp_size) * sp_size
    for key in SEQUENCE_KEYS:
        assert all(shard[key].shape == (2, padded_len // sp_size) for shard in shards)
        joined = torch.cat([shard[key] for shard in shards], dim=1)
        torch.testing.assert_close(joined[:, :seq_len], full[key][:, :seq_len])
    # The unpadded prefix is exactly the input batch (up to the requested resets).
    torch.testing.assert_close(torch.cat([s["tokens"] for s in shards], 1)[:, :seq_len],
                               batch["tokens"])
    torch.testing.assert_close(torch.cat([s["labels"] for s in shards], 1)[:, :seq_len],
                               batch["labels"])
    if resets:
        assert all(torch.equal(s["cu_seqlens"], shards[0]["cu_seqlens"]) for s in shards)
        assert shards[0]["cu_seqlens"][-1] == 2 * padded_len
    else:
        assert "cu_seqlens" not in shards[0]


def test_padding_values():
    batch = make_batch(2, 6)
    shards = gather_shards(batch, 4)
    tokens = torch.cat([s["tokens"] for s in shards], 1)
    labels = torch.cat([s["labels"] for s in shards], 1)
    loss_mask = torch.cat([s["loss_mask"] for s in shards], 1)
    positions = torch.cat([s["position_ids"] for s in shards], 1)
    assert tokens.shape == (2, 8)
    assert (tokens[:, 6:] == PAD).all() and (labels[:, 6:] == PAD).all()
    assert (loss_mask[:, 6:] == 0).all() and (loss_mask[:, :6] == 1).all()
    assert positions.tolist() == [list(range(8))] * 2


def test_pad_to_multiple_is_noop_when_divisible():
    batch = make_batch(1, 8)
    assert pad_to_multiple(batch, 4, PAD) is batch


def test_positions_are_global_offsets():
    batch = make_batch(3, 12)
    for rank, shard in enumerate(gather_shards(batch, 4)):
        expected = torch.arange(rank * 3, (rank + 1) * 3).repeat(3, 1)
        assert torch.equal(shard["position_ids"], expected)


def test_reset_position_ids_and_eod_mask_match_megatron():
    batch = make_batch(3, 20, seed=3)
    shards = gather_shards(batch, 4, reset_position_ids=True, eod_mask_loss=True)
    positions = torch.cat([s["position_ids"] for s in shards], 1)
    loss_mask = torch.cat([s["loss_mask"] for s in shards], 1)
    for row in range(3):
        _, megatron_loss_mask, megatron_positions = _get_ltor_masks_and_position_ids(
            batch["tokens"][row], EOD, True, False, True, False
        )
        assert torch.equal(positions[row], megatron_positions)
        assert torch.equal(loss_mask[row], megatron_loss_mask)


def test_resets_by_hand():
    tokens = torch.tensor([[5, EOD, 6, 7, EOD, EOD, 8]])
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.tensor([[1., 1, 0, 1, 1, 1, 1]]),
             "position_ids": torch.arange(7).unsqueeze(0)}
    reset = apply_resets(batch, EOD, reset_position_ids=True, eod_mask_loss=True)
    assert reset["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    # The EOD mask adds to the incoming mask (here a 0 at column 2) and keeps its dtype.
    assert reset["loss_mask"].tolist() == [[1, 0, 0, 1, 0, 0, 1]]
    assert reset["loss_mask"].dtype == torch.float32
    assert apply_resets(batch, EOD, False, False) is batch
    only_positions = apply_resets(batch, EOD, reset_position_ids=True, eod_mask_loss=False)
    assert only_positions["loss_mask"] is batch["loss_mask"]
    # Applying them again changes nothing (samples from a dataset built with them).
    again = apply_resets(reset, EOD, reset_position_ids=True, eod_mask_loss=True)
    assert all(torch.equal(again[key], reset[key]) for key in SEQUENCE_KEYS)


def test_reset_positions_then_padding():
    """Resets act on the unpadded sequence; padding then gets loss_mask 0 and counts on."""
    batch = {"tokens": torch.tensor([[5, EOD, 6, 7, 8, EOD]]),
             "labels": torch.tensor([[EOD, 6, 7, 8, EOD, 2]]), "loss_mask": torch.ones(1, 6),
             "position_ids": torch.arange(6).unsqueeze(0)}
    shards = gather_shards(batch, 4, reset_position_ids=True, eod_mask_loss=True)
    positions = torch.cat([s["position_ids"] for s in shards], 1)
    loss_mask = torch.cat([s["loss_mask"] for s in shards], 1)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 3, 4, 5]]
    assert loss_mask.tolist() == [[1, 0, 1, 1, 1, 0, 0, 0]]


def test_document_boundaries_by_hand():
    tokens = torch.tensor([[5, EOD, 6, 7], [EOD, 2, 3, EOD]])
    cu_seqlens, max_seqlen = document_boundaries(tokens, EOD)
    # Sample 0: [5 EOD][6 7]; sample 1: [EOD][2 3 EOD]; trailing EOD starts nothing.
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 2, 4, 5, 8]
    assert max_seqlen == 3


def test_padding_is_its_own_final_segment():
    # EOD == PAD on purpose: padded positions must still form exactly one segment per sample.
    batch = {
        "tokens": torch.tensor([[5, EOD, 6, 7, 8, 9]]),
        "labels": torch.tensor([[EOD, 6, 7, 8, 9, 2]]),
        "loss_mask": torch.ones(1, 6),
        "position_ids": torch.arange(6).unsqueeze(0),
    }
    shard = get_batch_for_sp_rank(batch, 1, 4, EOD, EOD, reset_attention_mask=True)
    assert shard["cu_seqlens"].tolist() == [0, 2, 6, 8]
    assert shard["max_seqlen"] == 4
    assert shard["tokens"].tolist() == [[6, 7]]


def test_cu_seqlens_reproduce_megatron_attention_mask():
    batch = make_batch(1, 24, seed=5)
    cu_seqlens, _ = document_boundaries(batch["tokens"], EOD)
    segment = torch.zeros(24, dtype=torch.long)
    segment[cu_seqlens[1:-1].long()] = 1
    segment = segment.cumsum(0)
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()
    megatron_masked, _, _ = _get_ltor_masks_and_position_ids(
        batch["tokens"][0], EOD, False, True, False, True
    )
    assert torch.equal(allowed, ~megatron_masked[0])


def test_shard_leaves_global_entries_untouched():
    batch = make_batch(1, 8)
    batch["cu_seqlens"] = torch.tensor([0, 3, 8], dtype=torch.int32)
    batch["max_seqlen"] = 5
    shard = shard_for_sp_rank(batch, 1, 2)
    assert shard["cu_seqlens"] is batch["cu_seqlens"] and shard["max_seqlen"] == 5
    assert torch.equal(shard["tokens"], batch["tokens"][:, 4:])


def test_indivisible_sequence_names_flags():
    message = "10 is not divisible by --ulysses-sp-size 4.*--seq-length"
    with pytest.raises(ValueError, match=message):
        shard_for_sp_rank(make_batch(1, 10), 0, 4)
    with pytest.raises(ValueError, match="--ulysses-sp-size 2"):
        shard_for_sp_rank(make_batch(1, 8), 2, 2)
