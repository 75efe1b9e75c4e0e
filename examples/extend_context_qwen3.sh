#!/usr/bin/env bash
# Extend a pretrained Qwen3 dense model (e.g. Qwen3-8B, native 32K) to 128K-token sequences with
# YaRN and Ulysses SP 8, then fine-tune it on long conversations, end to end:
#   1. write YaRN into a copy of the Hugging Face config.json (rope_scaling yarn, YARN_FACTOR x
#      ORIGINAL_CONTEXT, as Qwen's model card says) and import it (tools/convert_hf.py import;
#      CPU is enough): the checkpoint holds --position-embedding-type yarn and its flags,
#   2. tokenize long documents with the model's own tokenizer (tools/preprocess_data.py),
#   3. continue pretraining at SEQ_LENGTH with SP and the ALST memory features; the YaRN flags
#      come from the checkpoint (--use-checkpoint-args),
#   4. fine-tune (--sft) at SEQ_LENGTH on JSONL conversations, the loss on the assistant turns
#      only (SFTTokenizer on the model's tokenizer and chat template, or SFT_CHAT_TEMPLATE),
#   5. export to a Hugging Face folder whose config.json has the yarn rope_scaling.
# Each step is skipped when its output exists, so the script resumes where it stopped (steps 3
# and 4 resume from their last checkpoint).
#
# Usage, from the repository root, on one node of 8 GPUs:
#   HF_PATH=/models/Qwen3-8B DATA_JSONL=data/long_docs.jsonl SFT_JSONL=data/chats.jsonl \
#       bash examples/extend_context_qwen3.sh
# Environment (defaults in brackets): HF_PATH (required: config.json, *.safetensors and the
# tokenizer files), DATA_JSONL (required: one {"text": ...} per line), SFT_JSONL (required: one
# {"messages": [...]} per line, docs/training.md), RUN_DIR [runs/extend_qwen3], SP [8],
# GPUS_PER_NODE [8], ORIGINAL_CONTEXT [32768], YARN_FACTOR [4], SEQ_LENGTH [ORIGINAL_CONTEXT x
# YARN_FACTOR], GLOBAL_BATCH [DP x 4, DP = GPUS_PER_NODE / SP], TRAIN_ITERS [1000], LR [1e-5],
# MIN_LR [1e-6], WARMUP_ITERS [20], SFT_ITERS [500], SFT_LR [5e-6], SFT_MIN_LR [5e-7],
# SFT_WARMUP_ITERS [10], SFT_FORMAT [chat-template: the chat template, the loss on the
# assistant turns; docs/training.md], SFT_CHAT_TEMPLATE [none: the tokenizer's own; a Jinja file
# to fine-tune with instead: Qwen3's own drops the <think> blocks of earlier turns, so
# chat-template needs one that marks the assistant turns with {% generation %}, such as TRL's
# qwen3_training.jinja; docs/context_extension.md], SAVE_INTERVAL [100], EVAL_INTERVAL [100],
# EVAL_ITERS [4], WORKERS [16], SPLIT [99,1,0], GPU_ARGS [--bf16 --use-distributed-optimizer;
# empty to run on CPU], MEMORY_ARGS [TiledMLP, tiled loss and full recompute, as in
# extend_context_llama3.sh].
# Extra arguments go to both pretrain_gpt.py runs.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$(dirname "$0")/.."

HF_PATH=${HF_PATH:?set HF_PATH to the Hugging Face Qwen3 model directory}
DATA_JSONL=${DATA_JSONL:?set DATA_JSONL to a jsonl file of long documents}
SFT_JSONL=${SFT_JSONL:?set SFT_JSONL to a jsonl file of conversations}
RUN_DIR=${RUN_DIR:-runs/extend_qwen3}
SP=${SP:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DP=$(( GPUS_PER_NODE / SP ))
ORIGINAL_CONTEXT=${ORIGINAL_CONTEXT:-32768}
YARN_FACTOR=${YARN_FACTOR:-4}
SEQ_LENGTH=${SEQ_LENGTH:-$(( ORIGINAL_CONTEXT * YARN_FACTOR ))}
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( DP * 4 ))}
read -r -a GPU <<< "${GPU_ARGS---bf16 --use-distributed-optimizer}"
ALST="--tiled-mlp-shards auto --tiled-loss-shards auto --recompute-granularity full"
read -r -a MEMORY <<< "${MEMORY_ARGS-$ALST --recompute-method uniform --recompute-num-layers 1}"
HF_YARN=$RUN_DIR/hf_yarn
IMPORTED=$RUN_DIR/imported
DATA_PREFIX=$RUN_DIR/data/long
CPT_DIR=$RUN_DIR/checkpoints/pretrain
SFT_DIR=$RUN_DIR/checkpoints/sft
export_train_env

if [[ ! -f "$HF_YARN/config.json" ]]; then  # links to HF_PATH's files, config.json with YaRN
    python3 - "$HF_PATH" "$HF_YARN" "$YARN_FACTOR" "$ORIGINAL_CONTEXT" <<'EOF'
import json, os, sys
source, target, factor, original = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
os.makedirs(target, exist_ok=True)
for name in os.listdir(source):
    if name != "config.json" and not os.path.lexists(os.path.join(target, name)):
        os.symlink(os.path.abspath(os.path.join(source, name)), os.path.join(target, name))
with open(os.path.join(source, "config.json")) as f:
    config = json.load(f)
yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
if isinstance(config.get("rope_parameters"), dict):  # transformers >= 5
    config["rope_parameters"].update(yarn)
else:
    config["rope_scaling"] = yarn
config.pop("original_max_position_embeddings", None)  # it would win over rope_scaling's
config["max_position_embeddings"] = int(factor * original)
with open(os.path.join(target, "config.json.tmp"), "w") as f:
    json.dump(config, f, indent=2)
os.replace(os.path.join(target, "config.json.tmp"), os.path.join(target, "config.json"))
EOF
fi

if [[ ! -f "$IMPORTED/latest_checkpointed_iteration.txt" ]]; then
    python3 tools/convert_hf.py import --hf-path "$HF_YARN" --output "$IMPORTED"
fi

if [[ ! -f "${DATA_PREFIX}_text_document.idx" ]]; then
    mkdir -p "$(dirname "$DATA_PREFIX")"
    python3 tools/preprocess_data.py --input "$DATA_JSONL" --json-keys text \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_PATH" \
        --append-eod --workers "${WORKERS:-16}" --output-prefix "$DATA_PREFIX"
fi

# Flags of both runs: the model (YaRN included) from the checkpoint, SP, memory, optimizer.
COMMON=(--use-checkpoint-args --seq-length "$SEQ_LENGTH" --ulysses-sp-size "$SP"
        "${MEMORY[@]}" --attention-dropout 0 --hidden-dropout 0
        --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH" --lr-decay-style cosine
        --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
        ${GPU[@]+"${GPU[@]}"}
        --split "${SPLIT:-99,1,0}" --exit-signal-handler --log-interval 1
        --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-4}")

# Resume from DIR when it holds a checkpoint, else start from FROM (weights only).
start_from() {
    if [[ -f "$1/latest_checkpointed_iteration.txt" ]]; then START=(--load "$1")
    else START=(--load "$2" --finetune); fi
}

start_from "$CPT_DIR" "$IMPORTED"
torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" pretrain_gpt.py \
    "${START[@]}" "${COMMON[@]}" \
    --train-iters "${TRAIN_ITERS:-1000}" --lr "${LR:-1e-5}" --min-lr "${MIN_LR:-1e-6}" \
    --lr-warmup-iters "${WARMUP_ITERS:-20}" \
    --data-path "${DATA_PREFIX}_text_document" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_PATH" \
    --save "$CPT_DIR" --save-interval "${SAVE_INTERVAL:-100}" \
    --tensorboard-dir "$RUN_DIR/tensorboard/pretrain" "$@" 2>&1 | tee -a "$RUN_DIR/pretrain.log"

# The tokenizer files with SFT_CHAT_TEMPLATE as their chat template (chat_template.jinja wins
# over tokenizer_config.json's).
SFT_TOKENIZER=$HF_PATH
if [[ -n "${SFT_CHAT_TEMPLATE:-}" ]]; then
    SFT_TOKENIZER=$RUN_DIR/sft_tokenizer
    mkdir -p "$SFT_TOKENIZER"
    for file in "$HF_PATH"/*; do
        name=$(basename "$file")
        if [[ $name != chat_template.jinja && ! -L "$SFT_TOKENIZER/$name" ]]; then
            ln -s "$(cd "$(dirname "$file")" && pwd)/$name" "$SFT_TOKENIZER/$name"
        fi
    done
    cp "$SFT_CHAT_TEMPLATE" "$SFT_TOKENIZER/chat_template.jinja"
fi

# The pretraining checkpoint holds HuggingFaceTokenizer: --sft needs SFTTokenizer, so the
# tokenizer comes from this command line (--no-use-tokenizer-model-from-checkpoint-args).
start_from "$SFT_DIR" "$CPT_DIR"
torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" pretrain_gpt.py \
    "${START[@]}" "${COMMON[@]}" \
    --train-iters "${SFT_ITERS:-500}" --lr "${SFT_LR:-5e-6}" --min-lr "${SFT_MIN_LR:-5e-7}" \
    --lr-warmup-iters "${SFT_WARMUP_ITERS:-10}" \
    --sft --data-path "$SFT_JSONL" --no-use-tokenizer-model-from-checkpoint-args \
    --tokenizer-type SFTTokenizer --tokenizer-model "$SFT_TOKENIZER" \
    --sft-tokenizer-prompt-format "${SFT_FORMAT:-chat-template}" \
    --save "$SFT_DIR" --save-interval "${SAVE_INTERVAL:-100}" \
    --tensorboard-dir "$RUN_DIR/tensorboard/sft" "$@" 2>&1 | tee -a "$RUN_DIR/sft.log"

if [[ ! -f "$RUN_DIR/hf/config.json" ]]; then
    python3 tools/convert_hf.py export --load "$SFT_DIR" --output "$RUN_DIR/hf" \
        --tokenizer-dir "$HF_PATH"
fi
echo "done: $RUN_DIR/hf (Hugging Face, YaRN x$YARN_FACTOR in config.json)" >&2
