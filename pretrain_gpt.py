"""GPT pretraining with Ulysses sequence parallelism on megatron-core.

    torchrun --nproc-per-node 8 pretrain_gpt.py --ulysses-sp-size 8 <Megatron-LM flags>

`python pretrain_gpt.py --help` lists every flag. A bad configuration, tokenizer or data set
exits with status 2 and one message naming the flag, before any process group exists (token ids
outside the vocabulary are found when a batch is read, and end the run the same way; so does a
NaN loss or a NaN / Inf gradient, before its update, unless --no-check-for-nan-in-loss-and-grad).
"""

import sys
import warnings

# megatron-core announces its fallbacks on import; without apex (and on CPU without TE) they are
# expected here.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")

from megatron_ulysses.training.arguments import ConfigError, parse_args  # noqa: E402
from megatron_ulysses.training.cli import (  # noqa: E402
    report_error,
    run_distributed,
    say_warnings,
)

PROG = "pretrain_gpt.py"

def _report_data_error(error: Exception, config) -> int:
    """A bad batch is found only by the ranks that read it (one data-parallel replica, say):
    the first rank of each such model replica says it; torchrun then stops the other ranks."""
    from megatron_ulysses.sp import parallel_state as ps

    first_of_replica = True
    try:
        if ps.is_initialized():
            from megatron.core import parallel_state as mpu

            first_of_replica = (ps.get_ulysses_sp_rank() == 0
                                and mpu.get_tensor_model_parallel_rank() == 0
                                and mpu.get_pipeline_model_parallel_rank() == 0)
    except (AssertionError, RuntimeError):  # the groups are gone: say it anyway
        pass
    if first_of_replica:
        data_path = config.data.data_path
        data = f" (--data-path {' '.join(data_path)})" if data_path else ""
        print(f"{PROG}: error: {error}{data}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    try:
        config = parse_args(argv)
        say_warnings(PROG, config.warnings)
    except ConfigError as error:
        return report_error(PROG, error)
    from megatron_ulysses.data.datasets import DataError
    from megatron_ulysses.training import exits
    from megatron_ulysses.training.loop import pretrain
    from megatron_ulysses.training.schedule import NonFiniteError

    # DataError: a batch with token ids outside the vocabulary; NonFiniteError: a NaN loss or
    # gradient, found by every rank (--check-for-nan-in-loss-and-grad)
    return run_distributed(PROG, lambda: pretrain(config),
                           {DataError: lambda error: _report_data_error(error, config),
                            NonFiniteError: lambda error: report_error(PROG, error)},
                           ending=lambda: (f"stopped {exits.where()}; "
                                           f"{exits.last_checkpoint(config.checkpoint.save)}"))


if __name__ == "__main__":
    sys.exit(main())
