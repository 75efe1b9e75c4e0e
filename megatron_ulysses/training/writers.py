"""Where the training scalars go besides stdout: TensorBoard (--tensorboard-dir) and W&B
(--wandb-project, the optional `wandb` extra), the same tags to both. Rank 0 writes: unlike
Megatron-LM, whose loss lives on the last pipeline stage (hence its writers on the last rank),
every rank here holds the global loss, and rank 0 prints the log line."""

import dataclasses

import torch.distributed as dist

from . import wandb_run


def _flat_config(config) -> dict:
    """The run's flags as one flat dict (W&B's run config, as Megatron-LM passes `vars(args)`)."""
    flat = {}
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            flat.update(dataclasses.asdict(value))
    return flat


class ScalarWriters:
    """`add_scalar(tag, value, step)` to TensorBoard and W&B (either may be off); the interface
    megatron-core's `Timers.write` takes, so timers reach both."""

    def __init__(self, config):
        """`config`: the `RunConfig`; nothing is opened off rank 0."""
        logging = config.logging
        self.tensorboard = self.wandb = None
        self.backends = int(bool(logging.tensorboard_dir)) + int(bool(logging.wandb_project))
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        if logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=logging.tensorboard_dir,
                                             max_queue=logging.tensorboard_queue_size)
        if logging.wandb_project:
            self.wandb = wandb_run.start(logging, _flat_config(config))

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def add_scalar(self, tag: str, value, step: int) -> None:
        if value is None:
            return
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log({tag: value}, step=step)

    def timer_writers(self) -> list:
        """What megatron-core's `Timers.write` writes to (a SummaryWriter, the wandb module): one
        entry per configured backend on every rank, since each write is a collective; None off
        rank 0 and for a backend that did not start (a failed `wandb.init`)."""
        writers = [self.tensorboard] if self.tensorboard is not None else []
        if self.wandb is not None:
            import wandb

            writers.append(wandb)
        return writers + [None] * (self.backends - len(writers))

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
