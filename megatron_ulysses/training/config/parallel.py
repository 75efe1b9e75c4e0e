"""The parallelism section: Ulysses SP, TP and PP sizes -> the run's `ParallelDims` (the
`RunConfig.dims`), the pipeline layout (`PipelineFields`, which the model section takes in), and
Megatron-LM's context-parallel flags, accepted at CP 1 only: Ulysses SP splits the sequence
here. The flags that tune one parallelism's work live with what they tune: --sequence-parallel in
`model`, the distributed optimizer in `optimizer`, the process group's backend in `training`."""

import math
from dataclasses import dataclass
from typing import Optional

from ...errors import ConfigError, flag_name
from ...sp.parallel_state import TP_PP_DP_ORDER, ParallelDims
from .checks import Context, check_range, ignore_without, require

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
# Pipeline (PP > 1) flags whose values megatron-core's TransformerConfig and schedules take.
# (--account-for-*-in-pipeline-split change nothing at PP 1, as in Megatron-LM.)
_PIPELINE_ONLY = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                  "num_layers_per_virtual_pipeline_stage",
                  "num_virtual_stages_per_pipeline_rank",
                  "overlap_p2p_communication_warmup_flush")


@dataclass(frozen=True)
class PipelineFields:
    """`ModelConfig`'s pipeline layout (megatron-core's TransformerConfig fields; PP > 1)."""

    decoder_first_pipeline_num_layers: Optional[int]
    decoder_last_pipeline_num_layers: Optional[int]
    account_for_embedding_in_pipeline_split: bool
    account_for_loss_in_pipeline_split: bool
    use_gloo_process_groups: bool
    use_tp_pp_dp_mapping: bool
    # the virtual pipeline: model chunks per rank (None: one), derived from either flag
    virtual_pipeline_model_parallel_size: Optional[int]
    microbatch_group_size_per_virtual_pipeline_stage: Optional[int]
    overlap_p2p_communication_warmup_flush: bool
    overlap_p2p_comm: bool  # only the interleaved schedule overlaps, as in Megatron-LM


def add_arguments(parser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--ulysses-sp-size", type=int, default=1,
                   help="Ulysses SP size P: one sequence is split over P ranks (taken out of "
                   "data parallelism); SP rank r gets ceil or floor of (heads / TP) / P "
                   "heads, so P may be up to --num-attention-heads / TP.")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Megatron-LM's context parallelism: only 1 here; Ulysses SP "
                   "(--ulysses-sp-size) splits the sequence instead")
    g.add_argument("--cp-comm-type", nargs="+", choices=CP_COMM_TYPES, default=["p2p"],
                   help="context parallelism's exchange; no effect at --context-parallel-size 1")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                   help="their product must be --context-parallel-size (1 here)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="MoE's expert parallelism: only 1 here (no experts)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="MoE's expert TP: ignored without experts, as in Megatron-LM")
    g.add_argument("--disable-gloo-process-groups", action="store_false",
                   dest="use_gloo_process_groups",
                   help="create no extra gloo groups in megatron-core's parallel state")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="rank order tp-pp-dp (Megatron-LM's) instead of tp-dp-pp; Ulysses SP "
                   "groups stay blocks of consecutive data-parallel ranks")
    _add_pipeline_arguments(g)
    parser.set_defaults(virtual_pipeline_model_parallel_size=None)  # `validate` derives it


def _add_pipeline_arguments(g) -> None:
    """Megatron-LM's pipeline layout flags: they need --pipeline-model-parallel-size > 1."""
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--num-layers-per-virtual-pipeline-stage",
                 "--num-virtual-stages-per-pipeline-rank"):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None)
    for flag in ("--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split"):
        g.add_argument(flag, action="store_true")
    g.add_argument("--overlap-p2p-communication-warmup-flush", action="store_true")
    g.add_argument("--no-overlap-p2p-communication", action="store_false",
                   dest="overlap_p2p_comm", help="the interleaved schedule's sends and receives "
                   "are batched instead of overlapped with compute (needs PP > 2)")


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
        ignore_without(args, ctx, "a virtual pipeline, --num-layers-per-virtual-pipeline-stage "
                       "or --num-virtual-stages-per-pipeline-rank", ((
                           "--microbatch-group-size-per-virtual-pipeline-stage",
                           "microbatch_group_size_per_virtual_pipeline_stage", None),))


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

