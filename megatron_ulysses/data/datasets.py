"""megatron-core GPT datasets (real ``--data-path`` blends or ``--mock-data``) and a
data-parallel micro-batch sampler.

Every rank of one Ulysses SP group reads the same samples, so sampling is keyed by the pure
data-parallel rank/size; the sequence split happens later in ``sharding``.
"""

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_ulysses.data.tokenizers import TokenizerBase


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
    tokenizer: TokenizerBase,
    seq_length: int,
    train_valid_test_num_samples: Sequence[Optional[int]],
    data_path: Optional[List[str]] = None,
    split: str = "969,30,1",
    mock_data: bool = False,
    seed: int = 1234,
    data_cache_path: Optional[str] = None,
    is_built_on_rank: Callable[[], bool] = _every_rank,
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

    Samples are dicts of ``tokens labels loss_mask position_ids``, each ``[seq_length]``, with
    Megatron's EOD/position/attention resets left to ``sharding`` (they must follow padding).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    check_dataset_helpers()
    if mock_data == bool(data_path):
        raise ValueError(
            f"give exactly one of --data-path (got {data_path!r}) and --mock-data "
            f"(got {mock_data})"
        )
    blend = check_data_path(data_path) if data_path else None
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split if blend is not None else None,
        path_to_cache=data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    dataset_cls = MockGPTDataset if mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        dataset_cls, list(train_valid_test_num_samples), is_built_on_rank, config
    )
    return tuple(builder.build())


def check_data_path(data_path: List[str]) -> Tuple:
    """Parse ``--data-path`` words into megatron-core's blend and check every prefix has its
    ``.bin/.idx`` files; raises ``ValueError``/``FileNotFoundError`` naming the flag."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import get_blend_from_list

    try:
        blend = get_blend_from_list(list(data_path))
    except (AssertionError, ValueError):
        raise ValueError(f"--data-path {' '.join(data_path)!r}: expected PREFIX ... or WEIGHT "
                         "PREFIX WEIGHT PREFIX ...") from None
    missing = [prefix for prefix in blend[0] if not IndexedDataset.exists(prefix)]
    if missing:
        raise FileNotFoundError(
            f"--data-path prefixes without .bin/.idx files: {missing} (build them with "
            f"tools/preprocess_data.py --output-prefix)"
        )
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
    return iter(loader)
