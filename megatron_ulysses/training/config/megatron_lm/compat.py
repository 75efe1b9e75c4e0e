"""Megatron-LM's flags that change nothing here, accepted so that its command lines run: those
that name what this package always does (the one with a rule, --no-position-embedding, is checked
in `rules.py`), and those of Megatron-LM services and tuning not built here that do not change
what is trained (telemetry, straggler detection, NCCL and checkpoint-I/O tuning, options of
features that are off), each said once as ignored when given. Flags of features that would
change the run are refused instead (`refused.py`)."""

from ..checks import Context


def add_arguments(parser) -> None:
    g = parser.add_argument_group(
        "Megatron-LM flags accepted for compatibility (what this package always does)")
    for flag, why in (
        ("--use-mcore-models", "the model is always megatron-core's GPTModel"),
        ("--log-throughput", "throughput and TFLOP/s are always logged"),
        ("--use-flash-attn", "fused attention comes from --ulysses-attention-backend"),
        ("--attention-softmax-in-fp32", "the attention backends keep softmax in fp32"),
        ("--no-masked-softmax-fusion", "no masked-softmax fusion is used"),
        ("--no-create-attention-mask-in-dataloader", "the loader builds no attention mask: "
         "attention is causal (within documents with --reset-attention-mask)"),
        ("--no-position-embedding", "no learned position embedding: needs "
         "--position-embedding-type rope"),
        ("--apply-query-key-layer-scaling", "Megatron-LM's fp16 overflow guard for q.k "
         "(it forces the softmax into fp32): every attention backend here computes the "
         "softmax in fp32, so the result is the same"),
        ("--no-persist-layer-norm", "apex's persistent LayerNorm kernel is never used here"),
        ("--auto-detect-ckpt-format", "--load always recognizes the checkpoint's format: "
         "torch_dist (ours or Megatron-LM's) loads, any other is refused with one message"),
        ("--accumulate-allreduce-grads-in-fp32", "gradients always accumulate and reduce in "
         "fp32 here, unless --grad-reduce-in-bf16 (which turns this off, as in Megatron-LM)"),
        ("--no-one-logger", "NVIDIA's internal one-logger telemetry is never used here"),
        ("--disable-msc", "object storage (Multi-Storage Client) is never used here"),
        ("--exit-signal-handler-for-dataloader", "the data workers always block SIGTERM here, "
         "leaving it to the trainer (--exit-signal-handler)"),
    ):
        g.add_argument(flag, action="store_true", help=why)
    for why, said, specs in IGNORED:
        g = parser.add_argument_group("Megatron-LM flags accepted with no effect here"
                                      + (" (said once when given)" if said else ""), why)
        for spec in specs:
            options, kind = _options(spec)
            if kind == "switch":
                g.add_argument(*options, action="store_true")
            else:
                g.add_argument(*options, nargs="+" if kind == "values" else None, default=None)


# (why, said when given, flags): each flag `--a|--b` (aliases: one setting), `--a=` (takes a
# value) or `--a=+` (takes values). None of them changes what is trained.
IGNORED = (
    ("NVIDIA-internal telemetry (one-logger, app tags, OpenTelemetry, config dumps, the "
     "workload inspector) is not built here", True,
     ("--one-logger-async", "--one-logger-project=", "--one-logger-run-name=",
      "--app-tag-run-name=", "--app-tag-run-version=", "--otel-enabled", "--otel-service-name=",
      "--otel-span-groups=", "--run-workload-inspector-server", "--config-logger-dir=")),
    ("Megatron-LM's straggler detector, energy / device-memory / attention-logit logging, NVTX "
     "ranges, memory-history snapshots and tensor dumps are not built here (--timing-log-option "
     "all gives every rank's timers, --log-memory-to-tensorboard the memory)", True,
     ("--log-straggler", "--disable-straggler-on-startup", "--straggler-ctrlr-port=",
      "--straggler-minmax-count=", "--log-energy", "--log-device-memory-used",
      "--log-max-attention-logit", "--nvtx-ranges", "--record-shapes",
      "--gpu-sniff-test-interval=", "--record-memory-history", "--memory-snapshot-path=",
      "--dump-param-to-param-group-map=", "--save-activations-interval=",
      "--save-dgrads-interval=", "--save-params-interval=", "--save-wgrads-interval=",
      "--save-tokens-per-expert-interval=", "--result-rejected-tracker-filename=",
      "--pytorch-profiler-collect-chakra")),
    ("PyTorch's NCCL flight recorder is configured by its environment variables here "
     "(TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_FR_DUMP_TEMP_FILE)", True,
     ("--flight-recorder-dump-path=", "--flight-recorder-include-stack-trace",
      "--flight-recorder-trace-buffer-size=",
      "--no-flight-recorder-dump-on-timeout|--disable-flight-recorder-dump-on-timeout",
      "--no-flight-recorder-extra-dump-on-exec|--disable-flight-recorder-extra-dump-on-exec",
      "--no-flight-recorder-include-only-active|--disable-flight-recorder-include-only-active")),
    ("communication, data-loading, kernel and checkpoint-I/O tuning of Megatron-LM's own code "
     "paths; this package's process groups, loaders and save / load strategy are used", True,
     ("--high-priority-stream-groups=+", "--nccl-communicator-config-path=", "--use-sharp",
      "--sharp-enabled-group=", "--disable-symmetric-registration", "--create-all-gather-group",
      "--train-sync-interval=", "--num-dataset-builder-threads=", "--dataloader-fast-cache-load",
      "--dataloader-defer-npy-index-mmap", "--per-dataset-sequences-path=", "--use-gigatoken",
      "--pipeline-model-parallel-comm-backend=", "--distrib-optim-fully-reshardable-mem-efficient",
      "--dist-ckpt-workers=", "--async-ckpt-cpu-priority=", "--async-ckpt-io-priority=",
      "--ckpt-fully-parallel-load-exchange-algo=", "--ckpt-fully-parallel-load-per-rank-objects",
      "--ckpt-fully-parallel-load-process-group=", "--ckpt-fully-parallel-save-process-group=",
      "--ckpt-pg-tensors-cache-create", "--ckpt-pg-tensors-cache-path=",
      "--ckpt-drop-redundant-extra-state",
      "--no-ckpt-load-validate-sharding-integrity|--disable-ckpt-load-validate-sharding-integrity",
      "--dist-ckpt-save-pre-mcore-014", "--no-barrier-with-level-1-timing",
      "--distributed-timeout-seconds-after-init=", "--disable-jit-fuser",
      "--flash-attention-version=", "--fused-residual-rmsnorm",
      "--no-clone-scatter-output-in-embedding|--disable-clone-scatter-output-in-embedding",
      "--exit-signal-handler-for-training",
      "--object-storage-cache-path=")),
    ("options of features that are off or not built here (Transformer Engine's TP "
     "communication overlap, CUDA graphs, Megatron-FSDP's dtensor checkpoints, MXFP8 parameter "
     "gathers, tokenizer files in checkpoints, text encoding: training reads token ids); "
     "Megatron-LM ignores them without the feature too", True,
     ("--tp-comm-bootstrap-backend=", "--tp-comm-overlap-rs-dgrad",
      "--no-tp-comm-bulk-dgrad|--disable-tp-comm-bulk-dgrad",
      "--no-tp-comm-bulk-wgrad|--disable-tp-comm-bulk-wgrad",
      "--no-tp-comm-overlap-ag|--disable-tp-comm-overlap-ag",
      "--no-tp-comm-overlap-rs|--disable-tp-comm-overlap-rs",
      "--no-tp-comm-split-ag|--disable-tp-comm-split-ag",
      "--no-tp-comm-split-rs|--disable-tp-comm-split-rs", "--cuda-graph-warmup-steps=",
      "--no-strict-fsdp-dtensor-load|--disable-strict-fsdp-dtensor-load",
      "--reuse-grad-buf-for-mxfp8-param-ag",
      "--no-save-tokenizer-assets|--disable-save-tokenizer-assets",
      "--tokenizer-sentencepiece-legacy",
      "--no-tokenizer-sentencepiece-ignore-extra-whitespaces"
      "|--disable-tokenizer-sentencepiece-ignore-extra-whitespaces")),
    ("deprecated in Megatron-LM, which ignores them too", True,
     ("--use-dist-ckpt", "--dist-ckpt-format=", "--fp8-interval=", "--onnx-safe=")),
    ("torch.distributed.launch's: the ranks come from the environment (RANK, LOCAL_RANK)",
     False, ("--local-rank=",)),
    ("no experimental megatron-core feature is used here", False, ("--enable-experimental",)),
)


def _options(spec: str):
    """(option strings, 'switch' | 'value' | 'values') of an `IGNORED` flag."""
    names, _, value = spec.partition("=")
    return names.split("|"), "values" if value == "+" else "value" if _ else "switch"


def validate(args, ctx: Context) -> None:
    """One warning per reason, naming the ignored flags given."""
    for why, said, specs in IGNORED:
        given = []
        for spec in specs:
            options, kind = _options(spec)
            dest = options[0].lstrip("-").replace("-", "_")
            if getattr(args, dest) not in (None, False):
                given.append(options[0])
        if given and said:
            ctx.warnings.append(f"{', '.join(given)}: accepted with no effect here: {why}")
