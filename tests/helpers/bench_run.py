"""Runs a bench/ script as a user would, on CPU with one thread per process (the smoke tests of
bench/mfu.py, profile_step.py, attention_overhead.py, flash_attention.py, memory_record.py and
memory_plan.py)."""

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(script: str, *args, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python bench/<script> args...`; the finished process, its exit status checked to be 0."""
    run = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)],
                         capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run
