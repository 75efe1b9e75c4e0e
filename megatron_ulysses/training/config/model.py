"""The model section: shape, positions, numerics, and which layers and attention run (what the
GPTModel build reads). Its activation-memory and fusion flags are `memory.py`'s and
`fusions.py`'s, whose fields `ModelConfig` takes in."""

from dataclasses import dataclass
from typing import Optional

import torch

from ...sp.rope import YARN_DEFAULTS, yarn_mscale
from ...sp.backends import BACKENDS, resolve_backend, te_available
from ...errors import ConfigError, flag_name
from .checks import Context, check_positive, check_range, ignore_without, number, require
from .fusions import FusionFields
from .memory import MemoryFields
from .parallel import PipelineFields


@dataclass(frozen=True)
class ModelConfig(MemoryFields, FusionFields, PipelineFields):
    """The model's shape, numerics and memory features (what the GPTModel build reads)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    seq_length: int
    max_position_embeddings: int
    position_embedding_type: str
    rotary_base: int
    rotary_percent: float
    use_rope_scaling: bool
    rope_scaling_factor: float
    rotary_seq_len_interpolation_factor: Optional[float]
    rotary_scaling_factor: float  # YaRN's (--position-embedding-type yarn), as the next six
    yarn_original_max_position_embeddings: Optional[int]
    yarn_beta_fast: Optional[float]
    yarn_beta_slow: Optional[float]
    mscale: float
    mscale_all_dim: float
    yarn_correction_range_round_to_int: Optional[bool]
    normalization: str
    norm_epsilon: float
    swiglu: bool
    untie_embeddings_and_output_weights: bool
    disable_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    attention_dropout: float
    hidden_dropout: float
    init_method_std: float
    make_vocab_size_divisible_by: int
    sequence_parallel: bool
    bf16: bool
    fp16: bool
    ulysses_attention_backend: str
    transformer_impl: str  # the layer spec: "transformer_engine" or "local"
    attention_backend: str  # Megatron-LM's: TE's kernel family (auto, flash, fused, unfused) or local
    deterministic_mode: bool
    apply_layernorm_1p: bool  # megatron-core's layernorm_zero_centered_gamma
    squared_relu: bool
    rotary_interleaved: bool
    init_method_xavier_uniform: bool
    use_mup: bool
    mup_base_hidden_size: Optional[int]
    test_mode: bool
    te_rng_tracker: bool
    use_cpu_initialization: bool
    # --padded-vocab-size, or from the tokenizer by `pretrain` (`vocab.model_vocab_size`)
    padded_vocab_size: Optional[int] = None
    pad_vocab_size: bool = True  # --no-pad-vocab-size: the tokenizer's rows, not padded
    embedding_init_method_std: Optional[float] = None  # default --init-method-std

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


def add_arguments(parser, model_flags_required: bool = True) -> None:
    """`model_flags_required=False` (with --use-checkpoint-args): the checkpoint gives them."""
    g = parser.add_argument_group("model")
    _add_layer_arguments(g)
    _add_shape_arguments(g, model_flags_required)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise run-to-run and resume reproducibility on GPU: deterministic "
                   "TE attention (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0), deterministic torch and "
                   "cuBLAS kernels, megatron-core's deterministic embedding backward; slower")
    g.add_argument("--te-rng-tracker", action="store_true",
                   help="Transformer Engine's CUDA RNG tracker (megatron-core's "
                   "te_rng_tracker); GPU with --transformer-impl transformer_engine only")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialise the weights on the CPU, then move them (megatron-core's "
                   "use_cpu_initialization; CPU runs always do)")
    g.add_argument("--test-mode", action="store_true",
                   help="megatron-core's test_mode: extra self-checks in its layers")
    g.add_argument("--use-mup", action="store_true",
                   help="Maximal Update Parametrization (megatron-core >= 0.19's): init and "
                   "learning rates scaled by --hidden-size / --mup-base-hidden-size")
    g.add_argument("--mup-base-hidden-size", type=int, default=None,
                   help="the base width of --use-mup (default --hidden-size)")


def _add_layer_arguments(g) -> None:
    g.add_argument("--ulysses-attention-backend", choices=("auto",) + BACKENDS, default="auto",
                   help="The attention between the all-to-alls: te (Transformer Engine), sdpa "
                   "(torch), local (megatron-core), flash (FlashAttention-4: Hopper / "
                   "Blackwell, bf16 / fp16, --attention-dropout 0; pip install "
                   "'megatron_ulysses[flash]'); auto = te with --transformer-impl "
                   "transformer_engine, else sdpa (never flash).")
    g.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                   help="The layers around attention (as Megatron-LM): Transformer Engine's "
                   "(norm fused into the linear layers) or megatron-core's local ones; default "
                   "transformer_engine where TE and CUDA are there, else local.")
    g.add_argument("--attention-backend", choices=("auto", "flash", "fused", "unfused", "local"),
                   default="auto", help="Megatron-LM's: flash / fused / unfused pick Transformer "
                   "Engine's attention kernels (--ulysses-attention-backend te), local is "
                   "--ulysses-attention-backend local; auto leaves both to their defaults")


def _add_shape_arguments(g, required: bool) -> None:
    g.add_argument("--num-layers", type=int, required=required)
    g.add_argument("--hidden-size", type=int, required=required)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, required=required)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="with --group-query-attention (default 1 there, as in Megatron-LM)")
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden / heads")
    g.add_argument("--seq-length", type=int, required=required)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default --seq-length")
    _add_position_arguments(g)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--squared-relu", action="store_true",
                   help="the MLP's activation is relu(x)^2 (not with --swiglu)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norms keep gamma - 1: weights start at 0 and scale by 1 + w "
                   "(megatron-core's layernorm_zero_centered_gamma), LayerNorm and RMSNorm")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE rotates (even, odd) pairs (GPT-J) instead of halves; not with "
                   "TE's fused RoPE (add --no-rope-fusion on GPU)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the q/k/v projection only (Qwen2), with --disable-bias-linear")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--init-method-xavier-uniform", action="store_true",
                   help="initialise the linear weights with xavier_uniform_ (not "
                   "--init-method-std's normal)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="the model's vocabulary rows as given (>= the tokenizer's, divisible "
                   "by TP); default: the tokenizer's rounded up to --make-vocab-size-"
                   "divisible-by x TP")
    g.add_argument("--no-pad-vocab-size", "--disable-pad-vocab-size", dest="pad_vocab_size",
                   action="store_false", help="no vocab padding: the model has the tokenizer's "
                   "rows (or --padded-vocab-size), which must divide by TP")
    g.add_argument("--embedding-init-method-std", type=float, default=None,
                   help="the std of the embedding's normal initialization (default "
                   "--init-method-std), megatron-core's embedding_init_method_std")
    _add_variant_arguments(g)



def _add_position_arguments(g) -> None:
    """Position information: learned, RoPE (its base, share, scaling, interpolation), YaRN or
    none."""
    g.add_argument("--position-embedding-type",
                   choices=("rope", "yarn", "learned_absolute", "none"),
                   default="learned_absolute", help="none: no position information (NoPE), "
                   "yarn: RoPE with YaRN scaling (megatron-core's YarnRotaryEmbedding), as "
                   "megatron-core's GPTModel")
    g.add_argument("--use-rotary-position-embeddings", action="store_const",
                   dest="position_embedding_type", const="rope",
                   help="= --position-embedding-type rope (Megatron-LM's older flag)")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="llama3 RoPE frequency scaling (megatron-core's; with "
                   "--position-embedding-type rope)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="the llama3 scaling factor of --use-rope-scaling")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=number, default=None,
                   help="linear RoPE position interpolation: positions / factor")
    _add_yarn_arguments(g)


def _add_yarn_arguments(g) -> None:
    """YaRN's (Megatron-LM's names and defaults; unset ones get `YARN_DEFAULTS`)."""
    yarn = "with --position-embedding-type yarn"
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help=f"YaRN's context scaling factor (HF rope_scaling.factor), {yarn}")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help=f"the context the model was trained at (default 4096), {yarn}")
    g.add_argument("--yarn-beta-fast", type=float, default=None,
                   help=f"YaRN's high-frequency boundary in rotations (default 32), {yarn}")
    g.add_argument("--yarn-beta-slow", type=float, default=None,
                   help=f"YaRN's low-frequency boundary in rotations (default 1), {yarn}")
    g.add_argument("--mscale", type=float, default=1.0, help="cos / sin are scaled by "
                   "(0.1 * mscale * ln(factor) + 1) / (the same with --mscale-all-dim), " + yarn)
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help=f"the denominator's mscale of --mscale, {yarn}")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help=f"round YaRN's correction range to integers (the default), {yarn}")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int",
                   help=f"keep YaRN's correction range fractional (HF truncate false), {yarn}")

def _add_variant_arguments(g) -> None:
    """Megatron-LM's attention and MLP variants: their defaults (what this model is) only."""
    g.add_argument("--softmax-type", choices=("vanilla", "off-by-one", "learnable"),
                   default="vanilla", help="only vanilla (the standard softmax) here")
    g.add_argument("--rope-type", choices=("rope", "yarn"), default=None,
                   help="only rope here (Megatron-LM's standard attention takes no other; "
                   "YaRN is --position-embedding-type yarn)")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="only 0 here (the gated MLP is silu(x0) * x1)")


def check_values(args) -> None:
    """Range checks megatron-core would only trip over later (an assert or NaN losses)."""
    check_positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    for name in ("ffn_hidden_size", "kv_channels", "max_position_embeddings"):
        check_range(args, name, low=0, low_open=True, optional=True)
    check_range(args, "make_vocab_size_divisible_by", low=1)
    check_range(args, "padded_vocab_size", low=1, optional=True)
    check_range(args, "mup_base_hidden_size", low=1, optional=True)
    for name in ("attention_dropout", "hidden_dropout"):
        check_range(args, name, low=0, high=1, high_open=True)
    check_range(args, "rotary_base", low=0, low_open=True)
    check_range(args, "rotary_percent", low=0, high=1, low_open=True)
    for name in ("norm_epsilon", "init_method_std", "rope_scaling_factor"):
        check_range(args, name, low=0, low_open=True)
    check_range(args, "rotary_seq_len_interpolation_factor", low=0, low_open=True,
                optional=True)
    check_range(args, "embedding_init_method_std", low=0, low_open=True, optional=True)
    require(args.softmax_type == "vanilla", f"--softmax-type {args.softmax_type}: only the "
            "vanilla softmax is built here (the attention backends between the Ulysses "
            "all-to-alls have no softmax offset); drop it")
    require(args.rope_type in (None, "rope"), f"--rope-type {args.rope_type}: standard "
            "attention takes only rope (as in Megatron-LM, where it is multi-latent "
            "attention's); drop it (YaRN for this model: --position-embedding-type yarn)")
    require(args.glu_linear_offset == 0, f"--glu-linear-offset {args.glu_linear_offset}: the "
            "gated MLP here is silu(x0) * x1, with no offset; drop it")


def validate(args, ctx: Context) -> None:
    """Fill in the shape defaults and check the shape against the parallel layout, then the
    layers and attention, precision and RoPE."""
    _fill_shape(args, ctx)
    _resolve_layers_and_attention(args, ctx.cuda)
    require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive; give one")
    require(ctx.cuda or not (args.bf16 or args.fp16),
            "--bf16/--fp16 need CUDA (megatron-core's mixed-precision optimizer); "
            "CPU runs are fp32: drop the flag")
    _check_rope(args, ctx)
    _check_model_options(args, ctx)
    _check_flash_attention(args, ctx)


def _check_model_options(args, ctx: Context) -> None:
    """Megatron-LM's rules for the activation, vocab padding, MuP and TE's RNG tracker."""
    require(not (args.squared_relu and args.swiglu), "--squared-relu and --swiglu are "
            "exclusive (each is the MLP's activation); give one")
    require(args.padded_vocab_size is None or args.padded_vocab_size % ctx.dims.tp == 0,
            f"--padded-vocab-size ({args.padded_vocab_size}) must be divisible by "
            f"--tensor-model-parallel-size ({ctx.dims.tp})")
    if not args.use_mup:  # megatron-core reads it only with MuP
        ignore_without(args, ctx, "--use-mup",
                       (("--mup-base-hidden-size", "mup_base_hidden_size", None),))
    else:
        require(mup_supported(), "--use-mup needs megatron-core >= 0.19 (its MuP init and "
                f"optimizer groups); this is megatron-core {megatron_core_version()}")
    require(not args.te_rng_tracker or (ctx.cuda and args.transformer_impl ==
                                         "transformer_engine"),
            "--te-rng-tracker is Transformer Engine's CUDA RNG tracker: it needs CUDA and "
            "--transformer-impl transformer_engine; drop it on CPU")


def _check_flash_attention(args, ctx: Context) -> None:
    """FlashAttention-4's limits (flash-attn-4 4.0.0b36's interface): a backward only from
    Hopper on, bf16 / fp16 only, no dropout, head dims by GPU generation, no deterministic
    backward on compute capability 12.x."""
    if args.ulysses_attention_backend != "flash":
        return
    flag = "--ulysses-attention-backend flash"
    require(ctx.cuda, f"{flag} needs CUDA (FlashAttention-4's kernels); on CPU use sdpa or local")
    major, minor = torch.cuda.get_device_capability()
    require(major in (9, 10, 11, 12),
            f"{flag} needs a Hopper or Blackwell GPU (compute capability 9.0 to 12.x: "
            f"FlashAttention-4 has no backward below); this GPU is {major}.{minor}: use te or "
            "sdpa")
    require(args.bf16 or args.fp16, f"{flag} runs in bf16 or fp16 (FlashAttention-4 has no "
            "fp32 kernels): add --bf16, or use te, sdpa or local")
    require(args.attention_dropout == 0,
            f"{flag} has no attention dropout (FlashAttention-4 implements none): add "
            f"--attention-dropout 0 (got {args.attention_dropout}; the default is 0.1), or use "
            "te, sdpa or local")
    d = args.kv_channels
    # sm90: 8..256; sm100 / sm110: 8..128 or 256; 12.x (its sm80-style kernels): 8..128
    fits = d % 8 == 0 and (8 <= d <= (256 if major == 9 else 128)
                           or (major in (10, 11) and d == 256))
    limits = {9: "8 to 256", 10: "8 to 128, or 256", 11: "8 to 128, or 256"}.get(major,
                                                                                "8 to 128")
    require(fits, f"{flag}: head dim --kv-channels {d} is not one FlashAttention-4 runs on "
            f"compute capability {major}.{minor} ({limits}, a multiple of 8); use te or sdpa")
    require(not (args.deterministic_mode and major == 12),
            f"{flag} has no deterministic backward on compute capability {major}.{minor} "
            "(FlashAttention-4's sm120 kernels): drop --deterministic-mode, or use te")


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def mup_supported() -> bool:
    from megatron.core.transformer import TransformerConfig

    return "use_mup" in TransformerConfig.__dataclass_fields__


def _fill_shape(args, ctx: Context) -> None:
    """Megatron-LM's derived shape defaults (--num-query-groups 1 with --group-query-attention,
    ignored without it; --kv-channels, --ffn-hidden-size, --max-position-embeddings)."""
    dims = ctx.dims
    if args.group_query_attention:
        if args.num_query_groups is None:
            args.num_query_groups = 1
        require(args.num_query_groups > 0, "--group-query-attention needs a positive "
                f"--num-query-groups, got {args.num_query_groups}")
    else:
        if args.num_query_groups is not None:
            ctx.warnings.append(f"--num-query-groups {args.num_query_groups} is ignored without "
                                "--group-query-attention (as in Megatron-LM): every query head "
                                "has its own key / value head")
        args.num_query_groups = args.num_attention_heads
    if args.kv_channels is None:
        require(args.hidden_size % args.num_attention_heads == 0,
                f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
                f"({args.num_attention_heads}), or give --kv-channels")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    # The loader pads s to a multiple of P (loss mask 0); padded tokens still get positions.
    padded_length = dims.local_seq_length(args.seq_length) * dims.sp
    if args.max_position_embeddings is None:
        args.max_position_embeddings = padded_length
    if args.position_embedding_type == "learned_absolute":
        require(args.max_position_embeddings >= padded_length,
                f"--max-position-embeddings ({args.max_position_embeddings}) must be >= "
                f"--seq-length ({args.seq_length}) padded to a multiple of --ulysses-sp-size "
                f"({dims.sp}), {padded_length}, with learned absolute positions")
    if dims.tp == 1:
        args.sequence_parallel = False  # as Megatron-LM: nothing to split at TP = 1
    try:  # the loader pads s to a multiple of P; TP's sequence parallelism needs s/P % TP == 0
        dims.validate_model(args.num_attention_heads, args.num_query_groups,
                            args.seq_length if args.sequence_parallel else None)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _resolve_layers_and_attention(args, cuda: bool) -> None:
    """Fill in --transformer-impl (the layer spec) and --ulysses-attention-backend (the core
    attention) from each other and Megatron-LM's --attention-backend: TE's layers wherever TE
    and CUDA are there, TE's attention in them by default; every backend runs in TE's layers,
    te only there."""
    # A backend set by Megatron-LM's --attention-backend is named by that flag in errors.
    given = ""
    if args.attention_backend != "auto":
        ours = "local" if args.attention_backend == "local" else "te"
        require(args.ulysses_attention_backend in ("auto", ours),
                f"--attention-backend {args.attention_backend} runs --ulysses-attention-backend "
                f"{ours}, not {args.ulysses_attention_backend}; drop one of the two")
        args.ulysses_attention_backend = ours
        given = (f"--attention-backend {args.attention_backend} runs --ulysses-attention-backend "
                 f"{ours} here (drop it to get the default): ")
    try:  # te without Transformer Engine or CUDA fails here, not when the model is built
        if args.ulysses_attention_backend != "auto":
            resolve_backend(args.ulysses_attention_backend)
    except ValueError as error:
        raise ConfigError(given + str(error)) from None
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te_available() and cuda else "local"
    if args.transformer_impl == "transformer_engine":
        require(te_available(), "--transformer-impl transformer_engine needs Transformer Engine "
                "(pip install 'megatron_ulysses[te]'); use --transformer-impl local")
        require(cuda, "--transformer-impl transformer_engine needs CUDA (Transformer Engine's "
                "kernels); on CPU use --transformer-impl local")
    require(not (args.transformer_impl == "local" and args.ulysses_attention_backend == "te"),
            given + "--ulysses-attention-backend te runs in Transformer Engine's layers: drop "
            "--transformer-impl local, or use --ulysses-attention-backend sdpa or local")
    if args.ulysses_attention_backend == "auto":
        args.ulysses_attention_backend = ("te" if args.transformer_impl == "transformer_engine"
                                          else "sdpa")


def _yarn_options(args) -> tuple:
    """(flag, dest, default) of the YaRN flags, as given (--no-yarn-correction-...)."""
    def given(name):
        off = name == "yarn_correction_range_round_to_int" and getattr(args, name) is False
        return "--no-" + flag_name(name)[2:] if off else flag_name(name)

    return tuple((given(name), name, None if name.startswith("yarn_") else default)
                 for name, default in YARN_DEFAULTS.items())


def _check_rope(args, ctx: Context) -> None:
    if args.position_embedding_type != "yarn":  # megatron-core reads them only with yarn
        ignore_without(args, ctx, "--position-embedding-type yarn", _yarn_options(args))
    if args.position_embedding_type not in ("rope", "yarn"):  # no rotary embedding built
        ignore_without(args, ctx, "--position-embedding-type rope", (
            ("--use-rope-scaling", "use_rope_scaling", False),
            ("--rotary-seq-len-interpolation-factor", "rotary_seq_len_interpolation_factor",
             None),
            ("--rotary-interleaved", "rotary_interleaved", False)))
        return
    if args.position_embedding_type == "yarn":
        _check_yarn(args)
    # megatron-core's TransformerConfig refuses interleaved RoPE with TE's fused kernel.
    require(not (args.rotary_interleaved and ctx.cuda and te_available()
                 and not args.no_rope_fusion),
            "--rotary-interleaved does not work with TE's fused RoPE: add --no-rope-fusion")
    require(not (args.use_rope_scaling and args.rotary_seq_len_interpolation_factor is not None),
            "--use-rope-scaling and --rotary-seq-len-interpolation-factor are exclusive; give "
            "one")
    # megatron-core rotates int(d x percent) dims
    rotary_dim = args.kv_channels if args.rotary_percent >= 1.0 else \
        int(args.kv_channels * args.rotary_percent)
    require(rotary_dim >= 2 and rotary_dim % 2 == 0,
            f"RoPE rotates --kv-channels x --rotary-percent = {args.kv_channels} x "
            f"{args.rotary_percent} -> {rotary_dim} dimensions per head, which must be even "
            "and >= 2; change --rotary-percent (or --kv-channels)")


def _check_yarn(args) -> None:
    """What megatron-core's `YarnRotaryEmbedding` builds (all dims, non-interleaved halves, none
    of the other scalings), its unset flags filled in as Megatron-LM's model build does, and
    values whose tables and cos / sin factor are finite."""
    yarn = "--position-embedding-type yarn"
    require(not args.rotary_interleaved, f"{yarn} rotates halves (megatron-core's "
            "YarnRotaryEmbedding refuses interleaved pairs): drop --rotary-interleaved")
    require(args.rotary_percent == 1.0, f"{yarn} rotates every head dimension (megatron-core's "
            f"YaRN ignores --rotary-percent {args.rotary_percent}): drop --rotary-percent")
    other = [flag for flag, on in (
        ("--use-rope-scaling", args.use_rope_scaling),
        ("--rotary-seq-len-interpolation-factor",
         args.rotary_seq_len_interpolation_factor is not None)) if on]
    require(not other, f"{' and '.join(other)}: another RoPE scaling, which megatron-core's "
            f"YaRN ignores ({yarn} scales by --rotary-scaling-factor): drop it")
    for name, default in YARN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
                 "yarn_beta_fast", "yarn_beta_slow"):
        check_range(args, name, low=0, low_open=True)
    for name in ("mscale", "mscale_all_dim"):
        check_range(args, name)
        scale = yarn_mscale(args.rotary_scaling_factor, getattr(args, name))
        require(scale > 0, f"{yarn}: 0.1 x {flag_name(name)} ({getattr(args, name)}) x "
                f"ln(--rotary-scaling-factor {args.rotary_scaling_factor}) + 1 = {scale:.4g} "
                "must be positive (cos / sin are scaled by --mscale's over --mscale-all-dim's)")
