"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 <-> megatron_ulysses torch_dist checkpoints.

    python tools/convert_hf.py import --hf-path DIR --output CKPT [--tensor-model-parallel-size N]
    python tools/convert_hf.py export --load CKPT --output DIR

`import` reads DIR/config.json and DIR's *.safetensors (through model.safetensors.index.json when
there is one), converts them with `megatron_ulysses.hf`, builds the model in-process exactly as
pretrain_gpt.py does (one gloo process per TP rank, on CPU), loads the weights and writes them
with the trainer's own `save_checkpoint` at iteration 0, plus the HF config in the checkpoint's
common state. Train it with

    pretrain_gpt.py --load CKPT --use-checkpoint-args --finetune --seq-length ... ...

`export` loads a checkpoint (the import's or a trained one; any TP and pipeline layout) the way
the trainer does (its files are checked for pickled code first), at its TP and PP 1, and writes
DIR/config.json (the stored HF config with the checkpoint's values) and DIR/model.safetensors.
Bad input exits 2 with one message.
"""

import argparse
import glob
import json
import os
import shutil
import socket
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_ulysses import hf  # noqa: E402
from megatron_ulysses.sp.rope import YARN_CONFIG  # noqa: E402
from megatron_ulysses.training.arguments import (  # noqa: E402
    ConfigError, check_writable_dir, flag_name)

PROG = "convert_hf.py"
# Run flags the build needs and the conversion does not use.
ROUND_TO_INT = "yarn_correction_range_round_to_int"  # a switch: --no-... turns it off
_RUN = ["--seq-length", "8", "--micro-batch-size", "1", "--lr", "0", "--train-iters", "1",
        "--eval-iters", "0", "--mock-data", "--distributed-backend", "gloo"]


class ConversionError(Exception):
    """Bad input: exit 2 with this message."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("import", help="HF model directory -> torch_dist checkpoint")
    p.add_argument("--hf-path", required=True, help="directory with config.json + *.safetensors")
    p.add_argument("--output", required=True, help="checkpoint directory to write (--save)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="only 1 (the checkpoint trains at any pipeline size)")
    p = commands.add_parser("export", help="torch_dist checkpoint -> HF model directory")
    p.add_argument("--load", required=True, help="checkpoint directory (as pretrain's --load)")
    p.add_argument("--output", required=True, help="directory for config.json + "
                   "model.safetensors")
    p.add_argument("--tokenizer-dir", default=None,
                   help="copy the Hugging Face tokenizer files found here (tokenizer.json, "
                   "tokenizer_config.json, ...) into --output, so that the folder is complete")
    return parser


# What --tokenizer-dir copies, where present: the files transformers' save_pretrained writes
# for a tokenizer (its chat template is chat_template.jinja / .json), and generation_config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


# --- input --------------------------------------------------------------------------------------

def read_hf_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ConversionError(f"--hf-path {path!r} is not a directory")
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"--hf-path {path!r} has no config.json") from None
    except ValueError as error:
        raise ConversionError(f"--hf-path {file} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"--hf-path {file} does not hold a JSON object")
    return config


def safetensors_files(path: str) -> list:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConversionError(f"--hf-path {index} is not a safetensors index "
                                  f"({type(error).__name__}: {error})") from None
        files = [os.path.join(path, name) for name in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ConversionError(f"--hf-path {index} names missing files: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ConversionError(f"--hf-path {path!r} has no *.safetensors files")
    return files


def load_safetensors(files: list) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as error:  # truncated or not safetensors
            raise ConversionError(f"--hf-path {file} is not a readable safetensors file "
                                  f"({type(error).__name__}: {error})") from None
    return tensors


def trainer_argv(model_args: dict, tp: int) -> list:
    """pretrain_gpt.py's flags for the model of `model_args` (Megatron-LM names)."""
    argv = []
    yarn = model_args.get("position_embedding_type") == "yarn"
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "kv_channels", "max_position_embeddings", "position_embedding_type",
                "rotary_base", "normalization", "norm_epsilon", "attention_dropout",
                "hidden_dropout", "vocab_size", "rope_scaling_factor",
                "rotary_seq_len_interpolation_factor", "make_vocab_size_divisible_by",
                *(name for name in YARN_CONFIG if yarn and name != ROUND_TO_INT)):
        if model_args.get(key) is not None:
            argv += [flag_name(key), repr(model_args[key]) if isinstance(model_args[key], float)
                     else str(model_args[key])]
    if model_args.get("group_query_attention"):
        argv += ["--group-query-attention", "--num-query-groups",
                 str(model_args["num_query_groups"])]
    for key in ("use_rope_scaling", "swiglu", "untie_embeddings_and_output_weights",
                "disable_bias_linear", "add_qkv_bias", "qk_layernorm"):
        if model_args.get(key):
            argv.append(flag_name(key))
    if yarn and model_args.get(ROUND_TO_INT) is False:
        argv.append("--no-" + flag_name(ROUND_TO_INT)[2:])
    return argv + ["--tensor-model-parallel-size", str(tp)] + _RUN


def _parse(argv: list, world: int):
    from megatron_ulysses.training.arguments import parse_args

    try:
        return parse_args(argv, world_size=world)
    except ConfigError as error:
        raise ConversionError(str(error)) from None


# --- the gloo world (one process per TP rank) ---------------------------------------------------

def _worker(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1 if world > 1 else torch.get_num_threads())
    try:
        fn(*args)
    except (ConversionError, ConfigError, ValueError) as error:
        if rank == 0:
            print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    finally:
        _teardown()


def _teardown() -> None:
    import torch.distributed as dist

    from megatron_ulysses.sp import parallel_state as ps

    if ps.is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_world(world: int, fn, *args) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if world == 1:
        _worker(0, 1, port, fn, args)
        return
    import torch.multiprocessing as mp

    try:
        mp.spawn(_worker, args=(world, port, fn, args), nprocs=world, join=True)
    except mp.ProcessExitedException as error:
        raise SystemExit(error.exit_code if error.exit_code == 2 else 1) from None


def _build(config):
    from megatron_ulysses.training.loop import initialize_distributed
    from megatron_ulysses.training.model import build_model_and_optimizer

    initialize_distributed(config)
    return build_model_and_optimizer(config)


# --- import -------------------------------------------------------------------------------------

def _import_rank(argv, files, hf_config, model_args, output) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_ulysses.training.arguments import padded_vocab_size
    from megatron_ulysses.training.checkpoint.save import save_checkpoint

    tp = int(argv[argv.index("--tensor-model-parallel-size") + 1])
    config = _parse(argv, tp)
    config = config.with_padded_vocab_size(padded_vocab_size(
        model_args["vocab_size"], config.model.make_vocab_size_divisible_by, tp))
    model, optimizer, scheduler = _build(config)
    gpt = model.module
    spec = hf.detect_spec(gpt.state_dict())
    try:
        state = hf.hf_to_megatron_state_dict(load_safetensors(files), model_args,
                                             mpu.get_tensor_model_parallel_rank(), tp, spec=spec)
    except KeyError as error:  # a tensor the config asks for
        raise ConversionError(f"--hf-path {os.path.dirname(files[0])}: {error.args[0]}; its "
                              "config.json (num_hidden_layers, tie_word_embeddings, ...) and "
                              "safetensors disagree") from None
    own = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ConversionError(f"the converted weights do not fit the model: missing {missing}, "
                              f"unexpected {extra}")
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise ConversionError(f"{key}: converted shape {tuple(tensor.shape)}, model "
                                  f"{tuple(own[key].shape)}")
    with torch.no_grad():
        for key, tensor in state.items():
            own[key].copy_(tensor)
    dist.barrier()
    save_checkpoint(output, 0, model, optimizer, scheduler, config, 0,
                    extra_common={"hf_config": hf_config})


def import_hf(args) -> None:
    from megatron_ulysses.training.checkpoint.state import TRACKER

    if args.pipeline_model_parallel_size != 1:
        raise ConversionError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
                              ": import writes the model at PP 1; use 1 (the checkpoint trains "
                              "at any --pipeline-model-parallel-size)")
    if args.tensor_model_parallel_size < 1:
        raise ConversionError("--tensor-model-parallel-size must be positive, got "
                              f"{args.tensor_model_parallel_size}")
    check_writable_dir(args.output, "--output")
    if os.path.isfile(os.path.join(args.output, TRACKER)):
        raise ConversionError(f"--output {args.output} already holds a checkpoint ({TRACKER}); "
                              "choose an empty or new folder")
    hf_config = read_hf_config(args.hf_path)
    try:
        model_args = hf.model_args_from_hf_config(hf_config)
    except KeyError as error:
        raise ConversionError(f"--hf-path {args.hf_path}/config.json is missing the field "
                              f"{error.args[0]!r}") from None
    except (ValueError, TypeError) as error:
        raise ConversionError(f"--hf-path {args.hf_path}/config.json: {error}") from None
    files = safetensors_files(args.hf_path)
    tp = args.tensor_model_parallel_size
    # No padded vocab rows when the vocab splits over TP: their logits (0) would enter the
    # softmax and change HF's loss (by ln(1024 / 1000) for 1000 ids padded to 1024).
    vocab = model_args["vocab_size"]
    model_args["make_vocab_size_divisible_by"] = vocab // tp if vocab % tp == 0 else 128
    argv = trainer_argv(model_args, tp) + ["--save", args.output]
    _parse(argv, tp)  # every rule of the trainer (heads divisible by TP, ...) before any spawn
    run_world(tp, _import_rank, argv, files, hf_config, model_args, args.output)
    print(f"{PROG}: wrote {args.output} (TP {tp}); train it with pretrain_gpt.py --load "
          f"{args.output} --use-checkpoint-args --finetune ...")


# --- export -------------------------------------------------------------------------------------

def _export_rank(argv, model_args, hf_config, architecture, output) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megatron_ulysses.training.checkpoint.load import load_checkpoint

    tp = int(argv[argv.index("--tensor-model-parallel-size") + 1])
    config = _parse(argv, tp)
    config = config.with_padded_vocab_size(model_args["padded_vocab_size"])
    model, optimizer, scheduler = _build(config)
    load_checkpoint(config.checkpoint.load, model, optimizer, scheduler, config)
    own = {k: v.detach().clone() for k, v in model.module.state_dict().items()
           if not k.endswith("_extra_state")}
    shards = [None] * tp if dist.get_rank() == 0 else None
    dist.gather_object(own, shards, dst=0)
    if dist.get_rank() != 0:
        return
    tensors = hf.megatron_to_hf_state_dict(shards, model_args)
    dtype = (hf_config or {}).get("dtype") or (hf_config or {}).get("torch_dtype")
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
    tensors = {k: v.contiguous().clone() for k, v in tensors.items()}
    out_config = hf.hf_config_from_model_args(model_args, architecture, base_config=hf_config)
    os.makedirs(output, exist_ok=True)
    save_file(tensors, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(out_config, f, indent=2, sort_keys=True)
        f.write("\n")


def export_hf(args) -> None:
    from megatron_ulysses.training.checkpoint.load import read_common_state

    _check_export_output(args)
    found = read_common_state(args.load)
    if found is None:
        raise ConversionError(f"--load {args.load}: no checkpoint (no "
                              "latest_checkpointed_iteration.txt)")
    _, path, common = found
    saved, hf_config = common.get("args"), common.get("hf_config")
    if not isinstance(saved, dict):
        raise ConversionError(f"--load {path} holds no saved model args")
    if hf_config is not None and not isinstance(hf_config, dict):
        raise ConversionError(f"--load {path}: its hf_config is not a JSON object")
    vocab = (hf_config or {}).get("vocab_size") or saved.get("vocab_size")
    if not isinstance(vocab, int):
        raise ConversionError(f"--load {path} records no vocab size (no hf_config, no "
                              "--vocab-size); it was not imported by convert_hf.py")
    model_args = {**saved, "vocab_size": vocab,
                  "group_query_attention": saved["num_query_groups"] != saved[
                      "num_attention_heads"],
                  "attention_dropout": float((hf_config or {}).get("attention_dropout", 0.0))}
    if hf_config is not None:
        try:
            architecture = hf.model_type_of(hf_config)
        except ValueError as error:
            raise ConversionError(f"--load {path}: its stored hf_config: {error}") from None
    else:
        architecture = ("Qwen2ForCausalLM" if saved.get("add_qkv_bias") else
                        "Qwen3ForCausalLM" if saved.get("qk_layernorm") else "LlamaForCausalLM")
    try:  # refuse before any process starts
        hf.hf_config_from_model_args(model_args, architecture, base_config=hf_config)
    except ValueError as error:
        raise ConversionError(f"--load {path}: {error}") from None
    tokenizer_files = _tokenizer_files(args.tokenizer_dir)
    # Its TP (each rank's share fits where it trained) and PP 1 (the pipeline layout need not
    # match: `training.checkpoint.state.LAYOUT_ARGS`; --use-checkpoint-args takes no PP).
    tp = saved["tensor_model_parallel_size"]
    argv = ["--load", args.load, "--use-checkpoint-args", "--finetune", "--vocab-size",
            str(vocab), "--tensor-model-parallel-size", str(tp)] + _RUN
    _parse(argv, tp)
    run_world(tp, _export_rank, argv, model_args, hf_config, architecture, args.output)
    for name in tokenizer_files:
        shutil.copyfile(os.path.join(args.tokenizer_dir, name), os.path.join(args.output, name))
    print(f"{PROG}: wrote {args.output}/config.json and model.safetensors"
          + (f", copied {', '.join(tokenizer_files)}" if tokenizer_files else ""))


# Files in --output that a loader would take as the model's weights.
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                "pytorch_model.bin.index.json")


def _check_export_output(args) -> None:
    """--output is a writable directory without weights (a loader following an old index would
    take them with the new config) and not --tokenizer-dir."""
    check_writable_dir(args.output, "--output")
    old = sorted(os.path.basename(f) for pattern in WEIGHT_FILES
                 for f in glob.glob(os.path.join(glob.escape(args.output), pattern)))
    if old:
        raise ConversionError(f"--output {args.output} already holds weights ({', '.join(old)}); "
                              "choose an empty or new folder")
    if args.tokenizer_dir is not None and \
            os.path.realpath(args.output) == os.path.realpath(args.tokenizer_dir):
        raise ConversionError(f"--output {args.output} is --tokenizer-dir; choose an empty or "
                              "new folder")


def _tokenizer_files(directory):
    """The `TOKENIZER_FILES` in --tokenizer-dir (none without it); a directory with none of
    them is refused before anything is written."""
    if directory is None:
        return []
    if not os.path.isdir(directory):
        raise ConversionError(f"--tokenizer-dir {directory} is not a directory")
    found = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, name))]
    if not found:
        raise ConversionError(f"--tokenizer-dir {directory} holds no tokenizer file (none of "
                              f"{', '.join(TOKENIZER_FILES)})")
    return found


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        (import_hf if args.command == "import" else export_hf)(args)
    except (ConversionError, ConfigError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
