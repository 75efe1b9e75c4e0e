"""Session fixtures shared by the data, tool and CLI tests: a tiny sentencepiece model, a tiny
GPT-2 byte-level BPE and a tiny HuggingFace tokenizer directory trained on the bundled corpus, and
that corpus preprocessed into a megatron-core indexed dataset."""

import json
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "examples" / "data" / "corpus.jsonl"
TINY_VOCAB = 1000
sys.path.insert(0, str(REPO_ROOT / "tools"))
sys.path.insert(0, str(REPO_ROOT / "tests"))  # `from conftest import REPO_ROOT`
sys.path.insert(0, str(REPO_ROOT / "tests" / "helpers"))  # `from distributed import spawn`
sys.path.append(str(REPO_ROOT / "tests" / "unit"))  # integration files reuse its flag cases
# Every process the tests start skips the shutdown garbage collection (fast_exit/sitecustomize.py)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
    str(REPO_ROOT / "tests" / "helpers" / "fast_exit"), os.environ.get("PYTHONPATH")]))
TIERS = ("unit", "integration", "gpu")  # each tier's folder; its tests get its marker


def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker (`-m unit`); tests/gpu (the GPU suite, tests/gpu/run.sh)
    is skipped as a whole without CUDA."""
    import torch

    skip = pytest.mark.skip(reason="GPU suite: needs CUDA (run tests/gpu/run.sh on a GPU)")
    for item in items:
        tier = Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory) -> str:
    """Path of a BPE sentencepiece model trained on the bundled corpus."""
    import train_tokenizer

    prefix = str(tmp_path_factory.mktemp("tokenizer") / "tiny_sp")
    assert train_tokenizer.main(
        ["--input", str(CORPUS), "--output-prefix", prefix, "--vocab-size", str(TINY_VOCAB)]
    ) == 0
    return prefix + ".model"


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory):
    """``(vocab.json, merges.txt)`` of a GPT-2-style byte-level BPE (all 256 byte symbols,
    ``<|endoftext|>``) trained on the bundled corpus, as GPT-2's files are laid out."""
    from tokenizers import ByteLevelBPETokenizer

    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=600, min_frequency=2,  # with the 256 bytes
                            special_tokens=["<|endoftext|>"])
    folder = tmp_path_factory.mktemp("gpt2_bpe")
    vocab, merges = bpe.save_model(str(folder))
    return vocab, merges


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory, sp_model) -> str:
    """The bundled corpus as `.bin/.idx` (GPTSentencePieceTokenizer ids, eod appended)."""
    import preprocess_data

    prefix = str(tmp_path_factory.mktemp("corpus") / "corpus")
    assert preprocess_data.main([
        "--input", str(CORPUS), "--output-prefix", prefix, "--json-keys", "text",
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
        "--append-eod", "--workers", "1",
    ]) == 0
    return prefix + "_text_document"


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A local HuggingFace tokenizer directory whose post-processor adds a BOS."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    backend.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    path = tmp_path_factory.mktemp("hf") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def sft_tokenizer(tmp_path_factory):
    """The SFT fixture's word-level HuggingFace tokenizer directory (tests/helpers/sft_data.py)."""
    pytest.importorskip("transformers")
    from sft_data import save_sft_tokenizer

    return save_sft_tokenizer(tmp_path_factory.mktemp("sft") / "tokenizer")
