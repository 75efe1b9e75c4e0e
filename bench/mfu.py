"""Whole-model throughput and MFU at SP=1: megatron-core's own GPTModel with its TE layer spec
("stock") against ours (`megatron_ulysses.layer_specs.build_gpt_model(..., backend="te")`), and
the cost of each ALST memory feature of ours, all measured side by side in one run.

Model: Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 kv heads, head dim 64, ffn 8192
SwiGLU, RMSNorm, RoPE, vocab 128256, untied), bf16, micro batch 1. Every step is a full training
step: forward, per-token loss backward, megatron-core DDP grad sync (fp32 grad buffer) and
megatron-core Adam step (fp32 master weights, TE FusedAdam), unless --no-optimizer.

Variants per length: stock; stock + full recompute; ours; ours + full recompute (1 layer per
checkpoint); + TiledMLP; + tiled loss; + activation offload (cumulative). Ratios: ours/stock
throughput, and each memory feature's throughput relative to ours without it ("off").

Model FLOPs = 6*(params - input embedding)*s + 6*layers*s^2*hidden (causal attention, see
harness.py); TFLOP/s = model FLOPs / median step time; MFU against 989 TFLOP/s.

Command used (H200; environment in bench/RESULTS.md, "Setup"):
    python3 bench/mfu.py --warmup 1 --iters 2 --json $OUT/mfu.json
CPU smoke test of the script:
    python bench/mfu.py --preset tiny --backend sdpa --seqs 64 --warmup 1 --iters 1
"""

import argparse

import torch

import harness
from megatron_ulysses.memory.activation_offload import enable_activation_offload

# (build name, build kwargs, [(variant, recompute, tiled loss, offload)])
BUILDS = [
    ("stock", dict(kind="stock"), [
        ("stock", False, False, False),
        ("stock + full recompute", True, False, False),
    ]),
    ("ours", dict(kind="ours"), [
        ("ours", False, False, False),
        ("ours + full recompute", True, False, False),
    ]),
    ("ours, TiledMLP", dict(kind="ours", tiled_mlp=True, tiled_loss=True), [
        ("ours + recompute + TiledMLP", True, False, False),
        ("ours + recompute + TiledMLP + tiled loss", True, True, False),
        ("ours + recompute + TiledMLP + tiled loss + offload", True, True, True),
    ]),
]


def measure(trainer, shape, seq, warmup, iters):
    """Median step seconds and peak memory (GiB allocated, reserved) at `seq`."""
    tokens, labels, position_ids = harness.random_batch(shape, seq)
    harness.reset_memory()
    for _ in range(warmup):
        trainer.step(tokens, labels, position_ids)
    times = harness.time_calls(lambda: trainer.step(tokens, labels, position_ids), iters)
    return harness.median(times), harness.peak_memory_gib()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="8192,32768")
    parser.add_argument("--preset", default="llama-1b", choices=sorted(harness.PRESETS))
    parser.add_argument("--backend", default="te", help="te (stock: TE spec) or sdpa "
                        "(stock: megatron-core local spec)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-optimizer", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated build names to run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    harness.init_distributed(sp=1)
    shape = harness.PRESETS[args.preset]
    seqs = [int(s) for s in args.seqs.split(",")]
    results = {"versions": harness.versions(), "args": vars(args), "rows": [],
               "optimizer": None if args.no_optimizer else
               "megatron-core DDP (fp32 grads) + megatron-core Adam (fp32 master, TE FusedAdam)"}
    for build_name, build_kwargs, variants in BUILDS:
        if args.only and build_name not in args.only.split(","):
            continue
        config = harness.transformer_config(shape, recompute=True)
        model = harness.build_model(config=config, shape=shape, max_seq=max(seqs),
                                    backend=args.backend, **build_kwargs)
        params, params_no_emb = harness.count_params(model)
        results["params"], results["params_no_input_embedding"] = params, params_no_emb
        trainer = harness.Trainer(model, config, optimizer=not args.no_optimizer)
        trainer.init_optimizer_state()
        for seq in seqs:
            flops = harness.model_flops(params_no_emb, shape, seq)
            for name, recompute, tiled_loss, offload in variants:
                harness.set_recompute(config, recompute)
                if hasattr(model, "tiled_loss_shards"):
                    model.tiled_loss_shards = "auto" if tiled_loss else None
                handles = enable_activation_offload(model.decoder) if offload else ()
                row = {"s": seq, "variant": name}
                try:
                    seconds, (alloc, reserved) = measure(trainer, shape, seq, args.warmup,
                                                         args.iters)
                    row.update(seconds=seconds, tokens_per_s=seq / seconds,
                               tflops=flops / seconds / 1e12,
                               mfu=flops / seconds / 1e12 / harness.H200_PEAK_TFLOPS,
                               peak_alloc_gib=alloc, peak_reserved_gib=reserved)
                    print(f"s={seq:6d} {name:52s} {row['tokens_per_s']:9.0f} tok/s "
                          f"{row['tflops']:6.1f} TFLOP/s MFU {100 * row['mfu']:5.1f}% "
                          f"peak {alloc:6.1f} GiB", flush=True)
                except Exception as exc:  # OOM, or a broken variant: report, go on
                    row["error"] = harness.describe_failure(exc)
                    print(f"s={seq:6d} {name:52s} {row['error']}", flush=True)
                    trainer.model.zero_grad_buffer()
                finally:
                    for handle in handles:
                        handle.remove()
                results["rows"].append(row)
                harness.write_json(args.json, results)
        del trainer, model
        harness.reset_memory()

    rows = results["rows"]

    def find(seq, name):
        return next((r for r in rows if r["s"] == seq and r["variant"] == name
                     and "seconds" in r), None)

    print("\n| s | variant | tokens/s | TFLOP/s | MFU | peak GiB | vs ours (off) |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["s"]):
        if "seconds" not in r:
            print(f"| {r['s']} | {r['variant']} | {r['error'][:40]} | | | | |")
            continue
        base = find(r["s"], "ours")
        ratio = f"{base['seconds'] / r['seconds']:.3f}" if base else ""
        print(f"| {r['s']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['tflops']:.1f} | "
              f"{100 * r['mfu']:.1f}% | {r['peak_alloc_gib']:.1f} | {ratio} |")
    harness.shutdown()


if __name__ == "__main__":
    main()
