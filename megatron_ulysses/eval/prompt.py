"""The passkey prompt (the standard passkey test), tokenized to exactly the length asked for,
answer included (the filler is trimmed, never padded):

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it.
    I will quiz you about the important information there. <filler> The pass key is KEY.
    Remember it. KEY is the pass key. <filler> What is the pass key? The pass key is KEY

The filler repeats "The grass is green. The sky is blue. The sun is yellow. Here we go. There
and back again."; the needle sits at the sentence boundary nearest to depth d of the filler
(0: right after the introduction, 1: right before the question). KEY is drawn from --seed per
(length, depth, trial).
"""

import random
from dataclasses import dataclass
from typing import List

from ..errors import ConfigError

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
ANCHOR = "."  # what a continuation is tokenized after (see PromptBuilder.continuation)


@dataclass(frozen=True)
class Prompt:
    tokens: List[int]  # prompt + answer, exactly the requested length
    answer: List[int]  # the last len(answer) tokens: the key after "The pass key is"
    needle_start: int  # token index of the needle
    needle_end: int
    needle_depth: float  # where in the filler it actually sits (a sentence boundary)


def make_key(seed: int, length: int, depth: float, trial: int) -> int:
    """The 5-digit passkey of one trial; the same for every rank and layout."""
    return random.Random(f"passkey/{seed}/{length}/{depth!r}/{trial}").randint(10000, 99999)


class PromptBuilder:
    """Token-level prompts of an exact length. Each part is tokenized once, as it reads in
    running text (`continuation`), and the parts are concatenated, so the length is exact and the
    filler can be cut anywhere."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.intro = list(tokenizer.tokenize(INTRO))
        self.sentences = [self.continuation(sentence) for sentence in FILLER]
        self.question = self.continuation(QUESTION)
        if not (self.intro and all(self.sentences) and self.question):
            raise ConfigError("--tokenizer-model encodes the passkey prompt's text to no tokens")

    def continuation(self, text: str) -> List[int]:
        """The tokens of `text` after a sentence and a space: tokenized behind an anchor that
        is then cut off, so that word-initial forms (sentencepiece's "▁", byte-level BPE's
        leading space) are those of running text; tokenized with a leading space when the
        anchor does not tokenize as a prefix."""
        anchor = list(self.tokenizer.tokenize(ANCHOR))
        joined = list(self.tokenizer.tokenize(f"{ANCHOR} {text}"))
        if joined[:len(anchor)] == anchor and len(joined) > len(anchor):
            return joined[len(anchor):]
        return list(self.tokenizer.tokenize(f" {text}"))

    def parts(self, key: int):
        return self.continuation(NEEDLE.format(key=key)), self.continuation(str(key))

    def shortest(self, key: int) -> int:
        """The length of the prompt without filler."""
        needle, answer = self.parts(key)
        return len(self.intro) + len(needle) + len(self.question) + len(answer)

    def build(self, length: int, depth: float, key: int) -> Prompt:
        needle, answer = self.parts(key)
        budget = length - self.shortest(key)
        if budget < 0:
            raise ConfigError(too_short(length, self.shortest(key)))
        filler, boundaries, index = [], [0], 0
        while len(filler) < budget:
            sentence = self.sentences[index % len(self.sentences)]
            index += 1
            filler.extend(sentence[:budget - len(filler)])  # the last one may be cut
            boundaries.append(len(filler))
        cut = min(boundaries, key=lambda b: (abs(b - depth * budget), b))
        start = len(self.intro) + cut
        tokens = self.intro + filler[:cut] + needle + filler[cut:] + self.question + answer
        assert len(tokens) == length
        return Prompt(tokens=tokens, answer=answer, needle_start=start,
                      needle_end=start + len(needle),
                      needle_depth=cut / budget if budget else 0.0)


def too_short(length: int, need: int) -> str:
    """The message of a --lengths value below the prompt without filler (`need` tokens)."""
    return (f"--lengths: {length} tokens are too few for the passkey prompt, which needs {need} "
            "without any filler with this tokenizer")
