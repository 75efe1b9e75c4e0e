"""megatron-core GPT datasets (real ``--data-path`` blends or ``--mock-data``) and a
data-parallel micro-batch sampler.

Every rank of one Ulysses SP group reads the same samples, so sampling is keyed by the pure
data-parallel rank/size; the sequence split happens later in ``sharding``.
"""

import math
import os
import re
import struct
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy
import torch

from ..training.processes import helpers_keep_signals_blocked
from .sidecar import check_made_with

SPLIT_NAMES = ("train", "valid", "test")


class DataError(ValueError):
    """Bad ``--data-path`` data (damaged files, token ids outside the vocabulary) or a ``--split``
    that does not fit it. The message names the flag to change; ``pretrain_gpt.py`` prints it
    as one line and exits with status 2."""


def check_dataset_helpers() -> None:
    """Fail early, with the fix, if megatron-core's compiled dataset index helpers are missing.

    megatron-core wheels (cp311/cp312, x86_64 manylinux) ship ``helpers_cpp``; source installs
    and other platforms must compile ``helpers.cpp`` themselves.
    """
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError as err:
        import megatron.core.datasets as mcore_datasets

        raise ImportError(
            "megatron-core's C++ dataset helpers (megatron.core.datasets.helpers_cpp) are missing; "
            "install a megatron-core binary wheel for this Python or compile them (g++ and the "
            "pybind11 headers bundled with torch suffice):\n"
            f"  cd {mcore_datasets.__path__[0]} && g++ -O3 -shared -std=c++17 -fPIC "
            "-I$(python -c 'import torch.utils.cpp_extension as c; print(c.include_paths()[0])') "
            "-I$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"include\"])') "
            "helpers.cpp -o helpers_cpp$(python -c 'import sysconfig; "
            "print(sysconfig.get_config_var(\"EXT_SUFFIX\"))')"
        ) from err


def _every_rank() -> bool:
    return True


def build_train_valid_test_datasets(
    tokenizer: Any,
    seq_length: int,
    train_valid_test_num_samples: Sequence[Optional[int]],
    data_path: Optional[List[str]] = None,
    split: str = "969,30,1",
    mock_data: bool = False,
    seed: int = 1234,
    data_cache_path: Optional[str] = None,
    is_built_on_rank: Callable[[], bool] = _every_rank,
    reset_position_ids: bool = False,
    eod_mask_loss: bool = False,
    data_path_per_split: Optional[Sequence[Optional[List[str]]]] = None,
    mmap_bin_files: bool = True,
    sft: bool = False,
) -> Tuple:
    """Build (train, valid, test) megatron-core ``GPTDataset`` splits; a split is ``None`` when
    its weight in ``split`` is 0.

    Args:
        data_path: ``--data-path`` words: one prefix, several prefixes, or weight/prefix pairs
            such as ``["0.7", "prefixA", "0.3", "prefixB"]``.
        split: ``--split`` train/valid/test weights, e.g. ``"969,30,1"``.
        mock_data: ``--mock-data``: megatron-core's ``MockGPTDataset`` instead of ``data_path``.
        train_valid_test_num_samples: samples to draw per split (data wraps into extra epochs).
        data_cache_path: directory for megatron-core's index caches (``None``: next to the
            data). megatron-core 0.16 needs ``torch.distributed`` initialised to cache a
            weighted blend.
        is_built_on_rank: collective-aware builder hook; when ``torch.distributed`` is
            initialised the builder calls ``barrier`` and must be called on every rank.
        reset_position_ids, eod_mask_loss: ``--reset-position-ids``/``--eod-mask-loss``, applied
            by megatron-core's ``GPTDataset`` to each sample (``GPTDatasetConfig``).
        data_path_per_split: ``--train-data-path``/``--valid-data-path``/``--test-data-path``
            words (``None`` for a split not given): each split's own blend, no ``split``.
        mmap_bin_files: ``False`` (``--no-mmap-bin-files``): read ``.bin`` files with file
            reads instead of ``mmap``.
        sft: ``--sft``: the paths are JSONL conversation files, read by ``SFTDataset``
            (``sft_dataset``; ``tokenizer`` an ``SFTTokenizer``).

    Samples are dicts of ``tokens labels loss_mask position_ids``, each ``[seq_length]``, built
    by ``tokenizer`` (one of ``build_tokenizer``'s).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    from .sft_dataset import SFTDataset

    check_dataset_helpers()
    blend, blends = _blends(data_path, data_path_per_split, mock_data, sft)
    config = _dataset_config(tokenizer, seq_length, blend, split, seed, data_cache_path,
                             reset_position_ids, eod_mask_loss, blends, mmap_bin_files)
    dataset_cls = SFTDataset if sft else MockGPTDataset if mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        dataset_cls, list(train_valid_test_num_samples), is_built_on_rank, config
    )
    return tuple(builder.build())


def _blends(data_path, data_path_per_split, mock_data: bool, sft: bool = False):
    """(the --data-path blend, the per-split blends): exactly one data source is given. The
    files' contents and the split are check_data_path's, run once by the trainer first."""
    per_split = any(data_path_per_split or ())
    if mock_data + bool(data_path) + per_split != 1:
        raise ValueError(
            f"give exactly one of --data-path (got {data_path!r}), --train/valid/test-data-path "
            f"(got {data_path_per_split!r}) and --mock-data (got {mock_data})"
        )
    blend = parse_data_path(data_path, jsonl=sft) if data_path else None
    blends = [parse_data_path(words, f"--{name}-data-path", sft) if words else None
              for name, words in zip(SPLIT_NAMES, data_path_per_split)] if per_split else None
    return blend, blends


def _dataset_config(tokenizer, seq_length: int, blend, split: str, seed: int,
                    data_cache_path: Optional[str], reset_position_ids: bool,
                    eod_mask_loss: bool, blend_per_split=None, mmap_bin_files: bool = True):
    """megatron-core's ``GPTDatasetConfig`` (``blend`` and ``blend_per_split`` None: mock data;
    ``split`` only with ``blend``).
    ``--reset-attention-mask`` is not passed on: ``GPTDatasetConfig.reset_attention_mask`` only
    shapes the dense ``[s, s]`` attention mask (off here, ``create_attention_mask=False``);
    ``sharding.document_boundaries`` gives the attention its ``cu_seqlens`` instead."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split if blend is not None else None,
        mmap_bin_files=mmap_bin_files,
        path_to_cache=data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )


def unquote(split: str) -> str:
    """``--split`` without one pair of matching surrounding quotes: Megatron-LM's Llama
    examples pass ``"'99,1,0'"`` (a bash array element expanded unquoted), whose digits its own
    parser reads."""
    if len(split) >= 2 and split[0] == split[-1] and split[0] in "'\"":
        return split[1:-1]
    return split


def parse_split(split: str) -> List[float]:
    """``--split`` weights, e.g. ``"969,30,1"`` -> ``[969.0, 30.0, 1.0]``: one to three
    non-negative decimals separated by ``,`` (or ``/``); missing weights are 0, as in
    megatron-core, whose own parser silently drops signs and anything but digits and dots.
    Raises ``ValueError`` naming ``--split``."""
    parts = [part.strip() for part in re.split(r"[,/]", unquote(str(split)))]
    usage = ("give 1 to 3 non-negative train,valid,test weights separated by commas, e.g. "
             "--split 969,30,1 or --split 99,1,0")
    if not 1 <= len(parts) <= len(SPLIT_NAMES):
        raise ValueError(f"--split {split!r} has {len(parts)} parts: {usage}")
    if not all(re.fullmatch(r"\d+(\.\d*)?|\.\d+", part) for part in parts):
        raise ValueError(f"--split {split!r} is not a list of non-negative numbers: {usage}")
    weights = [float(part) for part in parts] + [0.0] * (len(SPLIT_NAMES) - len(parts))
    if not all(math.isfinite(weight) for weight in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} gives every split weight 0: {usage}")
    return weights


def split_document_ranges(split: str, num_documents: int) -> List[Optional[Tuple[int, int]]]:
    """The ``[begin, end)`` document range of each split (``None`` for a 0-weight split), as
    megatron-core's ``BlendedMegatronDatasetBuilder`` cuts a ``GPTDataset`` out of an index of
    ``num_documents`` sequences: its split matrix, then ``round(bookend * num_documents)``."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )
    from megatron.core.datasets.utils import normalize

    matrix = convert_split_vector_to_split_matrix(normalize(parse_split(split)))
    return [None if bookends is None else
            (int(round(bookends[0] * float(num_documents))),
             int(round(bookends[1] * float(num_documents))))
            for bookends in matrix]


# megatron.core.datasets.indexed_dataset's .idx: magic, version <Q (1), dtype code <B, sequence
# count <Q, document count <Q; then int32 sequence lengths, int64 sequence byte offsets into the
# .bin, int64 document indices (first sequence of each document, then the sequence count) and,
# for multimodal data only, int8 sequence modes.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")
_CHUNK = 1 << 22  # index entries checked at a time


class IndexSummary(NamedTuple):
    """What ``check_index`` read from a ``.idx``. ``sequence_lengths`` (int32, memory-mapped)
    are what megatron-core's ``GPTDataset`` splits and samples: each of the ``sequences`` is one
    of its documents. ``documents`` counts the ``.idx`` document indices' documents (several
    sequences each in sentence-split data)."""
    prefix: str
    dtype: numpy.dtype
    sequence_lengths: numpy.ndarray
    sequences: int
    documents: int
    tokens: int


def _damaged(prefix: str, flag: str, problem: str) -> DataError:
    return DataError(f"{flag} {prefix!r}: {problem}; re-create it with "
                     f"tools/preprocess_data.py or give another {flag}")


def check_index(prefix: str, flag: str = "--data-path") -> IndexSummary:
    """Check that ``prefix.idx`` has megatron-core's layout and agrees with ``prefix.bin``
    (megatron-core asserts, fails inside numpy, or reads past the end of the ``.bin`` in the
    middle of training on damaged files, and cannot map an empty ``.bin``). Raises
    ``DataError`` naming ``flag``, the option that gave ``prefix``."""
    from megatron.core.datasets.indexed_dataset import DType

    idx_path, bin_path = _check_files(prefix, flag)
    code, sequences, doc_count = _read_header(prefix, flag, idx_path)
    dtype = numpy.dtype(DType.dtype_from_code(code))
    lengths, tokens = _scan_index(prefix, flag, idx_path, dtype, sequences, doc_count)
    bin_size = os.path.getsize(bin_path)
    if bin_size != tokens * dtype.itemsize:
        raise _damaged(prefix, flag, f"{bin_path} is {bin_size} bytes but {idx_path} says "
                                     f"{tokens} tokens x {dtype.itemsize} bytes = "
                                     f"{tokens * dtype.itemsize}")
    if tokens == 0:
        raise _damaged(prefix, flag, f"it holds no tokens ({doc_count - 1} documents; "
                                     "megatron-core cannot read an empty .bin)")
    return IndexSummary(prefix, dtype, lengths, sequences, doc_count - 1, tokens)


def _check_files(prefix: str, flag: str) -> Tuple[str, str]:
    """``prefix``'s .idx and .bin paths, both regular files."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    missing = [path for path in (idx_path, bin_path) if not os.path.exists(path)]
    problems = [f"there is no {' and no '.join(missing)}"] if missing else []
    problems += [f"{path} is not a regular file" for path in (idx_path, bin_path)
                 if path not in missing and not os.path.isfile(path)]
    if problems:
        hint = (" (give the prefix without .bin/.idx)"
                if missing and prefix.endswith((".bin", ".idx")) else "")
        raise _damaged(prefix, flag, " and ".join(problems) + hint)
    return idx_path, bin_path


def _read_header(prefix: str, flag: str, idx_path: str) -> Tuple[int, int, int]:
    """The .idx header's (dtype code, sequences, document indices), checked against
    megatron-core's magic, version and dtype codes and the file's size."""
    from megatron.core.datasets.indexed_dataset import DType

    idx_size = os.path.getsize(idx_path)
    try:
        with open(idx_path, "rb") as stream:
            header = stream.read(_IDX_HEADER.size)
    except OSError as error:
        raise _damaged(prefix, flag, f"cannot read {idx_path} ({error.strerror})") from None
    if len(header) < _IDX_HEADER.size:
        raise _damaged(prefix, flag, f"{idx_path} is truncated ({idx_size} bytes, shorter than "
                                     f"the {_IDX_HEADER.size}-byte header)")
    magic, version, code, sequences, doc_count = _IDX_HEADER.unpack(header)
    if magic != _IDX_MAGIC:
        raise _damaged(prefix, flag, f"{idx_path} is not a megatron-core index (starts with "
                                     f"{magic!r}, not {_IDX_MAGIC!r})")
    codes = {dtype.value for dtype in DType}
    if version != 1 or code not in codes:
        raise _damaged(prefix, flag, f"{idx_path} has index version {version} and dtype code "
                                     f"{code} (megatron-core reads version 1, dtype codes "
                                     f"{min(codes)}-{max(codes)})")
    needed = _IDX_HEADER.size + 12 * sequences + 8 * doc_count
    if idx_size not in (needed, needed + sequences):  # + sequences: multimodal modes
        raise _damaged(prefix, flag, f"{idx_path} is {idx_size} bytes but its header "
                                     f"({sequences} sequences, {doc_count} document indices) "
                                     f"needs {needed}")
    return code, sequences, doc_count


def _scan_index(prefix: str, flag: str, idx_path: str, dtype, sequences: int,
                doc_count: int):
    """The sequence lengths (memory-mapped) and their token total, after checking that the
    offsets follow the lengths and the document indices run from 0 to `sequences` in order."""
    offset = _IDX_HEADER.size
    lengths = numpy.memmap(idx_path, numpy.int32, "r", offset, (sequences,))
    pointers = numpy.memmap(idx_path, numpy.int64, "r", offset + 4 * sequences, (sequences,))
    doc_indices = numpy.memmap(idx_path, numpy.int64, "r", offset + 12 * sequences, (doc_count,))
    consistent = doc_count > 0 and doc_indices[0] == 0 and doc_indices[-1] == sequences
    tokens = 0
    for start in range(0, sequences, _CHUNK):
        chunk = lengths[start:start + _CHUNK].astype(numpy.int64)
        starts = (tokens + numpy.cumsum(chunk) - chunk) * dtype.itemsize
        consistent = consistent and bool((chunk >= 0).all()) and \
            bool((pointers[start:start + _CHUNK] == starts).all())
        tokens += int(chunk.sum())
    for start in range(0, doc_count - 1, _CHUNK):
        steps = numpy.diff(doc_indices[start:start + _CHUNK + 1])
        consistent = consistent and bool((steps >= 0).all())
    if not consistent:
        raise _damaged(prefix, flag, f"{idx_path} has inconsistent document indices, sequence "
                                     "lengths or sequence offsets")
    return lengths, tokens


def check_split(split: str, index: IndexSummary) -> None:
    """Every split with a positive ``--split`` weight must get documents and tokens: megatron-core
    loops forever (``GPTDataset._get_num_epochs``) building a split of 0 tokens."""
    ranges = split_document_ranges(split, index.sequences)
    counts = [0 if bounds is None else bounds[1] - bounds[0] for bounds in ranges]
    for name, bounds in zip(SPLIT_NAMES, ranges):
        if bounds is None:
            continue
        tokens = int(index.sequence_lengths[bounds[0]:bounds[1]].astype(numpy.int64).sum())
        if tokens > 0:
            continue
        got = (f"0 of the {index.sequences} documents" if bounds[0] == bounds[1] else
               f"{bounds[1] - bounds[0]} documents with 0 tokens")
        per_split = ", ".join(f"{n} {c}" for n, c in zip(SPLIT_NAMES, counts))
        raise DataError(
            f"--split {split} gives the {name} split {got} of --data-path {index.prefix!r} "
            f"(documents per split: {per_split}); give the {name} split more weight, set its "
            f"weight to 0 to build no {name} split, or use more data")


def parse_data_path(data_path: List[str], flag: str = "--data-path",
                    jsonl: bool = False) -> Tuple:
    """``--data-path`` words -> megatron-core's blend ``(prefixes, weights or None)``; every
    prefix must have its ``.bin/.idx`` files (their contents are ``check_data_path``'s), or be a
    file with ``jsonl`` (``--sft``). Raises ``ValueError`` or ``FileNotFoundError`` naming the
    flag."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import get_blend_from_list

    try:
        blend = get_blend_from_list(list(data_path))
    except (AssertionError, ValueError):
        blend = None
    if not blend or not blend[0]:
        raise ValueError(f"{flag} {' '.join(data_path)!r}: expected PREFIX ... or WEIGHT "
                         "PREFIX WEIGHT PREFIX ...")
    weights = blend[1]
    if weights is not None and not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"{flag} {' '.join(data_path)!r}: blend weights must be "
                         f"positive, got {weights} (leave a prefix out to not read it)")
    if jsonl:
        missing = [path for path in blend[0] if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(f"{flag} {missing}: no such file (--sft reads JSONL files "
                                    "of conversations, one sample a line)")
        return blend
    missing = [prefix for prefix in blend[0] if not IndexedDataset.exists(prefix)]
    if missing:
        raise FileNotFoundError(f"{flag} prefixes without .bin/.idx files: {missing} "
                                f"({_missing_fix(data_path, missing, flag)})")
    return blend


def _missing_fix(data_path: List[str], missing: List[str], flag: str) -> str:
    """What to do about ``missing`` prefixes: drop an extension, split a quoted blend
    (``--data-path "$DATA_PATH"`` passes ``"0.5 a 0.5 b"`` as one word), or build them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import get_blend_from_list

    stems = [prefix[:-4] for prefix in missing if prefix.endswith((".bin", ".idx"))
             and IndexedDataset.exists(prefix[:-4])]
    if stems:
        return f"give each prefix without its extension: {stems}"
    words = [word for argument in data_path for word in argument.split()]
    if len(words) > len(data_path):
        try:
            blend = get_blend_from_list(words)
        except (AssertionError, ValueError):
            blend = None
        if blend and blend[0] and all(IndexedDataset.exists(prefix) for prefix in blend[0]):
            return (f"one word holds a whole blend: give its weights and prefixes as separate "
                    f"words (unquoted), {flag} {' '.join(words)}")
    return "build them with tools/preprocess_data.py --output-prefix"


def check_data_path(data_path: List[str], split: Optional[str] = None,
                    flag: str = "--data-path", made_with: Optional[Dict] = None) -> Tuple:
    """Parse ``--data-path`` words into megatron-core's blend, check every prefix has sound
    ``.bin/.idx`` files, was made with the tokenizer of the record ``made_with`` where its own
    record says which (``sidecar.check_made_with``) and, with ``split`` (``--split``), that every
    split with a positive weight gets documents. Raises ``FileNotFoundError`` (missing files) or
    ``ValueError`` (``DataError`` for the files and the split), naming the flag."""
    blend = parse_data_path(data_path, flag)
    if split is not None:
        parse_split(split)
    for prefix in dict.fromkeys(blend[0]):
        index = check_index(prefix, flag)
        if made_with is not None:
            check_made_with(prefix, flag, made_with)
        if split is not None:
            check_split(split, index)
    return blend


class PretrainingSampler:
    """Megatron-LM ``MegatronPretrainingSampler``: sequential, resumable, data-parallel.

    Each global batch step takes ``micro_batch_size * dp_size`` consecutive indices starting at
    ``consumed_samples`` and yields this DP rank's ``micro_batch_size`` of them. All SP ranks of
    one DP rank therefore get identical indices; different DP ranks get disjoint ones.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw (dataset length {total_samples}); check --split")
        if consumed_samples >= total_samples:
            raise ValueError(
                f"consumed samples {consumed_samples} >= dataset length {total_samples}; "
                f"raise --train-samples/--train-iters or start from an earlier checkpoint"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive (got {micro_batch_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is outside [0, {dp_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _rank_slice(self, global_indices: List[int]) -> List[int]:
        start = self.dp_rank * self.micro_batch_size
        return global_indices[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.dp_size
        global_indices: List[int] = []
        for index in range(self.consumed_samples, self.total_samples):
            global_indices.append(index)
            if len(global_indices) == step:
                yield self._rank_slice(global_indices)
                global_indices = []
        # A short tail is only usable when this rank still gets some of it.
        tail = self._rank_slice(global_indices)
        if tail and not self.drop_last:
            yield tail


def build_data_iterator(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
) -> Optional[Iterator]:
    """Iterator of collated micro batches (dicts of ``[b, s]`` CPU tensors) for one DP rank;
    ``None`` when ``dataset`` is ``None`` (an empty split)."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    # Its own generator: iter(DataLoader) draws the workers' base seed from it, and drawing from
    # the global torch RNG instead would shift every dropout mask after a resume.
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(consumed_samples),
    )
    with helpers_keep_signals_blocked():  # the workers: a job's signals are the trainer's
        return iter(loader)
