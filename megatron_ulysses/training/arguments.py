"""Command-line arguments of `pretrain_gpt.py`: Megatron-LM's flag names and meanings, plus ours
(`--ulysses-*`, the ALST memory flags). `validate_args` checks every configuration before the
first collective and raises one `ConfigError` naming the flag to change.
"""

import argparse
import math
import os

import torch

from ..backends import BACKENDS
from ..data.tokenizers import TOKENIZER_TYPES
from ..parallel_state import ParallelDims


class ConfigError(ValueError):
    """A bad configuration; the message names the flag that fixes it."""


def _tiles(value: str):
    """`--tiled-*-shards`: a positive int or 'auto'."""
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
                   help="Local attention inside the all-to-alls: te (Transformer Engine), sdpa "
                   "(torch), local (megatron-core); auto = te if installed, else sdpa.")

    g = parser.add_argument_group("ALST memory features (off by default, exact)")
    g.add_argument("--tiled-mlp-shards", type=_tiles, default=None,
                   help="Run the MLP over N sequence tiles (or 'auto' = ceil(s/h)).")
    g.add_argument("--tiled-loss-shards", type=_tiles, default=None,
                   help="Compute logits + loss over N sequence tiles (or 'auto': 1 GiB tiles).")
    g.add_argument("--offload-activations", action="store_true",
                   help="Keep full-recompute checkpoints in CPU memory "
                   "(needs --recompute-granularity full).")

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
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
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)

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
    g.add_argument("--lr", type=float, required=True)
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
    g.add_argument("--initial-loss-scale", type=float, default=2.0**16,
                   help="dynamic fp16 loss scale to start from (Megatron-LM: 2^32, which "
                   "skips ~17 steps while it halves down to a usable scale)")
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = parser.add_argument_group("activation recompute")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = parser.add_argument_group("run")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="instead of --train-iters: samples / global batch size iterations")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: save a checkpoint (needs --save) and exit")
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
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
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
        ("--no-bias-gelu-fusion", "unfused bias + GeLU (fused only on GPU with biases)"),
        ("--no-bias-swiglu-fusion", "unfused bias + SwiGLU (fused only on GPU with biases)"),
        ("--no-bias-dropout-fusion", "unfused bias + dropout + add (fused only on GPU)"),
        ("--no-gradient-accumulation-fusion", "gradient-accumulation fusion is off"),
        ("--no-rope-fusion", "RoPE fusion is off (global positions need our rotary)"),
        ("--log-validation-ppl-to-tensorboard", "validation loss goes to TensorBoard"),
    ):
        g.add_argument(flag, action="store_true", help=why)
    g.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                   help="transformer_engine = --ulysses-attention-backend te, local = local")
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
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; iteration and consumed samples start at 0")
    return parser


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate_args(args: argparse.Namespace, world_size: int, cuda: bool) -> argparse.Namespace:
    """Check the whole configuration for `world_size` processes and fill in derived values
    (`dims`, `data_parallel_size`, `num_microbatches`, `padded_vocab_size` is set later).
    Raises `ConfigError` before anything touches a process group."""
    try:
        args.dims = ParallelDims(world_size=world_size, tp=args.tensor_model_parallel_size,
                                 pp=args.pipeline_model_parallel_size, sp=args.ulysses_sp_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    dims = args.dims
    _require((args.train_iters is None) != (args.train_samples is None),
             "give one of --train-iters and --train-samples")
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters" if args.train_iters is not None
                 else "train_samples", "log_interval", "eval_interval"):
        _require(getattr(args, flag) > 0,
                 f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")

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
    padded_length = -(-args.seq_length // dims.sp) * dims.sp
    if args.max_position_embeddings is None:
        args.max_position_embeddings = padded_length
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
    args.data_parallel_size = dims.dp
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
        args.train_iters = max(1, args.train_samples // args.global_batch_size)

    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _require(args.lr_warmup_iters == 0,
                 "give --lr-warmup-fraction or --lr-warmup-iters, not both")
        _require(0 <= args.lr_warmup_fraction <= 1,
                 f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.transformer_impl is not None:
        backend = {"transformer_engine": "te", "local": "local"}[args.transformer_impl]
        _require(args.ulysses_attention_backend in ("auto", backend),
                 f"--transformer-impl {args.transformer_impl} contradicts "
                 f"--ulysses-attention-backend {args.ulysses_attention_backend}")
        args.ulysses_attention_backend = backend
    _require(0 <= args.min_lr <= args.lr,
             f"--min-lr ({args.min_lr}) must be in [0, --lr ({args.lr})]")
    _require(args.lr_warmup_iters <= args.lr_decay_iters,
             f"--lr-warmup-iters ({args.lr_warmup_iters}) must be <= --lr-decay-iters "
             f"({args.lr_decay_iters})")
    _require(args.clip_grad >= 0, f"--clip-grad must be >= 0, got {args.clip_grad}")
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
             "exclusive; give one")

    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive; give one")
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
    else:
        _require(args.recompute_method is None and args.recompute_num_layers is None,
                 "--recompute-method/--recompute-num-layers need --recompute-granularity full")
    if args.offload_activations:
        _require(args.recompute_granularity == "full",
                 "--offload-activations needs --recompute-granularity full (it offloads the "
                 "recompute checkpoints)")
    if args.sequence_parallel:
        _require(args.tiled_mlp_shards is None and args.tiled_loss_shards is None,
                 "--tiled-mlp-shards/--tiled-loss-shards do not support --sequence-parallel "
                 "with --tensor-model-parallel-size > 1")

    if args.mock_data:
        _require(not args.data_path, "give --data-path or --mock-data, not both")
        if args.tokenizer_type is None:
            args.tokenizer_type = "NullTokenizer"
    else:
        _require(bool(args.data_path), "give --data-path PREFIX (tools/preprocess_data.py "
                 "writes one) or --mock-data")
        _require(args.tokenizer_type is not None, "--data-path needs --tokenizer-type")
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None and args.vocab_size > 0,
                 "--tokenizer-type NullTokenizer (the --mock-data default) needs --vocab-size")
    elif args.tokenizer_model is None:
        raise ConfigError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    elif not os.path.exists(args.tokenizer_model):
        raise ConfigError(f"--tokenizer-model {args.tokenizer_model!r} does not exist")

    _require(not (args.exit_signal_handler and args.save is None),
             "--exit-signal-handler saves before exiting: it needs --save")
    _require(not (args.save_interval is not None and args.save is None),
             "--save-interval needs --save")
    _require(args.save_interval is None or args.save_interval > 0,
             f"--save-interval must be positive, got {args.save_interval}")
    _require(not (args.finetune and args.load is None), "--finetune needs --load")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    _require(not (args.distributed_backend == "nccl" and not cuda),
             "--distributed-backend nccl needs CUDA; use gloo")
    return args


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocab padding: a multiple of `--make-vocab-size-divisible-by` x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def parse_args(argv=None, world_size: int = None) -> argparse.Namespace:
    """Parse and validate; argparse errors exit 2, `ConfigError` is raised."""
    args = build_parser().parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate_args(args, world_size, torch.cuda.is_available())
