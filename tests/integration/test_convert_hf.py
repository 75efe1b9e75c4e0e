"""tools/convert_hf.py and `pretrain_gpt.py --use-checkpoint-args`, as a user runs them.

A tiny random Llama with GQA (fp32, untied, vocab 100) saved with `save_pretrained`:
- import at TP 1 (and TP 2) -> export gives every tensor bitwise equal and the same config.json;
  `AutoModelForCausalLM.from_pretrained` of the export gives the original's logits exactly;
- `pretrain_gpt.py --load CKPT --use-checkpoint-args --finetune` (no model flags) trains it at
  SP = 1 and SP = 2 with the same per-iteration losses, and the trained checkpoint exports; one
  saved at PP 2 exports the PP 1 tensors;
- bad input exits 2 with one message naming the flag;
- a tiny Qwen3 with YaRN: the same at 4x its original context, plus a resume.
"""

import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import transformers
from conftest import REPO_ROOT
from hf_models import save_random_model
from launcher import pretrain
from test_cli import losses

TOOL = str(REPO_ROOT / "tools" / "convert_hf.py")
VOCAB = 100


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def convert(*flags):
    return subprocess.run([sys.executable, TOOL, *flags], env=_env(), capture_output=True,
                          text=True, timeout=300)


def convert_refusal(capsys, *flags):
    """`convert_hf.main(flags)` in this process, for an input it must refuse before it starts
    any process (a refusal found later fails here, not by exiting pytest); its (exit status,
    stderr) as a `subprocess.CompletedProcess`. Each test keeps one `convert` run as the user
    meets it; the other refusals of its kind run here (a process costs seconds of imports)."""
    import convert_hf

    def no_world(*args):
        raise AssertionError(f"convert_hf.py {' '.join(flags)} was not refused before its "
                             "processes started")

    capsys.readouterr()
    with mock.patch.object(convert_hf, "run_world", no_world):
        code = convert_hf.main(list(flags))
    return subprocess.CompletedProcess(flags, code, *capsys.readouterr())


def save_random_llama(path, vocab: int):
    """A tiny random Llama with GQA (fp32, untied), weights spread wider than HF's init so that
    logits differ visibly, saved with `save_pretrained` to `path`."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        tie_word_embeddings=False, max_position_embeddings=256)
    return save_random_model(path, config, transformers.LlamaForCausalLM)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("hf") / "llama", VOCAB)


@pytest.fixture(scope="module")
def checkpoint(hf_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "imported"
    result = convert("import", "--hf-path", str(hf_dir), "--output", str(path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return path


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _assert_same_model(original, exported):
    a, b = _tensors(original), _tensors(exported)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert json.loads((exported / "config.json").read_text()) == \
        json.loads((original / "config.json").read_text())


def test_import_export_is_bitwise_and_loads_in_transformers(hf_dir, checkpoint, tmp_path):
    out = tmp_path / "exported"
    result = convert("export", "--load", str(checkpoint), "--output", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_same_model(hf_dir, out)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    logits = []
    for path in (hf_dir, out):
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert torch.equal(logits[0], logits[1])


def test_import_export_at_tp2_is_bitwise(hf_dir, tmp_path):
    ckpt, out = tmp_path / "tp2", tmp_path / "exported"
    result = convert("import", "--hf-path", str(hf_dir), "--output", str(ckpt),
                     "--tensor-model-parallel-size", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    result = convert("export", "--load", str(ckpt), "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_model(hf_dir, out)


def _train(nproc, checkpoint, *flags, data=("--mock-data",), model=("--use-checkpoint-args",)):
    # NullTokenizer adds its EOD after --vocab-size ids: VOCAB - 1 + 1 = the import's rows.
    return pretrain(nproc, [
        "--load", str(checkpoint), *model, "--finetune", *data,
        "--vocab-size", str(VOCAB - 1), "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
        "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--attention-dropout", "0", "--hidden-dropout", "0", *flags])


@pytest.fixture(scope="module")
def sp1_losses(checkpoint):
    """The losses of `_train(1, checkpoint)`: the imported model fine-tuned at SP 1."""
    return losses(_train(1, checkpoint))


def test_finetune_from_checkpoint_args_at_sp1_and_sp2(hf_dir, checkpoint, sp1_losses, tmp_path):
    expected = sp1_losses
    assert sorted(expected) == [1, 2]
    trained = tmp_path / "trained"
    got = losses(_train(2, checkpoint, "--ulysses-sp-size", "2", "--save", str(trained)))
    assert got.keys() == expected.keys()
    for iteration, loss in expected.items():
        assert got[iteration] == pytest.approx(loss, rel=2e-6), iteration
    # The trained checkpoint keeps the HF config: it exports, with the same config.json.
    out = tmp_path / "exported"
    result = convert("export", "--load", str(trained), "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((hf_dir / "config.json").read_text())
    assert not torch.equal(_tensors(out)["model.norm.weight"],
                           _tensors(hf_dir)["model.norm.weight"])  # it did train


def test_a_checkpoint_saved_at_pp2_exports_the_pp1_tensors(hf_dir, checkpoint, tmp_path):
    # --lr 0: the PP 2 run saves the imported weights unchanged, so its export must be the
    # import's, which the PP 1 export gives bitwise (test_import_export_is_bitwise_...).
    from megatron_ulysses.training.checkpoint.load import read_checkpoint_args

    pp2 = tmp_path / "pp2"
    assert list(losses(_train(2, checkpoint, "--pipeline-model-parallel-size", "2", "--lr", "0",
                              "--train-iters", "1", "--save", str(pp2)))) == [1]
    assert read_checkpoint_args(str(pp2))["pipeline_model_parallel_size"] == 2
    out = tmp_path / "exported"
    result = convert("export", "--load", str(pp2), "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_model(hf_dir, out)


def test_first_loss_of_the_imported_model_is_hf_loss(hf_dir, checkpoint, tmp_path):
    # Two copies of one 64-token document (split 50,50,0): every sample is that document. The
    # import pads no vocab rows (padded logits would enter the softmax), so iteration 1's loss
    # (before any update) is HF's.
    from hf_models import one_document_dataset

    tokens, prefix = one_document_dataset(tmp_path, VOCAB, 64)
    got = losses(_train(1, checkpoint, data=(
        "--data-path", prefix, "--split", "50,50,0", "--tokenizer-type", "NullTokenizer",
        "--data-cache-path", str(tmp_path / "cache"))))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(tokens[None]).logits[0]
    expected = torch.nn.functional.cross_entropy(logits, torch.cat([tokens[1:], tokens[:1]]))
    assert got[1] == pytest.approx(expected.item(), rel=1e-5)


def test_a_new_rotary_base_needs_the_model_flags_and_exports(hf_dir, checkpoint, sp1_losses,
                                                              tmp_path):
    # As Megatron-LM's, --use-checkpoint-args keeps the checkpoint's RoPE base over the command
    # line's (a warning says so); context extension raises it with the model flags instead:
    # that changes the numerics and reaches the exported config.json.
    import convert_hf
    from megatron_ulysses.training.arguments import parse_args
    from megatron_ulysses.training.checkpoint.load import read_checkpoint_args

    saved = read_checkpoint_args(str(checkpoint))
    run = ["--load", str(checkpoint), "--mock-data", "--vocab-size", str(VOCAB - 1),
           "--micro-batch-size", "1", "--lr", "0", "--train-iters", "1", "--eval-iters", "0"]
    config = parse_args(run + ["--use-checkpoint-args", "--rotary-base", "2000000"],
                        world_size=1)
    assert config.model.rotary_base == saved["rotary_base"] != 2000000
    assert [w for w in config.warnings if w.startswith(
        f"--rotary-base 2000000: the checkpoint's values are used instead (--rotary-base "
        f"{saved['rotary_base']}), as Megatron-LM's --use-checkpoint-args does")], config.warnings
    model_flags = convert_hf.trainer_argv(dict(saved, vocab_size=None, group_query_attention=(
        saved["num_query_groups"] != saved["num_attention_heads"])), 1)[:-len(convert_hf._RUN)]
    trained = tmp_path / "trained"
    raised = losses(_train(1, checkpoint, "--rotary-base", "2000000", "--save", str(trained),
                           model=model_flags))
    assert raised[1] != pytest.approx(sp1_losses[1], rel=1e-6)
    out, tokenizer = tmp_path / "exported", tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text('{"model_max_length": 131072}')
    result = convert("export", "--load", str(trained), "--output", str(out),
                     "--tokenizer-dir", str(tokenizer))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 131072}'
    config = json.loads((out / "config.json").read_text())
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    assert theta == 2000000


def test_bad_input_exits_2_naming_the_flag(hf_dir, tmp_path, capsys):
    result = convert("import", "--hf-path", str(tmp_path / "missing"), "--output",
                     str(tmp_path / "c"))
    assert result.returncode == 2 and "--hf-path" in result.stderr
    assert "Traceback" not in result.stderr
    result = convert_refusal(capsys, "import", "--hf-path", str(hf_dir), "--output",
                             str(tmp_path / "c"), "--tensor-model-parallel-size", "3")
    assert result.returncode == 2 and "--tensor-model-parallel-size" in result.stderr
    result = convert_refusal(capsys, "import", "--hf-path", str(hf_dir), "--output",
                             str(tmp_path / "c"), "--pipeline-model-parallel-size", "2")
    assert result.returncode == 2 and "import writes the model at PP 1" in result.stderr
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    result = convert_refusal(capsys, "import", "--hf-path", str(bad), "--output",
                             str(tmp_path / "c"))
    assert result.returncode == 2 and "architectures" in result.stderr
    assert "Traceback" not in result.stderr
    result = convert_refusal(capsys, "export", "--load", str(tmp_path / "nothing"), "--output",
                             str(tmp_path / "o"))
    assert result.returncode == 2 and "--load" in result.stderr
    assert not (tmp_path / "c").exists()


def _hf_copy(hf_dir, path, **changes):
    """`hf_dir` linked into `path`, with `changes` applied to its config.json (None deletes)."""
    path.mkdir()
    for name in os.listdir(hf_dir):
        if name != "config.json":
            os.symlink(hf_dir / name, path / name)
    config = json.loads((hf_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


def _refused(result, *words):
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # one error line; torch may log around it (at TP 2 the other rank's SIGTERM; on Python 3.12
    # "No CUDA runtime is found" when megatron-core 0.19 imports torch's cpp_extension)
    lines = [line for line in result.stderr.splitlines()
             if line.startswith("convert_hf.py: error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_import_refuses_bad_output_and_config_fields(hf_dir, tmp_path, capsys):
    unwritable = convert("import", "--hf-path", str(hf_dir), "--output", "/proc/nope")
    _refused(unwritable, "--output")
    assert "--save" not in unwritable.stderr
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "latest_checkpointed_iteration.txt").write_text("5")
    _refused(convert_refusal(capsys, "import", "--hf-path", str(hf_dir), "--output",
                             str(trained)), "--output")
    assert (trained / "latest_checkpointed_iteration.txt").read_text() == "5"
    bad = _hf_copy(hf_dir, tmp_path / "no_layers", num_hidden_layers=None)
    _refused(convert_refusal(capsys, "import", "--hf-path", str(bad), "--output",
                             str(tmp_path / "c")), "is missing the field 'num_hidden_layers'")


def test_import_refuses_tensors_the_config_wants_and_the_files_lack(hf_dir, tmp_path):
    more = _hf_copy(hf_dir, tmp_path / "three_layers", num_hidden_layers=3)
    _refused(convert("import", "--hf-path", str(more), "--output", str(tmp_path / "c"),
                     "--tensor-model-parallel-size", "2"), "model.layers.2.", "num_hidden_layers")
    untied = tmp_path / "untied"
    _hf_copy(hf_dir, untied)
    from safetensors.torch import save_file

    tensors = _tensors(hf_dir)
    del tensors["lm_head.weight"]
    (untied / "model.safetensors").unlink()
    save_file(tensors, str(untied / "model.safetensors"))
    _refused(convert("import", "--hf-path", str(untied), "--output", str(tmp_path / "c")),
             "lm_head.weight", "tie_word_embeddings")
    assert not (tmp_path / "c").exists()


def test_export_refuses_an_output_with_weights_or_not_writable(tmp_path, capsys):
    load = str(tmp_path / "nothing")  # refused before --load is read
    old = tmp_path / "old_model"
    old.mkdir()
    (old / "model-00001-of-00002.safetensors").write_bytes(b"")
    _refused(convert("export", "--load", load, "--output", str(old)), "--output",
             "model-00001-of-00002.safetensors")
    index = tmp_path / "indexed"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text("{}")
    _refused(convert_refusal(capsys, "export", "--load", load, "--output", str(index)),
             "--output")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    _refused(convert_refusal(capsys, "export", "--load", load, "--output", str(tokenizer),
                             "--tokenizer-dir", str(tokenizer)), "--output", "--tokenizer-dir")
    (tmp_path / "file").write_text("")
    _refused(convert_refusal(capsys, "export", "--load", load, "--output",
                             str(tmp_path / "file")), "--output")
    _refused(convert_refusal(capsys, "export", "--load", load, "--output", "/proc/nope"),
             "--output")


def test_qwen3_with_yarn_imports_trains_at_4x_its_context_resumes_and_exports(tmp_path):
    # A tiny Qwen3 (q/k norms, head_dim 32 != 64 / 4) with YaRN from a 16-token original context
    # to 64 (factor 4): the import round-trips bitwise, trains at 64 tokens at SP 1 and SP 2 with
    # the same losses, its checkpoint keeps the YaRN flags (--use-checkpoint-args takes them,
    # the command line's first), a resume at SP 2 continues SP 1's
    # uninterrupted run, and the trained checkpoint exports with the same config.json.
    from megatron_ulysses.training.checkpoint.load import read_checkpoint_args

    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=64, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 16})
    hf_dir = save_random_model(tmp_path / "qwen3", config, transformers.Qwen3ForCausalLM)
    checkpoint, out = tmp_path / "imported", tmp_path / "exported"
    result = convert("import", "--hf-path", str(hf_dir), "--output", str(checkpoint))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = convert("export", "--load", str(checkpoint), "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_model(hf_dir, out)
    saved = read_checkpoint_args(str(checkpoint))
    assert (saved["position_embedding_type"], saved["rotary_scaling_factor"],
            saved["yarn_original_max_position_embeddings"], saved["qk_layernorm"],
            saved["kv_channels"]) == ("yarn", 4.0, 16, True, 32)
    # --use-checkpoint-args takes the YaRN flags where the command line gives none
    from megatron_ulysses.training.arguments import parse_args

    run = ["--load", str(checkpoint), "--use-checkpoint-args", "--mock-data", "--vocab-size",
           str(VOCAB - 1), "--micro-batch-size", "1", "--lr", "0", "--train-iters", "1"]
    taken = parse_args(run, world_size=1).model
    assert (taken.rotary_scaling_factor, taken.yarn_correction_range_round_to_int) == (4.0, True)
    given = parse_args(run + ["--rotary-scaling-factor", "8",
                              "--no-yarn-correction-range-round-to-int"], world_size=1).model
    assert (given.rotary_scaling_factor, given.yarn_correction_range_round_to_int,
            given.yarn_original_max_position_embeddings) == (8.0, False, 16)
    constant = ("--lr-decay-style", "constant")  # 2 and 3 iterations: the same learning rates
    expected = losses(_train(1, checkpoint, "--train-iters", "3", *constant))
    assert sorted(expected) == [1, 2, 3]
    trained = tmp_path / "trained"
    got = losses(_train(2, checkpoint, "--ulysses-sp-size", "2", "--save", str(trained),
                        *constant))
    assert sorted(got) == [1, 2]
    resume = pretrain(2, [
        "--load", str(trained), "--use-checkpoint-args", "--mock-data",
        "--vocab-size", str(VOCAB - 1), "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "3", "--log-interval", "1",
        "--eval-iters", "0", "--num-workers", "0", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--ulysses-sp-size", "2", *constant,
        "--use-checkpoint-opt_param-scheduler"])
    got.update(losses(resume))
    assert got.keys() == expected.keys()
    for iteration, loss in expected.items():
        assert got[iteration] == pytest.approx(loss, rel=2e-6), iteration
    exported = tmp_path / "trained_exported"
    result = convert("export", "--load", str(trained), "--output", str(exported))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((exported / "config.json").read_text()) == \
        json.loads((hf_dir / "config.json").read_text())


def test_tokenizer_dir_copies_every_file_transformers_saves(tmp_path):
    # transformers writes a chat template to chat_template.jinja and a slow tokenizer's added
    # tokens to added_tokens.json: an export without them loses the template or the tokens.
    import convert_hf
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                        eos_token="<unk>")
    tokenizer.add_tokens(["<extra>"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "added_tokens.json").write_text('{"<extra>": 3}')
    saved = sorted(os.listdir(tmp_path / "tok"))
    assert "chat_template.jinja" in saved
    assert sorted(convert_hf._tokenizer_files(str(tmp_path / "tok"))) == saved
