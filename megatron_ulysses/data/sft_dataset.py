"""Megatron-LM's ``SFTDataset`` on megatron-core's ``MegatronDataset``, so that its dataset
builder blends, splits and samples the JSONL files as Megatron-LM's does (a module of its own:
importing megatron-core's datasets costs the tokenizer tools nothing)."""

from typing import Any, Dict

import torch
from megatron.core.datasets.megatron_dataset import MegatronDataset

from .sft import JsonlConversations, pack, split_conversations


class SFTDataset(MegatronDataset):
    """Sample ``i`` packs the conversations of the split's line ``i`` (wrapping around) into
    ``--seq-length`` (``sft.pack``); ``config.tokenizer`` is an ``SFTTokenizer``."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: Any) -> JsonlConversations:
        return JsonlConversations(dataset_path, config.tokenizer.prompt_format)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        tokenizer = self.config.tokenizer
        messages = self.dataset[int(self.indices[idx % len(self.indices)])]
        encoded = (tokenizer.tokenize_conversation(conversation)
                   for conversation in split_conversations(messages))
        return pack(encoded, self.config.sequence_length, tokenizer.pad)
