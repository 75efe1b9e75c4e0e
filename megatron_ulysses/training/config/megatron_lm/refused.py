"""Megatron-LM's flags that this package refuses without parsing them: whole features out of
scope (MoE, RL, inference, ...), by group with one reason each, and single flags of features not
built here, each with why and what to use instead. Every flag of Megatron-LM's parser is either
taken by a config section, accepted by `compat.py`, or named here, so a Megatron-LM command line
never stops with a bare 'unrecognized arguments' (`tests/helpers/megatron_lm_flags.txt` lists them).
`arguments.py` puts the refusal in the one message with the command line's other problems.
`REFUSED_VALUES` and `NOT_WIRED` refuse the values and features of flags a section parses."""

from typing import Dict, List, Sequence

from ....errors import ConfigError

# (group, why, flag-name prefixes, flags): membership is by prefix where Megatron-LM names a
# feature's flags that way.
OUT_OF_SCOPE = (
    ("MoE", "mixture-of-experts layers (and multi-token prediction) are not supported",
     ("--moe-", "--mtp-", "--expert-", "--ep-"),
     ("--num-experts", "--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm",
      "--high-priority-a2a-comm-stream", "--overlap-dispatch-backward-with-experts-wgrad",
      "--use-fused-weighted-squared-relu", "--use-grouped-gemm-for-shared-expert",
      "--enable-gpt-oss")),  # (Megatron-LM's gpt-oss examples pass it; its parser has not)
    ("multi-latent / DSA / linear attention", "only standard (grouped-query) softmax "
     "attention is split by Ulysses here",
     ("--dsa-", "--no-dsa-", "--disable-dsa-", "--linear-", "--mla-", "--gdp-"),
     ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
      "--qk-pos-emb-head-dim", "--v-head-dim", "--cache-mla-latents",
      "--attention-output-gate", "--experimental-attention-variant")),
    ("attention, activation and RoPE variants", "the layers here are a dense GPT / Llama "
     "decoder's (full causal softmax attention, gelu / SwiGLU / squared-ReLU MLP, RoPE or "
     "learned positions)", ("--mhc-",),
     ("--window-size", "--window-attn-skip-freq", "--quick-geglu",
      "--activation-func-clamp-value", "--qk-l2-norm", "--no-rope-freq", "--enable-mhc-connections",
      "--openai-gelu", "--apply-residual-connection-post-layernorm")),
    ("optimizers other than Adam", "megatron_ulysses trains with Adam (--optimizer adam)",
     ("--muon-", "--lion-", "--qk-clip"), ("--sgd-momentum", "--no-use-layer-wise-param-layout")),
    ("RL", "use Megatron-LM's RL pipeline", ("--rl-", "--no-rl-", "--grpo-"),
     ("--langrl-env-config", "--perform-rl-step", "--pretrained-checkpoint", "--refit-method")),
    ("inference", "this is a training script (use Megatron-LM's inference scripts)",
     ("--inference-", "--no-inference-", "--incoming-requests-", "--num-tokens-", "--prompt",
      "--suspend-", "--coordinator-"),
     ("--cuda-graph-modules", "--cuda-graph-scope", "--decode-only-cuda-graphs",
      "--enable-chunked-prefill", "--max-tokens-to-oom", "--num-speculative-tokens",
      "--output-bert-embeddings", "--use-legacy-static-engine",
      "--use-same-sampling-seed-across-dp-ranks", "--flash-decode", "--mlp-chunks-for-prefill",
      "--nccl-all-reduce-for-prefill", "--symmetric-ar-type",
      # the flags of its inference scripts (megatron.inference.utils, examples/inference)
      "--temperature", "--top_k", "--top_p", "--return-log-probs", "--top-n-logprobs",
      "--model-provider", "--skip-prompt-log-probs", "--stop-words", "--output-path",
      "--output-every-n-results", "--output-request-events", "--use-flashinfer-fused-rope",
      "--no-record-throughput", "--termination-id", "--throughput-check-only",
      "--drain-between-batches", "--batch-boundaries", "--use-coordinator", "--async-mode")),
    ("vision / multimodal", "the model is a text GPT", ("--dino-", "--img-", "--vision-"),
     ("--classes-fraction", "--data-per-class-fraction", "--head-lr-mult", "--iter-per-epoch",
      "--mask-factor", "--mask-type", "--no-data-sharding", "--num-channels", "--num-classes",
      "--patch-dim", "--swin-backbone-type", "--mrope-section")),
    ("BERT / T5 / biencoder", "the model is a decoder-only GPT",
     ("--bert-", "--biencoder-", "--ict-", "--indexer-", "--retriever-", "--encoder-",
      "--relative-attention-"),
     ("--block-data-path", "--decoder-seq-length", "--embedding-path", "--evidence-data-path",
      "--query-in-block-prob", "--titles-data-path", "--use-one-sent-docs",
      "--vocab-extra-ids", "--decoder-num-layers", "--mask-prob", "--short-seq-prob",
      "--sample-rate")),
    ("hybrid / Mamba / heterogeneous layers", "every layer is the same transformer layer",
     ("--mamba-", "--disable-mamba-", "--hybrid-", "--heterogeneous-layers-"),
     ("--spec", "--is-hybrid-model", "--max-seqlen-per-dp-cp-rank")),
    ("distillation / ModelOpt", "use Megatron-LM's post-training scripts",
     ("--logits-", "--export-"), ("--chat-template", "--modelopt-enabled")),
    ("FIM data", "Megatron-LM's fill-in-the-middle dataset is not in megatron-core",
     ("--fim-",), ()),
    ("FP4 and custom quantization", "FP8 (--fp8-format with the delayed, tensorwise, "
     "blockwise or mxfp8 recipe) is the low precision built here", ("--fp4-",),
     ("--fp8-output-proj", "--fp8-quantizer-factory", "--te-precision-config-file",
      "--output-logit-dtype", "--use-grouped-gemm-for-dense-mlp")),
    ("kernel and layer implementations", "the layer spec here is megatron-core's (TE's or its "
     "local layers) with the Ulysses attention; use --transformer-impl and "
     "--ulysses-attention-backend", (),
     ("--use-kitchen-attention", "--kitchen-attention-backend", "--use-te-activation-func",
      "--use-transformer-engine-op-fuser", "--batch-invariant-mode",
      "--batch-invariant-backend")),
    ("megatron-core's activation offloading", "use --offload-activations (full-recompute "
     "checkpoints in CPU memory) and --tiled-mlp-shards (the MLP in sequence tiles)", (),
     ("--fine-grained-activation-offloading", "--offload-modules", "--min-offloaded-tensor-size",
      "--activation-offload-fraction", "--delay-offload-until-cuda-graph",
      "--delta-offload-bytes-across-pp-ranks", "--fine-grained-offloading-max-inflight-offloads",
      "--cpu-offloading-num-layers", "--cpu-offloading-retain-pinned-cpu-buffers",
      "--mlp-chunks-for-training")),
    ("CUDA graphs", "the Ulysses all-to-alls are not captured: CUDA graphs are not wired "
     "(--cuda-graph-impl none)", (),
     ("--enable-cuda-graph", "--external-cuda-graph", "--optimizer-cuda-graph")),
    ("Megatron-FSDP options", "Megatron-FSDP's buffer, allocator and HSDP options are not "
     "wired into this package's model build", ("--megatron-fsdp-",),
     ("--fsdp-db-use-persist-buf-on-alloc-fail", "--keep-fp8-transpose-cache",
      "--suggested-communication-unit-size", "--enable-full-sharding-in-hsdp")),
    ("generalized tensor parallelism", "megatron-core's GTP weight rematerialization is not "
     "built here; use --tensor-model-parallel-size", ("--gtp-",),
     ("--tensor-parallel-num-weight-shards",)),
    ("fault tolerance and local checkpoints", "nvidia-resiliency-ext's fault tolerance and "
     "in-process restart, NVIDIA's ADLR autoresume and Megatron-LM's local / replicated "
     "checkpoints are not wired; --exit-signal-handler and --save-interval save, --load resumes",
     ("--inprocess-", "--fault-injector-", "--non-persistent-", "--replication"),
     ("--enable-ft-package", "--calc-ft-timeouts", "--ft-num-warmup-iters",
      "--adlr-autoresume", "--adlr-autoresume-interval")),
    ("checkpoint conversion", "convert with Megatron-LM's tools; --load reads torch_dist "
     "checkpoints, ours and Megatron-LM's", ("--ckpt-convert-",), ()),
)

# Single flags of features not built here: why, and what to use instead.
NOT_BUILT = {
    "--batch-size": "no longer valid in Megatron-LM either; use --micro-batch-size",
    "--warmup": "no longer valid in Megatron-LM either; use --lr-warmup-fraction "
                "(or --lr-warmup-iters / --lr-warmup-samples)",
    "--model-parallel-size": "no longer valid in Megatron-LM either; use "
                             "--tensor-model-parallel-size",
    "--use-legacy-models": "no longer valid in Megatron-LM either: the model is megatron-core's "
                           "GPTModel (drop the flag)",
    "--checkpoint-activations": "no longer valid in Megatron-LM either; use "
                                "--recompute-activations, or --recompute-granularity and "
                                "--recompute-method",
    "--activations-checkpoint-method": "no longer valid in Megatron-LM either; use "
                                       "--recompute-granularity full with --recompute-method",
    "--activations-checkpoint-num-layers": "no longer valid in Megatron-LM either; use "
                                           "--recompute-num-layers",
    "--DDP-impl": "no longer valid in Megatron-LM either: data parallelism is megatron-core's "
                  "DDP (--use-torch-fsdp2 or --use-megatron-fsdp shard it)",
    "--yaml-cfg": "YAML configs are not read here; give the flags on the command line",
    "--pipeline-model-parallel-layout": "custom pipeline layouts are not built here; use "
                                        "--pipeline-model-parallel-size with "
                                        "--decoder-first/last-pipeline-num-layers or "
                                        "--num-layers-per-virtual-pipeline-stage",
    "--iterations-to-skip": "skipping iterations is not built here",
    "--phase-transition-iterations": "training phases are not built here; run one job per "
                                     "phase (--load resumes)",
    "--full-validation": "evaluation reads --eval-iters batches; give a larger --eval-iters",
    "--multiple-validation-sets": "one validation set is evaluated here (--valid-data-path "
                                  "blends several)",
    "--validation-set-names": "one validation set is evaluated here",
    "--freeze-all-layers": "freezing layers is not built here",
    "--load-main-params-from-ckpt": "not built here: --no-load-optim starts the optimizer "
                                    "from the loaded weights",
    "--override-ckpt-iteration": "not built here; --finetune starts at iteration 0",
    "--ckpt-step": "--load reads the iteration named in its "
                   "latest_checkpointed_iteration.txt",
    "--enable-msc": "object-storage paths (Multi-Storage Client) are not read; give local "
                    "paths",
    "--dataloader-inter-document-masking": "use --reset-attention-mask (documents attend only "
                                           "within themselves)",
    "--fp16-lm-cross-entropy": "the loss is computed in fp32 here",
    "--fp32-residual-connection": "not wired: the residual stream stays in the parameter "
                                  "dtype",
    "--distribute-saved-activations": "not wired: --sequence-parallel and --ulysses-sp-size "
                                      "split the activations",
    "--no-initialization": "not wired: the weights are always initialized from --seed (then "
                           "--load replaces them)",
    "--tokenizer-metadata": "tokenizer metadata files are not read; give --tokenizer-type and "
                            "--tokenizer-model",
    "--allow-ambiguous-pad-tokens": "not wired: pad tokens in the data are masked out of the "
                                    "loss, as in Megatron-LM by default",
    "--mid-level-dataset-surplus": "not wired: blended datasets use megatron-core's default "
                                   "surplus (0.005)",
    "--lazy-mpu-init": "Megatron-LM's programmatic initialization is not built here",
    "--fake-process-group": "runs need real process groups here",
    "--use-ring-exchange-p2p": "needs a custom PyTorch build; not wired",
    "--mup-width-mult": "--use-mup takes only --mup-base-hidden-size here",
    "--mup-base-head-dim": "--use-mup takes only --mup-base-hidden-size here",
    "--mup-attn-scale-power": "--use-mup takes only --mup-base-hidden-size here",
    "--mup-embedding-mult": "--use-mup takes only --mup-base-hidden-size here",
    "--mup-output-mult": "--use-mup takes only --mup-base-hidden-size here",
}


def out_of_scope(flags: Sequence[str]) -> Dict[str, List[str]]:
    """`flags` (unknown to the parser) that name an out-of-scope feature, by its group, or a
    feature not built here (`NOT_BUILT`), as a group of its own named by the flag."""
    groups: Dict[str, List[str]] = {}
    for flag in dict.fromkeys(flags):
        if flag in NOT_BUILT:
            groups[flag] = [flag]
            continue
        for group, _, prefixes, names in OUT_OF_SCOPE:
            if flag in names or flag.startswith(prefixes):
                groups.setdefault(group, []).append(flag)
                break
    return groups


def refusal(groups: Dict[str, List[str]], extra: Sequence[str] = ()) -> str:
    """The one refusal naming every given refused flag with its group's reason (`extra`:
    refusals of known flags, e.g. --context-parallel-size > 1)."""
    why = {group: reason for group, reason, _, _ in OUT_OF_SCOPE}
    parts = [f"{group}: {NOT_BUILT[group]}" if group in NOT_BUILT else
             f"{group} ({', '.join(flags)}): {why[group]}" for group, flags in groups.items()]
    return ("these Megatron-LM features are out of scope for megatron_ulysses (dense GPT "
            "pretraining with Ulysses SP) or not built here: " + "; ".join(parts + list(extra)))


_RERUN = ("needs megatron-core's rerun engine (re-running an iteration), which megatron_ulysses "
          "does not wire; drop it (NaN losses and gradients are checked: --rerun-mode)")
# (field, the values built here, the refusal of another `{value}`), checked where the section
# of the field checks its values (`refuse_values`).
REFUSED_VALUES = (
    ("dataloader_type", (None, "single"), "--dataloader-type {value}: only single (Megatron-LM's "
     "default) is built here: each sample is read once, in order, resumable at any sample; "
     "drop it"),
    ("error_injection_rate", (0,), "--error-injection-rate {value} injects faults into "
     "megatron-core's rerun engine, which megatron_ulysses does not wire; drop it"),
    ("check_for_large_grads", (False,), "--check-for-large-grads " + _RERUN),
    ("check_for_spiky_loss", (False,), "--check-for-spiky-loss " + _RERUN),
    ("exit_signal", ("SIGTERM",), "--exit-signal {value}: only SIGTERM is handled here (the "
     "data workers and checkpoint writers block SIGTERM alone, so another signal sent to the "
     "job would kill them); send SIGTERM (e.g. SLURM's --signal=TERM@120)"),
    ("rerun_mode", ("disabled", "validate_results"), "--rerun-mode {value} needs megatron-core's "
     "rerun engine, which megatron_ulysses does not wire; use validate_results or disabled"),
    ("non_persistent_save_interval", (None,), "--non-persistent-save-interval: non-persistent "
     "(local / global) checkpoints are not supported; use --save-interval"),
    ("ckpt_format", ("torch", "torch_dist", "torch_dcp"), "--ckpt-format {value}: Megatron "
     "FSDP's checkpoint format is not written here; use --ckpt-format torch_dist (the default; "
     "--use-megatron-fsdp runs without --save / --load, --use-torch-fsdp2 saves torch_dist)"),
    ("cuda_graph_impl", ("none",), "--cuda-graph-impl {value}: CUDA graphs are not wired into "
     "megatron_ulysses yet (the Ulysses all-to-all is not captured); use none"),
)

# Features whose Megatron-LM rules are checked first (by their section), then refused here.
NOT_WIRED = {
    "--fp8-dot-product-attention": "Transformer Engine 2.20.2 found no FP8 attention kernel "
    "for the head-sharded q, k, v between the all-to-alls (H100, head dim 64: 'No dot product "
    "attention backend is available'); drop it (the linear layers still run in FP8)",
    "--tp-comm-overlap": "Transformer Engine's userbuffers are not initialized for the "
    "Ulysses-local sequence",
    "Megatron-FSDP options": "Megatron-FSDP's meta-device initialization, NCCL user buffers, "
    "double buffer, dtypes and outer (HSDP) sharding are not wired into megatron_ulysses' model "
    "build; drop them",
}


def refuse_values(args, names: Sequence[str]) -> None:
    """The first `REFUSED_VALUES` row of the fields `names` whose value is not built here."""
    for name, built, refusal in REFUSED_VALUES:
        if name in names and getattr(args, name) not in built:
            raise ConfigError(refusal.format(value=getattr(args, name)))


def not_wired(flags: str, feature: str = None) -> None:
    """Refuse `flags` (given) of the `NOT_WIRED` feature (default: the flag itself)."""
    raise ConfigError(f"{flags}: not supported yet: {NOT_WIRED[feature or flags]}")
