"""The ``--tokenizer-type`` tokenizers, usable as ``GPTDatasetConfig.tokenizer``.

``GPTSentencePieceTokenizer``, ``HuggingFaceTokenizer`` and ``TikTokenizer`` are megatron-core's
own (``megatron.core.tokenizers.MegatronTokenizer`` with its sentencepiece, huggingface and
tiktoken libraries, which give the same ids in megatron-core 0.16 and 0.19); their flags are
checked first (`tokenizer_flags`), so that errors name the flag.

Four are ours because megatron-core has no tokenizer with their Megatron-LM ids:

* ``SentencePieceTokenizer``: Megatron-LM appends ``<CLS> <SEP> <EOD> <MASK>`` (then pad, bos,
  eos and ``<extra_id_i>``) to the model's pieces and uses ``<EOD>`` as eod, while megatron-core's
  sentencepiece library uses the model's eos as eod and, in its legacy special-token mode, has no
  eod at all.
* ``NullTokenizer``: Megatron-LM's has eod = ``--vocab-size`` and ``vocab_size`` one larger,
  which megatron-core's null library gives in 0.16 but not in 0.19 (eod = ``vocab_size - 1``).
* ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file`` and ``--merge-file``;
  megatron-core's downloads the files when not given and reads the vocab file as the merges.
* ``Llama2Tokenizer``: Megatron-LM's (``--legacy-tokenizer``) puts the model's BOS before every
  text it tokenizes, with eod = eos; megatron-core maps the type to its plain sentencepiece
  library, which is ``GPTSentencePieceTokenizer`` here.

``SFTTokenizer`` (``--sft``'s prompt formats) is in ``sft``: megatron-core 0.16 has none.
"""

import json
import os
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence

from .sft import DEFAULT_PROMPT_FORMAT, SFTTokenizer
from .tokenizer_flags import (
    TIKTOKEN_SPECIAL_TOKENS,
    TOKENIZER_OPTIONS,
    TOKENIZER_TYPES,
    check_files,
    files_of,
    tokenizer_options,
)

def build_tokenizer_from(config: Any):
    """``build_tokenizer`` for the tokenizer flags of ``config`` (attributes)."""
    return build_tokenizer(config.tokenizer_type, config.tokenizer_model, config.vocab_size,
                           vocab_file=config.vocab_file, merge_file=config.merge_file,
                           prompt_format=getattr(config, "sft_tokenizer_prompt_format", None),
                           **tokenizer_options(config))


def _unique_identifiers(tokenizer: Any, path: Optional[str], **options: Any) -> OrderedDict:
    """What megatron-core's datasets hash into their index cache names."""
    identifiers = OrderedDict(
        [("class", f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"),
         ("tokenizer_path", path)])
    identifiers.update((option, str(value)) for option, value in options.items())
    return identifiers


def _load_sentencepiece(model_file: str, tokenizer_type: str, load: Callable[[], Any],
                        num_pieces: Callable[[Any], int]) -> Any:
    """``load()`` of a sentencepiece model file, its errors (sentencepiece raises
    ``RuntimeError`` with a terse protobuf message) raised as a ``ValueError`` naming
    ``--tokenizer-model``."""
    if os.path.isdir(model_file):
        raise ValueError(f"--tokenizer-model {model_file!r} is a directory; --tokenizer-type "
                         f"{tokenizer_type} needs a sentencepiece .model file")
    try:
        loaded = load()
    except (RuntimeError, OSError, ValueError) as error:
        raise ValueError(
            f"--tokenizer-model {model_file!r} is not a sentencepiece model ({error}); "
            f"--tokenizer-type {tokenizer_type} needs the .model file that "
            "tools/train_tokenizer.py or sentencepiece wrote (a HuggingFace tokenizer directory "
            "needs --tokenizer-type HuggingFaceTokenizer)"
        ) from None
    if num_pieces(loaded) == 0:
        raise ValueError(f"--tokenizer-model {model_file!r} is a sentencepiece model without "
                         f"pieces; --tokenizer-type {tokenizer_type} needs a trained model")
    return loaded


def _megatron_core_tokenizer(library: str, path: str, **options: Any):
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        path, metadata_path={"library": library, "model_type": "gpt"}, **options)


class _VocabTokenizer:
    """``vocab_size``, ``vocab`` and ``inv_vocab`` of a tokenizer holding ``_vocab`` (token ->
    id) and ``_inv_vocab``."""

    _vocab: Dict[str, int]
    _inv_vocab: Dict[int, str]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab


class SentencePieceTokenizer(_VocabTokenizer):
    """Megatron-LM ``SentencePieceTokenizer`` (see the module docstring); special tokens
    written literally in the text are encoded to their special ids."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        import sentencepiece

        self.unique_identifiers = _unique_identifiers(self, model_file,
                                                      vocab_extra_ids=vocab_extra_ids)
        self.tokenizer = _load_sentencepiece(
            model_file, "SentencePieceTokenizer",
            lambda: sentencepiece.SentencePieceProcessor(model_file=model_file), len)
        self._vocab = {self.tokenizer.id_to_piece(i): i for i in range(len(self.tokenizer))}
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}
        self._special_tokens: Dict[str, int] = {}

        self.cls = self._add_special_token("<CLS>")
        self.sep = self._add_special_token("<SEP>")
        self.eod = self._add_special_token("<EOD>")
        self.mask = self._add_special_token("<MASK>")
        self.pad = self._add_special_token(self._model_piece(self.tokenizer.pad_id(), "<PAD>"))
        self.bos = self._add_special_token(self._model_piece(self.tokenizer.bos_id(), "<BOS>"))
        self.eos = self._add_special_token(self._model_piece(self.tokenizer.eos_id(), "<EOS>"))
        self.additional_special_tokens_ids = [
            self._add_special_token(f"<extra_id_{i}>") for i in range(vocab_extra_ids)
        ]
        self._inv_special_tokens = {i: token for token, i in self._special_tokens.items()}

    def _model_piece(self, piece_id: int, fallback: str) -> str:
        # sentencepiece reports -1 for ids the model was trained without.
        if 0 <= piece_id < len(self.tokenizer):
            return self.tokenizer.id_to_piece(piece_id)
        return fallback

    def _add_special_token(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        self._special_tokens[token] = self._vocab[token]
        return self._vocab[token]

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        start = 0
        while True:
            hits = [(text.find(token, start), token) for token in self._special_tokens]
            hits = [(pos, token) for pos, token in hits if pos >= 0]
            if not hits:
                break
            pos, token = min(hits)
            ids.extend(self.tokenizer.encode_as_ids(text[start:pos]))
            ids.append(self._special_tokens[token])
            start = pos + len(token)
        ids.extend(self.tokenizer.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, ids: List[int]) -> str:
        pieces: List[str] = []
        run_start = 0
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                pieces.append(self.tokenizer.decode_ids(list(ids[run_start:i])) + " ")
                pieces.append(self._inv_special_tokens[token_id] + " ")
                run_start = i + 1
        pieces.append(self.tokenizer.decode_ids(list(ids[run_start:])))
        return "".join(pieces)


class NullTokenizer:
    """Megatron-LM ``NullTokenizer`` (see the module docstring): text is whitespace-separated
    ids; eod ``--null-tokenizer-eod-id`` (default ``vocab_size``); no pad id unless
    ``--null-tokenizer-pad-id`` gives one."""

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1):
        ids = {"eod_id": eod_id} if eod_id is not None else {}
        ids.update({"pad_id": pad_id} if pad_id != -1 else {})
        self.unique_identifiers = _unique_identifiers(self, None, vocab_size=vocab_size, **ids)
        self.vocab_size = int(vocab_size) + 1
        self.eod = self.eos = int(vocab_size) if eod_id is None else int(eod_id)
        self._pad = int(pad_id)
        for flag, value in (("--null-tokenizer-eod-id", self.eod),
                            ("--null-tokenizer-pad-id", None if pad_id == -1 else self._pad)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{flag} {value} is outside the NullTokenizer's ids [0, "
                                 f"{self.vocab_size}) (--vocab-size {vocab_size} plus eod)")

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: List[int]) -> str:
        return " ".join(str(int(x)) for x in ids)

    @property
    def pad(self) -> int:
        if self._pad == -1:
            raise NotImplementedError("NullTokenizer has no attribute 'pad'")
        return self._pad


class Llama2Tokenizer:
    """Megatron-LM ``Llama2Tokenizer`` (``--legacy-tokenizer``): the sentencepiece model's ids
    with its BOS before every tokenized text; eod = eos; pad is the model's (-1 when none)."""

    def __init__(self, model_file: str):
        import sentencepiece

        self.unique_identifiers = _unique_identifiers(self, model_file)
        self.tokenizer = _load_sentencepiece(
            model_file, "Llama2Tokenizer",
            lambda: sentencepiece.SentencePieceProcessor(model_file=model_file), len)
        self.vocab_size = len(self.tokenizer)
        self.bos, self.eos, self.pad = (self.tokenizer.bos_id(), self.tokenizer.eos_id(),
                                        self.tokenizer.pad_id())
        self.eod = self.eos
        if self.bos < 0:
            raise ValueError(f"--tokenizer-model {model_file!r} has no BOS piece, which "
                             "--tokenizer-type Llama2Tokenizer puts before every text; use "
                             "GPTSentencePieceTokenizer (no BOS) or a model trained with one")

    def tokenize(self, text: str) -> List[int]:
        return [self.bos] + self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.decode_ids(list(ids))


class GPT2BPETokenizer(_VocabTokenizer):
    """Megatron-LM ``GPT2BPETokenizer``: GPT-2's byte-level BPE (``vocab.json`` +
    ``merges.txt``) run by HuggingFace ``tokenizers``; eod is ``<|endoftext|>``; special
    tokens written in the text are encoded as text, as Megatron-LM's encoder does."""

    EOD = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        except ImportError as err:
            raise ImportError("--tokenizer-type GPT2BPETokenizer needs the 'tokenizers' package "
                              "(pip install tokenizers)") from err
        self.unique_identifiers = _unique_identifiers(self, vocab_file, merge_file=merge_file)
        self._vocab = self._read_vocab(vocab_file)
        self._inv_vocab = {i: token for token, i in self._vocab.items()}
        merges = self._read_merges(merge_file, self._vocab)
        self.tokenizer = Tokenizer(models.BPE(self._vocab, merges))
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tokenizer.decoder = decoders.ByteLevel()
        self.eod = self.eos = self._vocab.get(self.EOD)

    @staticmethod
    def _read_vocab(path: str) -> Dict[str, int]:
        try:
            with open(path, encoding="utf-8") as stream:
                vocab = json.load(stream)
        except (OSError, ValueError) as error:
            raise ValueError(f"--vocab-file {path!r} is not GPT-2's vocab.json ({error})") \
                from None
        ids = sorted(vocab.values()) if isinstance(vocab, dict) else None
        if not ids or not all(isinstance(i, int) for i in ids) or ids != list(range(len(ids))):
            raise ValueError(f"--vocab-file {path!r} is not GPT-2's vocab.json: it must map "
                             "tokens to the ids 0 .. n-1")
        return vocab

    @staticmethod
    def _read_merges(path: str, vocab: Dict[str, int]) -> List[tuple]:
        """The merge rules of a ``merges.txt`` (a ``#version`` first line is skipped)."""
        merges = []
        try:
            with open(path, encoding="utf-8") as stream:
                lines = stream.read().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--merge-file {path!r} is not GPT-2's merges.txt ({error})") \
                from None
        for line_no, line in enumerate(lines, start=1):
            if not line.strip() or (line_no == 1 and line.startswith("#version")):
                continue
            pair = line.split(" ")
            if len(pair) != 2 or "".join(pair) not in vocab:
                raise ValueError(f"--merge-file {path!r} line {line_no} ({line[:40]!r}) is not a "
                                 "merge of two tokens into one of --vocab-file's; give the "
                                 "merges.txt that belongs to the vocab.json")
            merges.append(tuple(pair))
        return merges

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _gpt_sentencepiece_tokenizer(model_file: str):
    """megatron-core's sentencepiece tokenizer: the model's own ids, ``eod == eos``; ``pad``
    is the model's pad id, -1 when it has none (as in Megatron-LM's
    ``GPTSentencePieceTokenizer``)."""
    return _load_sentencepiece(
        model_file, "GPTSentencePieceTokenizer",
        lambda: _megatron_core_tokenizer("sentencepiece", model_file),
        lambda tokenizer: tokenizer.vocab_size)


def _huggingface_tokenizer(model_path: str, use_fast: bool, include_special_tokens: bool,
                           trust_remote_code: bool):
    """megatron-core's huggingface tokenizer over a local ``transformers`` tokenizer directory
    (never downloads): ``eod`` is its eos id; text is encoded without the special tokens the
    tokenizer would add (BOS) unless ``include_special_tokens``. ``use_fast`` and
    ``include_special_tokens`` are always given because their defaults differ between
    megatron-core 0.16 and 0.19 (and Megatron-LM's since: fast, with special tokens)."""
    if not os.path.isdir(model_path):
        raise ValueError(
            f"--tokenizer-model {model_path!r} is not a directory; --tokenizer-type "
            "HuggingFaceTokenizer needs a local tokenizer directory (tokenizer.json, "
            "tokenizer_config.json, ...), a sentencepiece .model file needs --tokenizer-type "
            "GPTSentencePieceTokenizer or SentencePieceTokenizer"
        )
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "--tokenizer-type HuggingFaceTokenizer needs the 'transformers' package; install "
            "it or use --tokenizer-type GPTSentencePieceTokenizer with a sentencepiece "
            "--tokenizer-model"
        ) from err
    try:
        return _megatron_core_tokenizer("huggingface", model_path, use_fast=use_fast,
                                        include_special_tokens=include_special_tokens,
                                        trust_remote_code=trust_remote_code)
    except Exception as error:  # megatron-core re-raises transformers' errors as ValueError
        detail = str(error).split("Exception: ", 1)[-1].strip().splitlines()
        raise ValueError(
            f"--tokenizer-model {model_path!r} is not a HuggingFace tokenizer directory "
            f"({detail[0] if detail else type(error).__name__}); --tokenizer-type "
            "HuggingFaceTokenizer needs the directory that tokenizer.save_pretrained() wrote"
        ) from None


def _tiktoken_tokenizer(path: str, vocab_size: Optional[int], pattern: Optional[str],
                        num_special: int, special_tokens: Optional[Sequence[str]]):
    """megatron-core's tiktoken tokenizer: ids ``[0, num_special)`` are ``special_tokens``
    (then ``<SPECIAL_i>``), the ranks of the JSON vocabulary ``path`` follow, cut to
    ``vocab_size`` (default 2**17) ids; eod is ``</s>``; special tokens written in the text are
    encoded as such."""
    try:
        import tiktoken  # noqa: F401
    except ImportError as err:
        raise ImportError("--tokenizer-type TikTokenizer needs the 'tiktoken' package (pip "
                          "install tiktoken, or megatron_ulysses[tiktoken])") from err
    vocab_size = 2 ** 17 if vocab_size is None else vocab_size
    special = list(TIKTOKEN_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    missing = [token for token in TIKTOKEN_SPECIAL_TOKENS if token not in special]
    if missing or len(set(special)) != len(special):
        raise ValueError(f"--tokenizer-special-tokens {' '.join(special)} must hold each of "
                         f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)} once (missing: "
                         f"{' '.join(missing) or 'none'})")
    if not len(special) <= num_special < vocab_size:
        raise ValueError(f"--tiktoken-num-special-tokens {num_special} must be at least the "
                         f"{len(special)} special tokens and below --vocab-size {vocab_size}")
    ranks = _tiktoken_ranks(path)
    if ranks < vocab_size - num_special:
        raise ValueError(f"--tokenizer-model {path!r} has {ranks} ranks, fewer than --vocab-size "
                         f"{vocab_size} minus --tiktoken-num-special-tokens {num_special}; "
                         f"give --vocab-size {ranks + num_special} or less")
    options = {"pattern": pattern} if pattern else {}
    return _megatron_core_tokenizer("tiktoken", path, vocab_size=vocab_size,
                                    num_special_tokens=num_special,
                                    special_tokens=special, **options)


def _tiktoken_ranks(path: str) -> int:
    """The number of ranks in a tiktoken JSON vocabulary: a list of ``{"rank": i,
    "token_bytes": base64, "token_str": str}``, ranks 0.. in order, the first 256 single bytes.
    ``ValueError`` naming ``--tokenizer-model`` if it is not one."""
    import base64
    import binascii

    problem = "" if path.endswith(".json") else "its name does not end in .json"
    try:
        with open(path, encoding="utf-8") as stream:
            vocab = json.load(stream)
        for rank, entry in enumerate(vocab if isinstance(vocab, list) else [None]):
            token = base64.b64decode(entry["token_bytes"], validate=True)
            if entry["rank"] != rank or set(entry) != {"rank", "token_bytes", "token_str"} \
                    or (rank < 256 and token != bytes([rank])):
                problem = problem or f"entry {rank} is {str(entry)[:60]}"
    except (OSError, ValueError, TypeError, KeyError, binascii.Error) as error:
        problem = f"{type(error).__name__}: {error}"
    if problem:
        raise ValueError(f"--tokenizer-model {path!r} is not a tiktoken vocabulary ({problem}); "
                         "--tokenizer-type TikTokenizer needs the JSON list of {rank, "
                         "token_bytes, token_str} with ranks 0, 1, ..., the first 256 the bytes")
    return len(vocab)


def _special_id(tokenizer: Any, name: str) -> Optional[int]:
    """``tokenizer.<name>``, ``None`` when the tokenizer has no such id."""
    try:
        value = getattr(tokenizer, name)
    except (NotImplementedError, AttributeError):
        return None
    return None if value is None else int(value)


def padding_id(tokenizer: Any) -> int:
    """Id used to pad sequences: the tokenizer's pad id when it is a real id, else ``eod``.

    Padded positions always get loss_mask 0, so only embedding-validity matters here.
    """
    pad = _special_id(tokenizer, "pad")
    return pad if pad is not None and 0 <= pad < tokenizer.vocab_size else tokenizer.eod


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    vocab_extra_ids: int = 0,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    prompt_format: Optional[str] = None,
    **options: Any,
):
    """Build the tokenizer named by ``--tokenizer-type``.

    ``tokenizer_model`` (``--tokenizer-model``) is a sentencepiece ``.model`` file, a local
    HuggingFace tokenizer directory or a tiktoken JSON vocabulary; ``vocab_size``
    (``--vocab-size``) is for ``NullTokenizer`` and ``TikTokenizer``; ``vocab_file`` and
    ``merge_file`` (``--vocab-file``, ``--merge-file``) for ``GPT2BPETokenizer``;
    ``prompt_format`` (``--sft-tokenizer-prompt-format``) for ``SFTTokenizer``; ``options``
    are the other ``TOKENIZER_OPTIONS`` (their flags' dests), defaults where not given.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    option = {dest: default for dest, (default, _) in TOKENIZER_OPTIONS.items()}
    option.update(options, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(
                f"--tokenizer-type NullTokenizer needs a positive --vocab-size (got {vocab_size!r})"
            )
        return NullTokenizer(int(vocab_size), option["null_tokenizer_eod_id"],
                             option["null_tokenizer_pad_id"])
    check_files(tokenizer_type, files_of(tokenizer_type, tokenizer_model, vocab_file,
                                           merge_file))
    builders = {
        "GPT2BPETokenizer": lambda: GPT2BPETokenizer(vocab_file, merge_file),
        "SentencePieceTokenizer": lambda: SentencePieceTokenizer(
            tokenizer_model, vocab_extra_ids=option["vocab_extra_ids"]),
        "GPTSentencePieceTokenizer": lambda: _gpt_sentencepiece_tokenizer(tokenizer_model),
        "Llama2Tokenizer": lambda: Llama2Tokenizer(tokenizer_model),
        "TikTokenizer": lambda: _tiktoken_tokenizer(
            tokenizer_model, vocab_size, option["tiktoken_pattern"],
            option["tiktoken_num_special_tokens"], option["tokenizer_special_tokens"]),
        "HuggingFaceTokenizer": lambda: _huggingface_tokenizer(
            tokenizer_model, option["tokenizer_hf_use_fast"],
            option["tokenizer_hf_include_special_tokens"], option["trust_remote_code"]),
        "SFTTokenizer": lambda: SFTTokenizer(tokenizer_model,
                                             prompt_format or DEFAULT_PROMPT_FORMAT),
    }
    return builders[tokenizer_type]()


def check_for_training(tokenizer: Any, tokenizer_type: str,
                       tokenizer_model: Optional[str] = None) -> None:
    """What pretraining needs beyond a loadable tokenizer: an end-of-document id inside the
    vocabulary (megatron-core's datasets, ``--eod-mask-loss``, ``--reset-*`` and the SP padding
    all use it). Raises ``ValueError`` naming ``--tokenizer-model`` (``--vocab-file`` for
    GPT2BPETokenizer, whose eod is ``<|endoftext|>``)."""
    eod = _special_id(tokenizer, "eod")
    if eod is None or not 0 <= eod < tokenizer.vocab_size:
        if tokenizer_type == "GPT2BPETokenizer":
            raise ValueError(
                f"--vocab-file {tokenizer.unique_identifiers['tokenizer_path']!r} has no "
                f"{GPT2BPETokenizer.EOD} token, GPT2BPETokenizer's end-of-document id; give "
                "GPT-2's vocab.json or one with that token")
        source = f"--tokenizer-model {tokenizer_model!r}" if tokenizer_model else "the tokenizer"
        raise ValueError(
            f"{source} has no end-of-document id (--tokenizer-type {tokenizer_type} uses the "
            f"model's eos id, got {eod!r}, vocab size {tokenizer.vocab_size}); use a tokenizer "
            "with an eos token or --tokenizer-type SentencePieceTokenizer (which adds <EOD>)"
        )
