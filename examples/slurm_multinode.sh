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
# Without DATA_PATH it trains on --mock-data. UPPER_CASE variables, here and in common.sh, can be
# set in the environment (sbatch exports it); arguments after the script name go to pretrain_gpt.py.
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
# sbatch runs a copy of this script from a spool directory: find common.sh from the submit dir.
source "$SLURM_SUBMIT_DIR/examples/common.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SP=${SP:-8}                          # keep SP <= GPUS_PER_NODE so SP groups stay in a node
DP=$(( SLURM_NNODES * GPUS_PER_NODE / SP ))
SEQ_LENGTH=${SEQ_LENGTH:-131072}
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( DP * 8 ))}
RUN_DIR=${RUN_DIR:-runs/gpt1b_sp${SP}_${SLURM_NNODES}n}
LOG_FILE=${LOG_FILE:-$RUN_DIR/train_$SLURM_JOB_ID.log}

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export_train_env 540                 # 540 s < the 600 s of --signal=TERM@600
set_data_args GPTSentencePieceTokenizer 32000 quiet
set_gpt1b_args

mkdir -p "$RUN_DIR"
echo "$SLURM_NNODES nodes x $GPUS_PER_NODE GPUs = SP $SP x DP $DP; rdzv $MASTER_ADDR:$MASTER_PORT" \
    | tee -a "$LOG_FILE"
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
    pretrain_gpt.py "${GPT_ARGS[@]}" "$@" 2>&1 | tee -ai "$LOG_FILE"
