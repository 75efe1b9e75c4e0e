"""Megatron-LM's pipeline-schedule flags: the interleaved (virtual) pipeline and uneven stages.
megatron_ulysses builds one model chunk per stage with the layers split evenly, so these are
known, checked as Megatron-LM checks them, then refused in one message naming those given."""

from .checks import Context, check_range, require
from .performance import given_flags, raise_not_wired

_FLAGS = (
    ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage", None),
    ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank", None),
    ("--microbatch-group-size-per-virtual-pipeline-stage", "microbatch_group_size_per_vp_stage",
     None),
    ("--overlap-p2p-communication-warmup-flush", "overlap_p2p_comm_warmup_flush", False),
    ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers", None),
    ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers", None),
    ("--account-for-embedding-in-pipeline-split", "account_for_embedding_in_pipeline_split",
     False),
    ("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split", False),
)


def add_arguments(parser) -> None:
    g = parser.add_argument_group("pipeline schedule (Megatron-LM's; not wired yet: refused)")
    for flag, dest, off in _FLAGS:
        if off is None:
            g.add_argument(flag, dest=dest, type=int, default=None)
        else:
            g.add_argument(flag, dest=dest, action="store_true")


def check_values(args) -> None:
    for _, dest, off in _FLAGS:
        if off is None:
            check_range(args, dest, low=1, optional=True)


def validate(args, ctx: Context) -> None:
    given = given_flags(args, _FLAGS)
    if not given:
        return
    require(ctx.dims.pp > 1, f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} "
            "--pipeline-model-parallel-size > 1")
    require(args.num_layers_per_virtual_pipeline_stage is None
            or args.num_virtual_stages_per_pipeline_rank is None,
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
            "are exclusive; give one")
    raise_not_wired(", ".join(given), "megatron_ulysses builds one model chunk per pipeline "
                    "stage with --num-layers split evenly (no interleaved schedule, no uneven "
                    "stages); drop them")
