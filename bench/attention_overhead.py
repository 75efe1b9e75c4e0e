"""UlyssesAttention at SP=1 against the same local backend called directly, forward + backward.

Both sides share one module: `attn` (UlyssesAttention over a size-1 SP group) and
`attn.backend_attention` (the backend it wraps), so the ratio is the wrapper's own cost. Each
backend (TE, SDPA, FlashAttention-4 where flash-attn-4 imports) runs at every length, rounds interleaved (wrapped, direct, wrapped, ...), and
the median iteration of each side gives TFLOP/s; ratio = direct time / wrapped time (goal >= 0.99).
The modules' TransformerConfig is the trainer's (`training/model.py`) of one layer of this shape,
parsed from Megatron-LM flags by `harness.run_config`.

It also times torch SDPA's ways of doing GQA on the same tensors: kv heads expanded before the
call (what backends.SDPAAttention does), `enable_gqa=True`, and the expanded call pinned to one
kernel (cuDNN, flash); and it checks TEAttention (sbhd and packed THD) against an fp32 reference
before timing anything.

FLOPs: causal attention forward = 2*b*s^2*H*d (half of q.k^T + p.v), backward = 2.5x forward
(FlashAttention's convention: the backward recomputes q.k^T), so forward + backward = 3.5x.

Command used (H200; environment in bench/RESULTS.md, "Setup"):
    python3 bench/attention_overhead.py --rounds 2 --json $OUT/attention.json

Uneven heads (`--uneven 28/4@8,...`, H query / G kv heads at SP size P; runs on CPU too): each
SP rank's attention alone (its backend for its own H_r query heads, `head_layout.HeadLayout`,
and its kv heads after `expand_kv`, forward + backward on all `s` tokens; no collectives), per
distinct rank, timed side by side. The step waits for the slowest rank, which holds ceil(H/P)
heads: `imbalance` = slowest / mean rank time, against the head-count bound ceil(H/P) / (H/P);
an even case with ceil(H/P) heads per rank (28/4@7 next to 28/4@8) shows the slowest rank costs
what that even layout's ranks do. Command (GPU):
    python3 bench/attention_overhead.py --uneven 28/4@7,28/4@8,28/4@14,32/8@8,32/8@3,40/8@16 \
        --json $OUT/uneven.json
CPU smoke test (tests/integration/test_bench_smoke.py):
    python bench/attention_overhead.py --uneven 7/7@4,28/4@8 --seqs 64 --head-dim 8 \
        --backends sdpa,local --warmup 0 --iters 1 --rounds 1
"""

import argparse
import math

import torch
import torch.nn.functional as F

import harness


def attention_flops(s, b, heads, d, backward=True):
    fwd = 2.0 * b * s * s * heads * d
    return fwd * 3.5 if backward else fwd


def reference(q, k, v, doc_ids=None):
    """fp32 causal attention on the whole sequence: q `[s, b, H, d]`, k, v `[s, b, G, d]`;
    `doc_ids` `[b, s]` keeps attention inside documents."""
    q, k, v = (t.float() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
    allowed = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool, device=q.device).tril()
    allowed = allowed[None, None]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


def rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def check_te(config, tol=2e-2):
    """TEAttention (via UlyssesAttention at SP=1) vs fp32 reference: sbhd causal and packed THD
    (global cu_seqlens over [b*s]); outputs and q/k/v grads. Returns {case: max rel err}."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ulysses.sp.attention import UlyssesAttention

    s, b = 2048, 2
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    attn = UlyssesAttention(config, layer_number=1, backend="te").cuda()
    lengths = [[700, 1000, 348], [1, 2000, 47]]  # per sample, each sums to s
    bounds = [0]
    for sample in lengths:
        for n in sample:
            bounds.append(bounds[-1] + n)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    doc_ids = torch.repeat_interleave(
        torch.arange(len(bounds) - 1, device="cuda"), torch.tensor(sum(lengths, []), device="cuda")
    ).view(b, s)
    results = {}
    for case in ("sbhd", "thd"):
        gen = torch.Generator(device="cuda").manual_seed(len(results))
        q, k, v = (torch.randn(s, b, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for n in (heads, groups, groups))
        grad = torch.randn(s, b, heads * d, device="cuda", generator=gen, dtype=torch.bfloat16)
        packed = None
        if case == "thd":
            packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens,
                                     cu_seqlens_kv=cu_seqlens, max_seqlen_q=2000,
                                     max_seqlen_kv=2000)
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn(*ins, None, packed_seq_params=packed)
        out.backward(grad)
        refs = [t.clone().float().requires_grad_() for t in (q, k, v)]
        expected = reference(*refs, doc_ids if case == "thd" else None)
        expected.backward(grad.float().view(s, b, heads, d))
        errs = [rel_err(out, expected.reshape(s, b, -1))]
        errs += [rel_err(t.grad, r.grad) for t, r in zip(ins, refs)]
        results[case] = max(errs)
        status = "ok" if results[case] < tol and all(map(math.isfinite, errs)) else "FAIL"
        print(f"check TEAttention {case}: rel err out/dq/dk/dv = "
              + " ".join(f"{e:.2e}" for e in errs) + f"  [{status}]", flush=True)
    return results


def fwd_bwd(fn, q, k, v, grad):
    def run():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(grad)
    return run


def time_side_by_side(runs: dict, warmup: int, iters: int, rounds: int) -> dict:
    """Median seconds per call of each `runs[name]()`, rounds interleaved across names."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name] += harness.time_calls(run, iters)
    return {name: harness.median(t) for name, t in times.items()}


def sdpa_gqa_variants(q, k, v, rep):
    """Ways to run GQA through torch SDPA on `[s, b, H|G, d]` tensors, each -> `[s, b, H, d]`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def to_bhsd(t):
        return t.permute(1, 2, 0, 3)

    def expanded(q, k, v):
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        return F.scaled_dot_product_attention(*map(to_bhsd, (q, k, v)), is_causal=True)

    def pinned(kernel):
        def fn(q, k, v):
            with sdpa_kernel(kernel):
                return expanded(q, k, v)
        return fn

    def cudnn_first(q, k, v):
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(order, set_priority=True):
            return expanded(q, k, v)

    def gqa(q, k, v):
        return F.scaled_dot_product_attention(*map(to_bhsd, (q, k, v)), is_causal=True,
                                              enable_gqa=True)

    def gqa_pinned(kernel):
        def fn(q, k, v):
            with sdpa_kernel(kernel):
                return gqa(q, k, v)
        return fn

    variants = {
        "sdpa expand kv (default dispatch)": expanded,
        "sdpa enable_gqa=True (default dispatch)": gqa,
        "sdpa enable_gqa=True, cuDNN pinned": gqa_pinned(SDPBackend.CUDNN_ATTENTION),
        "sdpa enable_gqa=True, flash pinned": gqa_pinned(SDPBackend.FLASH_ATTENTION),
        "sdpa expand kv, cuDNN pinned": pinned(SDPBackend.CUDNN_ATTENTION),
        "sdpa expand kv, flash pinned": pinned(SDPBackend.FLASH_ATTENTION),
        "sdpa expand kv, cuDNN first (set_priority)": cudnn_first,
    }
    return {name: (lambda fn: lambda q, k, v: fn(q, k, v).permute(2, 0, 1, 3))(fn)
            for name, fn in variants.items()}


def attention_kernels(run) -> list:
    """Names (first 60 characters) of the GPU kernels taking most time in one call of `run`: the
    attention kernels, to tell which one a dispatch picked."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    return [e.key[:60] for e in events[:2]]


def parse_uneven_cases(text: str) -> list:
    """'28/4@8,32/8@3' -> [(28, 4, 8), (32, 8, 3)] (H query heads / G kv heads @ SP size P)."""
    cases = []
    for case in text.split(","):
        heads, rest = case.split("/")
        groups, sp = rest.split("@")
        cases.append((int(heads), int(groups), int(sp)))
    return cases


def rank_attention_runs(config, backend, layout, s, d, dtype):
    """{(H_r, kv repeats): fwd+bwd of one SP rank's attention with those heads} for every
    distinct rank of `layout`, on `s` tokens, plus {rank: its key}."""
    from megatron_ulysses.sp.backends import build_backend_attention
    from megatron_ulysses.sp.head_layout import expand_kv

    runs, keys = {}, {}
    for rank in range(layout.sp_size):
        heads, kv = len(layout.query_heads(rank)), len(layout.kv_heads(rank))
        key = keys[rank] = (heads, tuple(layout.kv_repeats(rank)))
        if key in runs:
            continue
        module = build_backend_attention(backend, config, 1, heads,
                                         layout.attended_kv_heads(rank), None, 0.0)
        module = module.to(harness.device())
        gen = torch.Generator(device=harness.device()).manual_seed(heads * 1000 + kv)
        q, k, v, grad = (torch.randn(s, 1, n, d, device=harness.device(), generator=gen,
                                     dtype=dtype) for n in (heads, kv, kv, heads))
        for t in (q, k, v):
            t.requires_grad_()

        def attend(q, k, v, module=module, rank=rank):
            return module(q, expand_kv(k, layout, rank), expand_kv(v, layout, rank))
        runs[key] = fwd_bwd(attend, q, k, v, grad)
    return runs, keys


def uneven_rows(args, backends) -> list:
    """Per case, sequence length and backend: every SP rank's attention time (see docstring)."""
    from megatron_ulysses.sp.head_layout import HeadLayout
    from megatron_ulysses.training.model import transformer_config

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    rows = []
    for heads, groups, sp in parse_uneven_cases(args.uneven):
        layout = HeadLayout(heads, groups, sp)
        shape = harness.Shape(hidden=heads * args.head_dim, layers=1, heads=heads,
                              kv_heads=groups, ffn=4 * heads * args.head_dim, vocab=128)
        seqs = [int(s) for s in args.seqs.split(",")]
        run = harness.run_config(shape, max(seqs), "sdpa")
        config = transformer_config(run.model, run.dims)
        for s in seqs:
            for backend in backends:
                runs, keys = rank_attention_runs(config, backend, layout, s, args.head_dim,
                                                 dtype)
                t = time_side_by_side(runs, args.warmup, args.iters, args.rounds)
                rank_s = [t[keys[r]] for r in range(sp)]
                slowest, mean = max(rank_s), sum(rank_s) / sp
                row = {"case": f"{heads}/{groups}@{sp}", "H": heads, "G": groups, "P": sp,
                       "s": s, "backend": backend,
                       "heads_per_rank": [len(layout.query_heads(r)) for r in range(sp)],
                       "rank_seconds": rank_s, "slowest_s": slowest, "mean_s": mean,
                       "imbalance": slowest / mean, "bound": -(-heads // sp) / (heads / sp),
                       "slowest_tflops": attention_flops(s, 1, -(-heads // sp), args.head_dim)
                       / slowest / 1e12}
                rows.append(row)
                print(f"{row['case']:>9s} s={s:6d} {backend:5s} heads/rank "
                      f"{min(row['heads_per_rank'])}-{max(row['heads_per_rank'])}: slowest "
                      f"{slowest * 1e3:8.2f} ms, mean {mean * 1e3:8.2f} ms, imbalance "
                      f"{row['imbalance']:.3f} (bound {row['bound']:.3f})", flush=True)
                del runs
                harness.reset_memory()
    return rows


def usable_backends(text: str) -> list:
    """The comma-separated backends that can run here: te with TE and CUDA, flash with
    flash-attn-4 and CUDA (each left out with a line saying so)."""
    from megatron_ulysses.sp.backends import flash_import_error, te_available

    cuda = torch.cuda.is_available()
    missing = {"te": not (te_available() and cuda),
               "flash": not cuda or flash_import_error() is not None}
    for name in text.split(","):
        if missing.get(name):
            print(f"backend {name}: left out (not installed here, or no CUDA)", flush=True)
    return [name for name in text.split(",") if not missing.get(name)]


def main_uneven(args):
    from megatron_ulysses.training.loop import initialize_distributed

    initialize_distributed(harness.run_config(harness.Shape(
        hidden=8 * args.head_dim, layers=1, heads=8, kv_heads=8, ffn=32 * args.head_dim,
        vocab=128), 64, "sdpa"))
    backends = usable_backends(args.backends)
    results = {"versions": harness.versions(), "args": vars(args)}
    results["uneven_rows"] = uneven_rows(args, backends)
    harness.write_json(args.json, results)
    print("\n| case | s | backend | heads per rank | slowest ms | mean ms | imbalance | bound |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["uneven_rows"]:
        print(f"| {r['case']} | {r['s']} | {r['backend']} | {min(r['heads_per_rank'])}-"
              f"{max(r['heads_per_rank'])} | {r['slowest_s'] * 1e3:.2f} | "
              f"{r['mean_s'] * 1e3:.2f} | {r['imbalance']:.3f} | {r['bound']:.3f} |")
    harness.shutdown()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="8192,32768", help="comma-separated sequence lengths")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--backends", default="te,sdpa,flash",
                        help="of te, sdpa, local, flash; those not installed are left out")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--uneven", default=None, metavar="H/G@P,...",
                        help="time each SP rank's attention for these head layouts instead "
                             "(e.g. 28/4@8; runs on CPU too)")
    return parser.parse_args()


def layer_config(args, seqs):
    """The TransformerConfig of one layer of the requested shape, built as the trainer builds
    it (the process group initialized for it)."""
    from megatron_ulysses.training.loop import initialize_distributed
    from megatron_ulysses.training.model import transformer_config

    hidden = args.heads * args.head_dim
    shape = harness.Shape(hidden=hidden, layers=1, heads=args.heads, kv_heads=args.kv_heads,
                          ffn=4 * hidden, vocab=128)
    run = harness.run_config(shape, max(seqs), "sdpa")
    initialize_distributed(run)
    return transformer_config(run.model, run.dims)


def random_inputs(s, b, heads, groups, d):
    """q, k, v [s, b, n, d] (requiring grad) and the output grad, flat and per head, seeded by s."""
    gen = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(s, b, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
               .requires_grad_() for n in (heads, groups, groups))
    grad = torch.randn(s, b, heads * d, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q, k, v, grad, grad.view(s, b, heads, d)


def time_wrapped_vs_direct(config, backends, s, inputs, flops, args, results) -> None:
    """Each backend through UlyssesAttention against its own attention called directly."""
    from megatron_ulysses.sp.attention import UlyssesAttention

    q, k, v, grad, grad4 = inputs
    for backend in backends:
        attn = UlyssesAttention(config, 1, backend=backend).cuda()
        runs = {
            "wrapped": fwd_bwd(lambda q, k, v: attn(q, k, v, None), q, k, v, grad),
            "direct": fwd_bwd(lambda q, k, v: attn.backend_attention(q, k, v), q, k, v, grad4),
        }
        try:
            t = time_side_by_side(runs, args.warmup, args.iters, args.rounds)
        except Exception as exc:
            print(f"s={s:6d} {backend}: {harness.describe_failure(exc)}", flush=True)
            continue
        row = {"s": s, "backend": backend, "wrapped_s": t["wrapped"], "direct_s": t["direct"],
               "wrapped_tflops": flops / t["wrapped"] / 1e12,
               "direct_tflops": flops / t["direct"] / 1e12,
               "ratio": t["direct"] / t["wrapped"]}
        results["rows"].append(row)
        print(f"s={s:6d} {backend:5s} UlyssesAttention {row['wrapped_tflops']:6.1f} TFLOP/s | "
              f"direct {row['direct_tflops']:6.1f} TFLOP/s | ratio {row['ratio']:.4f}",
              flush=True)
        harness.write_json(args.json, results)


def time_gqa_variants(config, s, inputs, flops, args, results) -> None:
    """The ways to run GQA attention (SDPA variants, TE's native GQA), one at a time."""
    from megatron_ulysses.sp.attention import UlyssesAttention
    from megatron_ulysses.sp.backends import te_available

    q, k, v, _, grad4 = inputs
    variants = sdpa_gqa_variants(q, k, v, args.heads // args.kv_heads)
    runs = {name: fwd_bwd(fn, q, k, v, grad4) for name, fn in variants.items()}
    if te_available():
        te = UlyssesAttention(config, 1, backend="te").cuda()
        runs["TE DotProductAttention (sbhd, GQA native)"] = fwd_bwd(
            lambda q, k, v: te.backend_attention(q, k, v), q, k, v, grad4)
    t = {}
    for name, run in runs.items():  # one at a time: a kernel may refuse the shape
        try:
            t.update(time_side_by_side({name: run}, args.warmup, args.iters, args.rounds))
        except Exception as exc:
            print(f"s={s:6d} {name}: not run ({str(exc).splitlines()[0][:120]})", flush=True)
    for name, seconds in t.items():
        row = {"s": s, "variant": name, "seconds": seconds,
               "tflops": flops / seconds / 1e12, "kernels": attention_kernels(runs[name])}
        results.setdefault("gqa_rows", []).append(row)
        print(f"s={s:6d} {name:45s} {row['tflops']:6.1f} TFLOP/s  {row['kernels']}",
              flush=True)


def record_sdpa_choice(s, inputs, rep, results) -> None:
    """Which kernel torch's SDPA picks by default for the call with k, v expanded to all heads."""
    q, k, v = inputs[:3]
    try:
        choice = torch._fused_sdp_choice(*(t.permute(1, 2, 0, 3) for t in (
            q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))),
            is_causal=True)
        print(f"s={s:6d} torch default SDPA choice for the expanded call: {choice}", flush=True)
        results.setdefault("sdpa_default_choice", {})[s] = int(choice)
    except Exception as exc:  # private API; informative only
        print(f"(torch._fused_sdp_choice unavailable: {exc})")


def print_summary(results) -> None:
    print("\n| s | backend | UlyssesAttention TFLOP/s | direct TFLOP/s | ratio |")
    print("|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['s']} | {r['backend']} | {r['wrapped_tflops']:.1f} | "
              f"{r['direct_tflops']:.1f} | {r['ratio']:.4f} |")
    print("\n| s | GQA variant | fwd+bwd TFLOP/s |")
    print("|---|---|---|")
    for r in results.get("gqa_rows", []):
        print(f"| {r['s']} | {r['variant']} | {r['tflops']:.1f} |")


def main():
    args = parse_args()
    if args.uneven:
        return main_uneven(args)
    if not torch.cuda.is_available():
        raise SystemExit("attention_overhead.py needs a GPU")
    seqs = [int(s) for s in args.seqs.split(",")]
    config = layer_config(args, seqs)
    results = {"versions": harness.versions(), "args": vars(args), "rows": [], "checks": {}}
    backends = usable_backends(args.backends)
    if "te" in backends:
        try:
            results["checks"] = check_te(config)
        except Exception as exc:  # keep timing SDPA even if TE is broken
            results["checks"] = {"error": harness.describe_failure(exc)}
            print(f"check TEAttention: {results['checks']['error']}", flush=True)
    b = 1
    for s in seqs:
        flops = attention_flops(s, b, args.heads, args.head_dim)
        inputs = random_inputs(s, b, args.heads, args.kv_heads, args.head_dim)
        time_wrapped_vs_direct(config, backends, s, inputs, flops, args, results)
        time_gqa_variants(config, s, inputs, flops, args, results)
        record_sdpa_choice(s, inputs, args.heads // args.kv_heads, results)
        harness.write_json(args.json, results)
        del inputs
        harness.reset_memory()
    print_summary(results)
    harness.shutdown()


if __name__ == "__main__":
    main()
