"""The activation-memory part of the model section: the ALST memory features (tiled MLP, tiled
logits + loss, activation offload; off by default, exact) and megatron-core's recompute."""

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple, Union

from ...sp.backends import te_available
from .checks import Context, check_range, ignore_without, require, tiles
from .fields import add_flags, flag, off_without

# megatron-core's selective-recompute submodules of a dense GPT layer.
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")


@dataclass(frozen=True)
class MemoryFields:
    """`ModelConfig`'s activation-memory fields."""

    tiled_mlp_shards: Union[int, str, None] = flag(  # a count, "auto", or None (off)
        None, "Run the MLP over N sequence tiles (or 'auto' = ceil(s/h)).", type=tiles)
    tiled_loss_shards: Union[int, str, None] = flag(
        None, "Compute logits + loss over N sequence tiles (or 'auto': 1 GiB tiles).",
        type=tiles)
    offload_activations: bool = flag(
        False, "Keep full-recompute checkpoints in CPU memory (needs --recompute-granularity "
        "full).")
    recompute_granularity: Optional[str] = flag(None, choices=("full", "selective"))
    recompute_activations: ClassVar[bool] = flag(
        False, "= --recompute-granularity selective (Megatron-LM's older flag)", kept=False)
    recompute_method: Optional[str] = flag(None, choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = flag(None)
    recompute_modules: Optional[Tuple[str, ...]] = flag(
        None, "with --recompute-granularity selective: the submodules to recompute "
        "(megatron-core's; default core_attn)", nargs="*", choices=RECOMPUTE_MODULES,
        needs="--recompute-granularity selective")


def add_arguments(parser) -> None:
    add_flags(parser, MemoryFields,
              "activation memory: ALST memory features (off by default, exact) and recompute")


def check_values(args) -> None:
    check_range(args, "recompute_num_layers", low=0, low_open=True, optional=True)


def validate(args, ctx: Context) -> None:
    """Runs after `model.validate` (it settles --sequence-parallel)."""
    if args.recompute_activations:
        require(args.recompute_granularity in (None, "selective"),
                f"--recompute-activations is --recompute-granularity selective, not "
                f"{args.recompute_granularity}; give one of the two")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        _check_full_recompute(args, ctx.dims.pp)
    elif args.recompute_granularity == "selective":
        require(args.recompute_method is None and args.recompute_num_layers is None,
                "--recompute-method/--recompute-num-layers need --recompute-granularity full, "
                "not selective (Megatron-LM's and megatron-core's rule)")
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        ctx.warnings.append("--recompute-method/--recompute-num-layers are ignored without "
                            "--recompute-granularity full (as in Megatron-LM)")
        args.recompute_method = args.recompute_num_layers = None
    if args.recompute_granularity != "selective":  # megatron-core reads it only there
        ignore_without(args, ctx, "--recompute-granularity selective",
                       off_without(MemoryFields, "--recompute-granularity selective"))
    if args.recompute_modules is not None:
        require(len(args.recompute_modules) > 0, "--recompute-modules needs at least one of "
                + ", ".join(RECOMPUTE_MODULES))
        require(not ("mlp" in args.recompute_modules and args.tiled_mlp_shards is not None),
                "--tiled-mlp-shards already recomputes the MLP tile by tile in backward: drop "
                "mlp from --recompute-modules")
        require(not ("layernorm" in args.recompute_modules and not te_available()),
                "--recompute-modules layernorm needs Transformer Engine (megatron-core's norm "
                "recompute runs through it); drop layernorm")
        args.recompute_modules = tuple(dict.fromkeys(args.recompute_modules))
    if args.offload_activations:
        require(args.recompute_granularity == "full",
                "--offload-activations needs --recompute-granularity full (it offloads the "
                "recompute checkpoints)")
    if args.sequence_parallel:
        require(args.tiled_mlp_shards is None and args.tiled_loss_shards is None,
                "--tiled-mlp-shards/--tiled-loss-shards do not support --sequence-parallel "
                "with --tensor-model-parallel-size > 1")


def _check_full_recompute(args, pp: int) -> None:
    require(args.recompute_method is not None,
            "--recompute-granularity full needs --recompute-method uniform|block")
    if args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    layers_per_stage = args.num_layers // pp
    require(args.recompute_num_layers <= layers_per_stage,
            f"--recompute-num-layers ({args.recompute_num_layers}) must be in [1, layers "
            f"per pipeline stage = --num-layers {args.num_layers} / "
            f"--pipeline-model-parallel-size {pp} = {layers_per_stage}]")
    # megatron-core 0.16's uniform chunks run past the last layer otherwise.
    require(args.recompute_method == "block"
            or layers_per_stage % args.recompute_num_layers == 0,
            f"--recompute-method uniform needs --recompute-num-layers "
            f"({args.recompute_num_layers}) to divide the layers per pipeline stage "
            f"({layers_per_stage})")
