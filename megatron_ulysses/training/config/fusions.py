"""The kernel-fusion part of the model section: GPU fusions on by default as in Megatron-LM
(each flag turns one off), the cross-entropy fusion off by default."""

import importlib.util
from dataclasses import dataclass

from ...sp.backends import te_available
from .checks import Context, require
from .fields import add_flags, flag


@dataclass(frozen=True)
class FusionFields:
    """`ModelConfig`'s fusion fields."""

    # also set by the rules where TE's fused RoPE would overflow
    no_rope_fusion: bool = flag(
        False, "unfused RoPE (default: TE's fused RoPE when TE is installed)")
    no_gradient_accumulation_fusion: bool = flag(
        False, "unfused weight-gradient accumulation (default: fused into main_grad when apex's "
        "fused_weight_gradient_mlp_cuda is installed)")
    no_bias_swiglu_fusion: bool = flag(False, "unfused (bias +) SwiGLU")
    no_bias_gelu_fusion: bool = flag(False, "unfused bias + GeLU (fused only with biases)")
    no_bias_dropout_fusion: bool = flag(False, "unfused bias + dropout + add")
    cross_entropy_loss_fusion: bool = flag(
        False, "fused vocab-parallel cross entropy (off by default, as in Megatron-LM)")
    cross_entropy_fusion_impl: str = flag(
        "native", "with --cross-entropy-loss-fusion: megatron-core's or TE's kernel",
        choices=("native", "te"))


def add_arguments(parser) -> None:
    add_flags(parser, FusionFields, "fusions (GPU; on by default as in Megatron-LM, off on CPU)")


def validate(args, ctx: Context) -> None:
    if args.cross_entropy_loss_fusion:
        require(args.tiled_loss_shards is None,
                "--tiled-loss-shards computes its own (unfused) cross entropy per tile: drop "
                "--cross-entropy-loss-fusion or --tiled-loss-shards")
        if args.cross_entropy_fusion_impl == "te":
            require(ctx.cuda and te_available(),
                    "--cross-entropy-fusion-impl te needs CUDA and Transformer Engine; use "
                    "native")


def gradient_accumulation_fusion(config, cuda: bool) -> bool:
    """Whether weight gradients accumulate fused into main_grad: TE's layers do it themselves,
    megatron-core's need apex's kernel; without it off, as Megatron-LM turns it off."""
    return cuda and not config.no_gradient_accumulation_fusion and \
        importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
