"""megatron-core DDP's gradient buckets (Megatron-LM's --ddp-* flags): their size or number,
NCCL-friendly padding, the reduction's fp32 accumulation and its fused division. The
`PerformanceConfig` takes these fields in; `ddp_kwargs` gives them to
DistributedDataParallelConfig (CPU and GPU: the buckets are the same over gloo)."""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from .checks import Context, check_range, require
from .fields import add_flags, flag

_flag = functools.partial(flag, field_default=True, cpu=True)


@dataclass(frozen=True)
class GradBucketFields:
    """DistributedDataParallelConfig's bucket fields (defaults: megatron-core's)."""

    ddp_bucket_size: Optional[int] = _flag(
        None, "parameters per gradient bucket (default: megatron-core's)")
    ddp_num_buckets: Optional[int] = _flag(
        None, "split the gradients into this many buckets (megatron-core >= 0.19)")
    ddp_pad_buckets_for_high_nccl_busbw: bool = _flag(
        False, "pad each bucket to a multiple of 2^16 elements")
    ddp_reduce_scatter_with_fp32_accumulation: bool = _flag(
        False, "reduce-scatter low-precision gradients, accumulating in fp32")
    ddp_param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = _flag(
        [], "parameters (fnmatch) whose gradients accumulate locally in fp32", nargs="+")
    gradient_reduce_div_fusion: bool = _flag(
        True, "divide the gradients after their reduction, not fused into it",
        names=("--no-gradient-reduce-div-fusion",))


# our field -> DistributedDataParallelConfig's (None: the same name)
_DDP_FIELDS = {"ddp_bucket_size": "bucket_size", "ddp_num_buckets": "num_buckets",
               "ddp_pad_buckets_for_high_nccl_busbw": "pad_buckets_for_high_nccl_busbw",
               "ddp_reduce_scatter_with_fp32_accumulation": "reduce_scatter_with_fp32_accumulation",
               "ddp_param_name_patterns_for_fp32_local_accumulation":
                   "param_name_patterns_for_fp32_local_accumulation",
               "gradient_reduce_div_fusion": "gradient_reduce_div_fusion"}


def add_arguments(parser) -> None:
    add_flags(parser, GradBucketFields, "gradient buckets (megatron-core DDP, Megatron-LM's flags)")


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
