"""Concatenate several megatron-core ``IndexedDataset`` prefixes (``.bin/.idx``) into one.

Documents keep their order: all of the first ``--input`` prefix, then the second, and so on.
Inputs are checked first (damaged files, different tokenizers or token dtypes are refused) and
the output never replaces an input file, whatever path names it.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _indexed import (  # noqa: E402
    Staged,
    ToolError,
    check_dataset,
    dataset_files,
    exit_on_sigterm,
    read_sidecar,
    reports_errors,
)
from megatron_ulysses.data.sidecar import (  # noqa: E402
    describe_tokenizer,
    same_tokenizer,
    write_sidecar,
)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, metavar="PREFIX",
                        help="dataset prefixes (paths without .bin/.idx)")
    parser.add_argument("--output-prefix", required=True)
    args = parser.parse_args(argv)
    # Real paths, so that ./x vs x, a symlinked directory or a symlinked file all count as one.
    inputs = {os.path.realpath(path): path
              for prefix in args.input for path in dataset_files(prefix)}
    for path in dataset_files(args.output_prefix):
        if os.path.realpath(path) in inputs:
            parser.error(f"--output-prefix {args.output_prefix!r} would overwrite the input file "
                         f"{inputs[os.path.realpath(path)]!r} (as {path!r}); choose an "
                         f"--output-prefix that is none of the --input prefixes")
    return args


def check_tokenizers(prefixes: List[str]) -> Optional[dict]:
    """The inputs' common tokenizer record (``None`` unless every input has one); refuses two
    inputs whose records differ."""
    records = [(prefix, read_sidecar(prefix, "--input")) for prefix in prefixes]
    known = [(prefix, record) for prefix, record in records if record is not None]
    for prefix, record in known[1:]:
        if not same_tokenizer(known[0][1], record):
            raise ToolError(
                f"--input {known[0][0]!r} and {prefix!r} were made by different tokenizers "
                f"({describe_tokenizer(known[0][1])} vs {describe_tokenizer(record)}); re-run "
                f"tools/preprocess_data.py for one of them with the other's "
                f"--tokenizer-type/--tokenizer-model/--vocab-size"
            )
    return known[0][1] if known and len(known) == len(records) else None


@reports_errors
def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    exit_on_sigterm()
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtypes = {prefix: check_dataset(prefix, "--input").dtype for prefix in args.input}
    record = check_tokenizers(args.input)
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{prefix}: {dtype.__name__}" for prefix, dtype in dtypes.items())
        raise ToolError(
            f"--input datasets use different token dtypes ({listed}); re-run "
            f"tools/preprocess_data.py for them with the same --tokenizer-type/--tokenizer-model"
        )

    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    bin_path, idx_path, sidecar_path = dataset_files(args.output_prefix)
    with Staged([bin_path, idx_path] + ([sidecar_path] if record else [])) as staged:
        builder = IndexedDatasetBuilder(staged.tmp[bin_path], dtype=dtypes[args.input[0]])
        for prefix in args.input:
            builder.add_index(prefix)
        builder.finalize(staged.tmp[idx_path])
        if record:
            write_sidecar(staged.tmp[sidecar_path], record)
        staged.publish()
    if not record and os.path.exists(sidecar_path):
        os.remove(sidecar_path)  # left by an earlier dataset at this prefix: no longer true

    merged = check_dataset(args.output_prefix, "--output-prefix")
    print(
        f"merged {len(args.input)} datasets into {args.output_prefix}: "
        f"{merged.documents} documents, {merged.tokens} tokens",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
