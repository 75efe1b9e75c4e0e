#!/usr/bin/env bash
# Cost of --deterministic-mode on one GPU: the same run (Llama-like, 8 layers, h 2048, 32/8 heads,
# s 8192, bf16, TE, distributed optimizer) with and without it, one after the other; prints the
# mean ms per iteration of iterations 4..ITERS and the ratio. Usage: bash bench/deterministic_mode.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS=${ITERS:-12}
run() {
    python3 pretrain_gpt.py --num-layers 8 --hidden-size 2048 --num-attention-heads 32 \
        --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 --swiglu \
        --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
        --untie-embeddings-and-output-weights --seq-length 8192 --micro-batch-size 1 \
        --global-batch-size 2 --lr 3e-4 --train-iters "$ITERS" --log-interval 1 --eval-iters 0 \
        --mock-data --vocab-size 32000 --bf16 --use-distributed-optimizer \
        --ulysses-attention-backend te --num-workers 0 "$@" 2>&1 \
        | sed -n 's/.*iteration *\([0-9]*\)\/.*per iteration (ms): \([0-9.]*\).*/\1 \2/p' \
        | awk '$1 >= 4 { s += $2; n++ } END { printf "%.1f\n", s / n }'
}
plain=$(run)
deterministic=$(run --deterministic-mode)
echo "ms/iteration: default $plain, --deterministic-mode $deterministic," \
     "ratio $(awk "BEGIN { printf \"%.3f\", $deterministic / $plain }")"
