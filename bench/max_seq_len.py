"""Longest sequence one GPU trains: stock megatron-core vs ours with the ALST memory features.

Model: Llama-3.2-1B shape (see harness.py), bf16, micro batch 1, SP=1, one full training step per
length through `harness.Trainer` (megatron-core's forward-backward schedule, megatron-core Adam:
fp32 master weights and moments, created before measuring). Both sides from the same Megatron-LM
flags (`harness.run_config`); --features picks the flags:

    stock  megatron-core GPTModel, TE layer spec, Megatron-LM's default fusions (harness.py),
           full recompute (1 layer per checkpoint)
    ours   the trainer with full recompute + TiledMLP + tiled loss + --offload-activations

Lengths run in increasing order on one model (built for the longest); the first OOM ends the
sweep. For each length it records peak GPU memory (allocated and reserved), step seconds and the
peak pinned host memory (where offload keeps the layer inputs), and rewrites --json after every
length (so a run cut short still leaves its curve). --log-every prints the live GPU memory every
N seconds from a side thread (for runs of many minutes).

Commands used (H200; environment in bench/RESULTS.md, "Setup"):
    python3 bench/max_seq_len.py --model stock --seqs 65536,131072,262144 --json $OUT/stock.json
    python3 bench/max_seq_len.py --model ours --seqs 65536,131072,262144,524288,1000064 \
        --log-every 30 --json /root/m/ours.json      (detached with setsid: it outlives one call)
Plot (locally, from the saved JSON files):
    python bench/max_seq_len.py --plot bench/results/max_seq_len_stock.json \
        bench/results/max_seq_len_ours.json --png bench/max_seq_len.png
"""

import argparse
import json
import threading
import time

import torch

import harness
from megatron_ulysses.training.loop import initialize_distributed

FEATURES = {"recompute": harness.FULL_RECOMPUTE, "tiled-mlp": harness.TILED_MLP,
            "tiled-loss": harness.TILED_LOSS, "offload": harness.OFFLOAD}


def memory_logger(every: float, t0: float, stop: threading.Event) -> threading.Thread:
    def run():
        while not stop.wait(every):
            print(f"  [{time.time() - t0:7.1f} s] GPU allocated "
                  f"{torch.cuda.memory_allocated() / harness.GIB:6.1f} GiB, peak "
                  f"{torch.cuda.max_memory_allocated() / harness.GIB:6.1f} GiB", flush=True)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def pinned_host_gib() -> float:
    """Pinned host memory in use at its peak since the last reset, GiB (torch's caching host
    allocator, block sizes rounded up; where offload keeps the layer inputs); 0 where torch
    does not report it."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not torch.cuda.is_available() or stats is None:
        return 0.0
    return stats().get("active_bytes.peak", 0) / harness.GIB


def selected_features(args) -> set:
    """--features, checked (default: recompute for the stock model, every feature for ours)."""
    features = set(args.features.split(",")) if args.features else (
        {"recompute"} if args.model == "stock" else set(FEATURES))
    unknown = features - set(FEATURES)
    if unknown or (args.model == "stock" and features - {"recompute"}):
        raise SystemExit(f"--features: unknown or not for {args.model}: {sorted(features)}")
    return features


def step_row(trainer, shape, seq: int, params_no_emb: int, args) -> dict:
    """One training step at `seq` tokens: peak memory, time and phases, or why it failed."""
    t0 = time.time()
    batch = harness.random_batch(shape.vocab, seq)
    harness.reset_memory()
    reset_host_peak = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if torch.cuda.is_available() and reset_host_peak is not None:
        reset_host_peak()
    phases = {}

    def progress(name):
        harness.synchronize()
        phases[name] = time.time() - t0
        print(f"  s={seq}: {name} done at {phases[name]:.1f} s, peak "
              f"{harness.peak_memory_gib()[0]:.1f} GiB", flush=True)

    stop = threading.Event()
    if args.log_every and torch.cuda.is_available():
        memory_logger(args.log_every, t0, stop)
    row = {"s": seq}
    try:
        trainer.step(batch, progress=progress)
        harness.synchronize()
        seconds = time.time() - t0
        alloc, reserved = harness.peak_memory_gib()
        flops = harness.model_flops(params_no_emb, shape, seq)
        row.update(status="ok", seconds=seconds, peak_alloc_gib=alloc,
                   peak_reserved_gib=reserved, phases=phases,
                   tflops=flops / seconds / 1e12, pinned_host_gib=pinned_host_gib())
        print(f"s={seq:8d} ok   peak {alloc:6.1f} GiB allocated, {reserved:6.1f} reserved; "
              f"{seconds:7.1f} s/step, {row['tflops']:.0f} TFLOP/s; pinned host "
              f"{row['pinned_host_gib']:.1f} GiB", flush=True)
    except Exception as exc:
        row.update(status=harness.describe_failure(exc), phases=phases,
                   peak_alloc_gib=harness.peak_memory_gib()[0])
        print(f"s={seq:8d} {row['status']} (peak before failing "
              f"{row['peak_alloc_gib']:.1f} GiB)", flush=True)
    finally:
        stop.set()
    return row


def sweep(args):
    """Build the model once (for the longest s), then one step per length until one fails."""
    shape = harness.PRESETS[args.preset]
    seqs = [int(s) for s in args.seqs.split(",")]
    features = selected_features(args)
    flags = sum((FEATURES[name] for name in FEATURES if name in features), ())
    config = harness.run_config(shape, max(seqs), args.backend, flags)
    initialize_distributed(config)
    trainer = harness.Trainer(args.model, config)
    params, params_no_emb = harness.count_params(trainer.model)
    trainer.init_optimizer_state()
    harness.reset_memory()
    static_gib = torch.cuda.memory_allocated() / harness.GIB if torch.cuda.is_available() else 0
    results = {"versions": harness.versions(), "args": vars(args), "model": args.model,
               "features": sorted(features), "flags": list(flags), "params": params,
               "static_gib": static_gib, "rows": []}
    print(f"{args.model} {sorted(features)}: {params / 1e9:.3f} B params, model + optimizer "
          f"state {static_gib:.1f} GiB", flush=True)
    for seq in seqs:
        row = step_row(trainer, shape, seq, params_no_emb, args)
        results["rows"].append(row)
        harness.write_json(args.json, results)
        if row["status"] != "ok":
            break
    harness.shutdown()


def plot(paths, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    limit = None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        ok = [r for r in data["rows"] if r["status"] == "ok"]
        label = (f"{data['model']}: " + " + ".join(data["features"])).replace(
            "stock: recompute", "stock megatron-core (TE spec) + full recompute")
        line, = ax.plot([r["s"] for r in ok], [r["peak_alloc_gib"] for r in ok], "o-",
                        label=label)
        for r in data["rows"]:
            if r["status"] == "incomplete":  # a step stopped part-way: peak so far, hollow
                ax.plot([ok[-1]["s"], r["s"]], [ok[-1]["peak_alloc_gib"], r["peak_alloc_gib"]],
                        ":", color=line.get_color())
                ax.plot([r["s"]], [r["peak_alloc_gib"]], "o", mfc="none", markersize=9,
                        color=line.get_color())
                ax.annotate("step not finished\n(peak so far)", (r["s"], r["peak_alloc_gib"]),
                            textcoords="offset points", xytext=(-40, 12), fontsize=8,
                            color=line.get_color())
            elif r["status"] != "ok":
                ax.plot([r["s"]], [r.get("peak_alloc_gib", 0)], "x", color=line.get_color(),
                        markersize=10)
                ax.annotate(r["status"][:12], (r["s"], r.get("peak_alloc_gib", 0)),
                            textcoords="offset points", xytext=(5, 5), color=line.get_color())
        limit = data["versions"].get("gpu_memory_gib", limit)
    ax.axhline(limit or 139.8, color="gray", linestyle="--", linewidth=1,
               label="GPU memory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens, one GPU, micro batch 1)")
    ax.set_ylabel("peak GPU memory allocated (GiB)")
    ax.set_title("Llama-3.2-1B shape, bf16, one training step incl. Adam")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    ticks = sorted({r["s"] for p in paths for r in json.load(open(p))["rows"]})
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t // 1024}K" if t % 1024 == 0 else f"{t:,}" for t in ticks],
                       fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("stock", "ours"), default="ours")
    parser.add_argument("--seqs", default="65536,131072,262144,524288,1048576")
    parser.add_argument("--features", default=None,
                        help=f"comma-separated subset of {','.join(FEATURES)} "
                             "(default: stock recompute; ours all)")
    parser.add_argument("--preset", default="llama-1b", choices=sorted(harness.PRESETS))
    parser.add_argument("--backend", default="te")
    parser.add_argument("--log-every", type=float, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                        help="plot these result files to --png instead of running")
    parser.add_argument("--png", default="bench/max_seq_len.png")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.png)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
