"""Concatenate several megatron-core ``IndexedDataset`` prefixes (``.bin/.idx``) into one.

Documents keep their order: all of the first ``--input`` prefix, then the second, and so on.
"""

import argparse
import os
import sys
from typing import List, Optional


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, metavar="PREFIX",
                        help="dataset prefixes (paths without .bin/.idx)")
    parser.add_argument("--output-prefix", required=True)
    args = parser.parse_args(argv)
    if args.output_prefix in args.input:
        parser.error(f"--output-prefix {args.output_prefix!r} is also an --input prefix")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    from megatron.core.datasets.indexed_dataset import (
        IndexedDataset,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    missing = [prefix for prefix in args.input if not IndexedDataset.exists(prefix)]
    if missing:
        raise SystemExit(f"--input prefixes without .bin/.idx files: {missing}")
    dtypes = {prefix: IndexedDataset(prefix).index.dtype for prefix in args.input}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{prefix}: {dtype.__name__}" for prefix, dtype in dtypes.items())
        raise SystemExit(
            f"--input datasets use different token dtypes ({listed}); re-run "
            f"tools/preprocess_data.py for them with the same --tokenizer-type/--tokenizer-model"
        )

    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    bin_path, idx_path = get_bin_path(args.output_prefix), get_idx_path(args.output_prefix)
    tmp_suffix = f".tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(bin_path + tmp_suffix, dtype=dtypes[args.input[0]])
    for prefix in args.input:
        builder.add_index(prefix)
    builder.finalize(idx_path + tmp_suffix)
    os.replace(bin_path + tmp_suffix, bin_path)
    os.replace(idx_path + tmp_suffix, idx_path)

    merged = IndexedDataset(args.output_prefix)
    print(
        f"merged {len(args.input)} datasets into {args.output_prefix}: "
        f"{len(merged.document_indices) - 1} documents, "
        f"{int(merged.sequence_lengths.sum())} tokens",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
