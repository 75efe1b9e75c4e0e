"""config/fields.py: a section's flags declared on its dataclass fields make the argparse group
(names, dest, types and switches derived from the field), and the declarations answer which
flags were given and which options need a feature."""

import argparse
import dataclasses
from typing import ClassVar, Optional, Tuple

import pytest

from megatron_ulysses.training.config import fields
from megatron_ulysses.training.config.fields import add_flags, flag


@dataclasses.dataclass(frozen=True)
class Section:
    size: int = flag(2, "a count")
    rate: Optional[float] = flag(None)
    kind: str = flag("a", choices=("a", "b"))
    on: bool = flag(False, needs="--kind b")
    fused: bool = flag(True, names=("--no-fused", "--disable-fused"), needs="--kind b")
    words: Tuple[str, ...] = flag([], nargs="+")
    read_only: ClassVar[int] = flag(0, names=("--read-only-flag",), kept=False)
    derived: int  # no flag


def _parse(argv):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, Section, "section")
    return parser.parse_args(argv)


def test_defaults_and_derived_options():
    args = _parse([])
    assert vars(args) == {"size": 2, "rate": None, "kind": "a", "on": False, "fused": True,
                          "words": [], "read_only": 0}
    args = _parse(["--size", "3", "--rate", "0.5", "--kind", "b", "--on", "--disable-fused",
                   "--words", "x", "y", "--read-only-flag", "7"])
    assert (args.size, args.rate, args.kind, args.on, args.fused, args.words,
            args.read_only) == (3, 0.5, "b", True, False, ["x", "y"], 7)
    with pytest.raises(argparse.ArgumentError, match="invalid int value: 'x'"):
        _parse(["--size", "x"])
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        _parse(["--kind", "c"])


def test_a_classvar_flag_is_not_a_field_nor_an_attribute():
    assert "read_only" not in {f.name for f in dataclasses.fields(Section)}
    config = Section(size=2, rate=None, kind="a", on=False, fused=True, words=(), derived=1)
    assert not hasattr(config, "read_only") and "read_only" not in repr(config)


def test_field_default_makes_the_dataclass_default():
    @dataclasses.dataclass(frozen=True)
    class WithDefaults:
        words: Tuple[str, ...] = flag(["x"], nargs="+", field_default=True)

    assert WithDefaults().words == ("x",)


def test_given_and_options_of_a_feature():
    args = _parse(["--on", "--no-fused", "--size", "2"])
    assert fields.given(args, Section) == ["--on", "--no-fused"]
    assert fields.given(args, Section, ["fused", "on"]) == ["--no-fused", "--on"]
    assert fields.off_without(Section, "--kind b") == (("--on", "on", False),
                                                      ("--no-fused", "fused", True))


@dataclasses.dataclass(frozen=True)
class Aliased:
    width: int = flag(None, required=True)
    style: str = flag("plain", choices=("plain", "rope"))
    old_style: ClassVar[str] = flag(None, action="store_const", const="rope", dest="style",
                                    kept=False)


def _parse_aliased(argv, required=True):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, Aliased, "aliased", required=required)
    return parser.parse_args(argv)


def test_a_dest_alias_sets_the_other_field_and_the_last_given_wins():
    assert _parse_aliased(["--width", "1"]).style == "plain"
    assert _parse_aliased(["--width", "1", "--old-style"]).style == "rope"
    assert _parse_aliased(["--width", "1", "--old-style", "--style", "plain"]).style == "plain"
    assert not hasattr(_parse_aliased(["--width", "1"]), "old_style")


def test_required_false_makes_no_flag_required():
    with pytest.raises(SystemExit):
        _parse_aliased([])
    assert _parse_aliased([], required=False).width is None
