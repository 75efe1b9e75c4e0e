"""Weak scaling of Ulysses SP: SP=N over N GPUs at s = N x base against SP=1 at s = base.

One torchrun command, one process per GPU, NCCL. Two phases on the same processes:

    SP=1   every GPU trains its own sample of `base` tokens (megatron DP = N)
    SP=N   the N GPUs train one sample of N x base tokens, base tokens per GPU (megatron DP' = N)

Both phases run ours (the trainer, `harness.Trainer("ours", ...)`, backend te by default) on the
Llama-3.2-1B shape with a full training step (megatron-core's schedule, DDP grad all-reduce over N
in both phases, megatron-core Adam).
Per-GPU throughput = local tokens / step time of the slowest rank; per-GPU TFLOP/s = model FLOPs
of the whole sample / N / step time (harness.py's formula). Attention work per token grows with
s, so per-GPU tokens/s falls with N by design; TFLOP/s per GPU is the weak-scaling figure (ideal:
1.0 x SP=1, more when the longer sequence keeps the GPU busier).

Commands:
    torchrun --nproc_per_node 8 bench/weak_scaling.py --base-seq 16384 --json weak.json  (not run)
    torchrun --nproc_per_node 1 bench/weak_scaling.py --base-seq 8192 --warmup 1 --iters 3 \
        --json $OUT/weak.json      (what ran: a functional check only, see bench/RESULTS.md)
"""

import argparse
import os

import torch
import torch.distributed as dist

import harness
from megatron_ulysses.sp import parallel_state as ps
from megatron_ulysses.training.loop import initialize_distributed


def run_phase(sp, seq, shape, args, world_size):
    """Median step seconds of the slowest rank and peak GiB (max over ranks)."""
    config = harness.run_config(shape, seq, args.backend,
                                harness.FULL_RECOMPUTE if args.recompute else (), sp=sp,
                                world_size=world_size)
    initialize_distributed(config)
    trainer = harness.Trainer("ours", config)
    _, params_no_emb = harness.count_params(trainer.model)
    batch = harness.random_batch(shape.vocab, seq, seed=ps.get_pure_data_parallel_rank(),
                                 sp_rank=ps.get_ulysses_sp_rank(), sp=sp)
    harness.reset_memory()
    for _ in range(args.warmup):
        trainer.step(batch)
    times = harness.time_calls(lambda: trainer.step(batch), args.iters)
    worst = torch.tensor([harness.median(times), harness.peak_memory_gib()[0]],
                         device=harness.device())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    seconds, peak = worst.tolist()
    del trainer, batch
    harness.reset_memory()
    ps.destroy_model_parallel()
    flops = harness.model_flops(params_no_emb, shape, seq)
    return {"sp": sp, "gpus": world_size, "s": seq, "s_per_gpu": seq // sp,
            "seconds": seconds, "tokens_per_s_per_gpu": seq / sp / seconds,
            "tflops_per_gpu": flops / sp / seconds / 1e12, "peak_alloc_gib": peak}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-seq", type=int, default=16384)
    parser.add_argument("--preset", default="llama-1b", choices=sorted(harness.PRESETS))
    parser.add_argument("--backend", default="te")
    parser.add_argument("--recompute", action="store_true", help="full recompute in both phases")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    shape = harness.PRESETS[args.preset]
    n = int(os.environ.get("WORLD_SIZE", "1"))  # the first phase starts the process group
    rows = [run_phase(1, args.base_seq, shape, args, n)]
    if n > 1:
        rows.append(run_phase(n, n * args.base_seq, shape, args, n))
    if dist.get_rank() == 0:
        base = rows[0]
        print("\n| SP | GPUs | s | s per GPU | tokens/s per GPU | TFLOP/s per GPU | peak GiB | "
              "TFLOP/s per GPU vs SP=1 |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['sp']} | {r['gpus']} | {r['s']} | {r['s_per_gpu']} | "
                  f"{r['tokens_per_s_per_gpu']:.0f} | {r['tflops_per_gpu']:.1f} | "
                  f"{r['peak_alloc_gib']:.1f} | {r['tflops_per_gpu'] / base['tflops_per_gpu']:.3f} |")
        harness.write_json(args.json, {"versions": harness.versions(), "args": vars(args),
                                       "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
