"""The model side of a run, one builder per thing: megatron-core's `TransformerConfig` from our
`ModelConfig`, the Ulysses GPTModel in megatron-core DDP (which reduces over DP x SP), and the
`OptimizerParamScheduler`. The benchmarks build through these too.
"""

import warnings

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.activations import squared_relu
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module

from .. import cpu_compat
from ..sp import rng
from ..sp.backends import te_available
from ..sp.layer_specs import build_gpt_model
from ..memory.activation_offload import enable_activation_offload
from ..sp.parallel_state import ParallelDims
from ..sp.rope import YARN_CONFIG, set_yarn_config
from .chunks import model_chunks
from .config import ModelConfig, OptimizerConfig, PerformanceConfig, RunConfig
from .config import grad_buckets
from .config.fusions import gradient_accumulation_fusion
from .config.performance import ddp_kwargs, transformer_kwargs
from .fsdp import UlyssesTorchFSDP2
from .optimizer import build_optimizer


def transformer_config(model: ModelConfig, dims: ParallelDims,
                       performance: PerformanceConfig = PerformanceConfig()) -> TransformerConfig:
    """megatron-core's config of the model (per-token loss; CPU initialization without CUDA;
    FP8 and the other speed features of `performance`; YaRN's parameters, as Megatron-LM)."""
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():  # 0.16 warns about its own default cuda_graph_scope
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        config = TransformerConfig(**transformer_config_kwargs(model, dims, cuda),
                                   **transformer_kwargs(performance))
    if model.position_embedding_type == "yarn":
        set_yarn_config(config, {name: getattr(model, name) for name in YARN_CONFIG})
    return config


def transformer_config_kwargs(model: ModelConfig, dims: ParallelDims, cuda: bool) -> dict:
    """`TransformerConfig`'s arguments from the model section."""
    return dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=model.swiglu,
        activation_func=_activation(model),
        add_bias_linear=not model.disable_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        init_method_std=model.init_method_std,
        embedding_init_method_std=model.embedding_init_method_std,
        **_init_methods(model),
        layernorm_zero_centered_gamma=model.apply_layernorm_1p,
        rotary_interleaved=model.rotary_interleaved,
        test_mode=model.test_mode,
        use_te_rng_tracker=model.te_rng_tracker,
        num_layers_in_first_pipeline_stage=model.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=model.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=model.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=model.account_for_loss_in_pipeline_split,
        virtual_pipeline_model_parallel_size=model.virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=model.microbatch_group_size_per_virtual_pipeline_stage,
        overlap_p2p_comm=model.overlap_p2p_comm, batch_p2p_comm=not model.overlap_p2p_comm,
        overlap_p2p_comm_warmup_flush=model.overlap_p2p_communication_warmup_flush,
        # read by megatron-core's FSDP2 wrapper: local layers' linears are not FSDP units
        transformer_impl=model.transformer_impl,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        sequence_parallel=model.sequence_parallel,
        params_dtype=model.params_dtype,
        pipeline_dtype=model.params_dtype,
        bf16=model.bf16,
        fp16=model.fp16,
        use_cpu_initialization=model.use_cpu_initialization or not cuda,
        calculate_per_token_loss=True,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
        recompute_modules=list(model.recompute_modules or ("core_attn",)),
        **_fusion_kwargs(model, cuda),
        deterministic_mode=model.deterministic_mode,
        # megatron-core's GPTModel sets TE's NVTE_{FLASH,FUSED,UNFUSED}_ATTN from it
        attention_backend=AttnBackend[model.attention_backend],
    )


def _fusion_kwargs(model: ModelConfig, cuda: bool) -> dict:
    """The fused kernels: Megatron-LM's defaults on GPU, each off by its --no-*-fusion flag."""
    return dict(
        # SwiGLU with or without bias, GeLU with bias.
        bias_activation_fusion=cuda and not model.squared_relu and (
            not model.no_bias_swiglu_fusion if model.swiglu else
            not model.no_bias_gelu_fusion and not model.disable_bias_linear),
        masked_softmax_fusion=False,  # only megatron-core's local attention has one
        bias_dropout_fusion=cuda and not model.no_bias_dropout_fusion,
        # TE's fused RoPE takes the frequencies `ShardedRotaryEmbedding` computes for the
        # global positions, as the unfused one does.
        apply_rope_fusion=cuda and not model.no_rope_fusion
        and model.position_embedding_type == "rope" and te_available(),
        gradient_accumulation_fusion=gradient_accumulation_fusion(model, cuda),
        cross_entropy_loss_fusion=model.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=model.cross_entropy_fusion_impl,
    )


def _activation(model: ModelConfig):
    """The MLP's activation, as Megatron-LM picks it (SwiGLU's gate is silu)."""
    return F.silu if model.swiglu else squared_relu if model.squared_relu else F.gelu


def _init_methods(model: ModelConfig) -> dict:
    """--init-method-xavier-uniform: every linear weight, output layers included (as
    Megatron-LM); --use-mup (megatron-core >= 0.19, checked by the config): its fields."""
    methods = {}
    if model.init_method_xavier_uniform:
        methods.update(init_method=torch.nn.init.xavier_uniform_,
                       output_layer_init_method=torch.nn.init.xavier_uniform_)
    if model.use_mup:
        methods.update(use_mup=True, mup_base_hidden_size=model.mup_base_hidden_size)
    return methods


def build_model(model: ModelConfig, optimizer: OptimizerConfig, seed: int,
                config: TransformerConfig, performance: PerformanceConfig = PerformanceConfig()):
    """The Ulysses GPTModel (in `Float16Module` for bf16/fp16) in megatron-core DDP; the
    weights are drawn from `seed` alone, the same on every DP x SP rank. With a virtual
    pipeline, as Megatron-LM's get_model: a list of them, one per virtual stage `vp_stage`
    (its layers megatron-core's for that stage; embedding on the first rank's first chunk,
    loss on the last rank's last chunk), drawn one after the other from `seed`."""
    vpp = model.virtual_pipeline_model_parallel_size
    with rng.weight_init_streams(seed), cpu_compat.tensors_stay_on_cpu():
        gpts = [_gpt_chunk(model, config, vp_stage) for vp_stage in
                ([None] if vpp is None else range(vpp))]
    chunks = []
    for index, gpt in enumerate(gpts):
        if torch.cuda.is_available():
            gpt.cuda(torch.cuda.current_device())
        if model.offload_activations:
            enable_activation_offload(gpt.decoder)
        # As Megatron-LM: one bucket for the chunks after the first, whose gradient reduction
        # the interleaved schedule overlaps with the other chunks' compute anyway.
        chunks.append(wrap_model(gpt, model, optimizer, config, performance,
                                 disable_bucketing=index > 0))
    return chunks[0] if vpp is None else chunks


def _gpt_chunk(model: ModelConfig, config: TransformerConfig, vp_stage):
    """The GPTModel of this pipeline rank's virtual stage `vp_stage` (None: the whole stage)."""
    first = mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    chunk = {} if vp_stage is None else {"vp_stage": vp_stage}
    return build_gpt_model(
        config, model.padded_vocab_size, model.max_position_embeddings,
        backend=model.ulysses_attention_backend, transformer_impl=model.transformer_impl,
        pre_process=first, post_process=last,
        tiled_mlp_shards=model.tiled_mlp_shards, tiled_loss_shards=model.tiled_loss_shards,
        parallel_output=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_percent=model.rotary_percent, rotary_base=model.rotary_base,
        rope_scaling=model.use_rope_scaling, rope_scaling_factor=model.rope_scaling_factor,
        seq_len_interpolation_factor=model.rotary_seq_len_interpolation_factor, **chunk,
    )


def wrap_model(gpt, model: ModelConfig, optimizer: OptimizerConfig, config: TransformerConfig,
               performance: PerformanceConfig = PerformanceConfig(),
               disable_bucketing: bool = False):
    """`gpt` as Megatron-LM's get_model wraps it: `Float16Module` for bf16/fp16 (half-precision
    weights, fp32 logits out), then megatron-core DDP (an fp32 grad buffer unless
    --grad-reduce-in-bf16; `disable_bucketing`: one bucket), or its FSDP2 / Megatron-FSDP wrapper
    (`fsdp.py`; never with a virtual pipeline, which needs PP > 1)."""
    if model.bf16 or model.fp16:
        gpt = Float16Module(config, gpt)
    kwargs = ddp_config_kwargs(optimizer, performance)
    if performance.use_torch_fsdp2:
        return UlyssesTorchFSDP2(config, TorchFullyShardedDataParallelConfig(**kwargs), gpt)
    if performance.use_megatron_fsdp:  # imported here: its import is slow, and GPU only
        from megatron.core.distributed import FullyShardedDataParallel

        return FullyShardedDataParallel(config=config, module=gpt,
                                        ddp_config=DistributedDataParallelConfig(**kwargs))
    return DistributedDataParallel(config=config, module=gpt,
                                   ddp_config=DistributedDataParallelConfig(**kwargs),
                                   disable_bucketing=disable_bucketing)


def ddp_config_kwargs(optimizer: OptimizerConfig, performance: PerformanceConfig) -> dict:
    """`DistributedDataParallelConfig`'s arguments (with FSDP2 its subclass's)."""
    fsdp2 = {"reshard_after_forward": performance.torch_fsdp2_reshard_after_forward} \
        if performance.use_torch_fsdp2 else {}
    return dict(overlap_grad_reduce=optimizer.overlap_grad_reduce,
                use_distributed_optimizer=optimizer.use_distributed_optimizer,
                **ddp_kwargs(performance), **grad_buckets.ddp_kwargs(performance), **fsdp2)


def gather_params(model, performance: PerformanceConfig) -> None:
    """With --overlap-param-gather the optimizer step updates only this rank's shard and leaves
    the all-gather to the next forward's hooks: finish it now, before a save reads the weights
    (Megatron-LM's force_param_sync), for each chunk."""
    if performance.overlap_param_gather:
        for chunk in model_chunks(model):
            chunk.start_param_sync(force_sync=True)


def build_scheduler(config: OptimizerConfig, optimizer) -> OptimizerParamScheduler:
    """LR and weight-decay schedule in samples, as Megatron-LM's get_optimizer_param_scheduler
    (the lengths are the config's, `config.optimizer.validate` derives them); each param group's
    own `max_lr` / `min_lr` (--decoupled-lr) is read by the scheduler."""
    return OptimizerParamScheduler(
        optimizer, init_lr=config.lr_warmup_init, max_lr=config.lr, min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_steps, lr_decay_steps=config.lr_decay_steps,
        lr_decay_style=config.lr_decay_style, start_wd=config.start_weight_decay,
        end_wd=config.end_weight_decay, wd_incr_steps=config.wd_incr_steps,
        wd_incr_style=config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=config.override_opt_param_scheduler,
        wsd_decay_steps=config.wsd_decay_steps, lr_wsd_decay_style=config.lr_wsd_decay_style,
    )


def build_model_and_optimizer(config: RunConfig):
    """The model (DDP), optimizer and LR scheduler of a run whose process groups exist
    (`loop.initialize_distributed`), wired as megatron-core's schedule needs them."""
    mcore_config = transformer_config(config.model, config.dims, config.performance)
    model = build_model(config.model, config.optimizer, config.training.seed, mcore_config,
                        config.performance)
    return attach_optimizer(config, mcore_config, model)


def attach_optimizer(config: RunConfig, mcore_config: TransformerConfig, model):
    """(model, optimizer, scheduler): the optimizer and LR scheduler of `model` (DDP, or its
    chunks) and, on `mcore_config`, the hooks megatron-core's schedule calls (grad finalize,
    `set_sync_funcs`, fp16 loss scale), as Megatron-LM's setup sets them."""
    optimizer = build_optimizer(config.optimizer, config.model, model, config.performance,
                                config.logging.log_num_zeros_in_grad)
    mcore_config.finalize_model_grads_func = finalize_model_grads
    set_sync_funcs(mcore_config, model, config.optimizer, config.performance)
    if config.model.fp16:
        mcore_config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, build_scheduler(config.optimizer, optimizer)


def set_sync_funcs(mcore_config: TransformerConfig, model, optimizer: OptimizerConfig,
                   performance: PerformanceConfig) -> None:
    """megatron-core's schedule hooks for DP communication on `mcore_config`, one per chunk
    (one function for one model), as Megatron-LM's train() sets them:
    - `no_sync_func`: a chunk's gradients reduce after its last micro batch only (Megatron-LM
      sets it only with --overlap-grad-reduce: DDP ignores it without, and Megatron-FSDP's
      no_shard / optim strategies then reduce once per step instead of per micro batch);
    - `grad_sync_func` with --overlap-grad-reduce and `align_grad_reduce` (not for torch
      FSDP2, as Megatron-LM): the schedule starts each chunk's reduction, at the same point on
      every pipeline rank;
    - `param_sync_func` with --overlap-param-gather and `align_param_gather` (a virtual
      pipeline): the schedule starts each chunk's all-gather ahead of its forward."""
    chunks = model_chunks(model)

    def per_chunk(name: str):
        funcs = [getattr(chunk, name) for chunk in chunks]
        return funcs if len(funcs) > 1 else funcs[0]

    mcore_config.no_sync_func = per_chunk("no_sync")
    if optimizer.overlap_grad_reduce and optimizer.align_grad_reduce \
            and not performance.use_torch_fsdp2:
        mcore_config.grad_sync_func = per_chunk("start_grad_sync")
    if performance.overlap_param_gather and performance.align_param_gather:
        mcore_config.param_sync_func = per_chunk("start_param_sync")
