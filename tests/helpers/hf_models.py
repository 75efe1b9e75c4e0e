"""Random Hugging Face models and the one-document dataset of the conversion tests (CPU and
GPU tiers)."""

import torch


def save_random_model(path, config, model_class):
    """A random `model_class` (fp32) of `config`, weights spread wider than HF's init (so that
    attention is far from uniform and positions change the logits), saved with
    `save_pretrained` to `path`."""
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class._from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(path)
    return path


def one_document_dataset(tmp_path, vocab: int, length: int):
    """(tokens, prefix): two copies of one random `length`-token document as an indexed dataset
    at `tmp_path/doc` (with --split 50,50,0 every sample is that document)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokens = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(3))
    prefix = str(tmp_path / "doc")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(2):
        builder.add_item(tokens.to(torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return tokens, prefix
