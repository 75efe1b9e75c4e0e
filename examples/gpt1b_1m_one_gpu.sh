#!/usr/bin/env bash
# A 10^6-token sequence on ONE GPU: the Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 kv
# heads, ffn 8192, vocab 128256, RoPE base 500000, untied), bf16, one sequence of SEQ_LENGTH tokens
# per step. What makes it fit (bench/RESULTS.md, "Memory model"):
#   full recompute (uniform, 1 layer)  keeps one [s, h] checkpoint per layer (4 KB per token);
#   --offload-activations              moves those checkpoints to pinned host memory (~65 GiB);
#   --tiled-mlp-shards auto            never holds the [s, ffn] MLP intermediate whole;
#   --tiled-loss-shards auto           never holds the [s, V] logits (256 KB per token) whole.
# On an H200 (141 GB, 128 GiB host RAM) one step peaks near 80 GiB on the GPU; see bench/RESULTS.md
# for the measured step time, TFLOP/s and host memory.
#
# Usage, from the repository root:
#   bash examples/gpt1b_1m_one_gpu.sh                      # --mock-data, 1 step
#   TRAIN_ITERS=4 SEQ_LENGTH=524288 bash examples/gpt1b_1m_one_gpu.sh
#   DATA_PATH=data/long_text_document TOKENIZER_MODEL=/models/Llama-3.2-1B \
#       bash examples/gpt1b_1m_one_gpu.sh        # a HuggingFaceTokenizer folder
# SEQ_LENGTH [1000064] is 10^6 rounded up to a multiple of 128, keeping [s, h] under 2^31
# elements; past 699050 tokens per rank TE's fused RoPE would overflow its 32-bit offsets, so the
# trainer runs RoPE unfused there (it says so once). Other variables: see common.sh
# (TRAIN_ITERS [1], LR, VOCAB_SIZE [128256], ...); extra arguments go to pretrain_gpt.py.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

SEQ_LENGTH=${SEQ_LENGTH:-1000064}
TRAIN_ITERS=${TRAIN_ITERS:-1}
RUN_DIR=${RUN_DIR:-runs/gpt1b_1m}
LOG_FILE=${LOG_FILE:-$RUN_DIR/train_$(date +%Y%m%d_%H%M%S).log}
SP=1 GLOBAL_BATCH=1 WARMUP_ITERS=0

export_train_env
set_data_args HuggingFaceTokenizer 128256
set_model_args 16 2048 32 8 8192 1e-5 500000
set_train_args
mkdir -p "$RUN_DIR"
echo "logging to $LOG_FILE" >&2
torchrun --standalone --nproc-per-node 1 pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${SP_ARGS[@]}" "${OPTIM_ARGS[@]}" "${RECOMPUTE_ARGS[@]}" \
    --offload-activations --tiled-mlp-shards auto --tiled-loss-shards auto \
    "${TOKENIZER_ARGS[@]}" "${DATA_ARGS[@]}" \
    --eval-iters 0 --log-interval 1 "$@" 2>&1 | tee -a "$LOG_FILE"
