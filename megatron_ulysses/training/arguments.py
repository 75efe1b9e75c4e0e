"""Command-line arguments of `pretrain_gpt.py`: Megatron-LM's flag names and meanings, plus ours
(`--ulysses-*`, the ALST memory flags). `validate_args` is the one place every rule lives: it checks
the whole configuration before the first collective, raises one `ConfigError` naming the flag to
change, fills in Megatron-LM's derived defaults and returns the frozen `RunConfig`.
"""

import argparse
import math
import os
import tempfile

import torch

from ..backends import BACKENDS, resolve_backend, te_available
from ..data.datasets import parse_data_path, parse_split
from ..data.tokenizers import add_tokenizer_arguments, check_tokenizer_flags
from ..errors import ConfigError, flag_name
from ..memory.tiling import check_num_tiles
from ..parallel_state import ParallelDims
from ..rope import fused_rope_fits
from ..vocab import padded_vocab_size  # noqa: F401 (re-exported)
from .config import RunConfig, from_namespace


# megatron-core's selective-recompute submodules of a dense GPT layer.
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")


def _tiles(value: str):
    """`--tiled-*-shards`: a positive int or 'auto' (`tiling.check_num_tiles`)."""
    try:
        number = value if value == "auto" else int(value)
        check_num_tiles(number, "the value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return number


def _number(value: str):
    """An int when integral ('4' -> 4), else a float."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}")
    return int(number) if number.is_integer() else number


class _Parser(argparse.ArgumentParser):
    """An argparse error is one line (the flag and what is wrong), not the 80-line usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser(model_flags_required: bool = True) -> argparse.ArgumentParser:
    """`model_flags_required=False` (with --use-checkpoint-args): the checkpoint gives them."""
    parser = _Parser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core with Ulysses sequence parallelism. "
        "Flags follow Megatron-LM; ours are --ulysses-sp-size, --ulysses-attention-backend and "
        "the ALST memory flags.",
        allow_abbrev=False,
    )
    g = parser.add_argument_group("Ulysses sequence parallelism")
    g.add_argument("--ulysses-sp-size", type=int, default=1,
                   help="Ulysses SP size P: one sequence is split over P ranks (taken out of "
                   "data parallelism); attention heads must divide by TP x P.")
    g.add_argument("--ulysses-attention-backend", choices=("auto",) + BACKENDS, default="auto",
                   help="The attention between the all-to-alls: te (Transformer Engine), sdpa "
                   "(torch), local (megatron-core); auto = te with --transformer-impl "
                   "transformer_engine, else sdpa.")
    g.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                   help="The layers around attention (as Megatron-LM): Transformer Engine's "
                   "(norm fused into the linear layers) or megatron-core's local ones; default "
                   "transformer_engine where TE and CUDA are there, else local.")

    g = parser.add_argument_group("ALST memory features (off by default, exact)")
    g.add_argument("--tiled-mlp-shards", type=_tiles, default=None,
                   help="Run the MLP over N sequence tiles (or 'auto' = ceil(s/h)).")
    g.add_argument("--tiled-loss-shards", type=_tiles, default=None,
                   help="Compute logits + loss over N sequence tiles (or 'auto': 1 GiB tiles).")
    g.add_argument("--offload-activations", action="store_true",
                   help="Keep full-recompute checkpoints in CPU memory "
                   "(needs --recompute-granularity full).")

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=model_flags_required)
    g.add_argument("--hidden-size", type=int, required=model_flags_required)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, required=model_flags_required)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden / heads")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"),
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="llama3 RoPE frequency scaling (megatron-core's; needs "
                   "--position-embedding-type rope)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="the llama3 scaling factor of --use-rope-scaling")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=_number, default=None,
                   help="linear RoPE position interpolation: positions / factor")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the q/k/v projection only (Qwen2), with --disable-bias-linear")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)

    g = parser.add_argument_group(
        "fusions (GPU; on by default as in Megatron-LM, off on CPU)")
    g.add_argument("--no-rope-fusion", action="store_true",
                   help="unfused RoPE (default: TE's fused RoPE when TE is installed)")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_true",
                   help="unfused weight-gradient accumulation (default: fused into main_grad "
                   "when apex's fused_weight_gradient_mlp_cuda is installed)")
    g.add_argument("--no-bias-swiglu-fusion", action="store_true",
                   help="unfused (bias +) SwiGLU")
    g.add_argument("--no-bias-gelu-fusion", action="store_true",
                   help="unfused bias + GeLU (fused only with biases)")
    g.add_argument("--no-bias-dropout-fusion", action="store_true",
                   help="unfused bias + dropout + add")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fused vocab-parallel cross entropy (off by default, as in Megatron-LM)")
    g.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default="native",
                   help="with --cross-entropy-loss-fusion: megatron-core's or TE's kernel")

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = parser.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro batch x data-parallel size")

    g = parser.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=("adam",), default="adam")
    g.add_argument("--lr", type=float, default=None, help="required unless --skip-train")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine",
                                                "inverse-square-root"), default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, take the LR / weight-decay schedule from these flags, not "
                   "from the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, take the LR / weight-decay schedule from the checkpoint "
                   "(without either flag a schedule that differs from the flags is an error)")

    g = parser.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static fp16 loss scale; default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=None,
                   help="dynamic fp16 loss scale to start from; default 2^20 / the tokens of "
                   "one micro batch on one rank (rounded up to a power of 2), since each rank "
                   "backpropagates the SUM of its per-token losses (Megatron-LM's 2^32 skipped "
                   "every step of a short run while it halved)")
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = parser.add_argument_group("activation recompute")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", choices=RECOMPUTE_MODULES, default=None,
                   help="with --recompute-granularity selective: the submodules to recompute "
                   "(megatron-core's; default core_attn)")

    g = parser.add_argument_group("run")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="instead of --train-iters: samples / global batch size iterations")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train", action="store_true",
                   help="no training: load the weights at --load, evaluate --eval-iters "
                   "validation batches (from the start of the valid split), print the "
                   "validation line and exit (--train-iters, --lr and --save are not needed)")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=_number, default=None,
                   help="save a checkpoint (needs --save) and exit once the run has taken this "
                   "many minutes (checked after every iteration, the same on every rank)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: save a checkpoint (needs --save) and exit")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="train on past a NaN loss or a NaN / Inf gradient (without it the run "
                   "stops before that update, which would turn the weights into NaN; with "
                   "--fp16 the loss scaler skips such steps instead)")
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise run-to-run and resume reproducibility on GPU: deterministic "
                   "TE attention (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0), deterministic torch and "
                   "cuBLAS kernels, megatron-core's deterministic embedding backward; slower")

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix, or weight prefix weight prefix ... for a blend")
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=2)
    add_tokenizer_arguments(g)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")

    g = parser.add_argument_group(
        "Megatron-LM flags accepted for compatibility (what this package always does)")
    for flag, why in (
        ("--use-mcore-models", "the model is always megatron-core's GPTModel"),
        ("--log-throughput", "throughput and TFLOP/s are always logged"),
        ("--use-flash-attn", "fused attention comes from --ulysses-attention-backend"),
        ("--attention-softmax-in-fp32", "the attention backends keep softmax in fp32"),
        ("--no-masked-softmax-fusion", "no masked-softmax fusion is used"),
        ("--log-validation-ppl-to-tensorboard", "validation loss goes to TensorBoard"),
        ("--no-create-attention-mask-in-dataloader", "the loader builds no attention mask: "
         "attention is causal (within documents with --reset-attention-mask)"),
        ("--no-position-embedding", "no learned position embedding: needs "
         "--position-embedding-type rope"),
    ):
        g.add_argument(flag, action="store_true", help=why)
    g.add_argument("--use-rotary-position-embeddings", action="store_const",
                   dest="position_embedding_type", const="rope",
                   help="= --position-embedding-type rope (Megatron-LM's older flag)")
    g.add_argument("--attention-backend", choices=("auto", "flash", "fused", "unfused", "local"),
                   default="auto", help="Megatron-LM's: flash / fused / unfused pick Transformer "
                   "Engine's attention kernels (--ulysses-attention-backend te), local is "
                   "--ulysses-attention-backend local; auto leaves both to their defaults")
    g.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist",
                   help="checkpoints are megatron-core dist_checkpointing (torch_dist)")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="TensorBoard gets a point every --log-interval")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")

    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--ckpt-fully-parallel-save", action=argparse.BooleanOptionalAction,
                   default=True, help="spread the writing of tensors replicated over DP x SP "
                   "across their replicas (Megatron-LM's default; --no-ckpt-fully-parallel-save: "
                   "the first replica writes each)")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; iteration and consumed samples start at 0")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="with --load: take the model's shape flags (--num-layers, "
                   "--hidden-size, heads, RoPE, norms, TP/PP, the vocab padding, ...) from the "
                   "checkpoint instead of the command line")
    return parser


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_range(args, name: str, low=None, high=None, low_open=False, high_open=False,
                 optional=False) -> None:
    """``--name`` must lie in the interval (``None`` ends are unbounded); NaN never does."""
    value = getattr(args, name)
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if ok and isinstance(value, float) and math.isinf(value):
        ok = False
    if not ok:
        if low is not None and high is not None:
            interval = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            interval = ("positive" if low == 0 and low_open else
                        f"{'>' if low_open else '>='} {low}")
        else:
            interval = f"{'<' if high_open else '<='} {high}"
        raise ConfigError(f"{flag_name(name)} must be {interval}, got {value}")


def check_writable_dir(path: str, flag: str) -> None:
    """``path`` is, or can be created as, a directory this process can write: a directory is
    made and removed again in it or in its nearest existing parent (as root, permission bits say
    nothing), so nothing is left behind and a bad path fails now, not after training."""
    target = os.path.abspath(path)
    probe_in = target
    while not os.path.exists(probe_in):
        parent = os.path.dirname(probe_in)
        if parent == probe_in:
            break
        probe_in = parent
    if not os.path.isdir(probe_in):
        where = "is a file" if probe_in == target else f"is under the file {probe_in!r}"
        raise ConfigError(f"{flag} {path!r} {where}, not a directory; give a directory path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_test_", dir=probe_in))
    except OSError as error:
        inside = "it" if probe_in == target else f"its parent {probe_in!r}"
        raise ConfigError(f"{flag} {path!r} is not writable: cannot create a directory in "
                          f"{inside} ({error.strerror}); give a writable {flag}") from None


def _check_ranges(args) -> None:
    """Range checks of the numeric flags that megatron-core would only trip over later (an
    assert, a hang, NaN losses or a silently different run)."""
    for name in ("ffn_hidden_size", "kv_channels", "max_position_embeddings", "vocab_size",
                 "lr_decay_iters", "exit_interval", "exit_duration_in_mins",
                 "recompute_num_layers"):
        _check_range(args, name, low=0, low_open=True, optional=True)
    for name in ("make_vocab_size_divisible_by", "distributed_timeout_minutes",
                 "tensorboard_log_interval", "hysteresis"):
        _check_range(args, name, low=1)
    for name in ("num_workers", "lr_warmup_iters"):
        _check_range(args, name, low=0)
    _check_range(args, "seed", low=0, high=2**32 - 1)  # numpy seeds the data sampling with it
    for name in ("attention_dropout", "hidden_dropout"):
        _check_range(args, name, low=0, high=1, high_open=True)
    _check_range(args, "rotary_base", low=0, low_open=True)
    _check_range(args, "rotary_percent", low=0, high=1, low_open=True)
    for name in ("norm_epsilon", "init_method_std", "adam_eps", "min_loss_scale",
                 "loss_scale_window"):
        _check_range(args, name, low=0, low_open=True)
    for name in ("loss_scale", "initial_loss_scale"):
        _check_range(args, name, low=0, low_open=True, optional=True)
    for name in ("lr", "min_lr", "weight_decay", "clip_grad"):
        _check_range(args, name, low=0)
    for name in ("adam_beta1", "adam_beta2"):
        _check_range(args, name, low=0, high=1, high_open=True)
    _check_range(args, "lr_warmup_fraction", low=0, high=1, high_open=True, optional=True)


def _check_data_source(args, warnings: list) -> None:
    """--mock-data or --data-path (whose .bin/.idx files must exist), --split, the tokenizer."""
    try:
        split = parse_split(args.split)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if args.mock_data:
        _require(not args.data_path, "give --data-path or --mock-data, not both")
        if args.tokenizer_type is None:
            args.tokenizer_type = "NullTokenizer"
    else:
        _require(bool(args.data_path), "give --data-path PREFIX (tools/preprocess_data.py "
                 "writes one) or --mock-data")
        _require(args.tokenizer_type is not None, "--data-path needs --tokenizer-type")
        try:  # the files' contents are checked by pretrain_gpt.py (check_data_path)
            parse_data_path(args.data_path)
        except (ValueError, OSError) as error:
            raise ConfigError(str(error)) from None
        _require(split[0] > 0 or args.skip_train, f"--split {args.split} gives the train split weight 0, so there "
                 "is nothing to train on; give it a positive first weight, e.g. --split 969,30,1")
        _require(not (args.skip_train and split[1] == 0),
                 f"--skip-train evaluates the valid split, but --split {args.split} gives it "
                 "weight 0; give it a weight, e.g. --split 0,1,0")
        if split[1] == 0 and args.eval_iters > 0:
            warnings.append(
                f"--split {args.split} gives the valid split weight 0: no evaluation runs "
                f"(--eval-iters {args.eval_iters} is ignored); give it a weight to evaluate")
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None and args.vocab_size > 0,
                 "--tokenizer-type NullTokenizer (the --mock-data default) needs --vocab-size")
    try:
        check_tokenizer_flags(args)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_rope_fusion(args, dims: ParallelDims, cuda: bool, warnings: list) -> None:
    """TE's fused RoPE only where its 32-bit offsets reach (`rope.fused_rope_fits`); past
    that the unfused RoPE runs, said once."""
    if not cuda or args.no_rope_fusion or args.position_embedding_type != "rope":
        return
    tokens = args.micro_batch_size * dims.local_seq_length(args.seq_length)
    heads = args.num_attention_heads // dims.tp
    groups = max(args.num_query_groups // dims.tp, 1)
    if not fused_rope_fits(tokens, heads, groups, args.kv_channels):
        args.no_rope_fusion = True
        warnings.append(
            f"RoPE runs unfused: TE's fused RoPE kernel indexes with 32-bit offsets and its k "
            f"is a view into the qkv projection of --micro-batch-size x --seq-length / "
            f"--ulysses-sp-size = {tokens} tokens x {heads + 2 * groups} heads x "
            f"{args.kv_channels} = {tokens * (heads + 2 * groups) * args.kv_channels:,} "
            f"elements per rank, past 2^31 (the fused kernel would read out of bounds: an "
            f"illegal address or NaN gradients); a larger --ulysses-sp-size brings it back, "
            f"--no-rope-fusion silences this")



def _resolve_layers_and_attention(args: argparse.Namespace, cuda: bool) -> None:
    """Fill in --transformer-impl (the layer spec) and --ulysses-attention-backend (the core
    attention) from each other and Megatron-LM's --attention-backend: TE's layers wherever TE
    and CUDA are there, TE's attention in them by default; every backend runs in TE's layers,
    te only there."""
    if args.attention_backend != "auto":
        ours = "local" if args.attention_backend == "local" else "te"
        _require(args.ulysses_attention_backend in ("auto", ours),
                 f"--attention-backend {args.attention_backend} runs --ulysses-attention-backend "
                 f"{ours}, not {args.ulysses_attention_backend}; drop one of the two")
        args.ulysses_attention_backend = ours
    try:  # te without Transformer Engine or CUDA fails here, not when the model is built
        if args.ulysses_attention_backend != "auto":
            resolve_backend(args.ulysses_attention_backend)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te_available() and cuda else "local"
    if args.transformer_impl == "transformer_engine":
        _require(te_available(), "--transformer-impl transformer_engine needs Transformer Engine "
                 "(pip install 'megatron_ulysses[te]'); use --transformer-impl local")
        _require(cuda, "--transformer-impl transformer_engine needs CUDA (Transformer Engine's "
                 "kernels); on CPU use --transformer-impl local")
    _require(not (args.transformer_impl == "local" and args.ulysses_attention_backend == "te"),
             "--ulysses-attention-backend te runs in Transformer Engine's layers: drop "
             "--transformer-impl local, or use --ulysses-attention-backend sdpa or local")
    if args.ulysses_attention_backend == "auto":
        args.ulysses_attention_backend = ("te" if args.transformer_impl == "transformer_engine"
                                          else "sdpa")

def validate_args(args: argparse.Namespace, world_size: int, cuda: bool) -> RunConfig:
    """Check the whole configuration for `world_size` processes, fill in the derived values
    (`num_microbatches`, defaults that depend on other flags) and freeze it. Raises
    `ConfigError` before anything touches a process group."""
    try:
        dims = ParallelDims(world_size=world_size, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, sp=args.ulysses_sp_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if args.initial_loss_scale is None and args.seq_length > 0 and args.micro_batch_size > 0:
        tokens = args.micro_batch_size * dims.local_seq_length(args.seq_length)
        args.initial_loss_scale = max(1.0, 2.0**20 / 2 ** math.ceil(math.log2(tokens)))
    if args.skip_train:
        _require(args.eval_iters > 0, f"--skip-train evaluates --eval-iters batches; give a "
                 f"positive --eval-iters (got {args.eval_iters})")
        if args.train_iters is None and args.train_samples is None:
            args.train_iters = 0  # nothing trains: no optimizer or schedule is built
        if args.lr is None:
            args.lr = 0.0
    else:
        _require(args.lr is not None, "--lr is required (except with --skip-train)")
    _require((args.train_iters is None) != (args.train_samples is None),
             "give one of --train-iters and --train-samples")
    steps = [] if args.skip_train else [
        "train_iters" if args.train_iters is not None else "train_samples"]
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", *steps, "log_interval", "eval_interval"):
        _require(getattr(args, flag) > 0,
                 f"{flag_name(flag)} must be positive, got {getattr(args, flag)}")
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
    _check_ranges(args)
    warnings = []  # said once, by rank 0, by pretrain_gpt.py
    _check_data_source(args, warnings)  # missing files first: they are what a user fixes first

    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention")
    if args.group_query_attention:
        _require(args.num_query_groups is not None and args.num_query_groups > 0,
                 "--group-query-attention needs a positive --num-query-groups")
    else:
        args.num_query_groups = args.num_attention_heads
    if args.kv_channels is None:
        _require(args.hidden_size % args.num_attention_heads == 0,
                 f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
                 f"({args.num_attention_heads}), or give --kv-channels")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    # The loader pads s to a multiple of P (loss mask 0); padded tokens still get positions.
    padded_length = dims.local_seq_length(args.seq_length) * dims.sp
    if args.max_position_embeddings is None:
        args.max_position_embeddings = padded_length
    _require(not (args.no_position_embedding and args.position_embedding_type != "rope"),
             "--no-position-embedding leaves no position information with "
             f"--position-embedding-type {args.position_embedding_type}; add "
             "--position-embedding-type rope (or --use-rotary-position-embeddings)")
    if args.position_embedding_type == "learned_absolute":
        _require(args.max_position_embeddings >= padded_length,
                 f"--max-position-embeddings ({args.max_position_embeddings}) must be >= "
                 f"--seq-length ({args.seq_length}) padded to a multiple of --ulysses-sp-size "
                 f"({dims.sp}), {padded_length}, with learned absolute positions")
    _require(args.num_layers % dims.pp == 0,
             f"--num-layers ({args.num_layers}) must be divisible by "
             f"--pipeline-model-parallel-size ({dims.pp})")

    if dims.tp == 1:
        args.sequence_parallel = False  # as Megatron-LM: nothing to split at TP = 1
    try:  # the loader pads s to a multiple of P; TP's sequence parallelism needs s/P % TP == 0
        dims.validate_model(args.num_attention_heads, args.num_query_groups,
                            args.seq_length if args.sequence_parallel else None)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _check_rope_fusion(args, dims, cuda, warnings)
    per_step = args.micro_batch_size * dims.dp
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    _require(args.global_batch_size > 0 and args.global_batch_size % per_step == 0,
             f"--global-batch-size ({args.global_batch_size}) must be a positive multiple of "
             f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x {dims.dp} = "
             f"{per_step}); data-parallel size = world {world_size} / (TP {dims.tp} x PP "
             f"{dims.pp} x --ulysses-sp-size {dims.sp})")
    args.num_microbatches = args.global_batch_size // per_step
    if args.train_samples is not None:
        _require(args.train_samples >= args.global_batch_size,
                 f"--train-samples ({args.train_samples}) must be >= --global-batch-size "
                 f"({args.global_batch_size}): training runs --train-samples // "
                 "--global-batch-size iterations")
        args.train_iters = args.train_samples // args.global_batch_size

    decay_defaulted = args.lr_decay_iters is None
    if decay_defaulted:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _require(args.lr_warmup_iters == 0,
                 "give --lr-warmup-fraction or --lr-warmup-iters, not both")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    _resolve_layers_and_attention(args, cuda)
    _require(0 <= args.min_lr <= args.lr,
             f"--min-lr ({args.min_lr}) must be in [0, --lr ({args.lr})]")
    # megatron-core's OptimizerParamScheduler asserts warmup < decay (whatever the decay style).
    warmup = ("--lr-warmup-iters" if args.lr_warmup_fraction is None else
              f"--lr-warmup-fraction {args.lr_warmup_fraction} x --lr-decay-iters")
    steps = ("--train-iters" if args.train_samples is None else
             f"--train-samples {args.train_samples} / --global-batch-size")
    decay = "--lr-decay-iters" + (f" (default {steps})" if decay_defaulted else "")
    _require(args.lr_warmup_iters < args.lr_decay_iters or args.skip_train,
             f"{warmup} ({args.lr_warmup_iters} iterations) must be < {decay} "
             f"({args.lr_decay_iters}); shorten the warmup or raise --lr-decay-iters")
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
             "exclusive; give one")

    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive; give one")
    if args.fp16 and args.loss_scale is None:  # megatron-core's DynamicGradScaler asserts it
        _require(args.min_loss_scale <= args.initial_loss_scale,
                 f"--min-loss-scale ({args.min_loss_scale}) must be <= --initial-loss-scale "
                 f"({args.initial_loss_scale})")
    if not cuda:
        _require(not (args.bf16 or args.fp16),
                 "--bf16/--fp16 need CUDA (megatron-core's mixed-precision optimizer); "
                 "CPU runs are fp32: drop the flag")
        _require(not args.use_distributed_optimizer,
                 "--use-distributed-optimizer needs CUDA (megatron-core's distributed "
                 "optimizer); drop it on CPU")
        _require(dims.pp == 1,
                 f"--pipeline-model-parallel-size {dims.pp} needs CUDA (megatron-core's "
                 "pipeline schedules); use 1 on CPU")

    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None,
                 "--recompute-granularity full needs --recompute-method uniform|block")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
        layers_per_stage = args.num_layers // dims.pp
        _require(args.recompute_num_layers <= layers_per_stage,
                 f"--recompute-num-layers ({args.recompute_num_layers}) must be in [1, layers "
                 f"per pipeline stage = --num-layers {args.num_layers} / "
                 f"--pipeline-model-parallel-size {dims.pp} = {layers_per_stage}]")
        # megatron-core 0.16's uniform chunks run past the last layer otherwise.
        _require(args.recompute_method == "block"
                 or layers_per_stage % args.recompute_num_layers == 0,
                 f"--recompute-method uniform needs --recompute-num-layers "
                 f"({args.recompute_num_layers}) to divide the layers per pipeline stage "
                 f"({layers_per_stage})")
    else:
        _require(args.recompute_method is None and args.recompute_num_layers is None,
                 "--recompute-method/--recompute-num-layers need --recompute-granularity full")
    if args.recompute_modules is not None:
        _require(args.recompute_granularity == "selective",
                 "--recompute-modules needs --recompute-granularity selective")
        _require(len(args.recompute_modules) > 0, "--recompute-modules needs at least one of "
                 + ", ".join(RECOMPUTE_MODULES))
        _require(not ("mlp" in args.recompute_modules and args.tiled_mlp_shards is not None),
                 "--tiled-mlp-shards already recomputes the MLP tile by tile in backward: drop "
                 "mlp from --recompute-modules")
        _require(not ("layernorm" in args.recompute_modules and not te_available()),
                 "--recompute-modules layernorm needs Transformer Engine (megatron-core's norm "
                 "recompute runs through it); drop layernorm")
        args.recompute_modules = tuple(dict.fromkeys(args.recompute_modules))
    if args.offload_activations:
        _require(args.recompute_granularity == "full",
                 "--offload-activations needs --recompute-granularity full (it offloads the "
                 "recompute checkpoints)")
    if args.cross_entropy_loss_fusion:
        _require(args.tiled_loss_shards is None,
                 "--tiled-loss-shards computes its own (unfused) cross entropy per tile: drop "
                 "--cross-entropy-loss-fusion or --tiled-loss-shards")
        if args.cross_entropy_fusion_impl == "te":
            _require(cuda and te_available(),
                     "--cross-entropy-fusion-impl te needs CUDA and Transformer Engine; use "
                     "native")
    if args.sequence_parallel:
        _require(args.tiled_mlp_shards is None and args.tiled_loss_shards is None,
                 "--tiled-mlp-shards/--tiled-loss-shards do not support --sequence-parallel "
                 "with --tensor-model-parallel-size > 1")

    if args.position_embedding_type != "rope":
        for name in ("use_rope_scaling", "rotary_seq_len_interpolation_factor"):
            _require(getattr(args, name) in (False, None),
                     f"{flag_name(name)} needs --position-embedding-type rope")
    _require(not (args.use_rope_scaling and args.rotary_seq_len_interpolation_factor is not None),
             "--use-rope-scaling and --rotary-seq-len-interpolation-factor are exclusive; give "
             "one")
    _check_range(args, "rope_scaling_factor", low=0, low_open=True)
    _check_range(args, "rotary_seq_len_interpolation_factor", low=0, low_open=True,
                 optional=True)
    if args.position_embedding_type == "rope":  # megatron-core rotates int(d x percent) dims
        rotary_dim = args.kv_channels if args.rotary_percent >= 1.0 else \
            int(args.kv_channels * args.rotary_percent)
        _require(rotary_dim >= 2 and rotary_dim % 2 == 0,
                 f"RoPE rotates --kv-channels x --rotary-percent = {args.kv_channels} x "
                 f"{args.rotary_percent} -> {rotary_dim} dimensions per head, which must be even "
                 "and >= 2; change --rotary-percent (or --kv-channels)")
        if args.reset_position_ids and not args.reset_attention_mask:
            warnings.append(
                "--reset-position-ids changes nothing with --position-embedding-type rope: RoPE "
                "takes positions from each document only with --reset-attention-mask, which "
                "also keeps documents from attending to each other; add --reset-attention-mask "
                "or drop --reset-position-ids")

    _require(not (args.exit_signal_handler and args.save is None),
             "--exit-signal-handler saves before exiting: it needs --save")
    _require(not (args.exit_duration_in_mins is not None and args.save is None),
             "--exit-duration-in-mins saves before exiting: it needs --save")
    _require(not (args.save_interval is not None and args.save is None),
             "--save-interval needs --save")
    _require(args.save_interval is None or args.save_interval > 0,
             f"--save-interval must be positive, got {args.save_interval}")
    _require(not (args.finetune and args.load is None), "--finetune needs --load")
    if args.skip_train:
        if args.load is None:
            warnings.append("--skip-train without --load evaluates the freshly initialised "
                            "model")
        if args.save is not None:
            warnings.append(f"--save {args.save} is ignored with --skip-train (nothing trains)")
    _require(not (args.use_checkpoint_args and args.load is None),
             "--use-checkpoint-args needs --load")
    for name in ("save", "tensorboard_dir", "data_cache_path"):  # fail now, not after training
        if getattr(args, name) is not None:
            check_writable_dir(getattr(args, name), flag_name(name))
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    _require(not (args.distributed_backend == "nccl" and not cuda),
             "--distributed-backend nccl needs CUDA; use gloo")
    return from_namespace(args, dims, warnings)


# Flags --use-checkpoint-args takes from the checkpoint's saved args (those it holds).
CHECKPOINT_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "max_position_embeddings", "position_embedding_type", "rotary_base",
    "rotary_percent", "use_rope_scaling", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", "normalization", "norm_epsilon", "swiglu",
    "untie_embeddings_and_output_weights", "disable_bias_linear", "add_qkv_bias",
    "qk_layernorm", "make_vocab_size_divisible_by", "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)


def apply_checkpoint_args(args: argparse.Namespace, given: frozenset = frozenset()) -> None:
    """--use-checkpoint-args: the model-shape flags from the checkpoint at --load (checked
    for pickled code before it is read), except those in `given` (flags on the command line win,
    as Megatron-LM's: e.g. a new --rotary-base for context extension; a shape that differs from
    the checkpoint's is refused by the load)."""
    _require(args.load is not None, "--use-checkpoint-args needs --load")
    from .checkpointing import read_checkpoint_args  # it imports this module

    saved = read_checkpoint_args(args.load)
    if saved is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint at --load {args.load} (its "
                          "latest_checkpointed_iteration.txt is missing)")
    missing = [flag_name(k) for k in ("num_layers", "hidden_size", "num_attention_heads")
               if saved.get(k) is None]
    _require(not missing, f"--use-checkpoint-args: the checkpoint at --load {args.load} holds "
             f"no {', '.join(missing)}; give them on the command line")
    for name in CHECKPOINT_ARGS:
        if name in saved and flag_name(name) not in given:
            setattr(args, name, saved[name])
    if "num_query_groups" in saved and not given & {"--group-query-attention",
                                                    "--num-query-groups"}:
        args.group_query_attention = saved["num_query_groups"] != saved["num_attention_heads"]
        if not args.group_query_attention:
            args.num_query_groups = None
    if args.vocab_size is None and saved.get("vocab_size") is not None and \
            args.tokenizer_type in (None, "NullTokenizer"):
        args.vocab_size = saved["vocab_size"]


def parse_args(argv=None, world_size: int = None) -> RunConfig:
    """Parse, validate and freeze; argparse errors exit 2, `ConfigError` is raised."""
    import sys

    raw = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(model_flags_required="--use-checkpoint-args" not in raw).parse_args(raw)
    if args.use_checkpoint_args:
        apply_checkpoint_args(args, given={word.split("=")[0] for word in raw
                                           if word.startswith("--")})
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate_args(args, world_size, torch.cuda.is_available())
