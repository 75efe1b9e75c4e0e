"""megatron-core DDP's gradient buckets (Megatron-LM's --ddp-* flags): their size or number,
NCCL-friendly padding, the reduction's fp32 accumulation and its fused division. The
`PerformanceConfig` takes these fields in; `ddp_kwargs` gives them to
DistributedDataParallelConfig (CPU and GPU: the buckets are the same over gloo)."""

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

from .checks import Context, check_range, require


@dataclass(frozen=True)
class GradBucketFields:
    """DistributedDataParallelConfig's bucket fields (defaults: megatron-core's)."""

    ddp_bucket_size: Optional[int] = None
    ddp_num_buckets: Optional[int] = None
    ddp_pad_buckets_for_high_nccl_busbw: bool = False
    ddp_reduce_scatter_with_fp32_accumulation: bool = False
    ddp_param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = ()
    gradient_reduce_div_fusion: bool = True


# our field -> DistributedDataParallelConfig's (None: the same name)
_DDP_FIELDS = {"ddp_bucket_size": "bucket_size", "ddp_num_buckets": "num_buckets",
               "ddp_pad_buckets_for_high_nccl_busbw": "pad_buckets_for_high_nccl_busbw",
               "ddp_reduce_scatter_with_fp32_accumulation": "reduce_scatter_with_fp32_accumulation",
               "ddp_param_name_patterns_for_fp32_local_accumulation":
                   "param_name_patterns_for_fp32_local_accumulation",
               "gradient_reduce_div_fusion": "gradient_reduce_div_fusion"}


def add_arguments(parser) -> None:
    g = parser.add_argument_group("gradient buckets (megatron-core DDP, Megatron-LM's flags)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per gradient bucket (default: megatron-core's, "
                   "max(40M, 1M x DP x SP) with --overlap-grad-reduce, else one bucket)")
    g.add_argument("--ddp-num-buckets", type=int, default=None,
                   help="split the gradients into this many buckets (megatron-core >= 0.19)")
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true",
                   help="pad each bucket to a multiple of 2^16 elements")
    g.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true",
                   help="reduce-scatter low-precision gradients, accumulating in fp32 (with "
                   "--grad-reduce-in-bf16; off with fp32 reduction, as in Megatron-LM)")
    g.add_argument("--ddp-param-name-patterns-for-fp32-local-accumulation", nargs="+",
                   default=[], help="fnmatch patterns of parameters whose gradients accumulate "
                   "locally in fp32 (megatron-core >= 0.19)")
    g.add_argument("--no-gradient-reduce-div-fusion", dest="gradient_reduce_div_fusion",
                   action="store_false",
                   help="divide the gradients after their reduction, not fused into it")


def check_values(args) -> None:
    check_range(args, "ddp_bucket_size", low=0, low_open=True, optional=True)
    check_range(args, "ddp_num_buckets", low=0, low_open=True, optional=True)


def validate(args, ctx: Context) -> None:
    """Megatron-LM's rules, and what this megatron-core's DDP config has."""
    args.ddp_param_name_patterns_for_fp32_local_accumulation = tuple(
        args.ddp_param_name_patterns_for_fp32_local_accumulation)
    require(args.ddp_bucket_size is None or args.ddp_num_buckets is None,
            "give --ddp-bucket-size or --ddp-num-buckets, not both")
    if args.ddp_reduce_scatter_with_fp32_accumulation and not args.grad_reduce_in_bf16:
        ctx.warnings.append("--ddp-reduce-scatter-with-fp32-accumulation is off: the gradients "
                            "already reduce in fp32 (as Megatron-LM turns it off with fp32 "
                            "reduction)")
        args.ddp_reduce_scatter_with_fp32_accumulation = False
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.package_info import __version__

    known = {field.name for field in dataclasses.fields(DistributedDataParallelConfig)}
    for name, ddp_name in _DDP_FIELDS.items():
        default = GradBucketFields.__dataclass_fields__[name].default
        require(ddp_name in known or getattr(args, name) in (default, None),
                f"--{name.replace('_', '-')} needs megatron-core >= 0.19 (its DDP config has "
                f"no {ddp_name}; installed: {__version__})")


def ddp_kwargs(fields: GradBucketFields) -> dict:
    """DistributedDataParallelConfig's bucket arguments (those given: the others keep
    megatron-core's defaults, also where this version lacks the field)."""
    return {ddp_name: getattr(fields, name) for name, ddp_name in _DDP_FIELDS.items()
            if getattr(fields, name) != GradBucketFields.__dataclass_fields__[name].default}
