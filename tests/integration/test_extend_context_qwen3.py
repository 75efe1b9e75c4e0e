"""examples/extend_context_qwen3.sh as a user runs it, small: a tiny random Qwen3 (q/k norms,
head_dim 32 != 64 / 4, a 16-token native context) with the SFT fixture's tokenizer is imported with
YaRN x4, pretrained on long documents and fine-tuned (--sft, chat-template) on conversations at 64
tokens by 2 processes at SP 2 (fp32, without the GPU-only flags), and exported. As Qwen3's, the
tokenizer's chat template renders the last assistant turn differently (chat-template refuses it),
so the fine-tuning takes SFT_CHAT_TEMPLATE, the same with {% generation %} marks. The export's
config.json holds the yarn rope_scaling, and transformers' model of it gives the loss of the
trained checkpoint run by pretrain_gpt.py at SP 2 (before any update) on a 64-token document."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from conftest import REPO_ROOT
from hf_models import one_document_dataset, save_random_model
from launcher import pretrain
from sft_data import SFT_JSONL, save_sft_tokenizer, words
from test_cli import losses, losses_of

VOCAB = 64  # the model's rows; the tokenizer has len(words()) of them
SEQ = 64
# the fixture's template, a last assistant turn ending in <SPECIAL_12>; and with the marks
TURN = "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
LAST = "{% if loop.last and message['role'] == 'assistant' %}{{ '<SPECIAL_12>' }}{% endif %}"
LAST_MARKED = "{% for message in messages %}" + TURN + LAST + "{% endfor %}"
GENERATION = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
              "{% generation %}" + TURN + LAST + "{% endgeneration %}{% else %}" + TURN +
              "{% endif %}{% endfor %}")


def _tiny_qwen3(path):
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=16)
    save_random_model(path, config, transformers.Qwen3ForCausalLM)
    save_sft_tokenizer(path, LAST_MARKED)
    return path


def _documents(path):
    """Long documents of the tokenizer's words (one token each)."""
    vocabulary = [w for w in words() if w.isalpha()]
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(24):
            f.write(json.dumps({"text": " ".join(rng.choice(vocabulary, 80))}) + "\n")
    return path


def _run_recipe(hf_dir, tmp_path):
    (tmp_path / "generation.jinja").write_text(GENERATION)
    bin_dir = os.path.dirname(sys.executable)  # python3 and torchrun of this interpreter
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", HF_PATH=str(hf_dir),
               DATA_JSONL=str(_documents(tmp_path / "docs.jsonl")), SFT_JSONL=str(SFT_JSONL),
               RUN_DIR=str(tmp_path / "run"), GPUS_PER_NODE="2", SP="2", ORIGINAL_CONTEXT="16",
               YARN_FACTOR="4", GLOBAL_BATCH="2", TRAIN_ITERS="2", SFT_ITERS="2",
               WARMUP_ITERS="0", SFT_WARMUP_ITERS="0", LR="1e-3", SFT_LR="1e-3", EVAL_ITERS="0",
               SPLIT="100,0,0", WORKERS="1", GPU_ARGS="",
               SFT_CHAT_TEMPLATE=str(tmp_path / "generation.jinja"))
    return subprocess.run(["bash", str(REPO_ROOT / "examples" / "extend_context_qwen3.sh"),
                           "--num-workers", "0"], env=env, capture_output=True, text=True,
                          timeout=300)


def test_recipe_imports_yarn_pretrains_finetunes_and_exports_what_transformers_runs(tmp_path):
    hf_dir = _tiny_qwen3(tmp_path / "qwen3")
    run = _run_recipe(hf_dir, tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "run" / "hf"
    for log in ("pretrain.log", "sft.log"):
        assert sorted(losses_of((tmp_path / "run" / log).read_text())) == [1, 2], log
    config = json.loads((out / "config.json").read_text())
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"],
            config["max_position_embeddings"]) == ("yarn", 4.0, 16, SEQ), config
    assert (out / "tokenizer.json").is_file()
    # The trained model (not the imported one) is what transformers loads, and gives its loss.
    tokens, prefix = one_document_dataset(tmp_path, VOCAB, SEQ)
    got = losses(pretrain(2, [
        "--load", str(tmp_path / "run" / "checkpoints" / "sft"), "--use-checkpoint-args",
        "--finetune", "--no-use-tokenizer-model-from-checkpoint-args",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
        "--data-path", prefix, "--split", "50,50,0", "--data-cache-path", str(tmp_path / "cache"),
        "--seq-length", str(SEQ), "--ulysses-sp-size", "2", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--lr", "0", "--train-iters", "1", "--eval-iters", "0",
        "--log-interval", "1", "--num-workers", "0", "--attention-dropout", "0",
        "--hidden-dropout", "0"]))
    plain = transformers.AutoConfig.from_pretrained(out)  # the export without its YaRN
    plain.rope_parameters = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    hf_losses = [_hf_loss(out, tokens), _hf_loss(hf_dir, tokens),
                 _hf_loss(out, tokens, config=plain)]
    assert got[1] == pytest.approx(hf_losses[0], rel=1e-5)
    assert hf_losses[1] != pytest.approx(hf_losses[0], rel=1e-3)  # it did train
    assert hf_losses[2] != pytest.approx(hf_losses[0], rel=1e-3)  # YaRN's positions count


def _hf_loss(path, tokens, **kwargs) -> float:
    """transformers' loss on `tokens` (labels the next tokens, wrapping as the two copies do)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    with torch.no_grad():
        logits = model(tokens[None]).logits[0]
    return torch.nn.functional.cross_entropy(logits, torch.cat([tokens[1:], tokens[:1]])).item()
