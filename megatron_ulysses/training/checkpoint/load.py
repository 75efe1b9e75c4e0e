"""`load_checkpoint` and the reads that need no process group: every problem with the checkpoint
is one `ConfigError` naming --load."""

import os
import pickle
import re

from megatron.core import __version__ as megatron_core_version
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    maybe_report_missing_and_unexpected_keys,
)
from megatron.core.transformer.module import Float16Module

from ...errors import ConfigError, flag_name
from ..chunks import model_chunks, state_keys
from ..fsdp import (
    local_shards_as_dtensors,
    main_params_as_dtensors,
    shard_loaded_states,
)
from ..logging import print_rank_0
from ..optimizer import count_on_after_load
from . import megatron_lm, save_guard
from .rng_state import rng_states_to_load, set_rng_tensors
from .state import (
    FORMAT_VERSION,
    MISSING_MEANS,
    MODEL_ARGS,
    OPTIMIZER_ARGS,
    OPTIMIZER_METADATA,
    SAVED_ARGS,
    TRACKER,
    args_of,
    checkpoint_dir,
    quiet_torch_checkpoint,
    read_tracker,
    sharded_state_dict,
)
from .trust import check_checkpoint_files, check_extra_states, extra_states_checked

# What a checkpoint may lack: TE attention's `_extra_state` (FP8 metadata; none without FP8), absent
# from checkpoints of the sdpa / local backends, e.g. tools/convert_hf.py's on a CPU node.
_OPTIONAL_KEYS = re.compile(r".*core_attention\.backend_attention\.(.+\.)?_extra_state(/.*)?")


def _check_missing(path: str, keys) -> None:
    """Keys this run's model and optimizer have and the checkpoint lacks: one `ConfigError`
    unless all are `_OPTIONAL_KEYS`."""
    missing = sorted(key for key in keys if not _OPTIONAL_KEYS.fullmatch(key))
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4
                                          else "")
        raise ConfigError(f"--load {path} lacks {len(missing)} entries this model has ({shown}): "
                          "it was saved by another model or layer spec")


def _flag(key: str) -> str:
    if key == "padded_vocab_size":
        return ("padded vocab size (from the tokenizer or --vocab-size, "
                "--make-vocab-size-divisible-by and TP, or --padded-vocab-size)")
    return flag_name(key)


def _vocab_hint(saved: dict, run: dict) -> str:
    """How to run with the checkpoint's padded vocab rows (`saved`) at this run's TP: they are
    the tokenizer's rounded up to a multiple of --make-vocab-size-divisible-by x TP, so another
    TP may pad to other rows (Megatron-LM's --use-checkpoint-args takes the checkpoint's)."""
    rows, tp = saved.get("padded_vocab_size"), run["tensor_model_parallel_size"]
    if not isinstance(rows, int) or saved.get("tensor_model_parallel_size") in (None, tp):
        return ""
    if rows % tp:
        return (f" (its {rows} vocab rows do not split over --tensor-model-parallel-size {tp}; "
                "run at a TP that divides them)")
    return (f" (the padding depends on TP: give --padded-vocab-size {rows} to keep the "
            "checkpoint's rows)")


ROTARY = {"rope", "yarn"}  # position types of the same weights (YaRN rescales RoPE)


def check_args(path: str, saved: dict, run: dict) -> None:
    """The checkpoint's model values (`saved`) against this run's (`run`); its TP and pipeline
    layout may differ (`LAYOUT_ARGS`), not its padded vocab."""
    keys = list(MODEL_ARGS)
    if run["position_embedding_type"] == "learned_absolute":
        keys.append("max_position_embeddings")
    missing = object()
    saved = {**MISSING_MEANS, **saved}
    mismatched = [(key, saved.get(key, missing), run[key]) for key in keys
                  if saved.get(key, missing) != run[key]
                  and {saved.get(key), run[key]} != ROTARY]
    if mismatched:
        details = "; ".join(
            f"{_flag(key)}: checkpoint {'(not saved)' if a is missing else repr(a)}, "
            f"this run {b!r}" for key, a, b in mismatched)
        vocab = any(key == "padded_vocab_size" for key, _, _ in mismatched)
        hint = _vocab_hint(saved, run) if vocab else ""
        raise ConfigError(f"--load {path} was saved with another model: {details}. Run with "
                          f"the checkpoint's values{hint}")
    if {saved.get("position_embedding_type"), run["position_embedding_type"]} == ROTARY:
        print_rank_0(f" WARNING: --position-embedding-type {run['position_embedding_type']}: "
                     f"the checkpoint's is {saved['position_embedding_type']} (--load {path}); "
                     "its weights load, positions are rotated by this run's")
    if run["position_embedding_type"] in ROTARY and saved.get("rotary_base") not in \
            (None, run["rotary_base"]):
        print_rank_0(f" WARNING: --rotary-base {run['rotary_base']} differs from the checkpoint's "
                     f"{saved['rotary_base']} (--load {path})")


def _check_optimizer_args(path: str, saved: dict, run: dict) -> None:
    different = [key for key in OPTIMIZER_ARGS if key in saved and saved[key] != run[key]]
    if different:
        details = ", ".join(f"{_flag(k)}: checkpoint {saved[k]}, this run {run[k]}"
                            for k in different)
        raise ConfigError(f"--load {path}: its optimizer state was saved with another optimizer "
                          f"({details}); run with the checkpoint's flags, or pass --no-load-optim "
                          "to load the weights only (Adam moments restart)")


def _checkpoint_path(root: str, iteration: int) -> str:
    path = checkpoint_dir(root, iteration)
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + ".old"):  # a crash between the two renames of a re-save
        print_rank_0(f" {path} is missing (a save was interrupted); loading {path}.old")
        return path + ".old"
    raise ConfigError(f"--load {root}: {TRACKER} names iteration {iteration}, but {path} does "
                      "not exist; fix the tracker or --load another directory")


def _load_common(path: str):
    """megatron-core's read of the common state (torch's weights_only unpickler with
    megatron-core's safe globals, after `check_checkpoint_files`)."""
    try:
        return dist_checkpointing.load_common_state_dict(path)
    except pickle.UnpicklingError as error:  # an admitted class this megatron-core lacks
        raise ConfigError(f"--load {path}: this megatron-core ({megatron_core_version}) "
                          f"cannot read its common state: {str(error).splitlines()[0]}") from None


def read_common_state(root: str):
    """(iteration, path, common state dict) of the latest checkpoint in `root`, None when there
    is none; its files are checked for pickled code before megatron-core reads them. A
    Megatron-LM checkpoint's common state comes in our layout (`megatron_lm`). Needs
    no process group."""
    iteration = read_tracker(root)
    if iteration is None:
        _refuse_hf_model(root)
        return None
    path = _checkpoint_path(root, iteration)
    megatron_lm.refuse_legacy_format(path)
    check_checkpoint_files(path)  # before megatron-core unpickles anything
    save_guard.verify_files(path)  # the save's record: no file missing, short or foreign
    with save_guard.read_errors_named(path):
        common = _load_common(path)
    if megatron_lm.is_megatron_lm(common):
        return iteration, path, megatron_lm.common_state(
            path, common, SAVED_ARGS, OPTIMIZER_METADATA)
    if not isinstance(common, dict) or common.get("format_version") != FORMAT_VERSION:
        version = common.get("format_version") if isinstance(common, dict) else None
        raise ConfigError(f"--load {path} has checkpoint format {version}, this version of "
                          f"megatron_ulysses reads format {FORMAT_VERSION} and Megatron-LM's "
                          "torch_dist checkpoints")
    return iteration, path, common


def _refuse_hf_model(root: str) -> None:
    """A HuggingFace model directory (config.json beside its weights) given as --load is one
    message naming the conversion, not a run from scratch with a warning."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    if "config.json" in names and any(name.endswith((".safetensors", ".safetensors.index.json"))
                                      or re.fullmatch(r"pytorch_model.*\.bin", name)
                                      for name in names):
        raise ConfigError(
            f"--load {root} is a HuggingFace model directory (config.json and its weights), "
            f"not a checkpoint: convert it with `python tools/convert_hf.py import --hf-path "
            f"{root} --output CKPT`, then give --load CKPT (--use-checkpoint-args takes its "
            "model flags)")


CARRIED_COMMON_KEYS = ("hf_config",)  # common state a save keeps from the loaded checkpoint


def carried_common_state(root: str) -> dict:
    """What the next save keeps from the checkpoint at `root`: the Hugging Face config
    tools/convert_hf.py stored on import (so a trained checkpoint still exports)."""
    found = read_common_state(root)
    if found is None:
        return {}
    return {key: found[2][key] for key in CARRIED_COMMON_KEYS if key in found[2]}


def read_checkpoint_args(root: str):
    """The saved model args (a dict) of the latest checkpoint in `root`, None when there is
    none (for --use-checkpoint-args)."""
    found = read_common_state(root)
    if found is None:
        return None
    saved = found[2].get("args")
    if not isinstance(saved, dict):
        raise ConfigError(f"--load {found[1]} holds no saved args (its common state has no "
                          "'args' dict); give the model flags instead of --use-checkpoint-args")
    return saved


def _check_resume(path: str, iteration: int, common: dict, config, model_only: bool) -> dict:
    """The checkpoint's saved args (returned) against this run's, its iteration against the
    tracker's and, when resuming training, against --train-iters."""
    saved_args = common.get("args")
    saved_args = saved_args if isinstance(saved_args, dict) else {}
    check_args(path, saved_args, args_of(config))
    saved_iteration = common.get("iteration")
    if saved_iteration != iteration:
        raise ConfigError(f"--load {path} holds iteration {saved_iteration}, but {TRACKER} "
                          f"names {iteration}")
    train_iters = config.training.train_iters
    if not model_only and iteration > train_iters:
        samples = iteration * config.training.global_batch_size
        raise ConfigError(f"--train-iters ({train_iters}) is smaller than the iteration "
                          f"of the checkpoint at --load {path} ({iteration}); give "
                          f"--train-iters {iteration} or more (--train-samples {samples} or "
                          f"more) or --finetune")
    return saved_args


def _load_scheduler(path: str, scheduler, state: dict) -> None:
    try:
        scheduler.load_state_dict(state)
    except AssertionError as error:  # megatron-core's check of flags vs checkpoint
        raise ConfigError(
            f"--load {path}: the LR schedule of the flags differs from the checkpoint's "
            f"({error}); pass --override-opt_param-scheduler to use the flags or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's") from None


def _load_strategy(path: str, flags):
    """megatron-core's load strategy for `path`; --ckpt-fully-parallel-load: each DP x SP replica
    reads a slice of the replicated tensors and they exchange them."""
    if not flags.ckpt_fully_parallel_load:
        return None
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path),
                                            mpu.get_data_parallel_group())


def _apply_strictness(path: str, strictness: str, unexpected, not_loaded) -> None:
    """--dist-ckpt-strictness on megatron-core's key lists: log_* logs, raise_* refuses (one
    `ConfigError`) what StrictHandling would. Keys this run needs and the checkpoint lacks
    (`unexpected`) are refused by `_check_missing` whatever the value (a model half loaded is
    never right); the other values are megatron-core's 'do nothing more'."""
    both = strictness.endswith("_all")
    extra = sorted(not_loaded) if both else []
    if strictness.startswith("log_"):
        maybe_report_missing_and_unexpected_keys(extra, unexpected, raise_error=False)
    elif strictness.startswith("raise_") and extra:
        shown = ", ".join(extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
        raise ConfigError(f"--load {path} holds {len(extra)} entries this run does not load "
                          f"({shown}) and --dist-ckpt-strictness is {strictness}")


def _load_weights(path: str, model, weights: dict) -> None:
    """The loaded `weights` (checked) into the GPTModel of `model` (DDP, one chunk)."""
    check_extra_states(path, weights)
    gpt = model.module.module if isinstance(model.module, Float16Module) else model.module
    weights = local_shards_as_dtensors(gpt, weights)
    with extra_states_checked():
        missing = gpt.load_state_dict(weights, strict=False).missing_keys
    _check_missing(path, missing)


def load_checkpoint(root: str, model, optimizer, scheduler, config):
    """Load the latest checkpoint in `root`; returns (iteration, consumed_samples), (0, 0)
    when there is none. `--finetune` loads the model only and restarts at 0; `optimizer` None
    loads the model only, at the checkpoint's iteration (--skip-train). Every problem with the
    checkpoint is one `ConfigError` naming --load. `config`: the `RunConfig`."""
    flags = config.checkpoint
    found = read_common_state(root)
    if found is None:
        print_rank_0(f" WARNING: no checkpoint at --load {root} ({TRACKER} missing); "
                     "training from scratch")
        return 0, 0
    iteration, path, common = found
    save_guard.verify_shards(path)  # their CRC-32, before training on them
    model_only = optimizer is None or flags.finetune
    saved_args = _check_resume(path, iteration, common, config, model_only)
    with_optimizer = not (model_only or flags.no_load_optim)
    if with_optimizer:
        _check_optimizer_args(path, saved_args, args_of(config))
        if common.get("optimizer_refusal"):
            raise ConfigError(f"--load {path}: {common['optimizer_refusal']}; pass "
                              "--no-load-optim to load the weights only (Adam moments restart)")
    rng_states = None
    if not (model_only or flags.no_load_rng):
        rng_states = rng_states_to_load(path, common, config.training.seed)
    state = sharded_state_dict(model, optimizer, scheduler, is_loading=True,
                                with_optimizer=with_optimizer, rng_states=rng_states)
    with quiet_torch_checkpoint(), save_guard.read_errors_named(path):
        # megatron-core's "unexpected": asked for, not in the checkpoint; "missing": the reverse
        loaded, not_loaded, missing = dist_checkpointing.load(
            state, path, sharded_strategy=_load_strategy(path, flags),
            strict=StrictHandling.RETURN_ALL,
            **({"verify_integrity": True} if flags.verify_integrity else {}))
    _apply_strictness(path, flags.dist_ckpt_strictness, missing, not_loaded)
    _check_missing(path, missing)
    for key, chunk in zip(state_keys(model), model_chunks(model)):
        _load_weights(path, chunk, loaded[key])
    if with_optimizer:
        main_params_as_dtensors(optimizer, loaded["optimizer"])
        optimizer.load_state_dict(loaded["optimizer"])
        shard_loaded_states(optimizer)
        count_on_after_load(optimizer)
        _load_scheduler(path, scheduler, loaded["opt_param_scheduler"])
    if rng_states is not None:
        set_rng_tensors({name: tensor[0] for name, tensor in loaded["rng_state"].items()})
    print_rank_0(f" loaded checkpoint from {path} at iteration {iteration}")
    if flags.finetune:
        return 0, 0
    return iteration, common["consumed_samples"]
