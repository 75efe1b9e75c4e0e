"""bench/flash_attention.py end to end on CPU: its fp32 reference (GQA, one kv group at a time)
against torch SDPA's math kernel, both modes timed, and backends that cannot run here (TE, FA4:
no GPU) reported without stopping the run."""

import json

from bench_run import run_bench


def test_flash_attention_bench_on_cpu(tmp_path):
    run_bench("flash_attention.py", "--backends", "sdpa-math,fa4,te", "--shapes", "4/2/8,3/1/16",
              "--seqs", "48", "--check-seq", "40", "--warmup", "0", "--iters", "1", "--rounds",
              "1", "--out", tmp_path)
    results = json.loads((tmp_path / "flash_attention.json").read_text())
    checks = {row["shape"]: row for row in results["checks"] if row["backend"] == "sdpa-math"}
    assert sorted(checks) == ["3/1/16", "4/2/8"]
    for row in checks.values():
        assert row["ok"] and set(row["errors"]) == {"out", "dq", "dk", "dv"}, row
        assert all(e["rel"] < 1e-5 for e in row["errors"].values()), row
    timed = {(r["shape"], r["mode"]) for r in results["rows"] if r["backend"] == "sdpa-math"}
    assert timed == {(shape, mode) for shape in checks for mode in ("fwd", "fwd+bwd")}
    assert all(r["tflops"] > 0 and r["s"] == 48 for r in results["rows"]), results["rows"]
    # Without a GPU both fail, to build or in the check, and are reported, not timed.
    assert all(set(failed) == {"fa4", "te"} for failed in results["not_built"].values())
    assert "| 4/2/8 | 48 | fwd+bwd | sdpa-math |" in (tmp_path / "flash_attention.md").read_text()

