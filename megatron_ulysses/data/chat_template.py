"""``--sft-tokenizer-prompt-format chat-template``: the tokenizer's own chat template with the
loss on the assistant turns only, for any template.

Assistant turn ``i`` is in the loss as the tokens that rendering ``messages[:i + 1]`` adds to
rendering ``messages[:i]`` with the generation prompt (``add_generation_prompt``): its content,
its end-of-turn token and what the template writes after it before the next turn (ChatML's
newline), as TRL's training templates mark them. This needs every such prefix's tokens to be a
prefix of the whole conversation's. A template that rewrites earlier turns once later ones
follow (Qwen3 drops the ``<think>`` blocks of earlier assistant turns) is used through HF's
``return_assistant_tokens_mask`` where it marks the assistant turns with ``{% generation %}``,
and refused otherwise.
"""

import re
from typing import Dict, List, Optional, Tuple

from .datasets import DataError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# a conversation that every template renders: the check of a template at load time
PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "why"}, {"role": "assistant", "content": "because"}]
FIXES = ("give a tokenizer whose chat template marks the assistant turns with {% generation %} "
         "... {% endgeneration %} (its chat_template.jinja), or --sft-tokenizer-prompt-format "
         "default (every token in the loss)")


def _is_prefix(head: List[int], tokens: List[int]) -> bool:
    return tokens[:len(head)] == head


class AssistantMask:
    """Tokens and loss mask of a conversation under a HF tokenizer's chat template; ``where``
    names the tokenizer in messages. Raises ``ValueError`` for a template it cannot use."""

    def __init__(self, tokenizer, where: str):
        self.tokenizer, self.where = tokenizer, where
        self.tagged = bool(GENERATION_TAG.search(tokenizer.chat_template))
        try:
            spans = self._spans(PROBE, self._ids(PROBE))
            marked = self._marked(PROBE)[1] if spans is None and self.tagged else [True]
        except Exception as error:  # jinja raises TemplateError, TypeError, ...
            raise ValueError(f"the chat template of {where} fails on a plain user/assistant "
                             f"conversation ({type(error).__name__}: {str(error)[:200]}), "
                             "which --sft-tokenizer-prompt-format chat-template renders; "
                             f"{FIXES}") from None
        if not any(marked):
            raise ValueError(f"the chat template of {where} has {{% generation %}} marks "
                             "around no token of the assistant turns, so "
                             "--sft-tokenizer-prompt-format chat-template would train on "
                             f"nothing; {FIXES}")
        if spans is None and not self.tagged:
            raise ValueError(
                f"the chat template of {where} renders earlier turns differently once later "
                "ones follow (e.g. drops their <think> blocks), so --sft-tokenizer-prompt-format "
                "chat-template cannot find the assistant turns' tokens from the conversation's "
                f"prefixes, and it has no {{% generation %}} marks; {FIXES}")

    def _ids(self, messages: List[Dict], prompt: bool = False) -> List[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _spans(self, conversation: List[Dict],
               tokens: List[int]) -> Optional[List[Tuple[int, int]]]:
        """[start, end) of each assistant turn in ``tokens``, ``None`` where a prefix's
        rendering is not a prefix of ``tokens``."""
        spans: List[Tuple[int, int]] = []
        for i, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            start = self._ids(conversation[:i], prompt=True)
            end = self._ids(conversation[:i + 1])
            if not (_is_prefix(start, tokens) and _is_prefix(end, tokens)
                    and (spans[-1][1] if spans else 0) <= len(start) < len(end)):
                return None
            spans.append((len(start), len(end)))
        return spans

    def __call__(self, conversation: List[Dict]) -> Tuple[List[int], List[bool]]:
        """(tokens, in_loss): the whole conversation's rendering and, per token, whether it
        belongs to an assistant turn."""
        tokens = self._ids(conversation)
        spans = self._spans(conversation, tokens)
        if spans is not None:
            in_loss = [False] * len(tokens)
            for start, end in spans:
                in_loss[start:end] = [True] * (end - start)
            return tokens, in_loss
        if not self.tagged:
            raise DataError(
                f"the chat template of {self.where} renders the earlier turns of the "
                f"conversation {str(conversation)[:120]} differently once later ones follow, so "
                "--sft-tokenizer-prompt-format chat-template cannot find its assistant turns' "
                f"tokens, and it has no {{% generation %}} marks; {FIXES}")
        return self._marked(conversation)

    def _marked(self, conversation: List[Dict]) -> Tuple[List[int], List[bool]]:
        """HF's tokens and mask of the template's ``{% generation %}`` blocks."""
        rendered = self.tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(rendered["input_ids"]), [bool(m) for m in rendered["assistant_masks"]]

