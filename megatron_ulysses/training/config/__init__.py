"""The run configuration: frozen, typed sections built once from the validated flags.

    argv --parse--> argparse.Namespace --validate_args--> RunConfig (frozen) --> builders

One module per section holds its dataclass, its flags (declared once on the dataclass's fields
with `fields.flag`; `add_arguments` makes its argparse group) and its own rules (`check_values`:
each flag alone; `validate`: the section's rules and derived defaults): `parallel` (->
`ParallelDims`), `model` (with its `memory` and `fusions` parts), `optimizer`, `data`,
`training`, `checkpoint`, `logging`, `performance` (GPU speed features, with `grad_buckets`).
Megatron-LM compatibility is fenced off in `megatron_lm/`: `compat` (its flags accepted with no
effect here) and `refused` (its flags and values refused, each with why and what to use). The
rules between sections live in `rules`; `checks` has the shared checks. `training/arguments.py`
runs them in order.

Every field is named as Megatron-LM's argument (`hidden_size` is `--hidden-size`; `flag_name`
gives the flag back for messages). Each builder takes the section it needs. `padded_vocab_size`
depends on the tokenizer, which `pretrain` loads before any process group: it makes the one
completed copy with `with_padded_vocab_size`; nothing changes a config after that.
"""

import dataclasses
from dataclasses import dataclass
from typing import Tuple

from ...sp.parallel_state import ParallelDims
from .checkpoint import CheckpointConfig
from .checks import section_of
from .data import DataConfig
from .logging import LoggingConfig
from .model import ModelConfig
from .optimizer import OptimizerConfig
from .performance import PerformanceConfig
from .training import TrainingConfig

__all__ = ["RunConfig", "ModelConfig", "OptimizerConfig", "DataConfig", "TrainingConfig",
           "CheckpointConfig", "LoggingConfig", "PerformanceConfig", "from_namespace"]


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
    performance: PerformanceConfig = PerformanceConfig()  # GPU speed features: none by default
    warnings: Tuple[str, ...] = ()  # said once by rank 0 (pretrain_gpt.py)

    def with_padded_vocab_size(self, padded_vocab_size: int) -> "RunConfig":
        model = dataclasses.replace(self.model, padded_vocab_size=padded_vocab_size)
        return dataclasses.replace(self, model=model)


def from_namespace(namespace, dims: ParallelDims, warnings=()) -> RunConfig:
    """The frozen config of validated flags (`arguments.validate_args` fills in the defaults)."""
    return RunConfig(
        dims=dims, model=section_of(ModelConfig, namespace),
        optimizer=section_of(OptimizerConfig, namespace),
        data=section_of(DataConfig, namespace),
        training=section_of(TrainingConfig, namespace),
        checkpoint=section_of(CheckpointConfig, namespace),
        logging=section_of(LoggingConfig, namespace),
        performance=section_of(PerformanceConfig, namespace), warnings=tuple(warnings),
    )
