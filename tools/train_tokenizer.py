"""Train a sentencepiece model usable with ``--tokenizer-type GPTSentencePieceTokenizer``.

Special ids are fixed (unk 0, bos 1, eos 2 = EOD, pad 3) and training is single threaded over
the unshuffled input, so the same corpus and flags always give the same model.
"""

import argparse
import io
import os
import sys
from pathlib import Path
from typing import Iterator, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from preprocess_data import open_input, parse_json_line  # noqa: E402

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# sentencepiece silently skips training lines longer than this (in UTF-8 bytes), so
# iter_training_lines splits longer lines (a whole jsonl document often is one) into pieces.
MAX_SENTENCE_BYTES = 1 << 15


def split_long_line(line: str, limit: int = MAX_SENTENCE_BYTES) -> Iterator[str]:
    """``line`` in pieces of at most ``limit`` UTF-8 bytes, cut at whitespace (a piece without
    whitespace is cut between two characters)."""
    data = line.encode("utf-8")
    while len(data) > limit:
        cut = max(data.rfind(b" ", 0, limit + 1), data.rfind(b"\t", 0, limit + 1))
        if cut <= 0:
            cut = limit
            while data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
                cut -= 1
        yield data[:cut].decode("utf-8")
        data = data[cut:].lstrip()
    yield data.decode("utf-8")


def iter_training_lines(path: str, json_keys: List[str]) -> Iterator[str]:
    """Non-empty text lines of a ``.txt`` file or of the ``json_keys`` texts of a jsonl file
    (either optionally ``.gz``), longer ones split by ``split_long_line``; unusable jsonl lines
    are reported on stderr and skipped."""
    is_text = path.endswith(".txt") or path.endswith(".txt.gz")
    with open_input(path) as stream:
        for line_no, raw in enumerate(stream, start=1):
            if is_text:
                texts = [raw.decode("utf-8", errors="replace")]
            else:
                parsed, reason = parse_json_line(raw, json_keys)
                if parsed is None:
                    print(f"{path}:{line_no}: skipped line {line_no}: {reason}", file=sys.stderr)
                    continue
                texts = list(parsed.values())
            for text in texts:
                for line in text.splitlines():
                    yield from (piece for piece in split_long_line(line) if piece.strip())


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", required=True, help=".jsonl, .jsonl.gz, .txt or .txt.gz")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys to read")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model/.vocab")
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--character-coverage", type=float, default=1.0)
    parser.add_argument("--byte-fallback", action="store_true",
                        help="encode unseen characters as bytes (adds 256 pieces)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input!r} is not a file")
    if args.vocab_size <= PAD_ID + 1:
        parser.error(
            f"--vocab-size must exceed the {PAD_ID + 1} special ids (got {args.vocab_size})"
        )
    return args


def main(argv: Optional[List[str]] = None) -> int:
    import sentencepiece

    args = get_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter_training_lines(args.input, args.json_keys),
            model_writer=model,
            model_type=args.model_type,
            vocab_size=args.vocab_size,
            character_coverage=args.character_coverage,
            byte_fallback=args.byte_fallback,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            num_threads=1,
            shuffle_input_sentence=False,
            input_sentence_size=0,
            max_sentence_length=MAX_SENTENCE_BYTES,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise SystemExit(
            f"sentencepiece training failed for --vocab-size {args.vocab_size} "
            f"--model-type {args.model_type} on --input {args.input!r}: {err}"
        ) from err
    model_path = args.output_prefix + ".model"
    with open(model_path + ".tmp", "wb") as handle:
        handle.write(model.getvalue())
    os.replace(model_path + ".tmp", model_path)
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    with open(args.output_prefix + ".vocab", "w", encoding="utf-8") as handle:
        for piece_id in range(processor.get_piece_size()):
            handle.write(f"{processor.id_to_piece(piece_id)}\t{processor.get_score(piece_id)}\n")
    print(f"wrote {model_path} ({processor.get_piece_size()} pieces)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
