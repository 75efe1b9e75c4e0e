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
# UPPER_CASE variable below can be set in the environment; extra arguments go to pretrain_gpt.py.
# Plot the run: python tools/plot_run.py "$LOG_FILE" (or "$TB_DIR").
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS=${GPUS:-8}
SP=${SP:-8}                          # --ulysses-sp-size; DP = GPUS / SP
SEQ_LENGTH=${SEQ_LENGTH:-131072}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-8}      # 8 x 128K = 1M tokens per step
TRAIN_ITERS=${TRAIN_ITERS:-5000}
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
WARMUP_ITERS=${WARMUP_ITERS:-100}
ATTN_BACKEND=${ATTN_BACKEND:-auto}   # te | sdpa | local | auto
RUN_DIR=${RUN_DIR:-runs/gpt1b_sp8}
CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
TB_DIR=${TB_DIR:-$RUN_DIR/tensorboard}
LOG_FILE=${LOG_FILE:-$RUN_DIR/train_$(date +%Y%m%d_%H%M%S).log}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
VOCAB_SIZE=${VOCAB_SIZE:-32000}      # only for the mock-data NullTokenizer

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# On SIGTERM torchrun waits this long before SIGKILL, so --exit-signal-handler can checkpoint.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}

if [[ -n "$TOKENIZER_MODEL" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
fi
if [[ -n "${DATA_PATH:-}" ]]; then
    [[ -n "$TOKENIZER_MODEL" ]] || { echo "DATA_PATH needs TOKENIZER_MODEL" >&2; exit 2; }
    read -r -a DATA_PREFIXES <<< "$DATA_PATH"
    DATA_ARGS=(--data-path "${DATA_PREFIXES[@]}" --split 99,1,0)
else
    echo "DATA_PATH is unset: training on --mock-data" >&2
    DATA_ARGS=(--mock-data)
fi

MODEL_ARGS=(
    --num-layers 16 --hidden-size 2048 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 --swiglu
    --normalization RMSNorm --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
)
TRAIN_ARGS=(
    --ulysses-sp-size "$SP" --ulysses-attention-backend "$ATTN_BACKEND"
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
    --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --clip-grad 1.0 --bf16 --use-distributed-optimizer
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
OUTPUT_ARGS=(
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-500}"
    --eval-interval "${EVAL_INTERVAL:-500}" --eval-iters "${EVAL_ITERS:-5}"
    --log-interval "${LOG_INTERVAL:-1}" --tensorboard-dir "$TB_DIR" --exit-signal-handler
)

mkdir -p "$(dirname "$LOG_FILE")"
echo "logging to $LOG_FILE" >&2
torchrun --standalone --nproc-per-node "$GPUS" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -ai "$LOG_FILE"
