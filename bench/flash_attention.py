"""FlashAttention-4 against cuDNN attention on one GPU, side by side: speed and numerics.

Backends, each on the same tensors q `[s, 1, H, d]`, k, v `[s, 1, G, d]` (bf16 on GPU), causal:
    fa4         flash_attn.cute.flash_attn_func (flash-attn-4, CuTe-DSL; on Hopper its
                flash_fwd_sm90 / flash_bwd_sm90 kernels), GQA native, on the [1, s, H, d] view
    fa4-det     the same with deterministic=True (only its backward differs: fwd+bwd rows only)
    te          megatron_ulysses.sp.backends.TEAttention, the trainer's `te` backend: Transformer
                Engine DotProductAttention, sbhd, GQA native; pinned to TE's fused (cuDNN) backend
                (NVTE_FLASH_ATTN=0), which it picks in our runs, where no flash-attn is installed
    sdpa-cudnn  torch SDPA with enable_gqa=True (backends.SDPAAttention's call) pinned to cuDNN
    sdpa-flash  the same pinned to torch's flash kernel
    sdpa-math   the same pinned to the math kernel (CPU smoke test only)
Shapes `H/G/d` (query heads / kv heads / head dim) as one Ulysses rank sees them: 32/8/64 is
bench/mfu.py's Llama-3.2-1B at SP 1, 4/1/128 Llama-3-8B (32/8/128) at SP 8.

Timing: per shape, length and mode (fwd under no_grad; fwd+bwd), each backend alone (a kernel may
refuse a shape: the error is printed and the run goes on): its first call timed apart (FA4
compiles its kernels then), `--warmup` calls, then `--rounds` x `--iters` calls, median.
TFLOP/s counts causal FLOPs as bench/attention_overhead.py does (forward 2*s^2*H*d, fwd+bwd 3.5x);
`vs_te` = te seconds / backend seconds (> 1: faster than cuDNN through TE).
Numerics, at `--check-seq` per shape: out, dq, dk, dv of each backend against attention in fp32
computed on the same device one kv group at a time; max abs error and relative error
(||x - ref|| / ||ref||); `ok` when every relative error is under `--tol` (2e-2, bench/
attention_overhead.py's bf16 tolerance for TE); fa4-det runs twice and must repeat bitwise. A
backend that raises in the check (or cannot be built) is not timed; the error is in the results.
`--budget-s` stops starting new (shape, length) cases once that many seconds have passed.

Writes $OUT/flash_attention.json and $OUT/flash_attention.md (OUT defaults to ./out). Command,
with TE and flash-attn-4 installed (docs/gpu.md):
    PYTHONUNBUFFERED=1 python3 bench/flash_attention.py 2>&1 | tee $OUT/flash_attention.log
`--dry-run` lists the cases. CPU smoke test (tests/integration/test_flash_attention_bench.py):
    python bench/flash_attention.py --backends sdpa-math --shapes 4/2/8 --seqs 64 --check-seq 64
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("NVTE_FLASH_ATTN", "0")  # before TE is imported: TE on cuDNN (docstring)

import torch

try:  # before megatron-core, which imports flash_attn.cute where it is installed
    from flash_attn.cute import flash_attn_func
    FA4_IMPORT_ERROR = None
except Exception as exc:  # a failing FA4 must not stop megatron-core's import: an ImportError
    flash_attn_func, FA4_IMPORT_ERROR = None, exc  # from here on, which it handles
    sys.modules["flash_attn.cute"] = None

import harness
from attention_overhead import (
    attention_flops,
    attention_kernels,
    fwd_bwd,
    sdpa_gqa_variants,
    time_side_by_side,
)

BACKENDS = ("fa4", "fa4-det", "te", "sdpa-cudnn", "sdpa-flash", "sdpa-math")
SDPA_VARIANTS = {"sdpa-cudnn": "sdpa enable_gqa=True, cuDNN pinned",
                 "sdpa-flash": "sdpa enable_gqa=True, flash pinned"}
MODES = ("fwd", "fwd+bwd")


def parse_shapes(text: str) -> list:
    """'32/8/64,4/1/128' -> [(32, 8, 64), (4, 1, 128)] (H / G / d)."""
    shapes = [tuple(int(n) for n in case.split("/")) for case in text.split(",")]
    for heads, groups, d in shapes:
        if len((heads, groups, d)) != 3 or heads % groups:
            raise SystemExit(f"--shapes: {heads}/{groups}/{d} needs H/G/d with G dividing H")
    return shapes


def sdpa_math(q, k, v):
    """SDPA (enable_gqa) pinned to the math kernel, `[s, b, H|G, d]` -> `[s, b, H, d]`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    return out.permute(2, 0, 1, 3)


def fa4_attention(deterministic: bool):
    """flash_attn_func on `[s, 1, H|G, d]` (as its `[1, s, H|G, d]` view) -> `[s, 1, H, d]`;
    raises FA4's import error where flash-attn-4 is missing or broken."""
    if FA4_IMPORT_ERROR is not None:
        raise FA4_IMPORT_ERROR

    def attend(q, k, v):
        out = flash_attn_func(*(t.transpose(0, 1) for t in (q, k, v)), causal=True,
                              deterministic=deterministic)
        return (out[0] if isinstance(out, tuple) else out).transpose(0, 1)
    return attend


def build_backends(names, heads, groups, d) -> tuple:
    """({name: attend(q, k, v)}, {name: error}) for this shape; a backend that cannot be built
    (not installed, no GPU) goes to the errors."""
    from megatron_ulysses.sp.backends import TEAttention

    variants = sdpa_gqa_variants(None, None, None, heads // groups)
    makers = {
        "fa4": lambda: fa4_attention(False),
        "fa4-det": lambda: fa4_attention(True),
        "te": lambda: TEAttention(SimpleNamespace(kv_channels=d, sequence_parallel=False), 1,
                                  heads, groups, None, 0.0).to(harness.device()),
        "sdpa-math": lambda: sdpa_math,
    }
    makers.update({name: (lambda v=variant: variants[v])
                   for name, variant in SDPA_VARIANTS.items()})
    fns, errors = {}, {}
    for name in names:
        try:
            fns[name] = makers[name]()
        except Exception as exc:  # report (with its traceback) and go on with the others
            errors[name] = harness.describe_failure(exc)
            print(f"{name}: not built ({errors[name]})", flush=True)
    return fns, errors


def inputs(s, heads, groups, d, dtype, seed):
    """q `[s, 1, H, d]`, k, v `[s, 1, G, d]` (leaves needing grad) and the output grad."""
    gen = torch.Generator(device=harness.device()).manual_seed(seed)
    q, k, v, grad = (torch.randn(s, 1, n, d, device=harness.device(), generator=gen, dtype=dtype)
                     for n in (heads, groups, groups, heads))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def reference(q, k, v, grad) -> dict:
    """fp32 causal attention and its q/k/v grads, one kv group at a time (its `H/G` query heads
    against its kv head; heads h and h' share kv head h // (H/G)): {"out", "dq", "dk", "dv"}."""
    s, _, heads, d = q.shape
    groups = k.shape[2]
    rep = heads // groups
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    result = {name: [] for name in ("out", "dq", "dk", "dv")}
    for g in range(groups):
        qg = q[:, 0, g * rep:(g + 1) * rep].detach().float().requires_grad_()
        kg, vg = (t[:, 0, g].detach().float().requires_grad_() for t in (k, v))
        scores = torch.einsum("shd,td->hst", qg, kg) / math.sqrt(d)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hst,td->shd", probs, vg)
        out.backward(grad[:, 0, g * rep:(g + 1) * rep].float())
        for name, t in zip(result, (out.detach(), qg.grad, kg.grad[:, None], vg.grad[:, None])):
            result[name].append(t)
        del scores, probs, out
    return {name: torch.cat(parts, dim=1)[:, None] for name, parts in result.items()}


def errors_against(got: dict, ref: dict) -> dict:
    """{tensor: {"max_abs", "rel"}} of `got` against the fp32 reference."""
    rows = {}
    for name, r in ref.items():
        diff = got[name].float() - r
        rows[name] = {"max_abs": diff.abs().max().item(), "rel": (diff.norm() / r.norm()).item()}
    return rows


def run_once(fn, q, k, v, grad) -> dict:
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def check_numerics(fns, shape, s, dtype, tol) -> list:
    """Each backend's out and grads against fp32 attention (docstring), one row per backend."""
    heads, groups, d = shape
    q, k, v, grad = inputs(s, heads, groups, d, dtype, seed=1)
    ref = reference(q, k, v, grad)
    rows = []
    for name, fn in fns.items():
        row = {"shape": "/".join(map(str, shape)), "s": s, "backend": name}
        try:
            got = run_once(fn, q, k, v, grad)
            row["errors"] = errors_against(got, ref)
            if name == "fa4-det":
                again = run_once(fn, q, k, v, grad)
                row["bitwise_repeat"] = all(torch.equal(got[n], again[n]) for n in got)
            rels = [e["rel"] for e in row["errors"].values()]
            row["ok"] = all(math.isfinite(e) and e < tol for e in rels) and row.get(
                "bitwise_repeat", True)
            row["kernels"] = (attention_kernels(lambda: run_once(fn, q, k, v, grad))
                              if torch.cuda.is_available() else [])
        except Exception as exc:
            row["error"] = harness.describe_failure(exc)
        rows.append(row)
        print(f"check {row['shape']} s={s} {name}: " + (
            row.get("error") or " ".join(f"{n} rel {e['rel']:.2e} max {e['max_abs']:.2e}"
                                         for n, e in row["errors"].items())
            + f" {'ok' if row['ok'] else 'FAIL'} {row['kernels']}"), flush=True)
    del q, k, v, grad, ref
    harness.reset_memory()
    return rows


def first_and_median(run, warmup, iters, rounds) -> dict:
    """Seconds of the first call (JIT compilation included) and the median of the timed ones."""
    start = time.perf_counter()
    run()
    harness.synchronize()
    first = time.perf_counter() - start
    median = time_side_by_side({"run": run}, warmup, iters, rounds)["run"]
    return {"first_call_s": first, "seconds": median}


def time_case(fns, shape, s, dtype, args) -> list:
    """Rows of one (shape, length): every backend in both modes, each alone."""
    heads, groups, d = shape
    q, k, v, grad = inputs(s, heads, groups, d, dtype, seed=s)
    rows = []
    for mode in MODES:
        flops = attention_flops(s, 1, heads, d, backward=mode == "fwd+bwd")
        for name, fn in fns.items():
            if mode == "fwd" and name == "fa4-det":
                continue  # its forward is fa4's
            if mode == "fwd":
                run = torch.no_grad()(lambda fn=fn: fn(q, k, v))
            else:
                run = fwd_bwd(fn, q, k, v, grad)
            row = {"shape": "/".join(map(str, shape)), "s": s, "mode": mode, "backend": name}
            try:
                row.update(first_and_median(run, args.warmup, args.iters, args.rounds))
                row["tflops"] = flops / row["seconds"] / 1e12
            except Exception as exc:
                row["error"] = harness.describe_failure(exc)
            rows.append(row)
            print(f"{row['shape']:>9s} s={s:6d} {mode:7s} {name:10s} " + (
                row.get("error") or f"{row['seconds'] * 1e3:8.2f} ms {row['tflops']:6.1f} "
                f"TFLOP/s (first call {row['first_call_s']:.1f} s)"), flush=True)
    for row in rows:
        base = next((r for r in rows if r["mode"] == row["mode"] and r["backend"] == "te"
                     and "seconds" in r), None)
        if base and "seconds" in row:
            row["vs_te"] = base["seconds"] / row["seconds"]
    del q, k, v, grad
    harness.reset_memory()
    return rows


def cases(args) -> list:
    """(shape, length) pairs, shortest length first: the budget drops the longest."""
    return [(shape, s) for s in sorted(int(n) for n in args.seqs.split(","))
            for shape in parse_shapes(args.shapes)]


def markdown(results) -> str:
    lines = [f"GPU: {results['versions'].get('gpu', 'cpu')}; versions: {results['versions']}",
             "", "| H/G/d | s | mode | backend | ms | TFLOP/s | vs te | first call s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['s']} | {r['mode']} | {r['backend']} | "
                         f"{r['error']} | | | |")
            continue
        vs = f"{r['vs_te']:.3f}" if "vs_te" in r else ""
        lines.append(f"| {r['shape']} | {r['s']} | {r['mode']} | {r['backend']} | "
                     f"{r['seconds'] * 1e3:.2f} | {r['tflops']:.1f} | {vs} | "
                     f"{r['first_call_s']:.1f} |")
    lines += ["", "| H/G/d | s | backend | out rel / max | dq | dk | dv | ok |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["checks"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['s']} | {r['backend']} | {r['error']} | | | | |")
            continue
        errs = " | ".join(f"{e['rel']:.2e} / {e['max_abs']:.2e}" for e in r["errors"].values())
        lines.append(f"| {r['shape']} | {r['s']} | {r['backend']} | {errs} | {r['ok']} |")
    lines += ["", f"not built: {results['not_built']}", f"skipped (budget): {results['skipped']}"]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="fa4,fa4-det,te,sdpa-cudnn,sdpa-flash")
    parser.add_argument("--shapes", default="32/8/64,4/1/128", help="H/G/d,...")
    parser.add_argument("--seqs", default="8192,32768,131072")
    parser.add_argument("--check-seq", type=int, default=8192,
                        help="length of the numerics check against fp32 (0: none)")
    parser.add_argument("--tol", type=float, default=2e-2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    names = args.backends.split(",")
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"--backends: unknown {unknown}; choose from {', '.join(BACKENDS)}")
    if args.dry_run:
        for shape, s in cases(args):
            for mode in MODES:
                print(f"{'/'.join(map(str, shape)):>9s} s={s:6d} {mode:7s} "
                      f"{attention_flops(s, 1, shape[0], shape[2], mode != 'fwd') / 1e12:8.3f} "
                      f"TFLOP: {', '.join(n for n in names if mode != 'fwd' or n != 'fa4-det')}")
        return
    run(args, names)


def run(args, names):
    start = time.perf_counter()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    results = {"versions": harness.versions(), "args": vars(args), "rows": [], "checks": [],
               "not_built": {}, "skipped": []}
    try:
        from importlib.metadata import version

        results["versions"].update({p: version(p) for p in ("flash-attn-4", "nvidia-cutlass-dsl")})
    except Exception as exc:
        results["versions"]["flash-attn-4"] = f"not installed ({exc})"
    print(f"GPU: {results['versions'].get('gpu', 'none (CPU)')}  {results['versions']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fns_by_shape = {}
    for shape in parse_shapes(args.shapes):
        fns_by_shape[shape], results["not_built"][str(shape)] = build_backends(names, *shape)
        if args.check_seq:
            checks = check_numerics(fns_by_shape[shape], shape, args.check_seq, dtype, args.tol)
            results["checks"] += checks
            for row in checks:  # a backend that raised here is not timed: it would raise again
                if "error" in row:
                    del fns_by_shape[shape][row["backend"]]
                    results["not_built"][str(shape)][row["backend"]] = f"check: {row['error']}"
    for shape, s in cases(args):
        if time.perf_counter() - start > args.budget_s:
            results["skipped"].append(f"{'/'.join(map(str, shape))} s={s}")
            print(f"budget: skipping {results['skipped'][-1]}", flush=True)
            continue
        results["rows"] += time_case(fns_by_shape[shape], shape, s, dtype, args)
        harness.write_json(out / "flash_attention.json", results)
    results["wall_s"] = time.perf_counter() - start
    harness.write_json(out / "flash_attention.json", results)
    (out / "flash_attention.md").write_text(markdown(results))
    print(markdown(results), flush=True)


if __name__ == "__main__":
    main()
