"""``--sft``: Megatron-LM's SFT data: ``SFTTokenizer`` and its prompt formats, the JSONL files'
checks and the packing of ``SFTDataset`` (``sft_dataset``).

Each JSONL line is one sample: ``{"messages": [{"role", "content"}, ...]}``, a new conversation
starting at every ``system`` message. A sample's conversations are tokenized with
``--sft-tokenizer-prompt-format``, packed one after another into ``--seq-length + 1`` tokens
(positions restart per conversation, ``cu_seqlens`` mark their ends) and cut on the right where
they overflow; the loss counts only the targets the format does not mask, and never one equal
to the pad id (Megatron-LM's rule).
"""

import json
import os
from typing import Dict, Iterable, List, Optional, Tuple

import numpy
import torch

from .chat_template import AssistantMask
from .datasets import DataError, IndexSummary, check_split, parse_data_path

IGNORE_INDEX = -100  # a target the loss never counts
ROLES = ("system", "user", "assistant", "tool")
NEMOTRON_H_PAD, NEMOTRON_PAD = "<SPECIAL_233>", "<unk>"
DEFAULT_PROMPT_FORMAT = "nemotron-h-aligned"  # Megatron-LM's default


def _strip_think(text: str) -> str:
    return text.replace("/think", "").replace("/no_think", "").strip()


def _nemotron_h_aligned(role: str, content: str) -> str:
    text = content.strip()
    return {"system": f"<SPECIAL_10>System\n{text}\n",
            "user": f"<SPECIAL_11>User\n{text}\n<SPECIAL_11>Assistant\n",
            "assistant": f"{text}\n"}.get(role, "")


def _nemotron_nano_v2(role: str, content: str) -> str:
    return {"system": f"<SPECIAL_10>System\n{_strip_think(content)}\n",
            "user": f"<SPECIAL_11>User\n{_strip_think(content)}\n",
            "assistant": f"<SPECIAL_11>Assistant\n{content.strip()}\n<SPECIAL_12>\n"
            }.get(role, "")


# format -> (each turn's text, None: the whole conversation's own text; assistant prefix kept
# out of the loss; pad token, None: the tokenizer's pad or eos; whether the loss counts only
# the assistant turns). chat-template is ours (chat_template.py).
PROMPT_FORMATS = {
    "nemotron-h-aligned": (_nemotron_h_aligned, "", NEMOTRON_H_PAD, True),
    "nemotron-nano-v2": (_nemotron_nano_v2, "<SPECIAL_11>Assistant\n", NEMOTRON_PAD, True),
    "identity": (None, "", NEMOTRON_PAD, False),
    "default": (None, "", None, False),
    "chat-template": (None, "", None, True),
}
CHAT_TEMPLATE_FORMATS = ("default", "chat-template")  # the tokenizer's own chat template


def masks_prompts(prompt_format: str) -> bool:
    """Whether the format keeps system, user and tool turns out of the loss (Megatron-LM:
    ``identity`` and ``default`` train on every token)."""
    return PROMPT_FORMATS[prompt_format][3]


class SFTTokenizer:
    """Megatron-LM's ``SFTTokenizer``: a local HuggingFace tokenizer directory and a prompt
    format. ``eod`` is its eos id, ``pad`` the format's pad token."""

    def __init__(self, model_path: str, prompt_format: str):
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"--sft-tokenizer-prompt-format {prompt_format!r} is not one of "
                             f"{', '.join(PROMPT_FORMATS)}")
        if not os.path.isdir(model_path):
            raise ValueError(f"--tokenizer-model {model_path!r} is not a directory; "
                             "--tokenizer-type SFTTokenizer needs a local HuggingFace tokenizer "
                             "directory (what tokenizer.save_pretrained() wrote)")
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ImportError("--tokenizer-type SFTTokenizer needs the 'transformers' package "
                              "(pip install transformers)") from err
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        except Exception as error:  # transformers raises OSError, ValueError, KeyError, ...
            raise ValueError(f"--tokenizer-model {model_path!r} is not a HuggingFace tokenizer "
                             f"directory ({type(error).__name__}: {str(error)[:200]})") from None
        self.prompt_format = prompt_format
        self.render, self.prefix, pad_token, _ = PROMPT_FORMATS[prompt_format]
        self.vocab_size = len(self.tokenizer)
        self.eod = self.eos = self.tokenizer.eos_token_id
        self.pad = self._pad_id(pad_token, model_path)
        if prompt_format in CHAT_TEMPLATE_FORMATS and not self.tokenizer.chat_template:
            raise ValueError(f"--tokenizer-model {model_path!r} has no chat template, which "
                             f"--sft-tokenizer-prompt-format {prompt_format} applies; give one "
                             "with a chat template or another format")
        self.assistant_mask = (AssistantMask(self.tokenizer, f"--tokenizer-model {model_path!r}")
                               if prompt_format == "chat-template" else None)
        self.unique_identifiers = {"class": "SFTTokenizer", "tokenizer_path": model_path,
                                   "prompt_format": prompt_format}

    def _pad_id(self, pad_token: Optional[str], model_path: str) -> int:
        tok = self.tokenizer
        if pad_token is None:
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        else:
            pad = tok.convert_tokens_to_ids(pad_token)
            pad = None if pad is None or tok.convert_ids_to_tokens(pad) != pad_token else pad
        if pad is None:
            raise ValueError(
                f"--tokenizer-model {model_path!r} has no "
                f"{pad_token or 'pad or eos'} token, which --sft-tokenizer-prompt-format "
                f"{self.prompt_format} pads with; give the tokenizer it was made for or "
                "another format")
        return int(pad)

    def _encode(self, text: str) -> List[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def tokenize_conversation(self, conversation: List[Dict]) -> Tuple[List[int], List[int]]:
        """(tokens, targets): targets are the tokens, ``IGNORE_INDEX`` where the format keeps
        them out of the loss (system, user and tool turns, the assistant prefix). A masking
        format encodes each turn alone and concatenates them (the text Megatron-LM encodes at
        once, which it asserts gives the same tokens); ``chat-template``: ``AssistantMask``."""
        if self.assistant_mask is not None:
            tokens, in_loss = self.assistant_mask(conversation)
            return tokens, [t if kept else IGNORE_INDEX for t, kept in zip(tokens, in_loss)]
        if self.render is None:
            text = ("".join(message["content"] for message in conversation)
                    if self.prompt_format == "identity" else
                    self.tokenizer.apply_chat_template(conversation, tokenize=False))
            tokens = self._encode(text)
            return tokens, list(tokens)
        tokens, targets = [], []
        prefix = len(self._encode(self.prefix)) if self.prefix else 0
        for message in conversation:
            turn = self._encode(self.render(message["role"], message["content"]))
            kept = prefix if message["role"] == "assistant" else len(turn)
            tokens += turn
            targets += [IGNORE_INDEX] * min(kept, len(turn)) + turn[kept:]
        return tokens, targets


def split_conversations(messages: List[Dict]) -> List[List[Dict]]:
    """A sample's messages as conversations: a new one starts at every ``system`` message."""
    conversations: List[List[Dict]] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def _conversation_problem(conversation: List[Dict], masked: bool) -> Optional[str]:
    """What a masking format cannot train on: no assistant turn, an empty one, or one that
    answers no user or tool turn."""
    if not masked:
        return None
    roles = [message["role"] for message in conversation]
    if "assistant" not in roles:
        return "has no assistant turn, so none of its tokens is in the loss"
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        if not message["content"]:
            return f"has an empty assistant turn (message {i + 1})"
        if i == 0 or roles[i - 1] not in ("user", "tool"):
            return f"has an assistant turn (message {i + 1}) that follows no user or tool turn"
    return None


def _line_problem(line: bytes, masked: bool) -> Optional[str]:
    """Why one JSONL line is not a sample, ``None`` when it is one."""
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, ValueError) as error:
        return f"is not JSON ({error})"
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        return "has no \"messages\" list"
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES
                and isinstance(message.get("content"), str)):
            return (f"message {i + 1} ({str(message)[:60]}) is not {{\"role\": one of "
                    f"{', '.join(ROLES)}, \"content\": a string}}")
    for n, conversation in enumerate(split_conversations(messages)):
        problem = _conversation_problem(conversation, masked)
        if problem:
            return f"conversation {n + 1} {problem}"
    return None


_SCANNED: Dict[Tuple[str, bool], numpy.ndarray] = {}
FORMAT_HELP = ("each line is one sample {\"messages\": [{\"role\": \"system\"|\"user\"|"
               "\"assistant\"|\"tool\", \"content\": \"...\"}, ...]}, a new conversation "
               "at every system message")


def scan_jsonl(path: str, prompt_format: str, flag: str = "--data-path") -> numpy.ndarray:
    """Byte offsets of the samples (non-blank lines) of an SFT JSONL file, after checking every
    line (once per process). Raises ``DataError`` naming ``flag``, the file and the line."""
    masked = masks_prompts(prompt_format)
    if (path, masked) in _SCANNED:
        return _SCANNED[(path, masked)]
    offsets, position = [], 0
    try:
        with open(path, "rb") as stream:
            for number, line in enumerate(stream, start=1):
                if line.strip():
                    problem = _line_problem(line, masked)
                    if problem:
                        raise DataError(f"{flag} {path!r} line {number} {problem}; "
                                        f"{FORMAT_HELP}")
                    offsets.append(position)
                position += len(line)
    except OSError as error:
        raise DataError(f"{flag} {path!r}: cannot read it ({error.strerror})") from None
    if not offsets:
        raise DataError(f"{flag} {path!r} holds no samples; {FORMAT_HELP}")
    _SCANNED[(path, masked)] = numpy.asarray(offsets, dtype=numpy.int64)
    return _SCANNED[(path, masked)]


class JsonlConversations:
    """The samples of one checked SFT JSONL file, read one line at a time."""

    def __init__(self, path: str, prompt_format: str):
        self.path = path
        self.offsets = scan_jsonl(path, prompt_format)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> List[Dict]:
        with open(self.path, "rb") as stream:
            stream.seek(int(self.offsets[index]))
            return json.loads(stream.readline())["messages"]


def pack(encoded: Iterable[Tuple[List[int], List[int]]], seq_length: int,
         pad: int) -> Dict[str, torch.Tensor]:
    """Megatron-LM's SFT packing of (tokens, targets) conversations into one sample.

    Conversations follow each other until ``seq_length + 1`` tokens are reached; the one that
    overflows is cut on the right and the rest dropped; the tail is padded (positions counting
    on, inside the last conversation's segment). tokens ``[s]`` = packed[:-1], labels = targets
    [1:] (``IGNORE_INDEX`` -> ``pad``); loss_mask 0 where the target was ``IGNORE_INDEX`` or is
    ``pad``; position_ids restart per conversation; cu_seqlens ``[s + 1]`` int32, the
    conversation ends then ``s`` repeated."""
    tokens: List[int] = []
    targets: List[int] = []
    positions: List[int] = []
    ends = [0]
    for conversation_tokens, conversation_targets in encoded:
        tokens += conversation_tokens
        targets += conversation_targets
        positions += range(len(conversation_tokens))
        ends.append(len(tokens))
        if len(tokens) > seq_length:
            tokens, targets = tokens[:seq_length] + [pad], targets[:seq_length] + [pad]
            positions, ends[-1] = positions[:seq_length + 1], seq_length
            break
    fill = seq_length + 1 - len(tokens)
    if fill > 0:
        tokens += [pad] * fill
        targets += [pad] * fill
        last = positions[-1] if positions else -1
        positions += range(last + 1, last + 1 + fill)
        ends[-1] = seq_length
    labels = torch.tensor(targets[1:], dtype=torch.int64)
    loss_mask = ((labels != pad) & (labels != IGNORE_INDEX)).to(torch.float32)
    cu_seqlens = torch.full((seq_length + 1,), seq_length, dtype=torch.int32)
    cu_seqlens[:len(ends)] = torch.tensor(ends, dtype=torch.int32)
    return {"tokens": torch.tensor(tokens[:-1], dtype=torch.int64),
            "labels": labels.masked_fill(labels == IGNORE_INDEX, pad),
            "loss_mask": loss_mask, "position_ids": torch.tensor(positions[:-1]),
            "cu_seqlens": cu_seqlens}


def check_sft_data_path(data_path: List[str], prompt_format: str, split: Optional[str] = None,
                        flag: str = "--data-path") -> None:
    """Every JSONL file of ``--data-path`` words exists and holds samples (``scan_jsonl``) and,
    with ``split``, every split with a positive weight gets some of them."""
    for path in dict.fromkeys(parse_data_path(data_path, flag, jsonl=True)[0]):
        samples = len(scan_jsonl(path, prompt_format, flag))
        if split is not None:
            check_split(split, IndexSummary(path, None, numpy.ones(samples, numpy.int32),
                                            samples, samples, samples))
