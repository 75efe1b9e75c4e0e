"""Command-line arguments of `pretrain_gpt.py`: Megatron-LM's flag names and meanings, plus ours
(`--ulysses-*`, the ALST memory flags). Each config section (`training/config/`) declares its
flags and checks its own rules; `validate_args` runs them all, and the rules between sections,
before the first collective: one `ConfigError` naming the flag to change, Megatron-LM's derived
defaults filled in, the frozen `RunConfig` returned.
"""

import argparse
import difflib
import os

import torch

from ..errors import ConfigError, flag_name  # noqa: F401 (re-exported)
from ..data.vocab import padded_vocab_size  # noqa: F401 (re-exported)
from .config import RunConfig, from_namespace, rules
from .config import (bounds, checkpoint, data, fusions, grad_buckets, logging, memory, model,
                     optimizer, parallel, performance, training)
from .config.megatron_lm import compat, refused
from .config.checkpoint import apply_checkpoint_args
from .config.checks import Context, require
from .config.checks import check_writable_dir  # noqa: F401 (re-exported)
from .config.memory import RECOMPUTE_MODULES  # noqa: F401 (re-exported)

# Each flag alone first (after the flags every check needs), then the sections' rules: data
# first, since missing files are what a user fixes first; then the rules between sections.
_VALUE_CHECKS = (model, training, logging, optimizer, memory, data, checkpoint, performance,
                 grad_buckets)
_RULES = (data, model, memory, fusions, training, optimizer, parallel, bounds, checkpoint,
          logging, performance, grad_buckets, compat)


_STRICT = ("type", "choices", "required")  # what argparse would stop at, at the first problem


class _Parser(argparse.ArgumentParser):
    """An argparse error is one line (the flag and what is wrong), not the 80-line usage; all the
    problems of a command line are reported together (`parse_all`). Each group and flag the
    sections add is kept (`groups`: arguments, flags as (option strings, options, action))."""

    def __init__(self, *args, **kwargs):
        self.groups, self.defaults, self.recording = [], {}, False
        super().__init__(*args, **kwargs)
        self.recording = True  # (not argparse's own groups)

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        if not self.recording:
            return group
        self.groups.append((args, kwargs, []))
        return _Recorded(group, self.groups[-1][2])

    def set_defaults(self, **kwargs):
        self.defaults.update(kwargs)
        super().set_defaults(**kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")

    def flags(self) -> list:
        return [flag for _, _, flags in self.groups for flag in flags]

    def option_strings(self) -> list:
        return ["-h", "--help"] + [name for _, _, action in self.flags()
                                   for name in action.option_strings]

    def parse_all(self, raw) -> argparse.Namespace:
        """Parse `raw`, collecting every problem (bad values, missing required flags, unknown
        and out-of-scope flags) into one message, exit 2; argparse stops at the first."""
        namespace, unknown, problems = _parse_leniently(self, raw)
        problems += _out_of_scope_and_unknown(self, namespace, unknown)
        if len(problems) == 1:
            self.error(problems[0])
        if problems:
            self.exit(2, f"{self.prog}: error: {len(problems)} problems:\n"
                      + "".join(f"  - {problem}\n" for problem in problems)
                      + "(--help lists the flags)\n")
        return namespace


class _Recorded:
    """An argparse group whose `add_argument` also records the flag in `flags`."""

    def __init__(self, group, flags: list):
        self._group, self._flags = group, flags

    def add_argument(self, *names, **options):
        action = self._group.add_argument(*names, **options)
        self._flags.append((names, options, action))
        return action


def _parse_leniently(parser: _Parser, raw):
    """Pass 1 reads the words with a copy of `parser` without types, choices or required flags
    (argparse would exit at the first bad one; --help is the copy's); pass 2 applies them to the
    given values, one flag at a time, collecting the problems."""
    lenient = _Parser(prog=parser.prog, description=parser.description, allow_abbrev=False)
    for args, kwargs, flags in parser.groups:
        group = lenient.add_argument_group(*args, **kwargs)
        for names, options, _ in flags:
            group.add_argument(*names, **{k: v for k, v in options.items() if k not in _STRICT})
    lenient.set_defaults(**parser.defaults)
    namespace, unknown = lenient.parse_known_args(raw)
    problems, missing = [], []
    for names, options, action in parser.flags():
        value = getattr(namespace, action.dest, None)
        if not _STRICT & options.keys():
            continue
        if action.required and value is None:
            missing.append("/".join(names))
        elif isinstance(value, str) or (isinstance(value, list) and value is not action.default):
            try:
                setattr(namespace, action.dest, _typed(names, options, value))
            except argparse.ArgumentError as error:
                problems.append(str(error))
    if missing:
        problems.append("the following arguments are required: " + ", ".join(missing))
    return namespace, unknown, problems


def _typed(names, options, value):
    """`value` (a word, or the words of an nargs flag) through the flag's type and choices: a
    parser of that one flag reads it."""
    one = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    action = one.add_argument(*names, **{k: v for k, v in options.items() if k != "required"})
    words = [f"{names[0]}={value}"] if isinstance(value, str) else [names[0], *value]
    return getattr(one.parse_args(words), action.dest)


def _out_of_scope_and_unknown(parser, namespace, unknown) -> list:
    """One refusal for the refused Megatron-LM flags (and context / expert parallelism > 1),
    one line for the unknown words, each flag with its values and the closest known flags."""
    given, flag = {}, None
    for word in unknown:
        if word.startswith("--"):
            flag, _, value = word.partition("=")
            given.setdefault(flag, []).extend([value] if value else [])
        elif flag is not None:
            given[flag].append(word)
        else:  # a stray value, e.g. after a store_true flag
            given.setdefault(word, [])
    groups = refused.out_of_scope(given)
    extra = [why for why in (parallel.context_parallel_refusal(namespace),
                             parallel.expert_parallel_refusal(namespace)) if why]
    problems = []
    if groups or extra:
        problems.append(refused.refusal(groups, extra))
    named = {name for names in groups.values() for name in names}
    known = parser.option_strings()
    words = [" ".join([word] + values) + _did_you_mean(word, known)
             for word, values in given.items() if word not in named]
    if words:
        problems.append("unrecognized arguments: " + " ".join(words))
    return problems


def _did_you_mean(word: str, known) -> str:
    close = difflib.get_close_matches(word, known, n=2, cutoff=0.75)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


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
                    performance, grad_buckets):
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


def given_flags(raw) -> frozenset:
    """The flags (`--name`) on the command line `raw`: those --use-checkpoint-args leaves."""
    return frozenset(word.split("=")[0] for word in raw if word.startswith("--"))


def parse_args(argv=None, world_size: int = None) -> RunConfig:
    """Parse, validate and freeze; argparse errors exit 2, `ConfigError` is raised."""
    import sys

    raw = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(model_flags_required="--use-checkpoint-args" not in raw).parse_all(raw)
    if args.use_checkpoint_args:
        apply_checkpoint_args(args, given=given_flags(raw))
        require(args.seq_length is not None, f"--use-checkpoint-args: the checkpoint at "
                f"--load {args.load} holds no --seq-length (saved before it was); give it")
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate_args(args, world_size, torch.cuda.is_available())
