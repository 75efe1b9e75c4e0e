#!/usr/bin/env bash
# Llama-3-8B shape, 256K-token sequences: Ulysses SP 8 (32K tokens per GPU) with the ALST memory
# features (sequence-tiled MLP, tiled logits + loss, checkpointed activations offloaded to CPU)
# and full recompute. Runs on one node of 8 GPUs, or on NNODES nodes (DP = NNODES * 8 / SP).
#
# Usage, from the repository root:
#   TOKENIZER_MODEL=/models/Meta-Llama-3-8B DATA_PATH=data/llama3_text_document \
#       bash examples/llama3_8b_long.sh
#   bash examples/llama3_8b_long.sh                          # no DATA_PATH: --mock-data
#   # 2 nodes: run on each node, with NODE_RANK 0 on the node at MASTER_ADDR and 1 on the other
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/llama3_8b_long.sh
# TOKENIZER_MODEL is a Hugging Face tokenizer (name or directory, TOKENIZER_TYPE to change it);
# the vocabulary size comes from it. UPPER_CASE variables can be set in the environment; extra
# arguments go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SP=${SP:-8}                          # 32 heads and 8 kv groups over 8 ranks: 4 q + 1 kv head
DP=$(( NNODES * GPUS_PER_NODE / SP ))
SEQ_LENGTH=${SEQ_LENGTH:-262144}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( DP * 8 ))}   # per DP rank: 8 x 256K = 2M tokens a step
TRAIN_ITERS=${TRAIN_ITERS:-5000}
ATTN_BACKEND=${ATTN_BACKEND:-auto}
RUN_DIR=${RUN_DIR:-runs/llama3_8b_sp${SP}}
CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
TB_DIR=${TB_DIR:-$RUN_DIR/tensorboard}
LOG_FILE=${LOG_FILE:-$RUN_DIR/train_node${NODE_RANK:-0}_$(date +%Y%m%d_%H%M%S).log}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}

if [[ "$NNODES" -eq 1 ]]; then
    LAUNCH_ARGS=(--standalone)
else
    LAUNCH_ARGS=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
                 --master-addr "${MASTER_ADDR:?set MASTER_ADDR (node 0)}"
                 --master-port "${MASTER_PORT:-29500}")
fi
if [[ -n "$TOKENIZER_MODEL" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL")
else
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-128256}")
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
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu
    --normalization RMSNorm --norm-epsilon 1e-5
    --position-embedding-type rope --rotary-base 500000
    --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
)
TRAIN_ARGS=(
    --ulysses-sp-size "$SP" --ulysses-attention-backend "$ATTN_BACKEND"
    --tiled-mlp-shards auto --tiled-loss-shards auto --offload-activations
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}"
    --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-100}" --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
)
OUTPUT_ARGS=(
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-200}"
    --eval-interval "${EVAL_INTERVAL:-200}" --eval-iters "${EVAL_ITERS:-2}"
    --log-interval "${LOG_INTERVAL:-1}" --tensorboard-dir "$TB_DIR" --exit-signal-handler
)

mkdir -p "$(dirname "$LOG_FILE")"
echo "$NNODES node(s) x $GPUS_PER_NODE GPUs = SP $SP x DP $DP; logging to $LOG_FILE" >&2
torchrun "${LAUNCH_ARGS[@]}" --nproc-per-node "$GPUS_PER_NODE" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -ai "$LOG_FILE"
