"""Run a script of this repository (pretrain_gpt.py, tools/eval_passkey.py) as one rank of a
torchrun job whose ranks share ONE GPU over gloo, for the tests only:

    torchrun --standalone --nproc-per-node 2 tests/gpu/gloo_launcher.py pretrain_gpt.py \\
        --distributed-backend gloo --ulysses-sp-size 2 ...

NCCL refuses two ranks on one GPU; gloo moves CUDA tensors for every collective the trainer
uses (all_reduce, reduce_scatter, all_gather, all_to_all_single, objects) but has no
coalescing for them: `torch.distributed._coalescing_manager`, which megatron-core's DDP wraps
around each bucket group's gradient reduce-scatter / all-reduce and parameter all-gather, fails
there. This launcher replaces it in megatron-core's `param_and_grad_buffer` (the only module the
trainer reaches it through) by a manager under which each collective runs on its own, then
runs the script as `python SCRIPT ARGS` would. The package itself is never patched: on NCCL the
coalesced path stays what users run. gloo's send/recv of CUDA tensors fails too, so pipeline
parallelism cannot run this way.
"""

import contextlib
import os
import runpy
import sys

import megatron.core.distributed.param_and_grad_buffer as param_and_grad_buffer

ENTERED = [0]  # how often megatron-core entered the manager: the tests check it did


class _Finished:
    """What the manager yields: megatron-core keeps it as the bucket group's handle only for
    asynchronous collectives (and calls `wait()`), which `one_by_one` refuses; synchronous ones
    are finished when they return."""

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def one_by_one(group=None, device=None, async_ops=False):
    """`torch.distributed._coalescing_manager`'s signature: the collectives issued inside run
    one at a time, synchronously, as without the manager. Asynchronous ones
    (--overlap-grad-reduce, --overlap-param-gather) would return handles the call sites drop
    (they wait on the manager instead), so they are refused rather than left unwaited."""
    if async_ops:
        raise RuntimeError("tests/gpu/gloo_launcher.py runs megatron-core's bucket collectives "
                           "synchronously; drop --overlap-grad-reduce / --overlap-param-gather")
    ENTERED[0] += 1
    yield _Finished()


def patch() -> None:
    if not hasattr(param_and_grad_buffer, "_coalescing_manager"):  # a megatron-core that moved it
        raise RuntimeError("megatron.core.distributed.param_and_grad_buffer has no "
                           "_coalescing_manager to replace; update tests/gpu/gloo_launcher.py")
    param_and_grad_buffer._coalescing_manager = one_by_one


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: torchrun ... tests/gpu/gloo_launcher.py SCRIPT [ARGS...]")
    patch()
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` puts its folder first
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # the script ends in sys.exit
        if os.environ.get("RANK", "0") == "0":
            print(f"gloo_launcher: {ENTERED[0]} bucket collective groups ran one by one",
                  file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
