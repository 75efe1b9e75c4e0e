"""Collectives and bytes per transformer layer at SP=P, counted, next to the theory and DeepSpeed.

Runs on CPU: P gloo processes (torch.multiprocessing spawn), fp32 tensors, the trainer's model
built as pretrain_gpt.py builds it (`harness.run_config` flags, `training/model.py`'s
`transformer_config` and `build_model`, backend sdpa) with the Llama-3.2-1B layer shape (hidden
2048, 32 heads, head dim 64, ffn 8192) and a small vocab, on a random batch sharded as the loader
shards it. One forward is the schedule's `forward_step` plus its loss function, then the backward
of that loss (no optimizer step, so no gradient reduction is counted). Every torch.distributed
collective is wrapped to count calls and the bytes handed to it during the decoder's forward
(hooks on the GPTModel's `decoder`) and the whole backward; per layer = count / layers.
Collectives outside the decoder (the loss's all-reduces over the size-1 tensor-parallel group)
are listed apart.

Theory per rank per layer forward (G' = max(G, P) kv heads after replication when G < P):
    in:  one all-to-all of (s/P)*b*(H + 2G')*d elements (q, k, v fused)
    out: one all-to-all of (s/P)*b*H*d elements
of which (P-1)/P leaves the rank (the rank's own chunk stays). Backward: the same two exchanges.
DeepSpeed's `DistributedAttention` (deepspeed.sequence.layer) is counted on the same q, k, v:
one all-to-all each for q, k, v and one for the output, 4 per forward, same bytes when G >= P
(it cannot replicate kv heads for G < P).

Command used (local CPU, see bench/RESULTS.md):
    python bench/comm_volume.py
"""

import argparse
import collections
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import harness
from megatron_ulysses.sp import parallel_state as ps
from megatron_ulysses.training.loop import initialize_distributed
from megatron_ulysses.training.model import build_model, transformer_config
from megatron_ulysses.training.schedule import forward_step

COLLECTIVES = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather",
               "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "send", "recv",
               "isend", "irecv", "batch_isend_irecv")


class CollectiveCounter:
    """Wraps torch.distributed's collectives; `calls[name]` and `bytes[name]` (input bytes) of
    the calls made while `active` (all of them unless `only_inside` is used)."""

    def __init__(self):
        self.calls, self.bytes = collections.Counter(), collections.Counter()
        self.originals = {}
        self.active = True

    def only_inside(self, module):
        """Count only calls made during `module`'s forward; returns the hook handles."""
        self.active = False

        def enter(*_):
            self.active = True

        def leave(*_):
            self.active = False
        return (module.register_forward_pre_hook(enter),
                module.register_forward_hook(leave, always_call=True))

    def __enter__(self):
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.originals[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            self.calls[name] += 1
            # all_to_all_single(output, input): the input is what this rank sends.
            if name == "all_to_all_single":
                tensor = args[1] if len(args) > 1 else kwargs.get("input")
            else:
                tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor):
                self.bytes[name] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return counted


def theory(s, b, heads, groups, d, p, elem):
    g_rep = max(groups, p)
    send_in = s // p * b * (heads + 2 * g_rep) * d * elem
    send_out = s // p * b * heads * d * elem
    return {"g_rep": g_rep, "in_bytes": send_in, "out_bytes": send_out,
            "leaves_rank_bytes": (send_in + send_out) * (p - 1) // p}


def deepspeed_count(q, k, v, group):
    """DeepSpeed DistributedAttention forward on the same shards: (calls, bytes)."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")

    def local_attn(q, k, v, *args, **kwargs):  # [s, b, H/P, d], [s, b, G/P, d]
        rep = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(rep, 2).permute(1, 2, 0, 3) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), k, v, is_causal=True)
        return out.permute(2, 0, 1, 3)

    attention = DistributedAttention(local_attn, group, scatter_idx=2, gather_idx=0)
    with CollectiveCounter() as counter:
        attention(q, k, v, 1)
    return counter


def worker(rank, world_size, port, args, queue):
    try:
        count_in_worker(rank, world_size, port, args, queue)
    except Exception:
        import traceback

        queue.put(("error", rank, traceback.format_exc()))
        raise


def count_in_worker(rank, world_size, port, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p, s, b, d = world_size, args.seq, 1, args.hidden // args.heads
    configs = {groups: harness.run_config(
        harness.Shape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=groups,
                      ffn=args.ffn, vocab=args.vocab), s, "sdpa", sp=p, world_size=p)
        for groups in map(int, args.kv_heads.split(","))}
    initialize_distributed(next(iter(configs.values())))  # the same groups for every G
    rows = []
    for groups, config in configs.items():
        model = build_model(config.model, config.optimizer, config.training.seed,
                            transformer_config(config.model, config.dims))
        batch = harness.random_batch(args.vocab, s, seed=1, sp_rank=rank, sp=p)
        with CollectiveCounter() as everywhere, CollectiveCounter() as fwd:
            handles = fwd.only_inside(harness.unwrap(model).decoder)
            output, loss_func = forward_step(iter([batch]), model)
            loss_sum = loss_func(output)[0]
        for handle in handles:
            handle.remove()
        with CollectiveCounter() as bwd:
            loss_sum.backward()
        row = {"P": p, "s": s, "b": b, "H": args.heads, "G": groups, "d": d,
               "layers": args.layers, "elem": 4,
               "fwd_calls": dict(fwd.calls), "fwd_bytes": dict(fwd.bytes),
               "fwd_outside_decoder_calls": dict(everywhere.calls - fwd.calls),
               "bwd_calls": dict(bwd.calls), "bwd_bytes": dict(bwd.bytes),
               "theory": theory(s, b, args.heads, groups, d, p, 4)}
        if groups % p == 0:
            gen = torch.Generator().manual_seed(2)
            shard = [torch.randn(s // p, b, n, d, generator=gen) for n in (args.heads, groups,
                                                                           groups)]
            ds = deepspeed_count(*shard, ps.get_ulysses_sp_group())
            row["deepspeed_calls"], row["deepspeed_bytes"] = dict(ds.calls), dict(ds.bytes)
        rows.append(row)
        del model, output, loss_sum
    if rank == 0:
        queue.put(("rows", rank, rows))
    harness.shutdown()


def report(rows):
    mib = 1 << 20
    print("Per rank, per layer, forward (bytes = what the rank hands to the collective; "
          "(P-1)/P of it leaves the rank):\n")
    print("| P | s | H | G | G' | collectives (measured) | sent MiB (measured) | "
          "sent MiB (theory: in + out) | leaves rank MiB | DeepSpeed collectives | "
          "DeepSpeed sent MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        layers, t = r["layers"], r["theory"]
        a2a = r["fwd_calls"].get("all_to_all_single", 0) / layers
        sent = r["fwd_bytes"].get("all_to_all_single", 0) / layers
        others = {k: v for k, v in r["fwd_calls"].items() if k != "all_to_all_single"}
        ds_calls = r.get("deepspeed_calls", {}).get("all_to_all_single")
        ds_bytes = r.get("deepspeed_bytes", {}).get("all_to_all_single")
        print(f"| {r['P']} | {r['s']} | {r['H']} | {r['G']} | {t['g_rep']} | "
              f"{a2a:g} all-to-all{' + ' + str(others) if others else ''} | {sent / mib:.2f} | "
              f"{t['in_bytes'] / mib:.2f} + {t['out_bytes'] / mib:.2f} = "
              f"{(t['in_bytes'] + t['out_bytes']) / mib:.2f} | {t['leaves_rank_bytes'] / mib:.2f} | "
              + (f"{ds_calls} all-to-all | {ds_bytes / mib:.2f} |" if ds_calls is not None
                 else "n/a (G < P) | |"))
    print("\nOutside the decoder, whole forward (not per layer): " + "; ".join(
        f"G={r['G']}: {r['fwd_outside_decoder_calls'] or 'none'}" for r in rows))
    print("\nBackward, per layer (whole backward / layers): " + "; ".join(
        f"G={r['G']}: {r['bwd_calls'].get('all_to_all_single', 0) / r['layers']:g} all-to-all, "
        f"{r['bwd_bytes'].get('all_to_all_single', 0) / r['layers'] / mib:.2f} MiB"
        + (f" + other {dict((k, v) for k, v in r['bwd_calls'].items() if k != 'all_to_all_single')}"
           if len(r["bwd_calls"]) > 1 else "")
        for r in rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", default="8,2", help="comma-separated; 2 < P shows G'")
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.sp, port, args, queue))
             for r in range(args.sp)]
    for proc in procs:
        proc.start()
    kind, rank, payload = queue.get()
    if kind == "error":
        for proc in procs:
            proc.kill()
        raise SystemExit(f"rank {rank} failed:\n{payload}")
    for proc in procs:
        proc.join()
    report(payload)


if __name__ == "__main__":
    main()
