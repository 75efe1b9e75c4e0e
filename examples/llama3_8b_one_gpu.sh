#!/usr/bin/env bash
# The Llama-3.1-8B shape (32 layers, hidden 4096, 32 / 8 heads, ffn 14336, vocab 128256, RoPE base
# 500000, untied) trained on ONE GPU at a long sequence, bf16, one sequence per step. What fits it:
#   --optimizer-cpu-offload --optimizer-offload-fraction F  megatron-core's HybridDeviceOptimizer
#       keeps the fp32 master weights and Adam moments of F of the parameters in host memory (it
#       steps them with torch's AdamW on the CPU); it needs --use-distributed-optimizer and
#       --use-precision-aware-optimizer (Megatron-LM's rules; the latter needs Transformer Engine);
#       --overlap-cpu-optimizer-d2h-h2d overlaps that step with its host <-> device copies
#   full recompute (uniform, 1 layer)   keeps one [s, h] checkpoint per layer;
#   --offload-activations               moves those checkpoints to pinned host memory;
#   --tiled-mlp-shards auto             never holds the [s, ffn] MLP intermediate whole;
#   --tiled-loss-shards auto            never holds the [s, V] logits whole.
# Prediction (python bench/memory_plan.py --strategies, bench/RESULTS.md section 8): weights
# (16 GB bf16) + fp32 grad buffer (32 GB) stay on the GPU whatever F is; the rest is a trade
# between GPU and host memory (16 bytes per parameter on the host per unit of F, plus the layer
# checkpoints, 32 x [s, h] bf16 = 64 GiB at 256K in power-of-two pinned blocks):
#   141 GB (H200, 125 GiB RAM): F = 0.3, s = 262144 (256K): ~136 GiB GPU, ~115 GiB host.
#       The host's pinned blocks double past 256K (each [s, h] block rounds up to 4 GiB), so
#       256K is the longest with this torch. Out of GPU memory: raise F (0.35); killed for
#       host memory: lower it.
#   80 GB (H100, 125 GiB RAM): F = 0.7, s = 40960 (40K); s = 65536 (64K) with
#       --grad-reduce-in-bf16 (below F = 0.5 that flag costs GPU memory: the offloaded
#       optimizer keeps an fp32 copy of the GPU share's bf16 grads).
# The slope of the model is calibrated on the 1B shape's measured peaks; these are predictions.
#
# Usage, from the repository root (--mock-data and a NullTokenizer of VOCAB_SIZE: no download; its
# eod id makes 128257 ids, padded to 128384 rows: 1M parameters more than Llama's 128256):
#   bash examples/llama3_8b_one_gpu.sh                          # 256K, F = 0.3, 3 iterations
#   SEQ_LENGTH=65536 OFFLOAD_FRACTION=0.7 bash examples/llama3_8b_one_gpu.sh --grad-reduce-in-bf16
#   DATA_PATH=data/long_text_document TOKENIZER_MODEL=/models/Llama-3.1-8B \
#       bash examples/llama3_8b_one_gpu.sh                   # a HuggingFaceTokenizer folder
# Each iteration's log line has the step time, TFLOP/s per GPU (MFU = that / 989 on H100 / H200),
# peak GPU memory and peak host memory (RSS). Other variables: see common.sh (TRAIN_ITERS [3],
# LR, VOCAB_SIZE [128256], ...); extra arguments go to pretrain_gpt.py.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

SEQ_LENGTH=${SEQ_LENGTH:-262144}
OFFLOAD_FRACTION=${OFFLOAD_FRACTION:-0.3}
TRAIN_ITERS=${TRAIN_ITERS:-3}
RUN_DIR=${RUN_DIR:-runs/llama3_8b_one_gpu}
LOG_FILE=${LOG_FILE:-$RUN_DIR/train_$(date +%Y%m%d_%H%M%S).log}
SP=1 GLOBAL_BATCH=1 WARMUP_ITERS=0

export_train_env
set_data_args HuggingFaceTokenizer 128256
# Llama-3.1-8B:  layers hidden heads kv-groups ffn norm-eps rope-base
set_model_args   32     4096   32    8         14336 1e-5   500000
set_train_args
mkdir -p "$RUN_DIR"
echo "s = $SEQ_LENGTH, --optimizer-offload-fraction $OFFLOAD_FRACTION; logging to $LOG_FILE" >&2
torchrun --standalone --nproc-per-node 1 pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${SP_ARGS[@]}" "${OPTIM_ARGS[@]}" "${RECOMPUTE_ARGS[@]}" \
    --use-precision-aware-optimizer --optimizer-cpu-offload \
    --optimizer-offload-fraction "$OFFLOAD_FRACTION" --overlap-cpu-optimizer-d2h-h2d \
    --offload-activations --tiled-mlp-shards auto --tiled-loss-shards auto \
    "${TOKENIZER_ARGS[@]}" "${DATA_ARGS[@]}" \
    --eval-iters 0 --log-interval 1 "$@" 2>&1 | tee -a "$LOG_FILE"
