#!/usr/bin/env bash
#SBATCH --job-name=ulysses-gpt
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@600
#SBATCH --output=slurm-%x-%j.out
#
# Multi-node Ulysses SP pretraining of the ~1.1B Llama-like GPT of pretrain_gpt_8gpu_sp8.sh.
# Submit from the repository root:
#   DATA_PATH=data/my_text_document TOKENIZER_MODEL=data/tokenizer.model \
#       sbatch examples/slurm_multinode.sh            # --nodes=N on the command line overrides
# Without DATA_PATH it trains on --mock-data. UPPER_CASE variables can be set in the environment
# (sbatch exports it); arguments after the script name go to pretrain_gpt.py.
#
# Layout: one torchrun per node, 8 ranks each; torchrun gives each node 8 consecutive global
# ranks. World = TP x PP x DP x SP, and SP groups are blocks of SP consecutive ranks, so with
# TP = PP = 1 and SP = 8 every SP group is one node: the Ulysses all-to-alls stay on NVLink and
# only the data-parallel gradient reduce-scatter/all-gather crosses nodes.
# 8 nodes x 8 GPUs = 64 GPUs, --ulysses-sp-size 8 -> DP 8: 8 sequences of 128K tokens per
# micro-step, each split over the 8 GPUs of a node (16K tokens per GPU).
# SIGTERM (--signal, 10 min before the time limit) makes --exit-signal-handler save a checkpoint;
# resubmitting resumes from CKPT_DIR.
set -euo pipefail
: "${SLURM_JOB_ID:?submit with sbatch}"
cd "$SLURM_SUBMIT_DIR"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SP=${SP:-8}                          # keep SP <= GPUS_PER_NODE so SP groups stay in a node
DP=$(( SLURM_NNODES * GPUS_PER_NODE / SP ))
SEQ_LENGTH=${SEQ_LENGTH:-131072}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( DP * 8 ))}
TRAIN_ITERS=${TRAIN_ITERS:-5000}
ATTN_BACKEND=${ATTN_BACKEND:-auto}
RUN_DIR=${RUN_DIR:-runs/gpt1b_sp${SP}_${SLURM_NNODES}n}
CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
TB_DIR=${TB_DIR:-$RUN_DIR/tensorboard}
LOG_FILE=${LOG_FILE:-$RUN_DIR/train_$SLURM_JOB_ID.log}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-540}

if [[ -n "$TOKENIZER_MODEL" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-32000}")
fi
if [[ -n "${DATA_PATH:-}" ]]; then
    [[ -n "$TOKENIZER_MODEL" ]] || { echo "DATA_PATH needs TOKENIZER_MODEL" >&2; exit 2; }
    read -r -a DATA_PREFIXES <<< "$DATA_PATH"
    DATA_ARGS=(--data-path "${DATA_PREFIXES[@]}" --split 99,1,0)
else
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
    --train-iters "$TRAIN_ITERS" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}"
    --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-100}" --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
OUTPUT_ARGS=(
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-500}"
    --eval-interval "${EVAL_INTERVAL:-500}" --eval-iters "${EVAL_ITERS:-5}"
    --log-interval "${LOG_INTERVAL:-1}" --tensorboard-dir "$TB_DIR" --exit-signal-handler
)

mkdir -p "$RUN_DIR"
echo "$SLURM_NNODES nodes x $GPUS_PER_NODE GPUs = SP $SP x DP $DP; rdzv $MASTER_ADDR:$MASTER_PORT" \
    | tee -a "$LOG_FILE"
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
    pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${TOKENIZER_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -ai "$LOG_FILE"
