"""The model section: shape, positions, numerics, and which layers and attention run (what the
GPTModel build reads). Its activation-memory and fusion flags are `memory.py`'s and
`fusions.py`'s, whose fields `ModelConfig` takes in."""

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ...sp.rope import YARN_DEFAULTS, yarn_mscale
from ...sp.backends import BACKENDS, resolve_backend, te_available
from ...errors import ConfigError, flag_name
from .checks import Context, check_positive, check_range, ignore_without, number, require
from .fields import add_flags, flag, off_without
from .fusions import FusionFields
from .memory import MemoryFields
from .parallel import PipelineFields


_YARN_ON = "--position-embedding-type yarn"
_YARN = "with " + _YARN_ON


@dataclass(frozen=True)
class ModelConfig(MemoryFields, FusionFields, PipelineFields):
    """The model's shape, numerics and memory features (what the GPTModel build reads)."""

    ulysses_attention_backend: str = flag(
        "auto", "the attention between the all-to-alls (docs/training.md); auto: te in TE's "
        "layers, else sdpa", choices=("auto",) + BACKENDS)
    transformer_impl: str = flag(  # the layer spec: "transformer_engine" or "local"
        None, "the layers around attention; default transformer_engine with TE and CUDA",
        choices=("transformer_engine", "local"))
    attention_backend: str = flag(  # TE's kernel family (auto, flash, fused, unfused) or local
        "auto", "TE's attention kernels of --ulysses-attention-backend te, or local",
        choices=("auto", "flash", "fused", "unfused", "local"))
    num_layers: int = flag(None, required=True)
    hidden_size: int = flag(None, required=True)
    ffn_hidden_size: int = flag(None, "default 4 x hidden size")
    num_attention_heads: int = flag(None, required=True)
    group_query_attention: ClassVar[bool] = flag(False, kept=False)
    num_query_groups: int = flag(
        None, "with --group-query-attention (default 1 there, as in Megatron-LM)")
    kv_channels: int = flag(None, "default hidden / heads")
    seq_length: int = flag(None, required=True)
    max_position_embeddings: int = flag(None, "default --seq-length")
    position_embedding_type: str = flag(
        "learned_absolute", "none: NoPE; yarn: RoPE with YaRN scaling",
        choices=("rope", "yarn", "learned_absolute", "none"))
    use_rotary_position_embeddings: ClassVar[str] = flag(
        None, "= --position-embedding-type rope (Megatron-LM's older flag)",
        action="store_const", dest="position_embedding_type", const="rope", kept=False)
    rotary_base: int = flag(10000)
    rotary_percent: float = flag(1.0)
    use_rope_scaling: bool = flag(False, "llama3 RoPE frequency scaling",
                                  needs="--position-embedding-type rope")
    rope_scaling_factor: float = flag(8.0, "the llama3 scaling factor of --use-rope-scaling")
    rotary_seq_len_interpolation_factor: Optional[float] = flag(
        None, "linear RoPE position interpolation: positions / factor", type=number,
        needs="--position-embedding-type rope")
    # YaRN's (Megatron-LM's names and defaults; unset ones get `YARN_DEFAULTS`)
    rotary_scaling_factor: float = flag(
        1.0, f"YaRN's context scaling factor (HF rope_scaling.factor), {_YARN}",
        needs=_YARN_ON)
    yarn_original_max_position_embeddings: Optional[int] = flag(
        None, f"the context the model was trained at (default 4096), {_YARN}",
        needs=_YARN_ON)
    yarn_beta_fast: Optional[float] = flag(
        None, f"YaRN's high-frequency boundary in rotations (default 32), {_YARN}",
        needs=_YARN_ON)
    yarn_beta_slow: Optional[float] = flag(
        None, f"YaRN's low-frequency boundary in rotations (default 1), {_YARN}",
        needs=_YARN_ON)
    mscale: float = flag(1.0, f"YaRN's cos / sin scale, {_YARN}", needs=_YARN_ON)
    mscale_all_dim: float = flag(0.0, f"the denominator's mscale of --mscale, {_YARN}",
                                 needs=_YARN_ON)
    yarn_correction_range_round_to_int: Optional[bool] = flag(
        None, f"round YaRN's correction range to integers (the default), {_YARN}",
        action="store_true", needs=_YARN_ON)
    no_yarn_correction_range_round_to_int: ClassVar[bool] = flag(
        True, f"keep YaRN's correction range fractional (HF truncate false), {_YARN}",
        dest="yarn_correction_range_round_to_int", kept=False)
    normalization: str = flag("LayerNorm", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = flag(1e-5)
    swiglu: bool = flag(False)
    squared_relu: bool = flag(False, "the MLP's activation is relu(x)^2 (not with --swiglu)")
    apply_layernorm_1p: bool = flag(  # megatron-core's layernorm_zero_centered_gamma
        False, "norms scale by 1 + w (zero-centered gamma)")
    rotary_interleaved: bool = flag(
        False, "RoPE rotates (even, odd) pairs (GPT-J), not halves",
        needs="--position-embedding-type rope")
    untie_embeddings_and_output_weights: bool = flag(False)
    disable_bias_linear: bool = flag(False)
    add_qkv_bias: bool = flag(
        False, "biases on the q/k/v projection only (Qwen2), with --disable-bias-linear")
    qk_layernorm: bool = flag(False)
    attention_dropout: float = flag(0.1)
    hidden_dropout: float = flag(0.1)
    init_method_std: float = flag(0.02)
    init_method_xavier_uniform: bool = flag(
        False, "xavier_uniform_ linear weights (not --init-method-std's normal)")
    make_vocab_size_divisible_by: int = flag(128)
    # --padded-vocab-size, or from the tokenizer by `pretrain` (`vocab.model_vocab_size`)
    padded_vocab_size: Optional[int] = flag(
        None, "the model's vocabulary rows (default: the tokenizer's, padded)")
    pad_vocab_size: bool = flag(
        True, "no vocab padding: the tokenizer's rows (must divide by TP)",
        names=("--no-pad-vocab-size", "--disable-pad-vocab-size"))
    embedding_init_method_std: Optional[float] = flag(  # default --init-method-std
        None, "the embedding's init std (default --init-method-std)")
    # Megatron-LM's attention and MLP variants: their defaults (what this model is) only.
    softmax_type: ClassVar[str] = flag(
        "vanilla", "only vanilla (the standard softmax) here",
        choices=("vanilla", "off-by-one", "learnable"), kept=False)
    rope_type: ClassVar[Optional[str]] = flag(
        None, "only rope here (YaRN: --position-embedding-type yarn)",
        choices=("rope", "yarn"), kept=False)
    glu_linear_offset: ClassVar[float] = flag(
        0.0, "only 0 here (the gated MLP is silu(x0) * x1)", kept=False)
    sequence_parallel: bool = flag(False)
    bf16: bool = flag(False)
    fp16: bool = flag(False)
    deterministic_mode: bool = flag(
        False, "bitwise reproducible GPU runs and resumes (deterministic kernels; slower)")
    te_rng_tracker: bool = flag(
        False, "Transformer Engine's CUDA RNG tracker (GPU, TE's layers)")
    use_cpu_initialization: bool = flag(
        False, "initialise the weights on the CPU (CPU runs always do)")
    test_mode: bool = flag(False, "megatron-core's test_mode: extra self-checks in its layers")
    use_mup: bool = flag(
        False, "Maximal Update Parametrization (megatron-core >= 0.19)")
    mup_base_hidden_size: Optional[int] = flag(
        None, "the base width of --use-mup (default --hidden-size)", needs="--use-mup")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


def add_arguments(parser, model_flags_required: bool = True) -> None:
    """`model_flags_required=False` (with --use-checkpoint-args): the checkpoint gives them."""
    add_flags(parser, ModelConfig, "model", required=model_flags_required)


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
        ignore_without(args, ctx, "--use-mup", off_without(ModelConfig, "--use-mup"))
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
        given = (f"--attention-backend {args.attention_backend} runs "
                 f"--ulysses-attention-backend {ours}")
        require(args.ulysses_attention_backend in ("auto", ours),
                f"{given}, not {args.ulysses_attention_backend}; drop one of the two")
        args.ulysses_attention_backend = ours
        given += " here (drop it to get the default): "
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
    return tuple(("--no-" + option[2:] if getattr(args, name) is False else option, name, default)
                 for option, name, default in off_without(ModelConfig, _YARN_ON))


def _check_rope(args, ctx: Context) -> None:
    if args.position_embedding_type != "yarn":  # megatron-core reads them only with yarn
        ignore_without(args, ctx, _YARN_ON, _yarn_options(args))
    if args.position_embedding_type not in ("rope", "yarn"):  # no rotary embedding built
        ignore_without(args, ctx, "--position-embedding-type rope",
                       off_without(ModelConfig, "--position-embedding-type rope"))
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
    yarn = _YARN_ON
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
