"""The whole-model benchmarks end to end on CPU at the tiny preset and one short sequence:
bench/mfu.py (stock megatron-core and ours side by side, two micro batches per optimizer step)
and bench/profile_step.py (the time breakdown of one step of ours); and the uneven-heads mode of
bench/attention_overhead.py (each SP rank's attention time for its own head count)."""

import json
import math

import pytest

from bench_run import run_bench

VARIANTS = ("stock", "ours", "ours-full-tiled")
CATEGORIES = {"communication", "norm", "attention", "optimizer", "loss", "gemm", "rope", "memcpy",
              "elementwise", "other"}


def test_mfu_rows_summary_and_step0_loss(tmp_path):
    out = tmp_path / "mfu.json"
    run = run_bench("mfu.py", "--preset", "tiny", "--backend", "local", "--seqs", "64",
                    "--tokens-per-step", "128", "--variants", ",".join(VARIANTS), "--warmup", "1",
                    "--iters", "1", "--json", out)
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
    assert summary["ours_fp8_over_bf16"] is None  # no FP8 row: FP8 needs TE on a GPU


def test_profile_step_categories_add_up(tmp_path):
    out = tmp_path / "profile.json"
    run = run_bench("profile_step.py", "--preset", "tiny", "--backend", "local", "--seq", "64",
                    "--json", out)
    results = json.loads(out.read_text())
    categories = {row["category"]: row for row in results["categories"]}
    assert set(categories) == CATEGORIES and len(results["categories"]) == len(CATEGORIES)
    assert math.isclose(sum(row["ms"] for row in categories.values()),
                        results["total_kernel_ms"], rel_tol=1e-6)
    assert math.isclose(sum(row["share"] for row in categories.values()), 1.0, rel_tol=1e-6)
    assert categories["gemm"]["ms"] > 0  # the tiny model's matmuls
    assert results["seq"] == 64 and results["step_seconds"] > 0
    assert results["top_kernels"] and all(k["category"] in CATEGORIES
                                          for k in results["top_kernels"])
    assert all(k["category"] == "other" for k in results["other_top"])


def test_attention_overhead_uneven_heads_rows(tmp_path):
    out = tmp_path / "uneven.json"
    run_bench("attention_overhead.py", "--uneven", "7/7@4,28/4@8", "--seqs", "64", "--head-dim",
              "8", "--backends", "sdpa,local", "--warmup", "0", "--iters", "1", "--rounds", "1",
              "--json", out)
    rows = json.loads(out.read_text())["uneven_rows"]
    assert [(r["case"], r["backend"]) for r in rows] == [
        ("7/7@4", "sdpa"), ("7/7@4", "local"), ("28/4@8", "sdpa"), ("28/4@8", "local")]
    for row in rows:
        heads = [2, 2, 2, 1] if row["H"] == 7 else [4] * 4 + [3] * 4
        assert row["heads_per_rank"] == heads and len(row["rank_seconds"]) == row["P"]
        assert row["slowest_s"] == max(row["rank_seconds"]) >= row["mean_s"] > 0
        assert row["imbalance"] == row["slowest_s"] / row["mean_s"]
        assert row["bound"] == pytest.approx(max(heads) / (row["H"] / row["P"]))
