"""The kernel-fusion part of the model section: GPU fusions on by default as in Megatron-LM
(each flag turns one off), the cross-entropy fusion off by default."""

from dataclasses import dataclass

from ...sp.backends import te_available
from .checks import Context, require


@dataclass(frozen=True)
class FusionFields:
    """`ModelConfig`'s fusion fields."""

    no_rope_fusion: bool  # also set by the rules where TE's fused RoPE would overflow
    no_gradient_accumulation_fusion: bool
    no_bias_swiglu_fusion: bool
    no_bias_gelu_fusion: bool
    no_bias_dropout_fusion: bool
    cross_entropy_loss_fusion: bool
    cross_entropy_fusion_impl: str


def add_arguments(parser) -> None:
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


def validate(args, ctx: Context) -> None:
    if args.cross_entropy_loss_fusion:
        require(args.tiled_loss_shards is None,
                "--tiled-loss-shards computes its own (unfused) cross entropy per tile: drop "
                "--cross-entropy-loss-fusion or --tiled-loss-shards")
        if args.cross_entropy_fusion_impl == "te":
            require(ctx.cuda and te_available(),
                    "--cross-entropy-fusion-impl te needs CUDA and Transformer Engine; use "
                    "native")
