"""The one error type of a bad configuration or input, and flag naming for its messages.

Every module that validates flags or inputs (the config sections, checkpoint loading and its
trust scan, the data and tokenizer checks, the tools) imports from here, so none of them imports
another just to raise.
"""


class ConfigError(ValueError):
    """A bad configuration; the message names the flag that fixes it."""


def flag_name(dest: str) -> str:
    """The command-line flag of an args attribute: `hidden_size` -> `--hidden-size`."""
    return "--" + dest.replace("_", "-")
