"""What every config section's flags and rules use: the validation context, the checks that raise
one `ConfigError` naming the flag, and the argparse value types."""

import argparse
import dataclasses
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import List

from ...errors import ConfigError, flag_name
from ...memory.tiling import check_num_tiles
from ...sp.parallel_state import ParallelDims


@dataclass
class Context:
    """What the rules know beyond the flags: the parallel layout (its `world_size` is the number
    of processes), whether CUDA is there, and the warnings said once by rank 0 (pretrain_gpt.py)."""

    dims: ParallelDims
    cuda: bool
    warnings: List[str] = field(default_factory=list)


def section_of(cls, args: argparse.Namespace):
    """The frozen section `cls` of the validated flags: each field is the flag of its name."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)})


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def ignore_without(args, ctx: Context, feature: str, options) -> None:
    """`options` ((flag, dest, default) each) of a feature that is off (`feature`: the flag
    that turns it on). Megatron-LM reads them only with it, so they change nothing: those given
    are said once, and all are set back to their defaults (the run is the one without them)."""
    given = [flag for flag, dest, default in options if getattr(args, dest) != default]
    if not given:
        return
    ctx.warnings.append(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect "
                        f"without {feature} (as in Megatron-LM): ignored")
    for _, dest, default in options:
        setattr(args, dest, default)


def check_range(args, name: str, low=None, high=None, low_open=False, high_open=False,
                optional=False) -> None:
    """``--name`` must lie in the interval (``None`` ends are unbounded); NaN never does."""
    value = getattr(args, name)
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if ok and isinstance(value, float) and math.isinf(value):
        ok = False
    if not ok:
        if low is not None and high is not None:
            interval = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            interval = ("positive" if low == 0 and low_open else
                        f"{'>' if low_open else '>='} {low}")
        else:
            interval = f"{'<' if high_open else '<='} {high}"
        raise ConfigError(f"{flag_name(name)} must be {interval}, got {value}")


def check_positive(args, *names: str) -> None:
    """Each ``--name`` must be > 0 (given: these flags have no `None` default)."""
    for name in names:
        require(getattr(args, name) > 0,
                f"{flag_name(name)} must be positive, got {getattr(args, name)}")


def check_writable_dir(path: str, flag: str) -> None:
    """``path`` is, or can be created as, a directory this process can write: a directory is
    made and removed again in it or in its nearest existing parent (as root, permission bits say
    nothing), so nothing is left behind and a bad path fails now, not after training."""
    target = os.path.abspath(path)
    probe_in = target
    while not os.path.exists(probe_in):
        parent = os.path.dirname(probe_in)
        if parent == probe_in:
            break
        probe_in = parent
    if not os.path.isdir(probe_in):
        where = "is a file" if probe_in == target else f"is under the file {probe_in!r}"
        raise ConfigError(f"{flag} {path!r} {where}, not a directory; give a directory path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_test_", dir=probe_in))
    except OSError as error:
        inside = "it" if probe_in == target else f"its parent {probe_in!r}"
        raise ConfigError(f"{flag} {path!r} is not writable: cannot create a directory in "
                          f"{inside} ({error.strerror}); give a writable {flag}") from None


def check_output_dir(args, name: str) -> None:
    """An optional output directory flag (``--save``, ...): writable if given."""
    if getattr(args, name) is not None:
        check_writable_dir(getattr(args, name), flag_name(name))


def tiles(value: str):
    """`--tiled-*-shards`: a positive int or 'auto' (`tiling.check_num_tiles`)."""
    try:
        number = value if value == "auto" else int(value)
        check_num_tiles(number, "the value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return number


def number(value: str):
    """An int when integral ('4' -> 4), else a float."""
    try:
        parsed = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}")
    return int(parsed) if parsed.is_integer() else parsed
