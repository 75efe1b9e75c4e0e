"""The logging section: how often the loop logs, and TensorBoard."""

from dataclasses import dataclass
from typing import Optional

from .checks import Context, check_output_dir, check_positive, check_range


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: Optional[str]


def add_arguments(parser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="TensorBoard gets a point every --log-interval")


def check_values(args) -> None:
    check_positive(args, "log_interval")
    check_range(args, "tensorboard_log_interval", low=1)


def validate(args, ctx: Context) -> None:
    check_output_dir(args, "tensorboard_dir")
