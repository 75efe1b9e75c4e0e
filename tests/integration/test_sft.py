"""--sft under Ulysses: on packed conversations of very different lengths (the fixture through
`SFTTokenizer` and `pack`), SP 2 gives SP 1's loss and every gradient, and SP 1 on them equals
each conversation run alone (`test_model`'s harness); changing one conversation's tokens leaves
every other conversation's per-token loss unchanged at SP 2; and Megatron-LM's SFT command line
(examples/post_training/modelopt/train.sh with its Qwen2.5 conf, shrunk) trains at SP 2 with the
losses of SP 1."""

import json

import pytest
from megatron_lm_args import CONF_TAIL, TRAIN_SETS
from launcher import pretrain
from sft_data import SFT_JSONL
from test_cli import losses

pytestmark = pytest.mark.core_version

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
        "--log-interval", "1", "--global-batch-size", "2", "--num-workers", "0",
    ]


def test_megatron_lm_sft_command_line_trains_at_sp2(sft_tokenizer, tmp_path):
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps({"train": [str(SFT_JSONL)], "valid": [str(SFT_JSONL)]}))
    argv = _megatron_lm_sft_argv(sft_tokenizer, str(blend))
    got = losses(pretrain(2, argv + ["--ulysses-sp-size", "2"], timeout=600))
    assert sorted(got) == [1, 2, 3]
    assert got == pytest.approx(losses(pretrain(1, argv, timeout=600)), rel=2e-6)
