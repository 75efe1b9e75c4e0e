"""bench/mfu.py end to end on CPU: the tiny preset at one short sequence, stock megatron-core and
ours side by side, two micro batches per optimizer step."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("stock", "ours", "ours-full-tiled")


def test_mfu_rows_summary_and_step0_loss(tmp_path):
    out = tmp_path / "mfu.json"
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "mfu.py"), "--preset", "tiny",
         "--backend", "local", "--seqs", "64", "--tokens-per-step", "128",
         "--variants", ",".join(VARIANTS), "--warmup", "1", "--iters", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = {row["key"]: row for row in results["rows"]}
    assert sorted(rows) == sorted(VARIANTS)
    for row in rows.values():
        assert "error" not in row, row
        assert row["s"] == 64 and row["num_microbatches"] == 2 and row["mfu"] > 0, row
        assert math.isfinite(row["loss_step0"]), row
    assert rows["stock"]["variant"].startswith("stock")
    assert rows["ours"]["variant"].startswith("ours")
    # Same flags, seed and batch, megatron-core's local attention on both sides, fp32 on CPU:
    # the trainer's first loss is stock megatron-core's, exactly.
    assert rows["ours"]["loss_step0"] == rows["stock"]["loss_step0"]

    [summary] = results["summary"]
    assert summary["s"] == 64 and summary["best_stock"] == "stock"
    assert summary["best_ours"] in {rows["ours"]["variant"], rows["ours-full-tiled"]["variant"]}
    assert summary["ratio"] == summary["mfu_ours"] / summary["mfu_stock"] > 0
