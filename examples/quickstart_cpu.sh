#!/usr/bin/env bash
# CPU quickstart, no GPU and no download: the bundled corpus -> a sentencepiece tokenizer ->
# megatron-core .bin/.idx -> a tiny GPT (RoPE, GQA, SwiGLU, RMSNorm) trained by 2 processes with
# Ulysses SP = 2 (each process holds half of every sequence). Takes a few minutes on 2 cores; the
# loss falls from ~8.3 (ln 4096) to ~1.2 and the curve is drawn to $OUT/loss.png.
#
# Usage, from anywhere:  bash examples/quickstart_cpu.sh [extra pretrain_gpt.py flags]
# Environment: OUT (default runs/quickstart), NPROC (2), SP (2), ITERS (120).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/quickstart}
NPROC=${NPROC:-2}
SP=${SP:-2}
ITERS=${ITERS:-120}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"

if [[ ! -f "$OUT/tokenizer.model" ]]; then
    python3 tools/train_tokenizer.py --input examples/data/corpus.jsonl \
        --output-prefix "$OUT/tokenizer" --vocab-size 4096
fi
if [[ ! -f "$OUT/corpus_text_document.idx" ]]; then
    python3 tools/preprocess_data.py --input examples/data/corpus.jsonl --json-keys text \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" \
        --append-eod --workers 2 --output-prefix "$OUT/corpus"
fi

python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --ulysses-sp-size "$SP" --ulysses-attention-backend sdpa \
    --num-layers 4 --hidden-size 128 --num-attention-heads 8 \
    --group-query-attention --num-query-groups 2 --ffn-hidden-size 352 --swiglu \
    --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
    --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 \
    --seq-length 256 --micro-batch-size 4 --global-batch-size 8 \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 \
    --adam-beta2 0.95 --clip-grad 1.0 --train-iters "$ITERS" \
    --data-path "$OUT/corpus_text_document" --split 95,5,0 \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" \
    --reset-position-ids --reset-attention-mask --eod-mask-loss --num-workers 0 \
    --log-interval 10 --eval-interval 40 --eval-iters 2 \
    --save "$OUT/checkpoints" --save-interval 60 --tensorboard-dir "$OUT/tensorboard" \
    "$@" 2>&1 | tee "$OUT/train.log"

python3 tools/plot_run.py "$OUT/train.log" --output "$OUT/loss.png" --title "CPU quickstart, SP=$SP"
echo "done: log $OUT/train.log, plot $OUT/loss.png, checkpoints $OUT/checkpoints"
