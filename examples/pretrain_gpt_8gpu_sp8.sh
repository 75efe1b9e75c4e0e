#!/usr/bin/env bash
# ~1.1B Llama-like GPT on one node of 8 GPUs: Ulysses SP 8 (DP 1), 128K-token sequences
# (16K tokens per GPU), bf16, full recompute, distributed optimizer.
#
# Usage, from the repository root:
#   DATA_PATH=data/my_text_document TOKENIZER_MODEL=data/tokenizer.model \
#       bash examples/pretrain_gpt_8gpu_sp8.sh
#   bash examples/pretrain_gpt_8gpu_sp8.sh                 # no DATA_PATH: --mock-data
#   TRAIN_ITERS=20 SEQ_LENGTH=32768 bash examples/pretrain_gpt_8gpu_sp8.sh --eval-iters 1
# DATA_PATH is a Megatron --data-path (a prefix, or a blend "0.7 pfx_a 0.3 pfx_b"). Every
# UPPER_CASE variable below, and those of common.sh (TRAIN_ITERS, LR, ATTN_BACKEND, VOCAB_SIZE of
# the mock-data NullTokenizer, ...), can be set in the environment; extra arguments go to
# pretrain_gpt.py.
# Plot the run: python tools/plot_run.py "$LOG_FILE" (or "$TB_DIR").
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

GPUS=${GPUS:-8}
SP=${SP:-8}                          # --ulysses-sp-size; DP = GPUS / SP
SEQ_LENGTH=${SEQ_LENGTH:-131072}
GLOBAL_BATCH=${GLOBAL_BATCH:-8}      # 8 x 128K = 1M tokens per step
RUN_DIR=${RUN_DIR:-runs/gpt1b_sp8}
LOG_FILE=${LOG_FILE:-$RUN_DIR/train_$(date +%Y%m%d_%H%M%S).log}

export_train_env
set_data_args GPTSentencePieceTokenizer 32000
set_gpt1b_args

mkdir -p "$(dirname "$LOG_FILE")"
echo "logging to $LOG_FILE" >&2
torchrun --standalone --nproc-per-node "$GPUS" pretrain_gpt.py "${GPT_ARGS[@]}" "$@" 2>&1 \
    | tee -ai "$LOG_FILE"
