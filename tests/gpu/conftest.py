"""The GPU suite: skipped as a whole without CUDA (the CPU CI collects and skips it).

On the H200: `bash tests/gpu/run.sh` after `../shared/device/prepare_te.sh` (see its header).
"""

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # tests/distributed.py, tests/conftest.py's fixtures


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU suite: needs CUDA (run tests/gpu/run.sh on a GPU)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
