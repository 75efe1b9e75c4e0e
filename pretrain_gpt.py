"""GPT pretraining with Ulysses sequence parallelism on megatron-core.

    torchrun --nproc-per-node 8 pretrain_gpt.py --ulysses-sp-size 8 <Megatron-LM flags>

`python pretrain_gpt.py --help` lists every flag. A bad configuration exits with status 2 and one
message naming the flag, before any process group exists.
"""

import os
import sys

from megatron_ulysses.training.arguments import ConfigError, parse_args


def _report(error: ConfigError) -> int:
    """Every rank finds the same configuration error; rank 0 says it."""
    if os.environ.get("RANK", "0") == "0":
        print(f"pretrain_gpt.py: error: {error}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as error:
        return _report(error)
    import torch.distributed as dist

    from megatron_ulysses import parallel_state as ps
    from megatron_ulysses.training.loop import pretrain

    try:
        pretrain(args)
    except ConfigError as error:  # data or tokenizer files, checked before any collective
        return _report(error)
    finally:
        if ps.is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main())
