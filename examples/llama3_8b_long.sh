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
# the vocabulary size comes from it. UPPER_CASE variables, here and in common.sh, can be set in the
# environment; extra arguments go to pretrain_gpt.py.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SP=${SP:-8}                          # 32 heads and 8 kv groups over 8 ranks: 4 q + 1 kv head
DP=$(( NNODES * GPUS_PER_NODE / SP ))
SEQ_LENGTH=${SEQ_LENGTH:-262144}
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( DP * 8 ))}   # per DP rank: 8 x 256K = 2M tokens a step
RUN_DIR=${RUN_DIR:-runs/llama3_8b_sp${SP}}
LOG_FILE=${LOG_FILE:-$RUN_DIR/train_node${NODE_RANK:-0}_$(date +%Y%m%d_%H%M%S).log}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}

export_train_env
if [[ "$NNODES" -eq 1 ]]; then
    LAUNCH_ARGS=(--standalone)
else
    LAUNCH_ARGS=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
                 --master-addr "${MASTER_ADDR:?set MASTER_ADDR (node 0)}"
                 --master-port "${MASTER_PORT:-29500}")
fi
set_data_args "$TOKENIZER_TYPE" 128256

# Llama-3-8B:    layers hidden heads kv-groups ffn norm-eps rope-base
set_model_args   32     4096   32    8         14336 1e-5   500000
set_train_args
TRAIN_ARGS=(
    "${SP_ARGS[@]}"
    --tiled-mlp-shards auto --tiled-loss-shards auto --offload-activations
    "${RECOMPUTE_ARGS[@]}" "${OPTIM_ARGS[@]}"
)
set_output_args 200 200 2
set_gpt_args

mkdir -p "$(dirname "$LOG_FILE")"
echo "$NNODES node(s) x $GPUS_PER_NODE GPUs = SP $SP x DP $DP; logging to $LOG_FILE" >&2
torchrun "${LAUNCH_ARGS[@]}" --nproc-per-node "$GPUS_PER_NODE" pretrain_gpt.py "${GPT_ARGS[@]}" \
    "$@" 2>&1 | tee -ai "$LOG_FILE"
