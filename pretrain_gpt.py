"""GPT pretraining with Ulysses sequence parallelism on megatron-core.

    torchrun --nproc-per-node 8 pretrain_gpt.py --ulysses-sp-size 8 <Megatron-LM flags>

`python pretrain_gpt.py --help` lists every flag. A bad configuration, tokenizer or data set
exits with status 2 and one message naming the flag, before any process group exists (token ids
outside the vocabulary are found when a batch is read, and end the run the same way).
"""

import os
import sys
import time
import traceback
import warnings

# megatron-core announces its fallbacks on import; without apex (and on CPU without TE) they are
# expected here.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")

from megatron_ulysses.training.arguments import ConfigError, parse_args  # noqa: E402

RANK_0_GRACE_S = 30  # how long the other ranks give rank 0 to report an error and exit


def _is_rank_0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _report(error: Exception) -> int:
    """Every rank finds the same configuration error; rank 0 says it. The others wait before
    they exit: torchrun stops every rank as soon as one exits, which could otherwise be before
    rank 0 has written the message; rank 0's exit ends the wait. A rank still alive after it
    (rank 0 did not find the error) says it itself."""
    if not _is_rank_0():
        time.sleep(RANK_0_GRACE_S)
    print(f"pretrain_gpt.py: error: {error}", file=sys.stderr, flush=True)
    return 2


def _report_data_error(error: Exception, config) -> int:
    """A bad batch is found only by the ranks that read it (one data-parallel replica, say):
    the first rank of each such model replica says it; torchrun then stops the other ranks."""
    from megatron_ulysses import parallel_state as ps

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
        print(f"pretrain_gpt.py: error: {error}{data}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    try:
        config = parse_args(argv)
        if _is_rank_0():
            for warning in config.warnings:
                print(f"pretrain_gpt.py: warning: {warning}", file=sys.stderr)
    except ConfigError as error:
        return _report(error)
    import torch.distributed as dist

    from megatron_ulysses import parallel_state as ps
    from megatron_ulysses.data.datasets import DataError
    from megatron_ulysses.training.loop import pretrain

    try:
        pretrain(config)
    except ConfigError as error:  # tokenizer and data files, or a --load that does not match
        return _leave(_report(error))
    except DataError as error:  # a batch with token ids outside the vocabulary
        return _leave(_report_data_error(error, config))
    except BaseException:
        if not _alone():
            traceback.print_exc()
            _leave(1)
        raise
    finally:  # reached on success, or alone (with several ranks an error left above)
        if ps.is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _alone() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_world_size() == 1


def _leave(code: int) -> int:
    """After an error in training with several ranks, exit at once: the others may be inside a
    collective this rank will never join, and tearing the process groups down can wait for them
    until the timeout; torchrun stops them when this rank exits. Alone, return the code."""
    if not _alone():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
