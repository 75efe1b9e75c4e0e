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


def save_sft_tokenizer(path: Path) -> str:
    """The tokenizer (ids: `words()` in order; eos `</s>`, pad `<pad>`) saved to `path`."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(words())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Split(Regex("\n"), "isolated")])
    backend.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return str(path)
