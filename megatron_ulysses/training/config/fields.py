"""A config section's flags, declared once on its dataclass: each field's `flag(...)` carries
the flag's default, help and argparse options; `add_flags` makes the section's argparse group.

Derived from the field where not given: the flag name (`--field-name`), `dest` (the field),
`type` (int / float from the annotation) and a switch's action (store_true for a False default,
store_false for True: its `names` say `--no-...`). A flag annotated `ClassVar[...]` and
declared `kept=False` is one the section's rules read but the frozen config does not keep (no
field, no attribute).
"""

import dataclasses
import typing
from dataclasses import dataclass
from typing import Optional, Tuple

_NONE = type(None)


@dataclass(frozen=True)
class Flag:
    """One flag's declaration (`flag` puts it in its field's metadata)."""

    default: object
    help: Optional[str]
    names: Tuple[str, ...]
    needs: Optional[str]  # the flag that turns this option's feature on (`off_without`)
    cpu: bool  # the option also runs without CUDA
    options: dict  # argparse's: choices, nargs, type, metavar, action, required


def flag(default=None, help=None, *, names=(), needs=None, cpu=False, kept=True,
         field_default=False, **options):
    """The dataclass field of one flag. `field_default`: the dataclass takes `default` (a list
    becomes a tuple) as its own; `kept=False`: a `ClassVar` flag (see the module)."""
    meta = {"flag": Flag(default, help, tuple(names), needs, cpu, options)}
    if field_default and kept:
        value = tuple(default) if isinstance(default, list) else default
        return dataclasses.field(default=value, metadata=meta)
    return dataclasses.field(metadata=meta)


def flags_of(cls, inherited: bool = False):
    """(field name, `Flag`) of `cls`'s flag fields, in declaration order (its own only, unless
    `inherited`)."""
    own = vars(cls).get("__annotations__", {})
    return [(f.name, f.metadata["flag"]) for f in cls.__dataclass_fields__.values()
            if "flag" in f.metadata and (inherited or f.name in own)]


def option_of(cls, name: str) -> str:
    """The flag of field `name` as the command line names it (its first name)."""
    spec = dict(flags_of(cls, inherited=True))[name]
    return spec.names[0] if spec.names else "--" + name.replace("_", "-")


def add_flags(parser, cls, title: str, description: str = None, required: bool = True):
    """The argparse group `title` of `cls`'s own flag fields (`required=False`: none is, as
    with --use-checkpoint-args). A `dest` option makes an alias that sets another field."""
    group = parser.add_argument_group(title, description)
    hints = typing.get_type_hints(cls)
    for name, spec in flags_of(cls):
        options = {"default": spec.default, **spec.options}
        if not required:
            options.pop("required", None)
        annotation = hints[name]
        if typing.get_origin(annotation) is typing.ClassVar:
            annotation = typing.get_args(annotation)[0]
        base = [t for t in typing.get_args(annotation) if t is not _NONE] or [annotation]
        if base == [bool] and not {"action", "nargs", "type"} & set(options):
            options["action"] = "store_false" if spec.default else "store_true"
            options.pop("default", None)
        elif len(base) == 1 and base[0] in (int, float) and "action" not in options:
            options.setdefault("type", base[0])
        options.setdefault("dest", name)
        group.add_argument(*(spec.names or ("--" + name.replace("_", "-"),)), help=spec.help,
                           **options)
    return group


def given(args, cls, names=None) -> list:
    """The flags of `cls`'s fields (`names`: those only, in that order) given a value other
    than their default."""
    specs = dict(flags_of(cls, inherited=True))
    return [option_of(cls, name) for name in (names or specs)
            if getattr(args, name) != specs[name].default]


def off_fields(cls, feature: str) -> list:
    """(field name, `Flag`) of `cls`'s options that need `feature`."""
    return [(name, spec) for name, spec in flags_of(cls, inherited=True) if spec.needs == feature]


def off_without(cls, feature: str) -> tuple:
    """(flag, field, default) of `cls`'s options that need `feature` (`checks.ignore_without`)."""
    return tuple((option_of(cls, name), name, spec.default)
                 for name, spec in off_fields(cls, feature))
