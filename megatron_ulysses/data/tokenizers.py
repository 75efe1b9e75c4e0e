"""Tokenizers with Megatron-LM semantics, usable as ``GPTDatasetConfig.tokenizer``.

megatron-core 0.16 ships its legacy tokenizer base in ``megatron.core.datasets.megatron_tokenizer``
but 0.19 removed that module, so ``TokenizerBase`` keeps the same attribute names
(``unique_identifiers``, ``vocab_size``, ``eod``, ``pad``, ...) without importing it.
"""

import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, List, Optional

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


class TokenizerBase(ABC):
    """Attribute-compatible stand-in for megatron-core's legacy ``MegatronTokenizer``.

    megatron-core datasets hash ``unique_identifiers`` into their index cache names, so every
    constructor argument that changes the ids must be passed to ``__init__``.
    """

    def __init__(self, *tokenizer_paths: Optional[str], **tokenizer_options: Any):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for option, value in tokenizer_options.items():
            self.unique_identifiers[option] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Text -> token ids."""

    @abstractmethod
    def detokenize(self, ids: List[int]) -> str:
        """Token ids -> text."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, including the special ids added on top of the model."""

    # Subclasses with a vocabulary set `_vocab` and `_inv_vocab`.
    @property
    def vocab(self) -> Dict[str, int]:
        """Token text -> id."""
        if not hasattr(self, "_vocab"):
            raise NotImplementedError(f"{type(self).__name__} has no vocabulary")
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token text."""
        if not hasattr(self, "_inv_vocab"):
            raise NotImplementedError(f"{type(self).__name__} has no vocabulary")
        return self._inv_vocab

    # Optional special ids: megatron-core catches these errors and falls back to its defaults.
    @property
    def eod(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'eod'")

    @property
    def pad(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'pad'")

    @property
    def bos(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'bos'")

    @property
    def eos(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'eos'")


def _load_sentencepiece(model_file: str, tokenizer_type: str):
    """The sentencepiece model, or a ``ValueError`` naming ``--tokenizer-model`` when the file is
    not one (sentencepiece raises ``RuntimeError`` with a terse protobuf message)."""
    import sentencepiece

    if os.path.isdir(model_file):
        raise ValueError(f"--tokenizer-model {model_file!r} is a directory; --tokenizer-type "
                         f"{tokenizer_type} needs a sentencepiece .model file")
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError, ValueError) as error:
        raise ValueError(
            f"--tokenizer-model {model_file!r} is not a sentencepiece model ({error}); "
            f"--tokenizer-type {tokenizer_type} needs the .model file that "
            "tools/train_tokenizer.py or sentencepiece wrote (a HuggingFace tokenizer directory "
            "needs --tokenizer-type HuggingFaceTokenizer)"
        ) from None
    if len(processor) == 0:
        raise ValueError(f"--tokenizer-model {model_file!r} is a sentencepiece model without "
                         f"pieces; --tokenizer-type {tokenizer_type} needs a trained model")
    return processor


class SentencePieceTokenizer(TokenizerBase):
    """Megatron-LM ``SentencePieceTokenizer``: appends ``<CLS> <SEP> <EOD> <MASK>`` (and pad, bos,
    eos when the model lacks them, then ``<extra_id_i>``) after the model's pieces.

    Special tokens written literally in the text are encoded to their special ids.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        self.tokenizer = _load_sentencepiece(model_file, "SentencePieceTokenizer")
        self._vocab = {self.tokenizer.id_to_piece(i): i for i in range(len(self.tokenizer))}
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}
        self._special_tokens: Dict[str, int] = {}

        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        self._pad_id = self._add_special_token(self._model_piece(self.tokenizer.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(self._model_piece(self.tokenizer.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(self._model_piece(self.tokenizer.eos_id(), "<EOS>"))
        self._extra_ids = [
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

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return list(self._extra_ids)


class GPTSentencePieceTokenizer(TokenizerBase):
    """Megatron-LM ``GPTSentencePieceTokenizer``: the model's own ids only, ``eod == eos``.

    ``pad`` is the model's pad id, -1 when the model has none (as in Megatron-LM); use
    ``padding_id`` to get an id that is safe to feed to the embedding.
    """

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)
        self.tokenizer = _load_sentencepiece(model_file, "GPTSentencePieceTokenizer")
        self._vocab = {self.tokenizer.id_to_piece(i): i for i in range(len(self.tokenizer))}
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.decode_ids(list(ids))

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_id()

    @property
    def eos(self) -> int:
        return self.tokenizer.eos_id()

    @property
    def bos(self) -> int:
        return self.tokenizer.bos_id()

    @property
    def pad(self) -> int:
        return self.tokenizer.pad_id()


class HuggingFaceTokenizer(TokenizerBase):
    """A local ``transformers`` tokenizer directory (never downloads); ``eod`` is its eos id."""

    def __init__(self, model_path: str):
        super().__init__(model_path)
        if not os.path.isdir(model_path):
            raise ValueError(
                f"--tokenizer-model {model_path!r} is not a directory; --tokenizer-type "
                "HuggingFaceTokenizer needs a local tokenizer directory (tokenizer.json, "
                "tokenizer_config.json, ...), a sentencepiece .model file needs --tokenizer-type "
                "GPTSentencePieceTokenizer or SentencePieceTokenizer"
            )
        try:
            import transformers
        except ImportError as err:
            raise ImportError(
                "--tokenizer-type HuggingFaceTokenizer needs the 'transformers' package; install "
                "it or use --tokenizer-type GPTSentencePieceTokenizer with a sentencepiece "
                "--tokenizer-model"
            ) from err
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(
                model_path, local_files_only=True
            )
        except Exception as error:  # transformers raises OSError, ValueError, KeyError, ...
            raise ValueError(
                f"--tokenizer-model {model_path!r} is not a HuggingFace tokenizer directory "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                "--tokenizer-type HuggingFaceTokenizer needs the directory that "
                "tokenizer.save_pretrained() wrote"
            ) from None
        self._vocab = self.tokenizer.get_vocab()
        self._inv_vocab = {i: token for token, i in self._vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def eos(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def bos(self) -> int:
        return self.tokenizer.bos_token_id

    @property
    def pad(self) -> int:
        return self.tokenizer.pad_token_id


class NullTokenizer(TokenizerBase):
    """Megatron-LM ``NullTokenizer``: text is space separated ids; ``eod`` is the extra id
    ``vocab_size`` (so the reported ``vocab_size`` is one larger); no pad id."""

    def __init__(self, vocab_size: int):
        super().__init__(None, vocab_size=vocab_size)
        self._eod_id = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: List[int]) -> str:
        return " ".join(str(int(x)) for x in ids)

    @property
    def vocab_size(self) -> int:
        return self._eod_id + 1

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eod_id


def padding_id(tokenizer: TokenizerBase) -> int:
    """Id used to pad sequences: the tokenizer's pad id when it is a real id, else ``eod``.

    Padded positions always get loss_mask 0, so only embedding-validity matters here.
    """
    try:
        pad = tokenizer.pad
    except NotImplementedError:
        return tokenizer.eod
    return pad if pad is not None and 0 <= pad < tokenizer.vocab_size else tokenizer.eod


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    vocab_extra_ids: int = 0,
) -> TokenizerBase:
    """Build the tokenizer named by ``--tokenizer-type``.

    ``tokenizer_model`` (``--tokenizer-model``) is a sentencepiece ``.model`` file or a local
    HuggingFace tokenizer directory; ``vocab_size`` (``--vocab-size``) is for ``NullTokenizer``.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(
                f"--tokenizer-type NullTokenizer needs a positive --vocab-size (got {vocab_size!r})"
            )
        return NullTokenizer(int(vocab_size))
    if tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if not os.path.exists(tokenizer_model):
        raise ValueError(
            f"--tokenizer-model {tokenizer_model!r} does not exist (needed by --tokenizer-type "
            f"{tokenizer_type}; only local files are used)"
        )
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    return HuggingFaceTokenizer(tokenizer_model)


def check_for_training(tokenizer: TokenizerBase, tokenizer_type: str,
                       tokenizer_model: Optional[str] = None) -> None:
    """What pretraining needs beyond a loadable tokenizer: an end-of-document id inside the
    vocabulary (megatron-core's datasets, ``--eod-mask-loss``, ``--reset-*`` and the SP padding
    all use it). Raises ``ValueError`` naming ``--tokenizer-model``."""
    try:
        eod = tokenizer.eod
    except NotImplementedError:
        eod = None
    if eod is None or not 0 <= int(eod) < tokenizer.vocab_size:
        source = f"--tokenizer-model {tokenizer_model!r}" if tokenizer_model else "the tokenizer"
        raise ValueError(
            f"{source} has no end-of-document id (--tokenizer-type {tokenizer_type} uses the "
            f"model's eos id, got {eod!r}, vocab size {tokenizer.vocab_size}); use a tokenizer "
            "with an eos token or --tokenizer-type SentencePieceTokenizer (which adds <EOD>)"
        )
