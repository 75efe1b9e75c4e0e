"""Megatron-LM's torch_dist checkpoints, read as ours.

Megatron-LM's `save_checkpoint` (checkpoint_version 3.0) writes through megatron-core's
dist_checkpointing what this package writes, with other names for the non-tensor part:

    common state      `args` (its argparse.Namespace), `checkpoint_version` 3.0, `iteration`,
                      `opt_param_scheduler` (megatron-core's OptimizerParamScheduler, as ours),
                      `num_floating_point_operations_so_far`, `rerun_state_machine`
    sharded           `model` (GPTModel.sharded_state_dict(): the same keys as ours, since
                      megatron-core's local layer spec maps its norms to the TE spec's names;
                      with a virtual pipeline `model0`, `model1`, ..., one per chunk, whose
                      keys are the whole model's: they load at any pipeline layout),
                      `optimizer` (unless --no-save-optim), `rng_state` (one ShardedObject
                      per (PP, TP) rank: python, numpy, torch, CUDA and tracker states),
                      `rerun_state_machine_state`

`common_state` maps the first onto our common state: the iteration, the consumed samples
(`args.consumed_train_samples`), the model args by our names, and no RNG layout: Megatron-LM's
RNG states are one per (PP, TP) rank from seeds without Ulysses SP ranks, so a run from its
checkpoint keeps the streams seeded from --seed (as ours at another layout).
"""

import argparse
import glob
import os

from ...errors import ConfigError

SAVED_BY = "Megatron-LM"
# Our arg names that Megatron-LM stores under another name or meaning.
_RENAMED = {
    "disable_bias_linear": lambda args: not args.add_bias_linear,
    # Megatron-LM keeps --num-query-groups' default (1) without --group-query-attention.
    "num_query_groups": lambda args: (args.num_query_groups if args.group_query_attention
                                      else args.num_attention_heads),
}
# Megatron-LM args of models this package does not build (their weights have other keys or
# meanings): the arg, the value that means "not used", the flag to name.
_UNSUPPORTED = (
    ("num_experts", None, "--num-experts"),
    ("multi_latent_attention", False, "--multi-latent-attention"),
    ("mtp_num_layers", None, "--mtp-num-layers"),
    ("apply_layernorm_1p", False, "--apply-layernorm-1p"),
    ("squared_relu", False, "--squared-relu"),
    ("rotary_interleaved", False, "--rotary-interleaved"),
)


def refuse_legacy_format(path: str) -> None:
    """Megatron-LM's legacy torch format (--ckpt-format torch: one `mp_rank_XX[_YYY]/
    model_optim_rng.pt` per TP x PP rank, a virtual pipeline's chunks as its `model0`,
    `model1`, ...) is a whole pickle per rank, readable only at the layout it was saved at: one
    `ConfigError` naming Megatron-LM's conversion to torch_dist, before any file is opened."""
    files = glob.glob(os.path.join(glob.escape(path), "mp_rank_*", "model_optim_rng.pt"))
    if files:
        raise ConfigError(
            f"--load {path} is a Megatron-LM checkpoint in its legacy torch format ({len(files)} "
            "mp_rank_*/model_optim_rng.pt files), which megatron_ulysses does not read; convert "
            "it to torch_dist with Megatron-LM's pretrain_gpt.py, the flags it was saved with "
            f"and --ckpt-format torch --load {os.path.dirname(os.path.normpath(path))} "
            "--ckpt-convert-format torch_dist --ckpt-convert-save NEW (it writes "
            "NEW/torch_dist), then --load NEW/torch_dist")


def is_megatron_lm(common) -> bool:
    return isinstance(common, dict) and isinstance(common.get("args"), argparse.Namespace) \
        and "checkpoint_version" in common


def _saved_args(args: argparse.Namespace, keys) -> dict:
    """Megatron-LM's `args` as our saved args (those of `keys` it holds)."""
    saved = {}
    for key in keys:
        try:
            saved[key] = _RENAMED[key](args) if key in _RENAMED else getattr(args, key)
        except AttributeError:  # an arg this Megatron-LM version did not have
            continue
    return saved


def _optimizer_refusal(args: argparse.Namespace, optimizer_metadata: dict):
    """Why the checkpoint's optimizer state cannot be loaded here (None when it can)."""
    if getattr(args, "no_save_optim", False):
        return "it was saved without optimizer state (--no-save-optim)"
    if getattr(args, "use_distributed_optimizer", False) and not getattr(
            args, "dist_ckpt_optim_fully_reshardable", False):
        return (f"its distributed optimizer state is in the dp_reshardable layout, which loads "
                f"only at the same DP layout and buckets; this package's is "
                f"{optimizer_metadata['distrib_optim_sharding_type']}")
    return None


def common_state(path: str, common: dict, keys, optimizer_metadata: dict) -> dict:
    """Megatron-LM's common state `common` (checked by `is_megatron_lm`) in our layout: the
    `keys` args by our names, iteration, consumed samples, no RNG layout, and `optimizer_refusal`
    (why its optimizer state cannot load, or None)."""
    args, version = common["args"], common["checkpoint_version"]
    if not isinstance(version, (int, float)) or version < 3.0:
        raise ConfigError(f"--load {path} is a Megatron-LM checkpoint of checkpoint_version "
                          f"{version!r}; only torch_dist checkpoints (version 3.0) load here")
    unsupported = [flag for key, off, flag in _UNSUPPORTED
                   if getattr(args, key, off) not in (off, 0)]
    if unsupported:
        raise ConfigError(f"--load {path} is a Megatron-LM checkpoint of a model this package "
                          f"does not build ({', '.join(unsupported)})")
    consumed = getattr(args, "consumed_train_samples", 0)
    if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
        raise ConfigError(f"--load {path}: its args.consumed_train_samples is {consumed!r}, not "
                          "a number of samples")
    return {
        "saved_by": SAVED_BY,
        "iteration": common.get("iteration"),
        "consumed_samples": consumed,
        "args": _saved_args(args, keys),
        "rng_layout": None,
        "optimizer_refusal": _optimizer_refusal(args, optimizer_metadata),
    }
