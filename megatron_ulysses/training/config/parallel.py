"""The parallelism section: Ulysses SP, TP and PP sizes -> the run's `ParallelDims` (the
`RunConfig.dims`), the pipeline layout (`PipelineFields`, which the model section takes in), and
Megatron-LM's context-parallel flags, accepted at CP 1 only: Ulysses SP splits the sequence
here. The flags that tune one parallelism's work live with what they tune: --sequence-parallel in
`model`, the distributed optimizer in `optimizer`, the process group's backend in `training`."""

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from ...errors import ConfigError, flag_name
from ...sp.parallel_state import TP_PP_DP_ORDER, ParallelDims
from .checks import Context, check_range, ignore_without, require
from .fields import add_flags, flag, off_without

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
# Pipeline (PP > 1) flags whose values megatron-core's TransformerConfig and schedules take.
# (--account-for-*-in-pipeline-split change nothing at PP 1, as in Megatron-LM.)
_PIPELINE_ONLY = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                  "num_layers_per_virtual_pipeline_stage",
                  "num_virtual_stages_per_pipeline_rank",
                  "overlap_p2p_communication_warmup_flush")
_VIRTUAL = ("a virtual pipeline, --num-layers-per-virtual-pipeline-stage or "
            "--num-virtual-stages-per-pipeline-rank")


@dataclass(frozen=True)
class PipelineFields:
    """`ModelConfig`'s pipeline layout (megatron-core's TransformerConfig fields; PP > 1), after
    the parallel sizes' flags (`ClassVar`s: `parallel_dims` reads them)."""

    ulysses_sp_size: ClassVar[int] = flag(
        1, "Ulysses SP size: one sequence is split over this many ranks (docs/training.md)",
        kept=False)
    tensor_model_parallel_size: ClassVar[int] = flag(1, kept=False)
    pipeline_model_parallel_size: ClassVar[int] = flag(1, kept=False)
    context_parallel_size: ClassVar[int] = flag(
        1, "only 1 here (--ulysses-sp-size splits the sequence)", kept=False)
    cp_comm_type: ClassVar[Tuple[str, ...]] = flag(
        ["p2p"], "context parallelism's exchange; no effect at --context-parallel-size 1",
        nargs="+", choices=CP_COMM_TYPES, kept=False)
    hierarchical_context_parallel_sizes: ClassVar[Optional[Tuple[int, ...]]] = flag(
        None, "their product must be --context-parallel-size (1 here)", nargs="+", type=int,
        kept=False)
    expert_model_parallel_size: ClassVar[int] = flag(
        1, "MoE's expert parallelism: only 1 here (no experts)", kept=False)
    expert_tensor_parallel_size: ClassVar[Optional[int]] = flag(
        None, "MoE's expert TP: ignored without experts, as in Megatron-LM", kept=False)
    use_gloo_process_groups: bool = flag(
        True, "create no extra gloo groups in megatron-core's parallel state",
        names=("--disable-gloo-process-groups",))
    use_tp_pp_dp_mapping: bool = flag(
        False, "rank order tp-pp-dp (Megatron-LM's) instead of tp-dp-pp")
    # Megatron-LM's pipeline layout flags: they need --pipeline-model-parallel-size > 1
    decoder_first_pipeline_num_layers: Optional[int] = flag(None)
    decoder_last_pipeline_num_layers: Optional[int] = flag(None)
    num_layers_per_virtual_pipeline_stage: ClassVar[Optional[int]] = flag(None, kept=False)
    num_virtual_stages_per_pipeline_rank: ClassVar[Optional[int]] = flag(None, kept=False)
    microbatch_group_size_per_virtual_pipeline_stage: Optional[int] = flag(None, needs=_VIRTUAL)
    account_for_embedding_in_pipeline_split: bool = flag(False)
    account_for_loss_in_pipeline_split: bool = flag(False)
    overlap_p2p_communication_warmup_flush: bool = flag(False)
    overlap_p2p_comm: bool = flag(  # only the interleaved schedule overlaps, as in Megatron-LM
        True, "the interleaved schedule's sends and receives do not overlap compute",
        names=("--no-overlap-p2p-communication",))
    # the virtual pipeline: model chunks per rank (None: one), derived from either flag
    virtual_pipeline_model_parallel_size: Optional[int]


def add_arguments(parser) -> None:
    add_flags(parser, PipelineFields, "parallelism")
    parser.set_defaults(virtual_pipeline_model_parallel_size=None)  # `validate` derives it


def parallel_dims(args, world_size: int) -> ParallelDims:
    """The sizes must be >= 1 and their product divide `world_size`, the number of processes."""
    try:
        order = {"order": TP_PP_DP_ORDER} if args.use_tp_pp_dp_mapping else {}
        return ParallelDims(world_size=world_size, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, sp=args.ulysses_sp_size,
                            **order)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def context_parallel_refusal(args) -> Optional[str]:
    """Why Megatron-LM's context-parallel flags cannot run as given (None: they are CP 1's)."""
    cp = getattr(args, "context_parallel_size", 1)
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    if not isinstance(cp, int) or (sizes is not None and not all(
            isinstance(size, int) for size in sizes)):
        return None  # a bad value: reported by the parser
    with_it = ""
    if sizes is not None:
        with_it = (f" (--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} "
                   "splits that context parallelism)")
    if cp > 1:
        a2a = ("; --cp-comm-type a2a is the same all-to-all idea" if any(
            "a2a" in kind for kind in args.cp_comm_type) else "")
        return (f"--context-parallel-size {cp}{with_it}: megatron-core's context parallelism "
                f"is not used here; Ulysses sequence parallelism splits the sequence: use "
                f"--ulysses-sp-size {cp}{a2a}")
    if cp < 1:
        return f"--context-parallel-size must be 1, got {cp}; use --ulysses-sp-size"
    if sizes is not None and math.prod(sizes) != 1:
        return (f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must "
                "multiply to --context-parallel-size (1); for context parallelism use "
                "--ulysses-sp-size")
    if "a2a+p2p" in args.cp_comm_type and sizes is None:
        return ("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (as in "
                "Megatron-LM); at --context-parallel-size 1 drop --cp-comm-type")
    return None


def expert_parallel_refusal(args) -> Optional[str]:
    """Why --expert-model-parallel-size cannot run as given (None: it is 1)."""
    ep = getattr(args, "expert_model_parallel_size", 1)
    if not isinstance(ep, int) or ep == 1:
        return None  # a bad value: reported by the parser
    return (f"--expert-model-parallel-size {ep}: expert parallelism splits MoE experts, which "
            "are not supported here (Megatron-LM too needs --num-experts for it); use 1")


def validate(args, ctx: Context) -> None:
    require(context_parallel_refusal(args) is None, str(context_parallel_refusal(args)))
    require(expert_parallel_refusal(args) is None, str(expert_parallel_refusal(args)))
    if args.expert_tensor_parallel_size is not None:
        ctx.warnings.append(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size} "
                            "is ignored: there are no MoE experts (as in Megatron-LM without "
                            "--num-experts)")
    if ctx.dims.pp == 1:
        given = [flag_name(name) for name in _PIPELINE_ONLY if getattr(args, name)]
        require(not given, f"{', '.join(given)} need --pipeline-model-parallel-size > 1 (as in "
                "Megatron-LM); drop them at pipeline size 1")
        args.overlap_p2p_comm = False
    else:
        _check_pipeline_layout(args, ctx.dims.pp)
    if args.virtual_pipeline_model_parallel_size is None:  # read by the interleaved schedule
        ignore_without(args, ctx, _VIRTUAL, off_without(PipelineFields, _VIRTUAL))


def _check_pipeline_layout(args, pp: int) -> None:
    """Megatron-LM's rules for uneven stages and the virtual pipeline."""
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                 "microbatch_group_size_per_virtual_pipeline_stage"):
        check_range(args, name, low=1, optional=True)
    per_stage, vpp = args.num_layers_per_virtual_pipeline_stage, \
        args.num_virtual_stages_per_pipeline_rank
    require(per_stage is None or vpp is None, "--num-layers-per-virtual-pipeline-stage and "
            "--num-virtual-stages-per-pipeline-rank are exclusive; give one")
    uneven = {name: getattr(args, name) for name in ("decoder_first_pipeline_num_layers",
                                                     "decoder_last_pipeline_num_layers")
              if getattr(args, name) is not None}
    accounted = args.account_for_embedding_in_pipeline_split + \
        args.account_for_loss_in_pipeline_split
    require(not (uneven and accounted), "--decoder-first/last-pipeline-num-layers and "
            "--account-for-embedding/loss-in-pipeline-split are exclusive (megatron-core's rule)")
    require(per_stage is None or not uneven, "uneven pipeline stages (--decoder-first/last-"
            "pipeline-num-layers) with a virtual pipeline need --num-virtual-stages-per-"
            "pipeline-rank, not --num-layers-per-virtual-pipeline-stage")
    stages = _stage_layers(args, pp, uneven, args.num_layers + accounted)
    if per_stage is not None:
        require(stages[0] % per_stage == 0, f"the layers per pipeline stage ({stages[0]}) must "
                f"be divisible by --num-layers-per-virtual-pipeline-stage ({per_stage})")
        vpp = stages[0] // per_stage
    require(vpp is None or all(layers % vpp == 0 for layers in stages),
            f"--num-virtual-stages-per-pipeline-rank {vpp} must divide the layers of every "
            f"pipeline stage ({', '.join(map(str, stages))}, the embedding / loss counted as "
            "layers), as megatron-core splits them")
    # One chunk per rank is the plain pipeline (Megatron-LM's --num-layers-per-virtual-pipeline-
    # stage equal to the layers per stage builds no chunks either).
    args.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None
    _check_interleaving(args, pp)


def _check_interleaving(args, pp: int) -> None:
    """Megatron-LM's rules for the interleaved schedule's flags; only it overlaps its p2p."""
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    require(interleaved or not args.overlap_p2p_communication_warmup_flush,
            "--overlap-p2p-communication-warmup-flush needs a virtual pipeline (megatron-core's "
            "rule: it overlaps the interleaved schedule's p2p communication)")
    require(not interleaved or args.overlap_p2p_comm or pp > 2,
            f"--no-overlap-p2p-communication with a virtual pipeline needs --pipeline-model-"
            f"parallel-size > 2 (got {pp}): at 2 one batch would send and receive twice between "
            "the same two ranks (Megatron-LM's rule); drop the flag")
    require(args.overlap_p2p_comm or not args.overlap_p2p_communication_warmup_flush,
            "--overlap-p2p-communication-warmup-flush needs the overlapped p2p communication; "
            "drop --no-overlap-p2p-communication")
    args.overlap_p2p_comm = interleaved and args.overlap_p2p_comm


def _stage_layers(args, pp: int, uneven: dict, layers: int) -> list:
    """The layers of each pipeline stage (the embedding / loss counted as `layers` has them)."""
    if uneven:
        rest, middle = layers - sum(uneven.values()), pp - len(uneven)
        given = " and ".join(f"{flag_name(name)} {value}" for name, value in uneven.items())
        require(rest == 0 if middle == 0 else rest >= middle and rest % middle == 0,
                f"--num-layers {args.num_layers} minus {given} leaves {rest} layers for the "
                f"other {middle} pipeline stages: they must split evenly, at least one each")
        return list(uneven.values()) + [rest // middle] * middle if middle else \
            list(uneven.values())
    require(layers % pp == 0, f"--num-layers ({args.num_layers}, plus the embedding / loss "
            f"counted as layers) must be divisible by --pipeline-model-parallel-size ({pp})")
    return [layers // pp] * pp

