"""Summarise a megatron-core ``IndexedDataset`` and optionally decode one of its documents."""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ulysses.data.tokenizer_flags import add_tokenizer_arguments  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _indexed import (  # noqa: E402
    ToolError,
    check_dataset,
    load_tokenizer,
    read_sidecar,
    reports_errors,
)
from megatron_ulysses.data.sidecar import describe_tokenizer  # noqa: E402


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-prefix", required=True, help="path without .bin/.idx")
    parser.add_argument("--sample", type=int, default=None, help="document index to print")
    add_tokenizer_arguments(parser, type_help="decode --sample with this tokenizer (else print "
                            "ids)")
    return parser.parse_args(argv)


@reports_errors
def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    check_dataset(args.data_prefix, "--data-prefix")
    record = read_sidecar(args.data_prefix, "--data-prefix")
    dataset = IndexedDataset(args.data_prefix)
    # Documents may span several sequences (sentence-split data), so sum per document.
    doc_bounds = dataset.document_indices
    cumulative = numpy.concatenate([[0], numpy.cumsum(dataset.sequence_lengths, dtype=numpy.int64)])
    doc_lengths = cumulative[doc_bounds[1:]] - cumulative[doc_bounds[:-1]]
    num_docs = len(doc_lengths)
    print(f"prefix:    {args.data_prefix}")
    print(f"dtype:     {dataset.index.dtype.__name__}")
    if record is not None:
        print(f"tokenizer: {describe_tokenizer(record)}")
    print(f"documents: {num_docs}")
    print(f"sequences: {len(dataset)}")
    print(f"tokens:    {int(doc_lengths.sum())}")
    if num_docs:
        print(
            "doc length: min {} / mean {:.1f} / median {:.0f} / p95 {:.0f} / max {}".format(
                int(doc_lengths.min()), float(doc_lengths.mean()), float(numpy.median(doc_lengths)),
                float(numpy.percentile(doc_lengths, 95)), int(doc_lengths.max()),
            )
        )
    if args.sample is None:
        return 0
    if not 0 <= args.sample < num_docs:
        raise ToolError(f"--sample {args.sample} is outside [0, {num_docs}) (document indices)")
    ids = [token for i in range(doc_bounds[args.sample], doc_bounds[args.sample + 1])
           for token in dataset[i].tolist()]
    print(f"document {args.sample}: {len(ids)} tokens")
    print(f"ids: {ids}")
    if args.tokenizer_type is not None:
        tokenizer = load_tokenizer(args)
        if max(ids, default=-1) >= tokenizer.vocab_size:
            raise ToolError(
                f"document {args.sample} holds token id {max(ids)} but the --tokenizer-type "
                f"{args.tokenizer_type} tokenizer has {tokenizer.vocab_size} ids; pass the "
                f"--tokenizer-type/--tokenizer-model/--vocab-size the dataset was made with"
            )
        print(f"text: {tokenizer.detokenize(ids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
