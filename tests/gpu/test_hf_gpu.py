"""A Hugging Face model's way through the product on the GPU, as a context-extension user runs it:
`tools/convert_hf.py import` on a CPU node (no CUDA: megatron-core's local layer spec), then on
the GPU with Transformer Engine's spec: export, `pretrain_gpt.py --use-checkpoint-args
--finetune` (bf16 and fp32), `--skip-train`, the export of the trained checkpoint, and
`tools/eval_passkey.py` at SP 1 (NCCL) and SP 2 (two processes on the GPU, gloo).

The model: a tiny random Llama with GQA and llama3 RoPE scaling. The data: two copies of one
document of exactly `--seq-length` tokens (split 50,50,0: one per split), so that every
sample, train or validation, is that document and Hugging Face's loss on it is the reference:
- the CPU import exports bitwise equal from the GPU (TE spec names of the local spec's weights);
- iteration 1's loss (before any update) equals HF's on the GPU: fp32 within 1e-4, bf16 1e-2;
- `--skip-train` on the trained checkpoint logs the trained run's last validation loss exactly
  (deterministic mode), and HF's loss of the export of that checkpoint is the same within 1e-2;
- the passkey tool's answers (fp32) at SP 2 equal SP 1's, and HF's teacher-forced argmax;
- a tiny Qwen3 (q/k norms, head_dim 128 != 256 / 4) with YaRN x4 from a 128-token original
  context, imported on the CPU node, gives HF's first loss at SEQ = 4 x 128 tokens at SP 1 and
  at SP 2 (two processes on the GPU, gloo, tests/gpu/gloo_launcher.py), fp32 within 1e-4 and
  bf16 1e-2; HF's loss without the YaRN differs by more than 10x the fp32 tolerance, so the
  fp32 case sees YaRN (the bf16 one checks the bf16 path, not YaRN).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY_VOCAB
from hf_models import save_random_model
from test_trainer import ITERATION, REPO, VALIDATION, report

import transformers  # noqa: E402 (offline machines: run.sh installs it from $HF_WHEELS)

# The sentencepiece tokenizer's vocabulary (conftest, for the passkey prompts); the import keeps
# exactly these rows (no padding: padded logits would change HF's loss), and NullTokenizer's
# `--vocab-size VOCAB - 1` plus its EOD makes the same count.
VOCAB, SEQ = TINY_VOCAB, 512
TOOL = str(REPO / "tools" / "convert_hf.py")
GLOO_LAUNCHER = str(REPO / "tests" / "gpu" / "gloo_launcher.py")


def _env(**changes):
    return dict(os.environ, PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1", **changes)


def _run(command, **env):
    result = subprocess.run(command, env=_env(**env), capture_output=True, text=True,
                            timeout=480, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, max_position_embeddings=16384)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    """(prefix, tokens): an indexed dataset of two copies of one `SEQ`-token document."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokens = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(3))
    prefix = str(tmp_path_factory.mktemp("data") / "doc")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(2):
        builder.add_item(tokens.to(torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix, tokens


def _hf_loss(path, tokens, **kwargs) -> float:
    """HF's mean cross entropy on the document as the data set serves it: labels are the next
    tokens, the last one wrapping to the next copy's first."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **kwargs).cuda()
    labels = torch.cat([tokens[1:], tokens[:1]]).cuda()
    with torch.no_grad():
        logits = model(tokens[None].cuda()).logits[0].float()
    return torch.nn.functional.cross_entropy(logits, labels).item()


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _import_on_cpu(hf_dir, path):
    """`path`: the checkpoint imported on a CPU node (CUDA hidden: local spec, gloo, sdpa)."""
    _run([sys.executable, TOOL, "import", "--hf-path", str(hf_dir), "--output", str(path)],
         CUDA_VISIBLE_DEVICES="")
    return path


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    return _import_on_cpu(hf_dir, tmp_path_factory.mktemp("ckpt") / "imported")


def test_cpu_import_exports_bitwise_from_the_te_spec(hf_dir, imported, tmp_path):
    out = tmp_path / "exported"
    _run([sys.executable, TOOL, "export", "--load", str(imported), "--output", str(out)])
    original, exported = _tensors(hf_dir), _tensors(out)
    assert sorted(original) == sorted(exported)
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((hf_dir / "config.json").read_text())


def _torchrun(nproc, *launcher):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *launcher]


def _train(imported, document, workdir, *flags, program=(sys.executable,)):
    """pretrain_gpt.py by `program` (one process; `_torchrun(...)` for several)."""
    prefix, _ = document
    return _run([*program, str(REPO / "pretrain_gpt.py"), "--load", str(imported),
                 "--use-checkpoint-args", "--data-path", prefix, "--split", "50,50,0",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
                 "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "1",
                 "--attention-dropout", "0", "--hidden-dropout", "0",
                 "--ulysses-attention-backend", "te", "--deterministic-mode",
                 "--log-interval", "1", "--num-workers", "0",
                 "--data-cache-path", str(workdir / "cache"), *flags])


@pytest.fixture(scope="module")
def trained(imported, document, tmp_path_factory):
    """A bf16 finetune of the imported checkpoint (3 iterations, saved), and an fp32 one."""
    work = tmp_path_factory.mktemp("runs")
    run = ["--finetune", "--lr", "1e-3", "--train-iters", "3", "--eval-interval", "3",
           "--eval-iters", "1"]
    bf16 = _train(imported, document, work, *run, "--bf16", "--save", str(work / "trained"))
    fp32 = _train(imported, document, work, *run)
    return {"bf16": bf16, "fp32": fp32, "checkpoint": work / "trained", "work": work}


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("bf16", 1e-2)])
def test_first_loss_of_the_imported_model_is_hf_loss(hf_dir, document, trained, precision,
                                                     tolerance):
    losses = {int(i): float(v) for i, v, *_ in ITERATION.findall(trained[precision])}
    assert sorted(losses) == [1, 2, 3]
    expected = _hf_loss(hf_dir, document[1])
    report(f"hf_first_loss_{precision}", ours=losses[1], hf=expected,
           rel=abs(losses[1] - expected) / expected)
    assert losses[1] == pytest.approx(expected, rel=tolerance)
    assert losses[3] < losses[1], "it did not train"


def test_skip_train_and_export_of_the_trained_checkpoint(document, trained, tmp_path):
    validation = {int(i): float(v) for i, v in VALIDATION.findall(trained["bf16"])}
    assert list(validation) == [3]
    evaluated = _train(trained["checkpoint"], document, trained["work"], "--skip-train",
                       "--eval-iters", "1", "--bf16")
    assert not ITERATION.search(evaluated), "--skip-train trained"
    skip = {int(i): float(v) for i, v in VALIDATION.findall(evaluated)}
    assert skip == validation, "--skip-train differs from the trained run's own evaluation"

    out = tmp_path / "exported"
    _run([sys.executable, TOOL, "export", "--load", str(trained["checkpoint"]), "--output",
          str(out)])
    hf_loss = _hf_loss(out, document[1])
    report("hf_loss_of_trained_export", ours=skip[3], hf=hf_loss,
           rel=abs(skip[3] - hf_loss) / hf_loss)
    assert hf_loss == pytest.approx(skip[3], rel=1e-2)


def _passkey(imported, sp_model, out, nproc, *flags):
    _run([*_torchrun(nproc), str(REPO / "tools" / "eval_passkey.py"), "--load", str(imported),
          "--use-checkpoint-args", "--tokenizer-type", "GPTSentencePieceTokenizer",
          "--tokenizer-model", sp_model, "--lengths", "256,1024", "--depths", "0,0.5,1",
          "--trials", "2", "--output-dir", str(out), "--ulysses-attention-backend", "te", *flags])
    return json.loads((out / "passkey.json").read_text())


def test_passkey_at_sp2_on_the_gpu_is_sp1_and_hf_argmax(hf_dir, imported, sp_model, tmp_path):
    from megatron_ulysses.data.tokenizers import build_tokenizer
    from megatron_ulysses.eval.prompt import PromptBuilder

    sp1 = _passkey(imported, sp_model, tmp_path / "sp1", 1)
    sp2 = _passkey(imported, sp_model, tmp_path / "sp2", 2, "--ulysses-sp-size", "2",
                   "--distributed-backend", "gloo")
    assert (tmp_path / "sp2" / "passkey.png").exists()
    assert len(sp1["records"]) == 12 and sp2["records"] == sp1["records"]
    builder = PromptBuilder(build_tokenizer("GPTSentencePieceTokenizer", sp_model))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda()
    agree = 0
    for record in sp1["records"]:
        prompt = builder.build(record["length"], record["depth"], record["key"])
        with torch.no_grad():
            logits = model(torch.tensor([prompt.tokens]).cuda()).logits[0]
        n = len(prompt.answer)
        argmax = logits[record["length"] - n - 1:record["length"] - 1].argmax(-1).tolist()
        agree += record["predicted_tokens"] == argmax
    report("passkey_gpu", records=len(sp1["records"]), agree_with_hf=agree)
    assert agree == len(sp1["records"])


YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": SEQ // 4}


@pytest.fixture(scope="module")
def qwen3_yarn(tmp_path_factory):
    """(HF directory, its CPU import): a tiny Qwen3 with YaRN x4 up to SEQ tokens."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=SEQ, rope_parameters=YARN)
    work = tmp_path_factory.mktemp("qwen3_yarn")
    hf_dir = save_random_model(work / "hf", config, transformers.Qwen3ForCausalLM)
    return hf_dir, _import_on_cpu(hf_dir, work / "imported")


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("bf16", 1e-2)])
def test_qwen3_with_yarn_gives_hf_loss_at_sp1_and_sp2(qwen3_yarn, document, precision,
                                                       tolerance, tmp_path):
    hf_dir, imported = qwen3_yarn
    run = ["--finetune", "--lr", "1e-3", "--train-iters", "1", "--eval-iters", "0",
           *(["--bf16"] if precision == "bf16" else [])]
    logs = {"sp1": _train(imported, document, tmp_path / "sp1", *run),
            "sp2": _train(imported, document, tmp_path / "sp2", *run, "--ulysses-sp-size", "2",
                          "--distributed-backend", "gloo",
                          program=_torchrun(2, GLOO_LAUNCHER))}
    first = {}
    for name, log in logs.items():
        assert "attention backend te in transformer_engine layers" in log, log[-3000:]
        assert log.count("lm loss:") == 1, log[-3000:]
        first[name] = float(ITERATION.search(log)[2])
    assert "DP 1 x Ulysses SP 2;" in logs["sp2"]
    expected = _hf_loss(hf_dir, document[1])
    plain = transformers.AutoConfig.from_pretrained(hf_dir)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": YARN["rope_theta"]}
    without_yarn = _hf_loss(hf_dir, document[1], config=plain)
    report(f"hf_qwen3_yarn_first_loss_{precision}", sp1=first["sp1"], sp2=first["sp2"],
           hf=expected, hf_without_yarn=without_yarn,
           rel_sp1=abs(first["sp1"] - expected) / expected,
           rel_sp2=abs(first["sp2"] - expected) / expected)
    if precision == "fp32":  # (CPU, fp32: YaRN moves HF's loss by 1.9e-3 relative)
        assert abs(without_yarn - expected) > 10 * tolerance * expected, "YaRN unseen"
    for name in ("sp1", "sp2"):
        assert first[name] == pytest.approx(expected, rel=tolerance), name
