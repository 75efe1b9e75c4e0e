"""Where one optimizer step of ours (the trainer) spends its time: the torch profiler's kernel
times, summed per category, so the next bottleneck is named by numbers.

Model: --preset (default llama-1b, harness.py), bf16 on GPU, micro batch 1, SP=1, built by
harness.py from Megatron-LM's flags (`harness.run_config`) plus --variant-flags (e.g.
"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"). One optimizer
step is ceil(--tokens-per-step / s) micro batches (default one) of the same random `[1, s]` batch
through megatron-core's forward-backward schedule, Adam and the LR scheduler (`Trainer.step`).
After --warmup unprofiled steps, one step runs under torch.profiler (CPU + CUDA activities).

Time: on GPU each kernel's self device time (CUDA events of the profiler's trace, kernels, memcpy
and memset; CPU ops and user annotations are left out, they would count the kernels twice), on
CPU each op's self CPU time. Each name goes to the first row of CATEGORIES with one of its
substrings (case-insensitive), else to "other". The table gives each category's ms, share of
the total and calls; then the total against the profiled step's wall time (CUDA events on GPU,
perf_counter on CPU; kernels on concurrent streams can add up to more than the wall time, idle
GPU time between kernels to less), the top 10 names overall and the top 15 in "other" (to audit
the categories). --trace writes the chrome trace.

Command (H200; environment in bench/RESULTS.md, "Setup"):
    python3 bench/profile_step.py --seq 32768 --json $OUT/profile.json
CPU smoke test (tests/integration/test_bench_smoke.py):
    python3 bench/profile_step.py --preset tiny --backend local --seq 64
"""

import argparse
import math
import shlex
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import harness
from megatron_ulysses.sp.backends import resolve_backend
from megatron_ulysses.training.loop import initialize_distributed

# (category, substrings of a kernel or op name, lowercase). First match wins, so the order is:
# communication first (NCCL kernel names contain "reduce" and "copy"); norm before attention
# (a cuDNN norm kernel would match "cudnn"); attention before gemm (cuDNN SDPA kernels contain
# "sm90_", FMHA ones "cutlass"); optimizer and loss before elementwise (multi_tensor_apply and
# nll_loss kernels contain "reduce"); gemm before memcpy (CUTLASS template names can contain
# "copy"); memcpy before elementwise (torch's copy kernels are elementwise_kernel<...copy...>).
# "cudnn" is attention: a GPT step runs no convolutions, only cuDNN fused attention. Unfused
# attention's matmuls (local backend) are gemm (its softmax is attention), an unfused RoPE or
# loss is elementwise.
CATEGORIES = (
    ("communication", ("nccl", "c10d", "gloo", "all_to_all", "alltoall", "allreduce",
                       "all_reduce", "allgather", "all_gather", "reduce_scatter",
                       "reducescatter", "record_param_comms")),
    ("norm", ("rmsnorm", "rms_norm", "layernorm", "layer_norm")),
    ("attention", ("flash", "fmha", "sdpa", "fused_attn", "fusedattn", "cudnn", "attention",
                   "scaled_dot_product", "masked_softmax", "aten::_softmax")),
    ("optimizer", ("multi_tensor", "adam", "_foreach_")),
    # TE's fused cross entropy: Triton online_softmax / cross_entropy / element_mul kernels.
    ("loss", ("cross_entropy", "crossentropy", "log_softmax", "logsoftmax", "nll_loss",
              "online_softmax", "element_mul")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "cublas", "sm90_", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("rope", ("rope", "rotary")),
    ("memcpy", ("memcpy", "memset", "copy")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "activation", "silu", "swiglu",
                     "gated_act", "reduce", "fill")),
    # CPU ops (GPU kernel names never start with aten::)
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::neg",
                     "aten::pow", "aten::sqrt", "aten::rsqrt", "aten::exp", "aten::lerp",
                     "aten::sum", "aten::mean", "aten::cat")),
)
OTHER = "other"
CATEGORY_NAMES = tuple(dict.fromkeys([name for name, _ in CATEGORIES] + [OTHER]))


def categorize(name: str) -> str:
    lower = name.lower()
    for category, substrings in CATEGORIES:
        if any(sub in lower for sub in substrings):
            return category
    return OTHER


def self_device_us(event) -> float:
    """Self device time in us (`self_cuda_time_total` on torch before 2.4)."""
    value = getattr(event, "self_device_time_total", None)
    return event.self_cuda_time_total if value is None else value


def kernel_times(prof, cuda: bool) -> list:
    """[{"name", "category", "ms", "calls"}] of the profiled kernels (GPU: device events, self
    device time) or ops (CPU: self CPU time), longest first."""
    rows = []
    for event in prof.key_averages():
        if cuda:
            if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation",
                                                                False):
                continue
            us = self_device_us(event)
        else:
            us = event.self_cpu_time_total
        rows.append({"name": event.key, "category": categorize(event.key), "ms": us / 1e3,
                     "calls": event.count})
    return sorted(rows, key=lambda row: -row["ms"])


def breakdown(kernels) -> list:
    """[{"category", "ms", "share", "calls"}] over CATEGORY_NAMES, longest first."""
    total = sum(k["ms"] for k in kernels)
    if total <= 0:
        raise SystemExit("the profiler recorded no kernel time (on GPU: is CUPTI available?)")
    rows = []
    for name in CATEGORY_NAMES:
        mine = [k for k in kernels if k["category"] == name]
        ms = sum(k["ms"] for k in mine)
        rows.append({"category": name, "ms": ms, "share": ms / total,
                     "calls": sum(k["calls"] for k in mine)})
    return sorted(rows, key=lambda row: -row["ms"])


def cell(name: str, width: int = 120) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= width else name[:width - 3] + "..."


def print_report(results) -> None:
    unit = "kernel" if results["device"] == "cuda" else "op"
    print(f"\n| category | ms | % of {unit} time | {unit} calls |")
    print("|---|---|---|---|")
    for row in results["categories"]:
        print(f"| {row['category']} | {row['ms']:.3f} | {100 * row['share']:.1f}% | "
              f"{row['calls']} |")
    total, step = results["total_kernel_ms"], 1e3 * results["step_seconds"]
    print(f"| total | {total:.3f} | 100.0% | {sum(r['calls'] for r in results['categories'])} |")
    print(f"\n{results['time_source']}: {total:.3f} ms; step wall time "
          f"({results['wall_clock']}): {step:.3f} ms; ratio {total / step:.3f}")
    for title, rows in (("Top 10 overall", results["top_kernels"]),
                        ('Top 15 in "other"', results["other_top"])):
        print(f"\n{title}:\n| name | category | ms | calls |\n|---|---|---|---|")
        for row in rows:
            print(f"| {cell(row['name'])} | {row['category']} | {row['ms']:.3f} | "
                  f"{row['calls']} |")


def parse_args():
    """The command line, --tokens-per-step defaulted and the backend resolved."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b", choices=sorted(harness.PRESETS))
    parser.add_argument("--backend", default="auto", help="te, sdpa, local or auto")
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help="at least this many tokens per optimizer step (micro batches of "
                        "--seq; default --seq: one micro batch)")
    parser.add_argument("--variant-flags", default="",
                        help="extra Megatron-LM flags, one string (e.g. --variant-flags="
                        "\"--recompute-granularity full --recompute-method uniform "
                        "--recompute-num-layers 1\"; a single flag needs the =)")
    parser.add_argument("--warmup", type=int, default=1, help="unprofiled optimizer steps first")
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", default=None, help="chrome trace of the profiled step")
    args = parser.parse_args()
    if args.tokens_per_step is None:
        args.tokens_per_step = args.seq
    if args.seq < 1 or args.tokens_per_step < 1 or args.warmup < 0:
        raise SystemExit("--seq and --tokens-per-step must be >= 1, --warmup >= 0")
    args.backend = resolve_backend(args.backend)
    return args


def profiled_step(trainer, batch, args, cuda: bool) -> tuple:
    """--warmup unprofiled steps, then one under torch.profiler: (profile, seconds, loss)."""
    for index in range(args.warmup):
        [seconds] = harness.time_calls(lambda: trainer.step(batch), 1)
        print(f"  warmup {index + 1}/{args.warmup}: {seconds:7.2f} s", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    losses = []
    with profile(activities=activities) as prof:
        [seconds] = harness.time_calls(lambda: losses.append(trainer.step(batch)), 1)
    print(f"  profiled step: {seconds:7.2f} s, loss {losses[0]:.4f}", flush=True)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return prof, seconds, losses[0]


def main():
    args = parse_args()
    shape = harness.PRESETS[args.preset]
    flags = shlex.split(args.variant_flags)
    micro_batches = math.ceil(args.tokens_per_step / args.seq)
    cuda = torch.cuda.is_available()

    config = harness.run_config(shape, args.seq, args.backend, flags,
                                num_microbatches=micro_batches)
    initialize_distributed(config)
    start = time.perf_counter()
    trainer = harness.Trainer("ours", config)
    label = " ".join(["ours"] + flags)
    print(f"s={args.seq} {label}: built in {time.perf_counter() - start:.1f} s; "
          f"{micro_batches} x {args.seq} tokens per step", flush=True)
    batch = harness.random_batch(shape.vocab, args.seq)
    prof, seconds, loss = profiled_step(trainer, batch, args, cuda)

    kernels = kernel_times(prof, cuda)
    categories = breakdown(kernels)
    results = {
        "versions": harness.versions(), "args": vars(args), "flags": flags, "seq": args.seq,
        "num_microbatches": micro_batches, "tokens_per_step": micro_batches * args.seq,
        "device": "cuda" if cuda else "cpu",
        "time_source": ("self device time of CUDA kernels, sum" if cuda
                        else "self CPU time of ops, sum"),
        "wall_clock": "CUDA events" if cuda else "perf_counter",
        "loss": loss, "step_seconds": seconds,
        "total_kernel_ms": sum(row["ms"] for row in categories), "categories": categories,
        "top_kernels": kernels[:10],
        "other_top": [k for k in kernels if k["category"] == OTHER][:15],
    }
    harness.write_json(args.json, results)
    print_report(results)
    harness.shutdown()


if __name__ == "__main__":
    main()
