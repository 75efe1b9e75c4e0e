"""The SFT fixture: `sft_conversations.jsonl` (4 samples, one a blank line apart; samples of 1
and 2 conversations, a tool turn) and a word-level HuggingFace tokenizer over its words with the
Nemotron prompt formats' special tokens, so that every token is one word, newline or special."""

from pathlib import Path

SFT_JSONL = Path(__file__).with_name("sft_conversations.jsonl")
SPECIAL = ["<unk>", "</s>", "<pad>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
           "<SPECIAL_233>"]
HEADERS = ["System", "User", "Assistant", "\n"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] "
                 "+ '\n' }}{% endfor %}")


def words() -> list:
    import json

    found = set()
    for line in SFT_JSONL.read_text().splitlines():
        for message in json.loads(line)["messages"] if line.strip() else ():
            found.update(message["content"].split())
            found.add(message["role"] + ":")
    return SPECIAL + HEADERS + sorted(found)


def save_sft_tokenizer(path: Path, chat_template: str = CHAT_TEMPLATE,
                       specials: tuple = (), extra_words: tuple = ()) -> str:
    """The tokenizer (ids: `words()` in order, then `specials` and `extra_words`; eos `</s>`,
    pad `<pad>`, bos `<|begin_of_text|>` where `specials` has it) saved to `path`."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(words() + list(specials) + list(extra_words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Split(Regex("\n"), "isolated")])
    backend.add_special_tokens([AddedToken(token, special=True)
                                for token in SPECIAL + list(specials)])
    bos = {"bos_token": BOS} if BOS in specials else {}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token="</s>", pad_token="<pad>", **bos)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    return str(path)


# Chat templates in the style of the real ones (ChatML as Qwen2.5's, with its default system
# turn; Llama 3's; Qwen3's, which drops the <think> block of assistant turns before the last
# user turn), for `save_sft_tokenizer(path, *CHAT_TEMPLATES[name])`.
BOS = "<|begin_of_text|>"
CHATML = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\nbe brief<|im_end|>\n' }}"
    "{%- endif %}{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m.role + "
    "'<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}")


def qwen3_style(generation_tags: bool) -> str:
    opened, closed = ("{%- generation %}", "{%- endgeneration %}") if generation_tags else ("", "")
    return (
        "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
        "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}"
        "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}" + opened +
        "{%- if loop.index0 > ns.last %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
        "{{- m.content + '<|im_end|>\n' }}" + closed +
        "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>",
                   "<think>", "</think>")
ROLE_WORDS = ("system", "user", "assistant", "tool")
CHAT_TEMPLATES = {
    "chatml": (CHATML, CHATML_SPECIALS, ROLE_WORDS),
    "llama3": (LLAMA3, (BOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
               ROLE_WORDS),
    "qwen3": (qwen3_style(False), CHATML_SPECIALS, ROLE_WORDS),
    "qwen3-generation": (qwen3_style(True), CHATML_SPECIALS, ROLE_WORDS),
}
