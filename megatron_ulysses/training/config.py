"""The run configuration: frozen, typed sections built once from the validated flags.

    argv --parse--> argparse.Namespace --validate_args--> RunConfig (frozen) --> builders

Every field is named as Megatron-LM's argument (`hidden_size` is `--hidden-size`; `flag_name`
gives the flag back for messages). Each builder takes the section it needs. `padded_vocab_size`
depends on the tokenizer, which `pretrain` loads before any process group: it makes the one
completed copy with `with_padded_vocab_size`; nothing changes a config after that.
"""

import dataclasses
from dataclasses import dataclass, fields
from typing import Optional, Tuple, Union

import torch

from ..parallel_state import ParallelDims

@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, numerics and memory features (what the GPTModel build reads)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    seq_length: int
    max_position_embeddings: int
    position_embedding_type: str
    rotary_base: int
    rotary_percent: float
    use_rope_scaling: bool
    rope_scaling_factor: float
    rotary_seq_len_interpolation_factor: Optional[float]
    normalization: str
    norm_epsilon: float
    swiglu: bool
    untie_embeddings_and_output_weights: bool
    disable_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    attention_dropout: float
    hidden_dropout: float
    init_method_std: float
    make_vocab_size_divisible_by: int
    sequence_parallel: bool
    bf16: bool
    fp16: bool
    ulysses_attention_backend: str
    transformer_impl: str  # the layer spec: "transformer_engine" or "local"
    attention_backend: str  # Megatron-LM's: TE's kernel family (auto, flash, fused, unfused) or local
    tiled_mlp_shards: Union[int, str, None]  # a count, "auto", or None (off)
    tiled_loss_shards: Union[int, str, None]
    offload_activations: bool
    recompute_granularity: Optional[str]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]
    recompute_modules: Optional[Tuple[str, ...]]
    no_rope_fusion: bool
    no_gradient_accumulation_fusion: bool
    no_bias_swiglu_fusion: bool
    no_bias_gelu_fusion: bool
    no_bias_dropout_fusion: bool
    cross_entropy_loss_fusion: bool
    cross_entropy_fusion_impl: str
    deterministic_mode: bool
    padded_vocab_size: Optional[int] = None  # set from the tokenizer by `pretrain`

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam, its LR / weight-decay schedule, fp16 loss scaling, DDP and the distributed
    optimizer (`bf16`/`fp16` come from `ModelConfig`)."""

    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    override_opt_param_scheduler: bool
    use_checkpoint_opt_param_scheduler: bool
    loss_scale: Optional[float]
    initial_loss_scale: Optional[float]
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool


@dataclass(frozen=True)
class DataConfig:
    """Data sets, tokenizer and the sequence-sharded loader."""

    data_path: Optional[Tuple[str, ...]]
    split: str
    mock_data: bool
    data_cache_path: Optional[str]
    num_workers: int
    tokenizer_type: str
    tokenizer_model: Optional[str]
    vocab_size: Optional[int]
    vocab_file: Optional[str]
    merge_file: Optional[str]
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool


@dataclass(frozen=True)
class TrainingConfig:
    """The loop: batch sizes, iterations, evaluation, exits, seeds, the process group."""

    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    train_iters: int
    eval_interval: int
    eval_iters: int
    skip_train: bool
    seed: int
    exit_interval: Optional[int]
    exit_duration_in_mins: Optional[float]
    exit_signal_handler: bool
    check_for_nan_in_loss_and_grad: bool
    distributed_backend: str
    distributed_timeout_minutes: int


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    ckpt_fully_parallel_save: bool


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: Optional[str]


@dataclass(frozen=True)
class RunConfig:
    """One run: its parallel layout and one section per builder."""

    dims: ParallelDims
    model: ModelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    warnings: Tuple[str, ...] = ()  # said once by rank 0 (pretrain_gpt.py)

    def with_padded_vocab_size(self, padded_vocab_size: int) -> "RunConfig":
        model = dataclasses.replace(self.model, padded_vocab_size=padded_vocab_size)
        return dataclasses.replace(self, model=model)


def _section(cls, namespace):
    values = {f.name: getattr(namespace, f.name) for f in fields(cls)
              if hasattr(namespace, f.name)}
    if "data_path" in values and values["data_path"] is not None:
        values["data_path"] = tuple(values["data_path"])
    return cls(**values)


def from_namespace(namespace, dims: ParallelDims, warnings=()) -> RunConfig:
    """The frozen config of validated flags (`arguments.validate_args` fills in the defaults)."""
    return RunConfig(
        dims=dims, model=_section(ModelConfig, namespace),
        optimizer=_section(OptimizerConfig, namespace), data=_section(DataConfig, namespace),
        training=_section(TrainingConfig, namespace),
        checkpoint=_section(CheckpointConfig, namespace),
        logging=_section(LoggingConfig, namespace), warnings=tuple(warnings),
    )
