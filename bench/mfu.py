"""Whole-model MFU at SP=1: stock megatron-core at Megatron-LM's default flags against ours (the
trainer), side by side in one run, at s = 8K, 32K and the longest the card holds (64K on 80 GB,
128K on 141 GB: --seqs auto).

Model (preset llama-1b): Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 kv heads, head
dim 64, ffn 8192 SwiGLU, RMSNorm, RoPE base 500000, vocab 128256, untied), bf16, micro batch 1.
Both sides are built by harness.py from the same Megatron-LM flags (`harness.megatron_flags`).
One optimizer step is ceil(--tokens-per-step / s) micro batches of the same random `[1, s]` batch
(262144 tokens: 32 x 8K, 8 x 32K, 2 x 128K, so the optimizer step is amortized) through
megatron-core's forward-backward schedule, then megatron-core's Adam (TE FusedAdam, fp32 master
weights) and the LR scheduler. Each variant is built fresh, runs --warmup steps, then --iters
timed steps (CUDA events); a variant that fails (OOM) records an error row and the run goes on.

Variants (keys for --variants / --skip; flags added to the base flags):
    stock            megatron-core GPTModel, TE spec, `harness.stock_transformer_config`:
                     Megatron-LM's default fusions + TE's fused cross entropy
    stock-full       + full recompute (uniform, 1 layer per checkpoint)
    ours             the trainer (pretrain_gpt.py's build), same flags
    ours-sdpa        + --ulysses-attention-backend sdpa (torch's SDPA, native GQA, in TE's
                     layers): same cuDNN kernels as TE's; 15% faster alone at 8K, 1.001x in the model
    ours-tiled       + TiledMLP + tiled loss (auto tiles), no recompute
    ours-selective   + --recompute-granularity selective (megatron-core's default module:
                     core_attn)
    ours-mlp         + --recompute-granularity selective --recompute-modules mlp + tiled loss
    ours-full        + full recompute
    ours-full-tiled  + full recompute + TiledMLP + tiled loss + activation offload
    stock-fp8, ours-fp8, stock-full-fp8, ours-mlp-fp8
                     the variant + FP8 GEMMs (`harness.FP8`: hybrid format, delayed scaling,
                     amax history 1024 / max, as Megatron-LM's Llama-3 8B H100 FP8 example);
                     attention stays bf16 (TE 2.20.2 has no FP8 attention kernel for it)
    ours-flash, ours-mlp-flash, ours-flash-fp8
                     ours / ours-mlp / ours-fp8 + --ulysses-attention-backend flash
                     (FlashAttention-4, in TE's layers; needs flash-attn-4: see below)

Default --skip (DEFAULT_PLAN): each side's candidates for best at each s, as measured on
2026-12-04/06, in bf16 and FP8 (the bf16 plan alone takes about 9 minutes of an H200 for all
three s). Left out: at 8K and 32K every recompute and TiledMLP variant (everything fits
without; they only cost: section 3 of
bench/RESULTS.md), at 128K the variants without recompute (OOM) and the slower full-recompute
ones of ours; the flash variants (FlashAttention-4, 1.2-1.4x cuDNN's attention alone on the
H100: bench/RESULTS.md) run at every s, bf16, and with FP8 at 8K. `--skip ""` runs everything.

MFU = model FLOPs per step (harness.model_flops x micro batches; recompute not counted) / median
step seconds / 989 TFLOP/s (the dense bf16 peak, for FP8 too, so FP8's MFU reads as its speed-up).
`summary`: per s, each side's best variant that fit, ours/stock, and ours' best FP8 / best bf16.
The JSON is rewritten after every row (a run cut short keeps its rows and summary).

Command (H200; environment in bench/RESULTS.md, "Setup"):
    python3 bench/mfu.py --warmup 1 --iters 2 --json $OUT/mfu.json
The flash variants need flash-attn-4 (`pip install 'megatron_ulysses[flash]'`, or
bench/prepare_flash4.sh for a node without a package index); without it their rows record the
ConfigError.
CPU smoke test (tests/integration/test_bench_smoke.py):
    python3 bench/mfu.py --preset tiny --backend local --seqs 64 --tokens-per-step 128 \
        --variants stock,ours --iters 1
"""

import argparse
import math
import time

import harness
from megatron_ulysses.sp.backends import resolve_backend
from megatron_ulysses.training.loop import initialize_distributed

FLASH = ("--ulysses-attention-backend", "flash")
VARIANTS = {  # key: (label, flags); a label starts with its side
    "stock": ("stock", ()),
    "stock-full": ("stock + full recompute", harness.FULL_RECOMPUTE),
    "ours": ("ours", ()),
    "ours-sdpa": ("ours + SDPA attention", ("--ulysses-attention-backend", "sdpa")),
    "ours-flash": ("ours + FlashAttention-4", FLASH),
    "ours-tiled": ("ours + TiledMLP + tiled loss", harness.TILED_MLP + harness.TILED_LOSS),
    "ours-selective": ("ours + selective recompute", harness.SELECTIVE_RECOMPUTE),
    "ours-mlp": ("ours + selective recompute (mlp) + tiled loss",
                 harness.SELECTIVE_RECOMPUTE + ("--recompute-modules", "mlp") + harness.TILED_LOSS),
    "ours-full": ("ours + full recompute", harness.FULL_RECOMPUTE),
    "ours-full-tiled": ("ours + full recompute + TiledMLP + tiled loss + offload",
                        harness.FULL_RECOMPUTE + harness.TILED_MLP + harness.TILED_LOSS
                        + harness.OFFLOAD),
    "stock-fp8": ("stock + FP8", harness.FP8),
    "ours-fp8": ("ours + FP8", harness.FP8),
    "stock-full-fp8": ("stock + full recompute + FP8", harness.FULL_RECOMPUTE + harness.FP8),
    "ours-mlp-fp8": ("ours + selective recompute (mlp) + tiled loss + FP8",
                     harness.SELECTIVE_RECOMPUTE + ("--recompute-modules", "mlp")
                     + harness.TILED_LOSS + harness.FP8),
    "ours-mlp-flash": ("ours + selective recompute (mlp) + tiled loss + FlashAttention-4",
                       harness.SELECTIVE_RECOMPUTE + ("--recompute-modules", "mlp")
                       + harness.TILED_LOSS + FLASH),
    "ours-flash-fp8": ("ours + FlashAttention-4 + FP8", FLASH + harness.FP8),
}
# What runs by default (the rest is --skip'ped): each side's candidates for best at each s.
DEFAULT_PLAN = {8192: ("stock", "ours", "stock-fp8", "ours-fp8", "ours-flash", "ours-flash-fp8"),
                32768: ("stock", "ours", "stock-fp8", "ours-fp8", "ours-flash"),
                65536: ("stock-full", "ours-mlp", "ours-mlp-flash"),
                131072: ("stock-full", "ours-mlp", "stock-full-fp8", "ours-mlp-fp8",
                         "ours-mlp-flash")}
DEFAULT_SKIP = ",".join(f"{seq}:{key}" for seq, keys in DEFAULT_PLAN.items() for key in VARIANTS
                        if key not in keys)


def measure(key, seq, shape, args, batch) -> dict:
    """Build variant `key` at `seq`, run its steps; the row's measured fields."""
    label, flags = VARIANTS[key]
    micro_batches = math.ceil(args.tokens_per_step / seq)
    config = harness.run_config(shape, seq, args.backend, flags, num_microbatches=micro_batches)
    start = time.perf_counter()
    trainer = harness.Trainer(label.split()[0], config)
    built = time.perf_counter() - start
    print(f"s={seq:6d} {label}: built in {built:.1f} s; {micro_batches} x {seq} tokens per step",
          flush=True)
    params, params_no_emb = harness.count_params(trainer.model)
    flops = micro_batches * harness.model_flops(params_no_emb, shape, seq)
    harness.reset_memory()
    losses, times = [], []
    for index in range(args.warmup + args.iters):
        [seconds] = harness.time_calls(lambda: losses.append(trainer.step(batch)), 1)
        warm = index < args.warmup
        if not warm:
            times.append(seconds)
        print(f"  {'warmup' if warm else 'step'} {index + 1}/{args.warmup + args.iters}: "
              f"{seconds:7.2f} s, loss {losses[-1]:.4f}", flush=True)
    seconds = harness.median(times)
    alloc, reserved = harness.peak_memory_gib()
    tflops = flops / seconds / 1e12
    return {"num_microbatches": micro_batches, "tokens_per_step": micro_batches * seq,
            "build_seconds": built, "params": params, "params_no_input_embedding": params_no_emb,
            "loss_step0": losses[0], "seconds": seconds, "step_seconds": times,
            "tokens_per_s": micro_batches * seq / seconds, "tflops": tflops,
            "mfu": tflops / harness.H200_PEAK_TFLOPS, "peak_alloc_gib": alloc,
            "peak_reserved_gib": reserved}


def best(rows, seq, side, fp8=None):
    """The row of highest MFU at `seq` of `side` that fit (FP8 or bf16 only when `fp8` says)."""
    fit = [r for r in rows if r["s"] == seq and r["variant"].split()[0] == side and "mfu" in r
           and (fp8 is None or r["key"].endswith("-fp8") == fp8)]
    return max(fit, key=lambda r: r["mfu"], default=None)


def summarize(rows) -> list:
    """Per s: each side's variant of highest MFU among those that fit, ours/stock, and ours'
    best FP8 over its best bf16."""
    summary = []
    for seq in sorted({row["s"] for row in rows}):
        stock, ours = best(rows, seq, "stock"), best(rows, seq, "ours")
        fp8, bf16 = best(rows, seq, "ours", fp8=True), best(rows, seq, "ours", fp8=False)
        summary.append({
            "s": seq, "best_stock": stock and stock["variant"],
            "best_ours": ours and ours["variant"],
            "ratio": ours["mfu"] / stock["mfu"] if stock and ours else None,
            "mfu_stock": stock and stock["mfu"], "mfu_ours": ours and ours["mfu"],
            "ours_fp8_over_bf16": fp8["mfu"] / bf16["mfu"] if fp8 and bf16 else None,
        })
    return summary


def auto_seqs() -> list:
    """The lengths this card holds: 8K, 32K and, beside them, 128K on a 141 GB card (stock fits
    it only with full recompute), 64K on an 80 GB one."""
    import torch

    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return [8192, 32768, 131072 if total_gib > 120 else 65536]


def parse_skip(text: str) -> set:
    skip = set()
    for entry in filter(None, text.split(",")):
        seq, _, key = entry.partition(":")
        if key not in VARIANTS or not seq.isdigit():
            raise SystemExit(f"--skip: expected SEQ:VARIANT with VARIANT one of "
                             f"{', '.join(VARIANTS)}, got {entry!r}")
        skip.add((int(seq), key))
    return skip


def print_tables(results) -> None:
    print("\n| s | variant | tokens/s | TFLOP/s | MFU | peak GiB | step-0 loss |")
    print("|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        if "mfu" not in r:
            print(f"| {r['s']} | {r['variant']} | {r['error'][:40]} | | | | |")
            continue
        print(f"| {r['s']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['tflops']:.1f} | "
              f"{100 * r['mfu']:.1f}% | {r['peak_alloc_gib']:.1f} | {r['loss_step0']:.4f} |")
    print("\n| s | best stock | MFU | best ours | MFU | ours / stock | ours FP8 / bf16 |")
    print("|---|---|---|---|---|---|---|")
    for e in results["summary"]:
        def mfu(value):
            return "" if value is None else f"{100 * value:.1f}%"

        def ratio(value):
            return "" if value is None else f"{value:.3f}"
        print(f"| {e['s']} | {e['best_stock'] or 'none fit'} | {mfu(e['mfu_stock'])} | "
              f"{e['best_ours'] or 'none fit'} | {mfu(e['mfu_ours'])} | {ratio(e['ratio'])} | "
              f"{ratio(e['ours_fp8_over_bf16'])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="auto", help="comma-separated lengths, or auto: "
                        "8K, 32K and 128K on a card of more than 120 GiB, else 8K, 32K, 64K")
    parser.add_argument("--tokens-per-step", type=int, default=262144,
                        help="at least this many tokens per optimizer step (micro batches of s)")
    parser.add_argument("--preset", default="llama-1b", choices=sorted(harness.PRESETS))
    parser.add_argument("--backend", default="auto", help="ours: te, sdpa, local or auto; "
                        "stock: TE spec for te, megatron-core's local spec otherwise")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--skip", default=DEFAULT_SKIP, help="comma-separated SEQ:VARIANT "
                        "pairs not to run ('' runs all)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps")
    parser.add_argument("--iters", type=int, default=2, help="timed optimizer steps")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    keys = args.variants.split(",")
    unknown = [key for key in keys if key not in VARIANTS]
    if unknown or args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}"
                         if unknown else "--iters must be >= 1 and --warmup >= 0")
    skip = parse_skip(args.skip)
    args.backend = resolve_backend(args.backend)
    shape = harness.PRESETS[args.preset]
    seqs = auto_seqs() if args.seqs == "auto" else [int(s) for s in args.seqs.split(",")]

    initialize_distributed(harness.run_config(shape, seqs[0], args.backend))
    results = {"versions": harness.versions(), "args": vars(args), "peak_tflops":
               harness.H200_PEAK_TFLOPS, "rows": [], "summary": []}
    for seq in seqs:
        batch = harness.random_batch(shape.vocab, seq)
        for key in keys:
            label = VARIANTS[key][0]
            if (seq, key) in skip:
                print(f"s={seq:6d} {label}: skipped (--skip)", flush=True)
                continue
            row = {"s": seq, "variant": label, "key": key, "flags": list(VARIANTS[key][1])}
            try:
                row.update(measure(key, seq, shape, args, batch))
                print(f"s={seq:6d} {label}: {row['tokens_per_s']:9.0f} tok/s "
                      f"{row['tflops']:6.1f} TFLOP/s MFU {100 * row['mfu']:5.1f}% "
                      f"peak {row['peak_alloc_gib']:6.1f} GiB", flush=True)
            except Exception as exc:  # OOM, or a broken variant: report, go on
                row["error"] = harness.describe_failure(exc)
                print(f"s={seq:6d} {label}: {row['error']}", flush=True)
            harness.reset_memory()
            results["rows"].append(row)
            results["summary"] = summarize(results["rows"])
            harness.write_json(args.json, results)
        del batch
        harness.reset_memory()
    print_tables(results)
    harness.shutdown()


if __name__ == "__main__":
    main()
