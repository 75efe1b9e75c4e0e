"""--sft under Ulysses: on packed conversations of very different lengths (the fixture through
`SFTTokenizer` and `pack`: Nemotron's format, and chat-template on a ChatML-style template), SP 2
gives SP 1's loss and every gradient, and SP 1 on them equals each conversation run alone
(`test_model`'s harness); changing one conversation's tokens leaves every other conversation's
per-token loss unchanged at SP 2; and Megatron-LM's SFT command line
(examples/post_training/modelopt/train.sh with its Qwen2.5 conf, shrunk) trains at SP 2 with the
losses of SP 1."""

import json

import pytest
import torch
import torch.distributed as dist
from distributed import spawn
from launcher import pretrain
from megatron_lm_args import CONF_TAIL, TRAIN_SETS
from sft_data import CHAT_TEMPLATES, SFT_JSONL, save_sft_tokenizer
from test_cli import losses
from test_model import EOD, PAD, _build, _destroy, _forward, _init, _run_case

from megatron_ulysses import cpu_compat
from megatron_ulysses.data.sft import SFTTokenizer, pack, split_conversations
from megatron_ulysses.data.sharding import get_batch_for_sp_rank
from megatron_ulysses.sp import parallel_state as ps

pytestmark = pytest.mark.core_version

SEQ = 31  # SP 2 pads it to 32: the padding is a segment of its own
# Row 1: three conversations of 10, 13 and (cut) 8 tokens; row 0 is the fixture's line 1 (17 and
# a cut 14).
ROW1 = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "what time"}, {"role": "tool", "content": "noon"},
         {"role": "assistant", "content": "it is noon"}],
        [{"role": "user", "content": "tell me a long story"},
         {"role": "assistant", "content": "once there was a cat and a dog"}]]


def _sft_sample(tokenizer_dir: str, prompt_format: str = "nemotron-h-aligned") -> dict:
    """One micro batch [2, SEQ] of packed conversations, loss on the assistant turns only.
    chat-template (on the ChatML-style template, its turns longer): row 1 is ROW1's last
    conversation (30 tokens, 10 in the loss) and a cut first one."""
    tokenizer = SFTTokenizer(tokenizer_dir, prompt_format)
    line = json.loads(SFT_JSONL.read_text().splitlines()[0])["messages"]
    row1 = ROW1 if prompt_format == "nemotron-h-aligned" else [ROW1[2], ROW1[0]]
    rows = [pack(map(tokenizer.tokenize_conversation, conversations), SEQ, tokenizer.pad)
            for conversations in (split_conversations(line), row1)]
    sample = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    assert sample["cu_seqlens"][:, :4].tolist() == (
        [[0, 17, 31, 31], [0, 10, 23, 31]] if prompt_format == "nemotron-h-aligned" else
        [[0, 20, 31, 31], [0, 30, 31, 31]])
    assert 0 < sample["loss_mask"].sum() < sample["loss_mask"].numel() / 2
    return sample


def _perturbed(sample: dict, row: int, start: int, end: int) -> dict:
    """`sample` with the tokens of the conversation [start, end) of `row` replaced (and the
    labels that are those tokens: labels are the next tokens)."""
    changed = {key: value.clone() for key, value in sample.items()}
    new = torch.randint(7, 48, (end - start,), generator=torch.Generator().manual_seed(5))
    changed["tokens"][row, start:end] = new
    changed["labels"][row, start:end - 1] = new[1:]
    assert not torch.equal(changed["tokens"], sample["tokens"])
    return changed


def _full_per_token(model, sample: dict) -> torch.Tensor:
    """This SP rank's shard through `model`, the per-token loss gathered to [b, s']."""
    shard = get_batch_for_sp_rank(sample, ps.get_ulysses_sp_rank(), 2, PAD, EOD)
    per_token = _forward(model, shard)[0].detach()
    parts = [torch.empty_like(per_token) for _ in range(2)]
    dist.all_gather(parts, per_token, group=ps.get_ulysses_sp_group())
    return torch.cat(parts, dim=1)


def _sft_cases(rank, world_size, tokenizer_dir, chatml_dir):
    cpu_compat.install()
    sample = _sft_sample(tokenizer_dir)
    # SP 2 = SP 1 (loss, every grad; sdpa and local) = each conversation alone at SP 1
    _run_case("sft rope", "rope", False, [sample], [(1, 2)], per_document=True)
    _run_case("sft chat-template rope", "rope", False, [_sft_sample(chatml_dir, "chat-template")],
              [(1, 2)], per_document=True)
    # Changing row 0's first conversation changes its loss terms only (row 1 second one: too).
    _init(1, 2)
    try:
        for backend in ("sdpa", "local"):
            model = _build(1, backend, "rope", False)
            base = _full_per_token(model, sample)
            for row, (start, end) in ((0, (0, 17)), (1, (10, 23))):
                other = _full_per_token(model, _perturbed(sample, row, start, end))
                inside = torch.zeros_like(base, dtype=torch.bool)
                inside[row, start:end] = True
                torch.testing.assert_close(other[~inside], base[~inside], rtol=0, atol=1e-6)
                assert (other[inside] - base[inside]).abs().max() > 1e-3, (backend, row)
    finally:
        _destroy()


def test_sp2_equals_sp1_and_conversations_never_attend_across(sft_tokenizer, tmp_path):
    chatml = save_sft_tokenizer(tmp_path / "chatml", *CHAT_TEMPLATES["chatml"])
    spawn(_sft_cases, 2, sft_tokenizer, chatml)


QWEN = "examples/post_training/modelopt/conf/Qwen/Qwen2.5-7B-Instruct.sh"


def _megatron_lm_sft_argv(tokenizer: str, blend: str) -> list:
    """The Qwen2.5 conf's MODEL_ARGS (shrunk, as `megatron_lm_args`) with train.sh's data,
    train, optimizer and eval arguments (counts shrunk; --use-distributed-optimizer and
    train.sh's ModelOpt flags left out: GPU-only and out of scope here)."""
    model = next(s for s in TRAIN_SETS if s.source == QWEN).argv[:-len(CONF_TAIL)]
    model = [tokenizer if word == "{HF_TOKENIZER}" else word for word in model]
    return model + [
        "--train-samples", "6", "--lr-decay-samples", "6", "--lr-warmup-samples", "0",
        "--sft", "--tokenizer-type", "SFTTokenizer", "--per-split-data-args-path", blend,
        "--no-gradient-accumulation-fusion", "--micro-batch-size", "1", "--attention-dropout",
        "0.0", "--hidden-dropout", "0.0", "--no-check-for-nan-in-loss-and-grad",
        "--lr", "5.0e-5", "--min-lr", "1.0e-7", "--lr-decay-style", "cosine", "--clip-grad",
        "1.0", "--weight-decay", "0.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.010",
        "--eval-iters", "1", "--eval-interval", "1000", "--save-interval", "1000",
        "--log-interval", "1", "--global-batch-size", "2",
    ]


def test_megatron_lm_sft_command_line_trains_at_sp2(sft_tokenizer, tmp_path):
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps({"train": [str(SFT_JSONL)], "valid": [str(SFT_JSONL)]}))
    argv = _megatron_lm_sft_argv(sft_tokenizer, str(blend))
    got = losses(pretrain(2, argv + ["--ulysses-sp-size", "2"], timeout=600))
    assert sorted(got) == [1, 2, 3]
    assert got == pytest.approx(losses(pretrain(1, argv, timeout=600)), rel=2e-6)


def test_a_bad_jsonl_line_is_one_message_naming_file_and_line(sft_tokenizer, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(SFT_JSONL.read_text() + '{"messages": [{"role": "user", "content": "a"}]}\n')
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps({"train": [str(data)]}))
    run = pretrain(2, _megatron_lm_sft_argv(sft_tokenizer, str(blend)) + [
        "--ulysses-sp-size", "2", "--save", str(tmp_path / "ckpt")], timeout=120)
    # a failed rank: torchrun's status 1; one message (rank 0's), no traceback, nothing saved
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"pretrain_gpt.py: error: --train-data-path {str(data)!r} line 5 conversation 1 has no "
        "assistant turn"), run.stderr[-3000:]
    assert not (tmp_path / "ckpt").exists()
