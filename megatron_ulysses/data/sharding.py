"""Pure tensor functions that turn a GPT micro batch into one Ulysses rank's sequence shard.

No process groups here: callers pass ``sp_rank``/``sp_size``. ``--reset-position-ids`` and
``--eod-mask-loss`` are megatron-core's (``GPTDatasetConfig``, or its
``_get_ltor_masks_and_position_ids`` here for batches from a dataset built without them).
``document_boundaries`` is ours because megatron-core 0.16's ``GPTDataset`` gives document
boundaries only as a dense ``[s, s]`` attention mask and 0.19's ``inter_document_masking`` gives
per-sample ``cu_seqlens`` over the unpadded ``s``, while the attention needs them over the
flattened ``[b*s']`` batch padded to a multiple of ``P``, with the padding as its own segment.

Glossary: ``b`` micro batch size, ``s`` full sequence length, ``P`` Ulysses SP size,
``s/P`` local sequence length. ``labels`` are already shifted (``labels[:, i]`` is the token
after ``tokens[:, i]``), as megatron-core's ``GPTDataset`` returns them.
"""

from typing import Dict, Optional, Tuple

import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_ulysses.data.datasets import DataError

# The [b, s] entries of a batch; everything else (cu_seqlens, max_seqlen) describes the global
# sequence and is shared by all SP ranks.
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def pad_to_multiple(batch: Dict[str, torch.Tensor], multiple: int, pad_id: int) -> Dict:
    """Pad every ``[b, s]`` entry on the right to ``[b, s']``, ``s'`` the next multiple of
    ``multiple``. tokens/labels get ``pad_id``, loss_mask 0, position_ids keep counting
    (last+1, last+2, ...). Returns ``batch`` itself when ``s`` is already a multiple.
    """
    seq_len = batch["tokens"].shape[1]
    num_pad = -seq_len % multiple
    if num_pad == 0:
        return batch
    padded = dict(batch)
    for key in ("tokens", "labels"):
        padded[key] = torch.nn.functional.pad(batch[key], (0, num_pad), value=pad_id)
    padded["loss_mask"] = torch.nn.functional.pad(batch["loss_mask"], (0, num_pad), value=0)
    positions = batch["position_ids"]
    steps = torch.arange(1, num_pad + 1, dtype=positions.dtype, device=positions.device)
    padded["position_ids"] = torch.cat([positions, positions[:, -1:] + steps], dim=1)
    return padded


def _document_starts(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """``[b, s]`` bool: True where a document starts (column 0 and right after every EOD)."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod_id
    return starts


def packed_starts(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[b, s]`` bool: True where a segment of a packed sample starts, from each sample's own
    ``cu_seqlens`` ``[b, n]`` (``--sft``'s, trailing entries ``s``)."""
    starts = torch.zeros(cu_seqlens.shape[0], seq_len, dtype=torch.bool)
    rows, entries = torch.nonzero(cu_seqlens < seq_len, as_tuple=True)
    starts[rows, cu_seqlens[rows, entries].to(torch.int64)] = True
    starts[:, 0] = True
    return starts


def document_boundaries(
    tokens: torch.Tensor, eod_id: int, valid_length: Optional[int] = None,
    starts: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, int]:
    """Cumulative document lengths of the batch-major flattened ``[b*s]`` sequence.

    A document starts at every sample start and after every EOD (Megatron-LM
    ``reset_attention_mask``), or where ``starts`` says. Positions ``>= valid_length`` in each
    sample are padding and form one final segment per sample, whatever their token ids.

    Args:
        tokens: ``[b, s]`` token ids.
        eod_id: end-of-document id.
        valid_length: unpadded length; ``None`` means ``s``.
        starts: ``[b, valid_length]`` bool segment starts (``packed_starts``) instead of EODs.
    Returns:
        ``cu_seqlens`` int32 ``[num_segments + 1]`` (first 0, last ``b*s``) and ``max_seqlen``.
    """
    batch_size, seq_len = tokens.shape
    valid_length = seq_len if valid_length is None else valid_length
    if starts is None:
        starts = _document_starts(tokens, eod_id)
    else:
        starts = torch.nn.functional.pad(starts, (0, seq_len - starts.shape[1]), value=False)
    starts[:, valid_length:] = False
    if valid_length < seq_len:
        starts[:, valid_length] = True
    start_positions = torch.nonzero(starts.reshape(-1)).reshape(-1)
    end = torch.tensor([batch_size * seq_len], device=tokens.device)
    cu_seqlens = torch.cat([start_positions, end]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return cu_seqlens, max_seqlen


def apply_resets(batch: Dict[str, torch.Tensor], eod_id: int, reset_position_ids: bool,
                 eod_mask_loss: bool) -> Dict:
    """``--reset-position-ids`` (positions restart after every EOD) and ``--eod-mask-loss``
    (loss_mask 0 on EOD tokens) on a collated ``[b, s]`` batch, row by row with the function
    megatron-core's ``GPTDataset`` applies them with; a sample that already has them is
    unchanged."""
    if not (reset_position_ids or eod_mask_loss):
        return batch
    rows = [_get_ltor_masks_and_position_ids(row, eod_id, reset_position_ids, False,
                                             eod_mask_loss, False) for row in batch["tokens"]]
    batch = dict(batch)
    if eod_mask_loss:
        eod_mask = torch.stack([loss_mask for _, loss_mask, _ in rows])
        batch["loss_mask"] = batch["loss_mask"].masked_fill(eod_mask == 0, 0)
    if reset_position_ids:
        batch["position_ids"] = torch.stack([positions for _, _, positions in rows])
    return batch


def shard_for_sp_rank(batch: Dict, sp_rank: int, sp_size: int) -> Dict:
    """Keep columns ``[r*s/P, (r+1)*s/P)`` of every ``[b, s]`` entry -> ``[b, s/P]``.

    Other entries (``cu_seqlens``, ``max_seqlen``) are global and returned unchanged. Slices are
    made contiguous so a later host-to-device copy moves only this rank's share.
    """
    seq_len = batch["tokens"].shape[1]
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"SP rank {sp_rank} is outside [0, --ulysses-sp-size {sp_size})")
    if seq_len % sp_size != 0:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by --ulysses-sp-size {sp_size}; choose a "
            f"--seq-length that is a multiple of {sp_size} (or pad the batch first)"
        )
    local = seq_len // sp_size
    columns = slice(sp_rank * local, (sp_rank + 1) * local)
    return {
        key: value[:, columns].contiguous() if key in SEQUENCE_KEYS else value
        for key, value in batch.items()
    }


def check_token_ids(sample_batch: Dict[str, torch.Tensor], vocab_size: int) -> None:
    """Raise ``DataError`` when a token or label id is outside ``[0, vocab_size)``: the data was
    tokenized with another (larger) vocabulary than the tokenizer given for training."""
    low = min(int(sample_batch[key].min()) for key in ("tokens", "labels"))
    high = max(int(sample_batch[key].max()) for key in ("tokens", "labels"))
    if high >= vocab_size or low < 0:
        found = f"token id {high}" if high >= vocab_size else f"negative token id {low}"
        raise DataError(
            f"the --data-path data holds {found}, outside the tokenizer's vocabulary of "
            f"{vocab_size} ids (0 to {vocab_size - 1}): it was tokenized with another tokenizer; "
            f"give the --tokenizer-model it was made with (NullTokenizer: a --vocab-size of at "
            f"least {max(high, 1)}), or re-create --data-path with tools/preprocess_data.py"
        )


def get_batch_for_sp_rank(
    sample_batch: Dict[str, torch.Tensor],
    sp_rank: int,
    sp_size: int,
    pad_id: int,
    eod_id: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    vocab_size: Optional[int] = None,
) -> Dict:
    """One SP rank's share of a collated ``GPTDataset`` batch, computed on CPU.

    Applies ``--eod-mask-loss`` and ``--reset-position-ids`` (``apply_resets``) on the unpadded
    sequence, pads ``s`` to a multiple of ``P`` (padding: loss_mask 0, positions counting on),
    computes ``cu_seqlens``/``max_seqlen`` over the padded ``[b*s']`` sequence when
    ``reset_attention_mask`` or the samples are packed (padding is its own final segment per
    sample), then shards.

    Args:
        sample_batch: ``tokens labels loss_mask position_ids``, each ``[b, s]``; packed samples
            (``--sft``) also ``cu_seqlens`` ``[b, s + 1]``, their segments' own boundaries.
        reset_position_ids, eod_mask_loss: needed only when the dataset was built without them
            (``build_train_valid_test_datasets``); passing them again changes nothing.
        vocab_size: the tokenizer's vocabulary size; when given, token ids outside
            ``[0, vocab_size)`` raise ``DataError`` (a ``ValueError``) here, on CPU, instead of
            an index error in the embedding (a device-side assert on GPU).
    Returns:
        ``tokens labels loss_mask position_ids`` ``[b, s'/P]`` and, when
        ``reset_attention_mask`` or packed, ``cu_seqlens`` (int32) and ``max_seqlen`` (int).
    """
    tokens = sample_batch["tokens"]
    if vocab_size is not None:
        check_token_ids(sample_batch, vocab_size)
    batch = apply_resets({key: sample_batch[key] for key in SEQUENCE_KEYS}, eod_id,
                         reset_position_ids, eod_mask_loss)
    batch = pad_to_multiple(batch, sp_size, pad_id)
    starts = (packed_starts(sample_batch["cu_seqlens"], tokens.shape[1])
              if "cu_seqlens" in sample_batch else None)
    if reset_attention_mask or starts is not None:
        batch["cu_seqlens"], batch["max_seqlen"] = document_boundaries(
            batch["tokens"], eod_id, valid_length=tokens.shape[1], starts=starts
        )
    return shard_for_sp_rank(batch, sp_rank, sp_size)
