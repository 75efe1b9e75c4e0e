"""--sft-tokenizer-prompt-format chat-template: on chat templates in the style of ChatML
(Qwen2.5) and Llama 3 the loss mask is the hand-computed one (each assistant turn's content and
end-of-turn token, ChatML's newline after it; never the generation prompt); the packed sample's
loss counts exactly those tokens; a Qwen3-style template that rewrites earlier turns is refused
at load time (one ConfigError before any process group), or, with {% generation %} marks,
masked as HF's return_assistant_tokens_mask; a template that rewrites some conversations only
is refused on the first of them."""

import pytest
from sft_data import CHAT_TEMPLATE, CHAT_TEMPLATES, SFT_JSONL, save_sft_tokenizer

from megatron_ulysses.data.datasets import DataError
from megatron_ulysses.data.sft import SFTTokenizer, pack
from megatron_ulysses.errors import ConfigError
from megatron_ulysses.training.arguments import parse_args
from megatron_ulysses.training.inputs import check_inputs

CONVERSATION = [{"role": "system", "content": "use tools"},
                {"role": "user", "content": "what time"}, {"role": "tool", "content": "noon"},
                {"role": "assistant", "content": "it is noon"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"}]

# The renderings, "\n" a newline token, a token in [brackets] one in the loss.
EXPECTED = {
    "chatml": r"<|im_start|> system \n use tools <|im_end|> \n <|im_start|> user \n what time "
              r"<|im_end|> \n <|im_start|> user \n <tool_response> \n noon \n </tool_response> "
              r"<|im_end|> \n <|im_start|> assistant \n [it] [is] [noon] [<|im_end|>] [\n] "
              r"<|im_start|> user \n hi <|im_end|> \n <|im_start|> assistant \n [hello] [there] "
              r"[<|im_end|>] [\n]",
    "llama3": r"<|begin_of_text|> <|start_header_id|> system <|end_header_id|> \n \n use tools "
              r"<|eot_id|> <|start_header_id|> user <|end_header_id|> \n \n what time <|eot_id|> "
              r"<|start_header_id|> tool <|end_header_id|> \n \n noon <|eot_id|> "
              r"<|start_header_id|> assistant <|end_header_id|> \n \n [it] [is] [noon] "
              r"[<|eot_id|>] <|start_header_id|> user <|end_header_id|> \n \n hi <|eot_id|> "
              r"<|start_header_id|> assistant <|end_header_id|> \n \n [hello] [there] [<|eot_id|>]",
}


def _tokenizer(tmp_path, name: str, prompt_format: str = "chat-template") -> SFTTokenizer:
    return SFTTokenizer(save_sft_tokenizer(tmp_path / name, *CHAT_TEMPLATES[name]),
                        prompt_format)


def _expected(rendering: str):
    """(words, in the loss) of an EXPECTED rendering."""
    words = rendering.split()
    return ([word.strip("[]").replace(r"\n", "\n") for word in words],
            [word.startswith("[") for word in words])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_loss_is_on_the_assistant_turns(tmp_path, name):
    tokenizer = _tokenizer(tmp_path, name)
    tokens, targets = tokenizer.tokenize_conversation(CONVERSATION)
    words, in_loss = _expected(EXPECTED[name])
    assert tokenizer.tokenizer.convert_ids_to_tokens(tokens) == words
    assert targets == [t if kept else -100 for t, kept in zip(tokens, in_loss)]
    # the same tokens as `default`, which trains on all of them
    assert SFTTokenizer(tokenizer.unique_identifiers["tokenizer_path"],
                        "default").tokenize_conversation(CONVERSATION) == (tokens, tokens)
    # packed: the loss counts exactly the assistant tokens, as the labels of the token before
    sample = pack([(tokens, targets)], len(tokens) + 3, tokenizer.pad)
    trained = [i for i, kept in enumerate(in_loss) if kept]
    assert sample["loss_mask"].nonzero().flatten().tolist() == [i - 1 for i in trained]
    assert sample["labels"][[i - 1 for i in trained]].tolist() == [tokens[i] for i in trained]


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    with pytest.raises(ValueError) as error:
        _tokenizer(tmp_path, "qwen3")
    message = str(error.value)
    assert message.startswith(f"the chat template of --tokenizer-model "
                              f"{str(tmp_path / 'qwen3')!r} renders earlier turns differently")
    assert "{% generation %}" in message and "--sft-tokenizer-prompt-format default" in message
    _tokenizer(tmp_path, "qwen3", "default")  # every token in the loss: no need to find them
    # before any process group: one ConfigError
    config = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                         "8", "--seq-length", "64", "--max-position-embeddings", "64",
                         "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters",
                         "1", "--lr", "1e-4", "--sft", "--data-path", str(SFT_JSONL),
                         "--tokenizer-type", "SFTTokenizer", "--tokenizer-model",
                         str(tmp_path / "qwen3"), "--sft-tokenizer-prompt-format",
                         "chat-template"], world_size=1)
    with pytest.raises(ConfigError) as error:
        check_inputs(config)
    assert str(error.value) == message


def test_generation_marks_around_nothing_are_refused(tmp_path):
    template, specials, extra = CHAT_TEMPLATES["qwen3"]
    empty = template.replace("{{- m.content + '<|im_end|>\n' }}",
                             "{%- generation %}{%- endgeneration %}"
                             "{{- m.content + '<|im_end|>\n' }}")
    assert empty != template
    with pytest.raises(ValueError, match="has {% generation %} marks around no token"):
        SFTTokenizer(save_sft_tokenizer(tmp_path / "empty", empty, specials, extra),
                     "chat-template")


def test_generation_marks_give_hf_assistant_mask(tmp_path):
    tokenizer = _tokenizer(tmp_path, "qwen3-generation")
    hf = tokenizer.tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tokens, targets = tokenizer.tokenize_conversation(CONVERSATION)
    assert tokens == list(hf["input_ids"])
    assert targets == [t if m else -100 for t, m in zip(tokens, hf["assistant_masks"])]
    # only the last turn has its <think> block; its trailing newline is in the mark
    words = tokenizer.tokenizer.convert_ids_to_tokens([t for t in targets if t != -100])
    assert words == ["it", "is", "noon", "<|im_end|>", "\n", "<think>", "\n", "\n", "</think>",
                     "\n", "\n", "hello", "there", "<|im_end|>", "\n"]
    # one turn: the prefixes are prefixes, and they give what the marks give
    single = tokenizer.tokenize_conversation(CONVERSATION[1:4])
    hf = tokenizer.tokenizer.apply_chat_template(
        CONVERSATION[1:4], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert single[1] == [t if m else -100 for t, m in zip(single[0], hf["assistant_masks"])]


def test_a_conversation_the_template_rewrites_is_named(tmp_path):
    # renders the earlier turns' "tell" as "say": a plain conversation is fine, this one is not
    template = CHAT_TEMPLATE.replace("message['content']", "(message['content'] if loop.last "
                                     "else message['content'].replace('tell', 'say'))") + \
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    tokenizer = SFTTokenizer(save_sft_tokenizer(tmp_path / "tok", template), "chat-template")
    tokens, targets = tokenizer.tokenize_conversation(CONVERSATION[4:])
    assert tokenizer.tokenizer.convert_ids_to_tokens([t for t in targets if t != -100]) == \
        ["hello", "there", "\n"]
    with pytest.raises(DataError, match=r"renders the earlier turns of the conversation "
                       r"\[\{'role': 'user', 'content': 'tell me'"):
        tokenizer.tokenize_conversation([{"role": "user", "content": "tell me"},
                                         {"role": "assistant", "content": "hello"}])
