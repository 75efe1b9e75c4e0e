"""Uneven heads from the command line: a tiny random HF Qwen2 with 28 query / 4 kv heads (head
dim 8, 2 layers, q/k/v bias), imported with tools/convert_hf.py, trains through pretrain_gpt.py at
SP 8 (4 heads on SP ranks 0-3, 3 on ranks 4-7; kv heads on up to 2 ranks) with SP 1's losses."""

import pytest
import transformers
from hf_models import save_random_model
from test_cli import losses
from test_convert_hf import VOCAB, _train, convert


def test_qwen2_with_28_heads_trains_at_sp8_with_sp1_losses(tmp_path):
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=224, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=256)
    hf_dir = save_random_model(tmp_path / "qwen2", config, transformers.Qwen2ForCausalLM)
    checkpoint = tmp_path / "imported"
    result = convert("import", "--hf-path", str(hf_dir), "--output", str(checkpoint))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = losses(_train(1, checkpoint))
    assert sorted(expected) == [1, 2]
    got = losses(_train(8, checkpoint, "--ulysses-sp-size", "8"))
    assert got.keys() == expected.keys()
    for iteration, loss in expected.items():
        assert got[iteration] == pytest.approx(loss, rel=2e-6), iteration
