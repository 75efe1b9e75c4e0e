"""Random Hugging Face models for the conversion tests (CPU and GPU tiers)."""

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
