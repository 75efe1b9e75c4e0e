# Shared pieces of the GPU launch scripts pretrain_gpt_8gpu_sp8.sh, slurm_multinode.sh and
# llama3_8b_long.sh. Sourced, not run: source "$(dirname "$0")/common.sh" (the slurm script, run
# from a spool copy, sources "$SLURM_SUBMIT_DIR/examples/common.sh"). Sourcing only defines the
# functions below; they read UPPER_CASE variables set by the calling script or the environment
# (default in brackets) and set the arrays that the scripts pass to pretrain_gpt.py.
#   export_train_env [SHUTDOWN_S]  export CUDA_DEVICE_MAX_CONNECTIONS [1], PYTORCH_CUDA_ALLOC_CONF
#       [expandable_segments:True], TORCH_ELASTIC_SHUTDOWN_TIMEOUT [SHUTDOWN_S, else 600]
#   set_data_args TOKENIZER_TYPE VOCAB [quiet]  TOKENIZER_ARGS: TOKENIZER_TYPE on TOKENIZER_MODEL,
#       else a NullTokenizer of VOCAB_SIZE [VOCAB]. DATA_ARGS: DATA_PATH (a prefix, or a blend
#       "0.7 pfx_a 0.3 pfx_b"; exits 2 without TOKENIZER_MODEL), else --mock-data (said on stderr
#       unless quiet)
#   set_model_args LAYERS HIDDEN HEADS KV_GROUPS FFN [NORM_EPS [ROPE_BASE]]  MODEL_ARGS of a
#       Llama-like GPT (GQA, SwiGLU, RMSNorm, RoPE, no biases, untied embeddings), SEQ_LENGTH long
#   set_train_args  SP_ARGS: SP, ATTN_BACKEND [auto]. OPTIM_ARGS: MICRO_BATCH [1], GLOBAL_BATCH,
#       TRAIN_ITERS [5000], LR [3e-4], MIN_LR [3e-5], WARMUP_ITERS [100]; cosine, AdamW, bf16,
#       distributed optimizer. RECOMPUTE_ARGS: full recompute of every layer
#   set_output_args SAVE EVAL EVALS  OUTPUT_ARGS: CKPT_DIR [$RUN_DIR/checkpoints], TB_DIR
#       [$RUN_DIR/tensorboard], SAVE_INTERVAL [SAVE], EVAL_INTERVAL [EVAL], EVAL_ITERS [EVALS],
#       LOG_INTERVAL [1], --exit-signal-handler
#   set_gpt_args  GPT_ARGS = MODEL_ARGS TRAIN_ARGS TOKENIZER_ARGS DATA_ARGS OUTPUT_ARGS
#   set_gpt1b_args  (after set_data_args) GPT_ARGS of the ~1.1B GPT of pretrain_gpt_8gpu_sp8.sh
#       and slurm_multinode.sh: SP, optimizer, full recompute; checkpoint and eval every 500 steps

export_train_env() {
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    # On SIGTERM torchrun waits this long before SIGKILL, so --exit-signal-handler can checkpoint.
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-${1:-600}}
}

set_data_args() {
    TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
    if [[ -n "$TOKENIZER_MODEL" ]]; then
        TOKENIZER_ARGS=(--tokenizer-type "$1" --tokenizer-model "$TOKENIZER_MODEL")
    else
        TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-$2}")
    fi
    if [[ -n "${DATA_PATH:-}" ]]; then
        [[ -n "$TOKENIZER_MODEL" ]] || { echo "DATA_PATH needs TOKENIZER_MODEL" >&2; exit 2; }
        read -r -a DATA_PREFIXES <<< "$DATA_PATH"
        DATA_ARGS=(--data-path "${DATA_PREFIXES[@]}" --split 99,1,0)
    else
        [[ "${3:-}" == quiet ]] || echo "DATA_PATH is unset: training on --mock-data" >&2
        DATA_ARGS=(--mock-data)
    fi
}

set_model_args() {
    local norm=() rope=()
    [[ -z "${6:-}" ]] || norm=(--norm-epsilon "$6")
    [[ -z "${7:-}" ]] || rope=(--rotary-base "$7")
    MODEL_ARGS=(
        --num-layers "$1" --hidden-size "$2" --num-attention-heads "$3"
        --group-query-attention --num-query-groups "$4" --ffn-hidden-size "$5" --swiglu
        --normalization RMSNorm ${norm[@]+"${norm[@]}"}
        --position-embedding-type rope ${rope[@]+"${rope[@]}"}
        --untie-embeddings-and-output-weights --disable-bias-linear
        --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
        --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    )
}

set_train_args() {
    SP_ARGS=(--ulysses-sp-size "$SP" --ulysses-attention-backend "${ATTN_BACKEND:-auto}")
    OPTIM_ARGS=(
        --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "$GLOBAL_BATCH"
        --train-iters "${TRAIN_ITERS:-5000}" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}"
        --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-100}" --weight-decay 0.1
        --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
    )
    RECOMPUTE_ARGS=(
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    )
}

set_output_args() {
    CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
    TB_DIR=${TB_DIR:-$RUN_DIR/tensorboard}
    OUTPUT_ARGS=(
        --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-$1}"
        --eval-interval "${EVAL_INTERVAL:-$2}" --eval-iters "${EVAL_ITERS:-$3}"
        --log-interval "${LOG_INTERVAL:-1}" --tensorboard-dir "$TB_DIR" --exit-signal-handler
    )
}

set_gpt_args() {
    GPT_ARGS=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${DATA_ARGS[@]}"
              "${OUTPUT_ARGS[@]}")
}

set_gpt1b_args() {
    set_model_args 16 2048 32 8 8192         # layers hidden heads kv-groups ffn
    set_train_args
    TRAIN_ARGS=("${SP_ARGS[@]}" "${OPTIM_ARGS[@]}" "${RECOMPUTE_ARGS[@]}")
    set_output_args 500 500 5
    set_gpt_args
}
