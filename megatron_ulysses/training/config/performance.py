"""The performance section: Megatron-LM's GPU speed features, each through megatron-core's own
piece and with Megatron-LM's meaning and rules.

    FP8 GEMMs (Transformer Engine)        -> TransformerConfig.fp8*      (`transformer_kwargs`)
    overlapped param all-gather, bf16 grad
    reduce, distributed-optimizer instances -> DistributedDataParallelConfig (`ddp_kwargs`)
    precision-aware optimizer, CPU offload  -> megatron-core's OptimizerConfig (`optimizer_kwargs`)
    deferred embedding wgrad (PP > 1)       -> TransformerConfig

FP8 runs inside each rank's layers (the Ulysses all-to-alls move bf16 / fp16). Sharded data
parallelism (`training/fsdp.py`): --use-torch-fsdp2 (CPU and GPU) and --use-megatron-fsdp (GPU),
both over DP x SP. Features not wired here (Megatron-FSDP's buffer options, TP comm overlap,
CUDA graphs) are validated as Megatron-LM validates them, then refused in one message. Options
of a feature that is off are ignored with one warning; every flag but --use-torch-fsdp2's needs
CUDA.
"""

import dataclasses
import functools
import os
from typing import ClassVar, Optional

import torch

from ...sp.backends import te_available
from ...errors import ConfigError
from .checks import Context, check_range, ignore_without, require
from . import fields
from .fields import add_flags, flag
from .fusions import gradient_accumulation_fusion
from .grad_buckets import GradBucketFields
from .megatron_lm.refused import not_wired, refuse_values

_SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")
# The precision-aware optimizer's dtypes (TE's FusedAdam): other than fp32 only with it.
# Megatron-LM's map of their names (fp8 states are stored as uint8).
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp8": torch.uint8}
_OPTIMIZER_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
                     "exp_avg_sq_dtype")
# Megatron-FSDP's options as a whole: validated, then refused (not wired into the model build);
# meta-device initialization and NCCL user buffers are features of their own in Megatron-LM.
_FSDP_OPTIONS = ("init_model_with_meta_device", "nccl_ub", "fsdp_manual_registration",
                 "fsdp_double_buffer", "megatron_fsdp_main_params_dtype",
                 "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype",
                 "outer_dp_sharding_strategy")
_flag = functools.partial(flag, field_default=True)
_fp8 = functools.partial(_flag, needs="--fp8-format")
_offload = functools.partial(_flag, needs="--optimizer-cpu-offload")
_fsdp = functools.partial(_flag, needs="--use-megatron-fsdp")
_dtype = functools.partial(_flag, "fp32", "with --use-precision-aware-optimizer: this state's "
                           "dtype")


@dataclasses.dataclass(frozen=True)
class PerformanceConfig(GradBucketFields):
    """What megatron-core's configs receive from this section (defaults: none of it); the
    `ClassVar` flags are Megatron-LM's, validated here, then refused."""

    fp8: Optional[str] = _flag(  # Transformer Engine's FP8 GEMMs and attention
        None, "FP8 GEMMs in TE's layers; hybrid: e4m3 forward, e5m2 backward",
        names=("--fp8-format",), choices=("e4m3", "hybrid"))
    fp8_recipe: str = _fp8(
        "delayed", "FP8 scaling (blockwise: Hopper+, mxfp8: Blackwell)",
        choices=("delayed", "tensorwise", "blockwise", "mxfp8", "custom"))
    fp8_margin: int = _fp8(0, "FP8 scaling-factor margin")
    fp8_amax_history_len: int = _fp8(1, "delayed scaling: the amax history length")
    fp8_amax_compute_algo: str = _fp8("most_recent", "delayed scaling: amax from the history",
                                      choices=("most_recent", "max"))
    fp8_param_gather: bool = _fp8(False, "FP8 compute weights, all-gathered in FP8")
    fp8_dot_product_attention: bool = _fp8(
        False, "FP8 core attention between the all-to-alls (refused for now)")
    fp8_wgrad: bool = _fp8(True, "weight gradients in bf16 / fp16, not FP8",
                           names=("--no-fp8-wgrad", "--disable-fp8-wgrad"))
    first_last_layers_bf16: bool = _fp8(
        False, "keep the first and last layers out of FP8 (not with --fp8-recipe delayed)")
    num_layers_at_start_in_bf16: int = _fp8(
        1, "with --first-last-layers-bf16: the first layers kept in bf16")
    num_layers_at_end_in_bf16: int = _fp8(
        1, "with --first-last-layers-bf16: the last layers kept in bf16")
    overlap_param_gather: bool = _flag(
        False, "the distributed optimizer's param all-gather overlaps the next forward")
    # the interleaved schedule launches each chunk's all-gather (Megatron-LM's rule: only
    # there, so the config's default is off)
    align_param_gather: bool = dataclasses.field(default=False, metadata=flag(
        True, "with a virtual pipeline: each stage starts its all-gathers as it needs them",
        names=("--no-align-param-gather",), cpu=True).metadata)
    overlap_param_gather_with_optimizer_step: ClassVar[bool] = _flag(
        False, "refused (as Megatron-LM, with torch_dist checkpoints)", kept=False)
    grad_reduce_in_bf16: bool = _flag(
        False, "with --bf16: accumulate and reduce gradients in bf16 (default fp32)",
        needs="--bf16")
    ddp_average_in_collective: ClassVar[bool] = _flag(
        False, "accepted: changes nothing with the per-token loss", kept=False, cpu=True)
    # the distributed optimizer's instances, the precision-aware optimizer, megatron-core's
    # CPU offload (HybridDeviceOptimizer)
    num_distributed_optimizer_instances: int = _flag(
        1, "shard the distributed optimizer over DP x SP / N ranks, N replicas")
    use_precision_aware_optimizer: bool = _flag(
        False, "TE's FusedAdam with low-precision states (distributed optimizer)")
    optimizer_cpu_offload: bool = _flag(
        False, "optimizer states and step on the CPU (HybridDeviceOptimizer)")
    optimizer_offload_fraction: float = _offload(
        1.0, "with --optimizer-cpu-offload: the fraction of states on the CPU")
    overlap_cpu_optimizer_d2h_h2d: bool = _offload(
        False, "with --optimizer-cpu-offload: overlap its step with the copies")
    use_torch_optimizer_for_cpu_offload: bool = _offload(
        False, "with --optimizer-cpu-offload: torch's AdamW on the GPU share too")
    pin_cpu_grads: bool = _offload(
        True, "with --optimizer-cpu-offload: pageable host gradient copies",
        names=("--no-pin-cpu-grads",))
    pin_cpu_params: bool = _offload(
        True, "with --optimizer-cpu-offload: pageable host parameter copies",
        names=("--no-pin-cpu-params",))
    main_grads_dtype: str = _dtype(choices=("fp32", "bf16"))  # Megatron-LM's choices
    main_params_dtype: str = _dtype(choices=("fp32", "fp16"))
    exp_avg_dtype: str = _dtype(choices=tuple(_DTYPES))
    exp_avg_sq_dtype: str = _dtype(choices=tuple(_DTYPES))
    disable_bf16_reduced_precision_matmul: bool = _flag(
        False, "with --bf16: cuBLAS accumulates bf16 GEMMs in full precision")
    tp_comm_overlap: ClassVar[bool] = _flag(
        False, "TE userbuffers TP overlap: validated, not wired yet (refused)", kept=False)
    tp_comm_overlap_cfg: ClassVar[Optional[str]] = _flag(
        None, "with --tp-comm-overlap: the userbuffers YAML", needs="--tp-comm-overlap",
        kept=False)
    cuda_graph_impl: ClassVar[str] = _flag(
        "none", "CUDA graphs: only none (the others are not wired)", kept=False,
        choices=("none", "local", "transformer_engine", "full_iteration"))
    defer_embedding_wgrad_compute: bool = _flag(
        False, "PP > 1: the output layer's wgrad GEMMs run in the pipeline flush")
    wgrad_deferral_limit: int = _flag(
        0, "micro batches whose output-layer wgrad is deferred (0: all)",
        needs="--defer-embedding-wgrad-compute")
    # Megatron FSDP and torch FSDP2; Megatron-FSDP's other options validated, then refused
    use_megatron_fsdp: bool = _flag(
        False, "Megatron-FSDP over DP x SP (GPU; no checkpoints)")
    use_torch_fsdp2: bool = _flag(
        False, "torch FSDP2 over DP x SP (ZeRO-3; CPU and GPU)", cpu=True)
    torch_fsdp2_reshard_after_forward: bool = _flag(
        True, "with --use-torch-fsdp2: keep the gathered parameters (ZeRO-2)",
        names=("--torch-fsdp2-no-reshard-after-forward",),
        needs="--use-torch-fsdp2", cpu=True)
    data_parallel_sharding_strategy: str = _fsdp(
        "optim_grads_params", "with --use-megatron-fsdp: what is sharded over DP x SP",
        choices=_SHARDING)
    init_model_with_meta_device: ClassVar[bool] = _flag(False, "with --use-megatron-fsdp",
                                                        kept=False)
    nccl_ub: ClassVar[bool] = _flag(False, "with --use-megatron-fsdp", names=("--use-nccl-ub",),
                                    kept=False)
    fsdp_double_buffer: ClassVar[bool] = _fsdp(False, "with --use-megatron-fsdp", kept=False)
    fsdp_manual_registration: ClassVar[bool] = _flag(
        False, "with --use-megatron-fsdp and --use-nccl-ub", kept=False)
    megatron_fsdp_main_params_dtype: ClassVar[str] = _fsdp("fp32", choices=_FSDP_DTYPES,
                                                           kept=False)
    megatron_fsdp_main_grads_dtype: ClassVar[str] = _fsdp("auto", choices=_FSDP_DTYPES,
                                                          kept=False)
    megatron_fsdp_grad_comm_dtype: ClassVar[str] = _fsdp("auto", choices=_FSDP_DTYPES,
                                                         kept=False)
    outer_dp_sharding_strategy: ClassVar[str] = _fsdp(
        "no_shard", "with --use-megatron-fsdp", choices=("no_shard", "optim"), kept=False)


def transformer_kwargs(perf: PerformanceConfig) -> dict:
    """TransformerConfig's fields, as Megatron-LM's core_transformer_config_from_args sets them
    (same names; `fp8_param` from --fp8-param-gather)."""
    return dict(fp8=perf.fp8, fp8_recipe=perf.fp8_recipe, fp8_margin=perf.fp8_margin,
                fp8_amax_history_len=perf.fp8_amax_history_len,
                fp8_amax_compute_algo=perf.fp8_amax_compute_algo,
                fp8_param=perf.fp8_param_gather,
                fp8_dot_product_attention=perf.fp8_dot_product_attention,
                defer_embedding_wgrad_compute=perf.defer_embedding_wgrad_compute,
                wgrad_deferral_limit=perf.wgrad_deferral_limit, fp8_wgrad=perf.fp8_wgrad,
                first_last_layers_bf16=perf.first_last_layers_bf16,
                num_layers_at_start_in_bf16=perf.num_layers_at_start_in_bf16,
                num_layers_at_end_in_bf16=perf.num_layers_at_end_in_bf16,
                disable_bf16_reduced_precision_matmul=perf.disable_bf16_reduced_precision_matmul)


def ddp_kwargs(perf: PerformanceConfig) -> dict:
    """DistributedDataParallelConfig's fields, as Megatron-LM's get_megatron_ddp_config sets
    them: grads accumulate and reduce in fp32 unless --grad-reduce-in-bf16 or a
    --main-grads-dtype bf16."""
    in_fp32 = not perf.grad_reduce_in_bf16 and perf.main_grads_dtype == "fp32"
    kwargs = dict(grad_reduce_in_fp32=in_fp32,
                  overlap_param_gather=perf.overlap_param_gather,
                  align_param_gather=perf.align_param_gather,
                  num_distributed_optimizer_instances=perf.num_distributed_optimizer_instances,
                  fp8_param_gather=perf.fp8_param_gather)
    if perf.use_megatron_fsdp:
        kwargs.update(use_megatron_fsdp=True,
                      data_parallel_sharding_strategy=perf.data_parallel_sharding_strategy)
    return kwargs


def optimizer_kwargs(perf: PerformanceConfig) -> dict:
    """megatron-core OptimizerConfig's fields (the FP8 recipe only with FP8)."""
    return dict(overlap_param_gather=perf.overlap_param_gather,
                use_precision_aware_optimizer=perf.use_precision_aware_optimizer,
                optimizer_cpu_offload=perf.optimizer_cpu_offload,
                optimizer_offload_fraction=perf.optimizer_offload_fraction,
                overlap_cpu_optimizer_d2h_h2d=perf.overlap_cpu_optimizer_d2h_h2d,
                use_torch_optimizer_for_cpu_offload=perf.use_torch_optimizer_for_cpu_offload,
                pin_cpu_grads=perf.pin_cpu_grads, pin_cpu_params=perf.pin_cpu_params,
                fp8_recipe=perf.fp8_recipe if perf.fp8 else None,
                **{name: _DTYPES[getattr(perf, name)] for name in _OPTIMIZER_DTYPES})



def add_arguments(parser) -> None:
    add_flags(parser, PerformanceConfig, "performance (GPU; Megatron-LM's flags and meanings)")


def check_values(args) -> None:
    check_range(args, "fp8_amax_history_len", low=1)
    check_range(args, "fp8_margin", low=0)
    check_range(args, "num_distributed_optimizer_instances", low=1)
    check_range(args, "optimizer_offload_fraction", low=0, high=1)
    check_range(args, "wgrad_deferral_limit", low=0)


def validate(args, ctx: Context) -> None:
    """The options of features that are off ignored; torch FSDP2's rules; on CPU one message
    for all the other flags given; on GPU Megatron-LM's rules, then the features not wired here
    refused. After the parallel section (it derives the virtual pipeline)."""
    # Megatron-LM's rule: only the interleaved schedule launches aligned all-gathers.
    args.align_param_gather = args.align_param_gather and \
        args.virtual_pipeline_model_parallel_size is not None
    _ignore_options_of_features_off(args, ctx)
    _check_torch_fsdp2(args, ctx)
    given = fields.given(args, PerformanceConfig, _gpu_flags())
    if not ctx.cuda:
        require(not given, f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                "CUDA (GPU performance features of megatron-core and Transformer Engine); "
                "CPU runs do without: drop " + ("it" if len(given) == 1 else "them"))
        return
    if args.use_megatron_fsdp and not args.use_distributed_optimizer:  # as Megatron-LM does
        ctx.warnings.append("--use-megatron-fsdp runs megatron-core's distributed optimizer "
                            "over its buffers: --use-distributed-optimizer is on")
        args.use_distributed_optimizer = True
    _check_fp8(args)
    _check_ddp(args, ctx)
    _check_optimizer(args)
    require(not args.defer_embedding_wgrad_compute or ctx.dims.pp > 1,
            "--defer-embedding-wgrad-compute defers into the pipeline flush: it needs "
            "--pipeline-model-parallel-size > 1")
    require(not args.defer_embedding_wgrad_compute or args.tiled_loss_shards is None,
            "--defer-embedding-wgrad-compute defers the output layer's GEMM, which "
            "--tiled-loss-shards computes per tile: drop one")
    # megatron-core's TransformerConfig refuses it without the fused wgrad accumulation
    require(not args.defer_embedding_wgrad_compute or gradient_accumulation_fusion(args, True),
        "--defer-embedding-wgrad-compute needs gradient-accumulation fusion (apex's "
        "fused_weight_gradient_mlp_cuda, without --no-gradient-accumulation-fusion)")
    _check_tp_comm_overlap(args, ctx)
    _check_megatron_fsdp(args, ctx)
    _refuse_megatron_fsdp_optim(args)
    refuse_values(args, ("cuda_graph_impl",))


def _gpu_flags() -> list:
    """The fields of the GPU-only flags, FP8's first, then Megatron-FSDP's."""
    fp8 = ["fp8"] + [name for name, _ in fields.off_fields(PerformanceConfig, "--fp8-format")]
    fsdp = ["use_megatron_fsdp", "data_parallel_sharding_strategy", *_FSDP_OPTIONS]
    return fp8 + fsdp + [name for name, spec in fields.flags_of(PerformanceConfig)
                         if not spec.cpu and name not in fp8 + fsdp]


def _ignore_options_of_features_off(args, ctx: Context) -> None:
    """The options of a feature that is off change nothing in Megatron-LM (megatron-core reads
    them only with it): said once and back to their defaults, before the CPU check (so CPU runs
    take them too)."""
    for feature, on in (("--fp8-format", args.fp8 is not None),
                        ("--optimizer-cpu-offload", args.optimizer_cpu_offload),
                        ("--tp-comm-overlap", args.tp_comm_overlap),
                        ("--defer-embedding-wgrad-compute", args.defer_embedding_wgrad_compute),
                        ("--use-megatron-fsdp", args.use_megatron_fsdp),
                        ("--use-torch-fsdp2", args.use_torch_fsdp2), ("--bf16", args.bf16)):
        if not on:
            ignore_without(args, ctx, feature, fields.off_without(PerformanceConfig, feature))


def _check_fp8(args) -> None:
    """Megatron-LM's and Transformer Engine's FP8 rules, on the flags of this run."""
    if args.fp8 is None:  # its options were set aside by `_ignore_options_of_features_off`
        return
    require(args.transformer_impl == "transformer_engine",
            f"--fp8-format {args.fp8} runs Transformer Engine's FP8 GEMMs: it needs "
            "--transformer-impl transformer_engine")
    require(args.bf16 or args.fp16, f"--fp8-format {args.fp8} needs --bf16 or --fp16 (the "
            "weights, the Ulysses all-to-all and the non-FP8 ops run in that dtype)")
    _check_fp8_recipe(args)
    _check_bf16_layers(args)
    require(not args.fp8_param_gather or args.use_distributed_optimizer,
            "--fp8-param-gather all-gathers the distributed optimizer's FP8 weights: it needs "
            "--use-distributed-optimizer")
    require(not args.fp8_dot_product_attention or args.ulysses_attention_backend == "te",
            "--fp8-dot-product-attention runs TE's FP8 attention kernel: it needs "
            f"--ulysses-attention-backend te, not {args.ulysses_attention_backend}")
    if args.fp8_dot_product_attention:
        not_wired("--fp8-dot-product-attention")


def _check_bf16_layers(args) -> None:
    """--first-last-layers-bf16: megatron-core's TransformerConfig rules."""
    if not args.first_last_layers_bf16:
        return
    require(args.fp8_recipe != "delayed", "--first-last-layers-bf16 is not supported with "
            "--fp8-recipe delayed (megatron-core's rule); use tensorwise or blockwise")
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    for option in ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"):
        count = getattr(args, option[2:].replace("-", "_"))
        require(0 <= count <= per_stage, f"{option} ({count}) must be between 0 and the layers "
                f"per pipeline stage ({per_stage})")


def _check_fp8_recipe(args) -> None:
    """The recipes this GPU and TE run (megatron-core's fp8_utils picks TE's recipe class)."""
    from megatron.core.utils import is_te_min_version

    recipe = args.fp8_recipe
    require(recipe != "custom", "--fp8-recipe custom needs Megatron-LM's "
            "--fp8-quantizer-factory, which megatron_ulysses does not take; use delayed, "
            "tensorwise or blockwise")
    major, minor = torch.cuda.get_device_capability()
    require(recipe != "mxfp8" or major >= 10,
            f"--fp8-recipe mxfp8 needs a Blackwell GPU (compute capability 10.0+), this one is "
            f"{major}.{minor}; use delayed, tensorwise or blockwise (Hopper)")
    require((major, minor) >= (8, 9), f"--fp8-format needs FP8 tensor cores (Ada / Hopper, "
            f"compute capability 8.9+); this GPU is {major}.{minor}")
    require(recipe != "blockwise" or major >= 9,
            f"--fp8-recipe blockwise needs Hopper (9.0+); this GPU is {major}.{minor}")
    needs = {"tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0", "mxfp8": "2.1.0"}
    require(recipe not in needs or is_te_min_version(needs[recipe]),
            f"--fp8-recipe {recipe} needs Transformer Engine >= {needs.get(recipe)}; upgrade "
            "it or use --fp8-recipe delayed")


def _check_ddp(args, ctx: Context) -> None:
    """The distributed optimizer's overlap and instances, bf16 grad reduction (Megatron-LM's
    validate_args)."""
    if args.overlap_param_gather:
        require(args.use_distributed_optimizer, "--overlap-param-gather overlaps the "
                "distributed optimizer's all-gather: it needs --use-distributed-optimizer")
        require(args.overlap_grad_reduce,
                "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    if args.overlap_param_gather_with_optimizer_step:  # Megatron-LM's rules, in its order
        flag = "--overlap-param-gather-with-optimizer-step"
        require(args.use_distributed_optimizer, f"{flag} needs --use-distributed-optimizer")
        require(args.overlap_param_gather, f"{flag} needs --overlap-param-gather")
        require(args.virtual_pipeline_model_parallel_size is not None, f"{flag} needs "
                "interleaved pipeline parallelism (--num-layers-per-virtual-pipeline-stage)")
        raise ConfigError(f"{flag} is not supported with distributed checkpointing (as in "
                          "Megatron-LM), and torch_dist is this package's only checkpoint "
                          "format; drop it (--overlap-param-gather still overlaps the "
                          "all-gather with the forward)")
    instances = args.num_distributed_optimizer_instances
    if instances > 1:
        require(args.use_distributed_optimizer, f"--num-distributed-optimizer-instances "
                f"{instances} splits the distributed optimizer: it needs "
                "--use-distributed-optimizer")
        shards = ctx.dims.dp * ctx.dims.sp
        require(shards % instances == 0,
                f"--num-distributed-optimizer-instances {instances} must divide the ranks the "
                f"distributed optimizer shards over, data parallel x --ulysses-sp-size = "
                f"{ctx.dims.dp} x {ctx.dims.sp} = {shards}")


def _check_optimizer(args) -> None:
    """megatron-core's precision-aware optimizer and CPU offload (Megatron-LM's rules)."""
    if args.use_precision_aware_optimizer:
        require(args.use_distributed_optimizer,
                "--use-precision-aware-optimizer needs --use-distributed-optimizer")
        require(te_available(), "--use-precision-aware-optimizer runs Transformer Engine's "
                "FusedAdam: install Transformer Engine")
    if args.optimizer_cpu_offload:
        require(args.use_precision_aware_optimizer, "--optimizer-cpu-offload needs "
                "--use-precision-aware-optimizer (the hybrid optimizer reuses its code path)")
        require(not args.fp8_param_gather or args.fp8_recipe == "delayed",
                "--optimizer-cpu-offload with --fp8-param-gather needs --fp8-recipe delayed")
    dtypes = fields.given(args, PerformanceConfig, _OPTIMIZER_DTYPES)
    require(not dtypes or args.use_precision_aware_optimizer,
            f"{', '.join(dtypes)} other than fp32 {'needs' if len(dtypes) == 1 else 'need'} "
            "--use-precision-aware-optimizer (megatron-core's rule)")
    require(not (args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype != "fp32"),
            f"--accumulate-allreduce-grads-in-fp32 needs --main-grads-dtype fp32 (got "
            f"{args.main_grads_dtype}), as in Megatron-LM")


def _check_tp_comm_overlap(args, ctx: Context) -> None:
    """Megatron-LM's rules for TE's userbuffers overlap, then refused (not wired)."""
    if not args.tp_comm_overlap:
        return
    require(ctx.dims.tp > 1 and args.sequence_parallel,
            "--tp-comm-overlap overlaps TP's sequence-parallel communication with the GEMMs: "
            "it needs --tensor-model-parallel-size > 1 and --sequence-parallel")
    require(args.transformer_impl == "transformer_engine",
            "--tp-comm-overlap needs --transformer-impl transformer_engine")
    not_wired("--tp-comm-overlap")


def _check_torch_fsdp2(args, ctx: Context) -> None:
    """Megatron-LM's rules for --use-torch-fsdp2."""
    if not args.use_torch_fsdp2:
        return
    require(not args.use_megatron_fsdp, "--use-torch-fsdp2 and --use-megatron-fsdp are "
            "exclusive; give one")
    require(not args.use_distributed_optimizer, "--use-torch-fsdp2 shards the optimizer state "
            "itself: drop --use-distributed-optimizer (megatron-core's distributed optimizer "
            "does not take FSDP2's parameters)")
    require(ctx.dims.pp == 1, "--use-torch-fsdp2 is not supported with pipeline parallelism "
            f"(--pipeline-model-parallel-size {ctx.dims.pp}); use 1")
    require(args.untie_embeddings_and_output_weights, "--use-torch-fsdp2 needs "
            "--untie-embeddings-and-output-weights (as in Megatron-LM: a tied weight would be "
            "sharded by two FSDP units)")
    shards = ctx.dims.dp * ctx.dims.sp
    require(not (args.swiglu and ctx.dims.tp > 1 and shards % 2 and shards > 1),
            "--use-torch-fsdp2 with "
            f"--swiglu and --tensor-model-parallel-size {ctx.dims.tp} needs an even data parallel "
            f"x --ulysses-sp-size (it is {shards}): an FSDP2 shard of a TP rank's fused "
            "[gate; up] rows must lie in one half to be checkpointed")
    # TE's and apex's fused wgrad accumulation write DDP's main_grad, which FSDP2 has not.
    require(not gradient_accumulation_fusion(args, ctx.cuda),
            "--use-torch-fsdp2 is not supported with gradient-accumulation fusion (as in "
            "Megatron-LM): add --no-gradient-accumulation-fusion")


def _check_megatron_fsdp(args, ctx: Context) -> None:
    """Megatron-LM's rules for --use-megatron-fsdp; its options (those left: without it its
    buffer options are ignored) are refused."""
    given = fields.given(args, PerformanceConfig, _FSDP_OPTIONS)
    if args.use_megatron_fsdp and args.init_model_with_meta_device:
        require(args.data_parallel_sharding_strategy != "no_shard",
                "--init-model-with-meta-device is not supported with "
                "--data-parallel-sharding-strategy no_shard")
    require(not args.fsdp_manual_registration or (args.use_megatron_fsdp and args.nccl_ub),
            "--fsdp-manual-registration needs --use-megatron-fsdp and --use-nccl-ub")
    if given:
        not_wired(", ".join(given), "Megatron-FSDP options")
    if not args.use_megatron_fsdp:
        return
    require(ctx.dims.pp == 1, "--use-megatron-fsdp is not wired with pipeline parallelism "
            f"here (--pipeline-model-parallel-size {ctx.dims.pp}); use 1")
    require(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1", "--use-megatron-fsdp "
            "needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1 (as in Megatron-LM); it is 1")
    require(args.save is None and args.load is None, "--use-megatron-fsdp: Megatron-FSDP "
            "saves only in its fsdp_dtensor checkpoint format, which megatron_ulysses does not "
            "write or read; drop --save / --load, or use --use-torch-fsdp2 (torch_dist "
            "checkpoints, resumable at another DP x SP)")


def _refuse_megatron_fsdp_optim(args) -> None:
    """Megatron-FSDP's optim strategy, measured wrong on an H100 (bf16, TE, gloo on one GPU,
    against DDP; not SP's doing): refused until found."""
    require(not (args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim"),
            "--data-parallel-sharding-strategy optim with --use-megatron-fsdp is not supported "
            "yet: on an H100 its first gradient norm was 1.5x DDP's at SP 2 and at DP 2 without "
            "SP alike, and its losses drifted up to 2% (no_shard, optim_grads and "
            "optim_grads_params matched DDP within 1e-4); use optim_grads or optim_grads_params")

