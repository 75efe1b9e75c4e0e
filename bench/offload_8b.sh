#!/usr/bin/env bash
# Longest sequence of the Llama-3.1-8B shape on ONE GPU with optimizer CPU offload and the memory
# features (examples/llama3_8b_one_gpu.sh): each length of SEQS is its own short run (a fresh
# process, ITERS iterations, bounded by `timeout`), in increasing order; the first failure (GPU
# OOM, host OOM kill, timeout) ends the sweep. Per length it records the last iteration's step
# time, TFLOP/s and MFU (against 989 TFLOP/s dense bf16, the FLOPs of bench/mfu.py: 6 x matmul
# params x s + 6 x layers x s^2 x h, recompute not counted), peak GPU memory
# (max_memory_allocated), the process's peak RSS (pinned offload buffers included) and the
# machine's peak used host memory (MemTotal - MemAvailable, sampled every 2 s).
#
# Usage on the GPU machine, from the repository root, with Transformer Engine installed and
# `export PYTHONPATH=$PWD:$PYTHONPATH` (bench/RESULTS.md, "Setup"):
#   OUT=$OUT bash bench/offload_8b.sh                                  # SEQS below, F = 0.3
#   SEQS="262144" OFFLOAD_FRACTION=0.35 OUT=$OUT bash bench/offload_8b.sh    # more GPU margin
# Extra arguments go to pretrain_gpt.py. Writes $OUT/offload_8b.json and $OUT/offload_8b.md, and
# each run's log ($OUT/s<SEQ>.log). DEADLINE_S [570] bounds the whole sweep (e.g. to fit a job's
# time limit): a length is started only with at least MIN_RUN_S [150] left, and is cut at
# the deadline (status "timeout"). Rough cost on an H200 (at ~350 TFLOP/s): start-up ~1-2 min,
# then ~65 s a step at 128K, ~130 s at 192K, ~210 s at 256K; so 256K with ITERS=2 wants a run
# of its own (SEQS=262144).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/offload_8b}
SEQS=${SEQS:-"131072 196608 262144 327680"}
ITERS=${ITERS:-2}
DEADLINE_S=${DEADLINE_S:-570}
MIN_RUN_S=${MIN_RUN_S:-150}
export OFFLOAD_FRACTION=${OFFLOAD_FRACTION:-0.3}
mkdir -p "$OUT"
: > "$OUT/runs.txt"
start=$(date +%s)

sample_host_used() {  # the machine's peak used memory in GiB, every 2 s, into $1
    local peak=0 used
    while true; do
        used=$(awk '/MemTotal/ {t = $2} /MemAvailable/ {a = $2} END {print t - a}' /proc/meminfo)
        (( used > peak )) && peak=$used && echo "$peak" > "$1"
        sleep 2
    done
}

for seq in $SEQS; do
    left=$(( DEADLINE_S - ($(date +%s) - start) ))
    if (( left < MIN_RUN_S )); then
        echo "$seq not_run 0 0" >> "$OUT/runs.txt"
        echo "s=$seq: not run ($left s left of DEADLINE_S)" >&2
        continue
    fi
    echo 0 > "$OUT/host_used_$seq.kib"
    sample_host_used "$OUT/host_used_$seq.kib" &
    sampler=$!
    t0=$(date +%s)
    SEQ_LENGTH=$seq TRAIN_ITERS=$ITERS RUN_DIR="$OUT/run_$seq" LOG_FILE="$OUT/s$seq.log" \
        timeout -k 20 "$left" bash examples/llama3_8b_one_gpu.sh "$@" > /dev/null 2>&1
    rc=$?
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
    echo "$seq $rc $(( $(date +%s) - t0 )) $(cat "$OUT/host_used_$seq.kib")" >> "$OUT/runs.txt"
    echo "s=$seq: exit $rc after $(( $(date +%s) - t0 )) s" >&2
    (( rc == 0 )) || break
done

python3 - "$OUT" "$ITERS" "$OFFLOAD_FRACTION" "$*" <<'PY'
import json, re, sys
from pathlib import Path

out, iters, fraction, extra = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
PEAK_TFLOPS = 989.0
LINE = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): (\S+) \|.*"
                  r"TFLOP/s per GPU: (\S+) \|.*lm loss: (\S+) \|.*grad norm: (\S+) \|.*"
                  r"peak memory \(GiB\): (\S+) \|(?: peak host memory \(GiB\): (\S+) \|)?")


def status(rc, log):
    if rc == 0:
        return "ok"
    if rc in (124, 137) and "Signal 9" not in log:
        return "timeout"
    if "out of memory" in log.lower() or "OutOfMemoryError" in log:
        return "GPU OOM"
    if "Signal 9" in log or "SIGKILL" in log or rc == 137:
        return "killed (host OOM?)"
    return f"failed (exit {rc})"


rows = []
for line in (out / "runs.txt").read_text().split("\n"):
    if not line.strip():
        continue
    seq, rc, seconds, host_kib = line.split()
    row = {"s": int(seq), "wall_s": int(seconds),
           "host_used_peak_gib": int(host_kib) / 2**20}
    if rc == "not_run":
        rows.append(dict(row, status="not run (time)"))
        continue
    log_path = out / f"s{seq}.log"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    its = [m.groups() for m in LINE.finditer(log)]
    row["status"] = status(int(rc), log)
    row["iterations"] = [{"iteration": int(i), "step_s": float(ms) / 1e3, "tflops": float(tf),
                          "mfu": float(tf) / PEAK_TFLOPS, "loss": float(loss), "grad_norm": gn,
                          "peak_gpu_gib": float(gpu),
                          "peak_rss_gib": float(rss) if rss else None}
                         for i, ms, tf, loss, gn, gpu, rss in its]
    if row["status"] != "ok":
        row["log_tail"] = log[-1500:]
    rows.append(row)
summary = {"model": "Llama-3.1-8B shape, one GPU", "iters": iters,
           "optimizer_offload_fraction": fraction, "extra_args": extra, "rows": rows}
(out / "offload_8b.json").write_text(json.dumps(summary, indent=1))
lines = [f"Llama-3.1-8B shape, one GPU, --optimizer-offload-fraction {fraction:g} {extra}; "
         f"last of {iters} iterations", "",
         "| s | status | s/step | TFLOP/s | MFU | peak GPU GiB | peak RSS GiB | host used GiB "
         "| loss | grad norm |", "|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    last = (r.get("iterations") or [None])[-1]
    cells = ["", "", "", "", "", "", "", ""]
    if last:
        cells = [f"{last['step_s']:.1f}", f"{last['tflops']:.1f}", f"{100 * last['mfu']:.1f}%",
                 f"{last['peak_gpu_gib']:.1f}",
                 f"{last['peak_rss_gib']:.1f}" if last["peak_rss_gib"] else "",
                 f"{r['host_used_peak_gib']:.1f}", f"{last['loss']:.4f}", last["grad_norm"]]
    elif "host_used_peak_gib" in r and r["status"] != "not run (time)":
        cells[5] = f"{r['host_used_peak_gib']:.1f}"
    lines.append(f"| {r['s']:,} | {r['status']} | " + " | ".join(cells) + " |")
(out / "offload_8b.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
