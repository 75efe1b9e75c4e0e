"""Test-only: every Python process the suite starts (pretrain_gpt.py ranks, torchrun, the tools,
spawned workers) skips the garbage collection of interpreter shutdown, which walks the ~400k
objects torch and megatron-core leave and costs 2-3 s per process on CI's cores. conftest.py puts
this directory on PYTHONPATH.

The hook runs last among the atexit handlers (it is registered first), so every cleanup a
process registers (multiprocessing's, torch's, megatron-core's) still runs as it does for a
user; only the final collection of what is left is skipped, as os._exit would. A
sitecustomize this shadows (a distribution's) is still imported."""

import atexit
import gc
import importlib
import os
import sys

atexit.register(gc.freeze)


def _import_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop(__name__)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module(__name__)
    except ModuleNotFoundError as error:  # none to shadow
        if error.name != __name__:
            raise
    finally:
        sys.path[:] = saved
        sys.modules[__name__] = ours


_import_shadowed()
