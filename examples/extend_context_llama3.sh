#!/usr/bin/env bash
# Extend a pretrained Llama 3.1 8B to 128K-token sequences with Ulysses SP 8, end to end:
#   1. import the Hugging Face checkpoint (tools/convert_hf.py import; CPU is enough),
#   2. tokenize long documents with the model's own tokenizer (tools/preprocess_data.py),
#   3. continue pretraining at SEQ_LENGTH with SP, Llama 3.1's RoPE scaling (from its config,
#      taken from the checkpoint by --use-checkpoint-args) and the ALST memory features,
#   4. the passkey-retrieval test of the result at several lengths (tools/eval_passkey.py),
#   5. export back to a Hugging Face folder (tools/convert_hf.py export).
# Each step is skipped when its output exists, so the script resumes where it stopped (step 3
# resumes from its last checkpoint).
#
# Usage, from the repository root, on one node of 8 GPUs:
#   HF_PATH=/models/Meta-Llama-3.1-8B DATA_JSONL=data/long_docs.jsonl \
#       bash examples/extend_context_llama3.sh
# Environment (defaults in brackets): HF_PATH (required: config.json, *.safetensors and the
# tokenizer files), DATA_JSONL (required: one {"text": ...} per line), RUN_DIR
# [runs/extend_llama3], SP [8], GPUS_PER_NODE [8], SEQ_LENGTH [131072], TRAIN_ITERS [1000],
# GLOBAL_BATCH [DP x 4, DP = GPUS_PER_NODE / SP], LR [1e-5], PASSKEY_LENGTHS [8192,32768,131072].
# Extra arguments go to pretrain_gpt.py. --use-checkpoint-args takes the checkpoint's RoPE base
# and dropout over the command line's, as Megatron-LM's does (a warning says so): a new base
# needs the model flags instead of --use-checkpoint-args.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

HF_PATH=${HF_PATH:?set HF_PATH to the Hugging Face model directory}
DATA_JSONL=${DATA_JSONL:?set DATA_JSONL to a jsonl file of long documents}
RUN_DIR=${RUN_DIR:-runs/extend_llama3}
SP=${SP:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DP=$(( GPUS_PER_NODE / SP ))
SEQ_LENGTH=${SEQ_LENGTH:-131072}
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( DP * 4 ))}
IMPORTED=$RUN_DIR/imported
DATA_PREFIX=$RUN_DIR/data/long
CKPT_DIR=$RUN_DIR/checkpoints
TOKENIZER=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_PATH")
export_train_env

if [[ ! -f "$IMPORTED/latest_checkpointed_iteration.txt" ]]; then
    python3 tools/convert_hf.py import --hf-path "$HF_PATH" --output "$IMPORTED"
fi

if [[ ! -f "${DATA_PREFIX}_text_document.idx" ]]; then
    mkdir -p "$(dirname "$DATA_PREFIX")"
    python3 tools/preprocess_data.py --input "$DATA_JSONL" --json-keys text "${TOKENIZER[@]}" \
        --append-eod --workers "${WORKERS:-16}" --output-prefix "$DATA_PREFIX"
fi

# The first run starts from the import (weights only); later runs resume from CKPT_DIR.
if [[ -f "$CKPT_DIR/latest_checkpointed_iteration.txt" ]]; then
    START=(--load "$CKPT_DIR")
else
    START=(--load "$IMPORTED" --finetune)
fi
torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" pretrain_gpt.py \
    "${START[@]}" --use-checkpoint-args \
    --seq-length "$SEQ_LENGTH" --ulysses-sp-size "$SP" \
    --tiled-mlp-shards auto --tiled-loss-shards auto \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --attention-dropout 0 --hidden-dropout 0 \
    --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH" \
    --train-iters "${TRAIN_ITERS:-1000}" --lr "${LR:-1e-5}" --min-lr "${MIN_LR:-1e-6}" \
    --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-20}" --weight-decay 0.1 \
    --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer \
    --data-path "${DATA_PREFIX}_text_document" --split 99,1,0 "${TOKENIZER[@]}" \
    --save "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-100}" --exit-signal-handler \
    --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-4}" --log-interval 1 \
    --tensorboard-dir "$RUN_DIR/tensorboard" "$@" 2>&1 | tee -a "$RUN_DIR/train.log"

if [[ ! -f "$RUN_DIR/passkey/passkey.json" ]]; then
    torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" tools/eval_passkey.py \
        --load "$CKPT_DIR" --use-checkpoint-args --ulysses-sp-size "$SP" --bf16 \
        "${TOKENIZER[@]}" --lengths "${PASSKEY_LENGTHS:-8192,32768,131072}" \
        --depths 0,0.25,0.5,0.75,1 --trials 5 --output-dir "$RUN_DIR/passkey"
fi

if [[ ! -f "$RUN_DIR/hf/config.json" ]]; then
    python3 tools/convert_hf.py export --load "$CKPT_DIR" --output "$RUN_DIR/hf" \
        --tokenizer-dir "$HF_PATH"
fi
echo "done: $RUN_DIR/hf (Hugging Face), $RUN_DIR/passkey/passkey.png (passkey heat map)" >&2
