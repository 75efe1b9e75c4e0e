"""Command-line arguments of `pretrain_gpt.py`: Megatron-LM's flag names and meanings, plus ours
(`--ulysses-*`, the ALST memory flags). Each config section (`training/config/`) declares its
flags and checks its own rules; `validate_args` runs them all, and the rules between sections,
before the first collective: one `ConfigError` naming the flag to change, Megatron-LM's derived
defaults filled in, the frozen `RunConfig` returned.
"""

import argparse
import os

import torch

from ..errors import ConfigError, flag_name  # noqa: F401 (re-exported)
from ..vocab import padded_vocab_size  # noqa: F401 (re-exported)
from .config import RunConfig, from_namespace, rules
from .config import (checkpoint, compat, data, fusions, logging, memory, model, optimizer,
                     parallel, performance, pipeline, training)
from .config.checkpoint import apply_checkpoint_args
from .config.checks import Context
from .config.checks import check_writable_dir  # noqa: F401 (re-exported)
from .config.memory import RECOMPUTE_MODULES  # noqa: F401 (re-exported)

# Each flag alone first (after the flags every check needs), then the sections' rules: data
# first, since missing files are what a user fixes first; then the rules between sections.
_VALUE_CHECKS = (model, training, logging, optimizer, memory, data, checkpoint, performance,
                 pipeline)
_RULES = (data, model, memory, fusions, training, optimizer, parallel, checkpoint, logging,
          performance, pipeline)


class _Parser(argparse.ArgumentParser):
    """An argparse error is one line (the flag and what is wrong), not the 80-line usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser(model_flags_required: bool = True) -> argparse.ArgumentParser:
    """`model_flags_required=False` (with --use-checkpoint-args): the checkpoint gives them."""
    parser = _Parser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core with Ulysses sequence parallelism. "
        "Flags follow Megatron-LM; ours are --ulysses-sp-size, --ulysses-attention-backend and "
        "the ALST memory flags.",
        allow_abbrev=False,
    )
    parallel.add_arguments(parser)
    model.add_arguments(parser, model_flags_required)
    for section in (memory, fusions, training, optimizer, data, logging, checkpoint, compat,
                    performance, pipeline):
        section.add_arguments(parser)
    return parser


def validate_args(args: argparse.Namespace, world_size: int, cuda: bool) -> RunConfig:
    """Check the whole configuration for `world_size` processes, fill in the derived values
    (`num_microbatches`, defaults that depend on other flags) and freeze it. Raises
    `ConfigError` before anything touches a process group."""
    ctx = Context(dims=parallel.parallel_dims(args, world_size), cuda=cuda)
    rules.check_run_length(args, ctx)
    for section in _VALUE_CHECKS:
        section.check_values(args)
    for section in _RULES:
        section.validate(args, ctx)
    rules.validate(args, ctx)
    return from_namespace(args, ctx.dims, ctx.warnings)


def parse_args(argv=None, world_size: int = None) -> RunConfig:
    """Parse, validate and freeze; argparse errors exit 2, `ConfigError` is raised."""
    import sys

    raw = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(model_flags_required="--use-checkpoint-args" not in raw).parse_args(raw)
    if args.use_checkpoint_args:
        apply_checkpoint_args(args, given={word.split("=")[0] for word in raw
                                           if word.startswith("--")})
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate_args(args, world_size, torch.cuda.is_available())
