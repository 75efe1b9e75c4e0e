"""Per-GPU model + optimizer state of each data-parallel strategy, and the longest sequence it
leaves room for with the memory features on; nothing is built or run.

Per GPU, the state of DDP + the distributed optimizer, Megatron-FSDP's optim / optim_grads /
optim_grads_params and optimizer CPU offload (`strategy_state`, read from megatron-core 0.19.2's
code) for the Llama-3.1-8B and 70B shapes at DP x SP layouts, and the longest sequence each
leaves with full recompute + TiledMLP + tiled loss + activation offload: the activation bytes
per token are memory_model.py's analytic terms plus the backward's extra, fitted to
max_seq_len.py's measured peaks (`Calibration`). Also, for one GPU with optimizer offload, the
offload fraction that leaves room for the longest sequence within the host's memory.

Output: markdown tables and --json {calibration, cards, card_reserve_gib, host_overhead_gib,
rows, one_gpu}. bench/RESULTS.md section 8:
    python bench/memory_plan.py --strategies --json bench/results/memory_strategies.json
"""

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import harness
from megatron_ulysses.memory import activation_offload
from memory_model import Profile, analytic, apply_features, layer_terms

SHAPES = {
    "llama-1b": harness.PRESETS["llama-1b"],
    "llama-3.1-8b": harness.Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336,
                                  vocab=128256),
    "llama-3.1-70b": harness.Shape(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672,
                                   vocab=128256),
}
# Memory torch reports (total_memory, GiB): H100 80 GB HBM3 and H200 141 GB (bench/RESULTS.md).
CARDS = {"80 GB": 79.2, "141 GB": 139.8}
# Left free on every card: CUDA context, cuBLAS / cuDNN / TE workspaces and allocator slack, which
# max_memory_allocated (what the calibration measured) does not count. An assumption.
CARD_RESERVE_GIB = 2.5
# Host memory a training process uses besides the offloaded tensors (Python, torch, TE, CUDA's
# host side, the data loader): an assumption, to be checked against bench/offload_8b.sh's RSS.
HOST_OVERHEAD_GIB = 8.0
STRATEGIES = ("ddp", "optim", "optim_grads", "optim_grads_params", "offload")
STRATEGY_LABELS = {
    "ddp": "DDP + distributed optimizer",
    "optim": "Megatron-FSDP optim",
    "optim_grads": "Megatron-FSDP optim_grads",
    "optim_grads_params": "Megatron-FSDP optim_grads_params",
    "offload": "DDP + dist. opt. + optimizer offload",
}
# Megatron-FSDP's communication sizes (megatron_fsdp.py, megatron-core 0.19.2), in elements:
# reduce-scatter queue capacity max(1e9, 2 x unit) and all-gather prefetch half of it.
FSDP_MIN_COMM_UNIT = 1_000_000_000
MEASURED_PEAKS = str(Path(__file__).resolve().parent / "results" / "max_seq_len_ours.json")
DEFAULT_STRATEGIES = "ddp,optim,optim_grads,optim_grads_params,offload:1,offload:0.5"


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a Llama-shaped GPT (untied, no biases): `layer` per TransformerLayer (the
    FSDP unit of optim_grads_params), `outside` the embedding, output layer and final norm."""
    layer: int
    layers: int
    outside: int

    @property
    def total(self) -> int:
        return self.layer * self.layers + self.outside

    @classmethod
    def of(cls, shape, vocab: int) -> "ParamCounts":
        h, f, H, G = shape.hidden, shape.ffn, shape.heads, shape.kv_heads
        d = h // H
        layer = 2 * h + h * (H + 2 * G) * d + H * d * h + 3 * h * f  # norms, qkv, proj, SwiGLU
        return cls(layer=layer, layers=shape.layers, outside=2 * vocab * h + h)


@dataclass(frozen=True)
class StateTerms:
    """Bytes per GPU of weights, gradients, fp32 master weights and Adam's two fp32 moments;
    `transient` the largest unsharded buffers the strategy allocates during the step; `host_*`
    host memory: optimizer state (pageable), pinned fp32 grad copies and pinned bf16 staging."""
    weights: float
    grads: float
    master: float
    moments: float
    transient: float = 0.0
    host_optimizer: float = 0.0
    host_grads: float = 0.0
    host_staging: float = 0.0

    @property
    def device(self) -> float:
        return self.weights + self.grads + self.master + self.moments + self.transient

    @property
    def host(self) -> float:
        return self.host_optimizer + self.host_grads + self.host_staging


def fsdp_transient(counts: ParamCounts, grad_bytes: int) -> float:
    """optim_grads_params' unsharded buffers at the backward's peak (megatron-core 0.19.2): the
    bf16 params outside the layers (one bucket, kept gathered: PRESERVED) and of the running layer
    plus the ceil(max(5e8, unit) / unit) prefetched ones; the grads of that outside bucket (its
    output layer's arrive first, its embedding's last) and of the layers in the reduce-scatter
    queue (freed only when popped past max(1e9, 2 x unit) elements) plus the one accumulating."""
    unit, layers = counts.layer, counts.layers
    capacity = max(FSDP_MIN_COMM_UNIT, 2 * unit)
    gathered = min(layers, 1 + -(-(capacity // 2) // unit))
    reducing = min(layers, capacity // unit + 2)
    return 2 * (counts.outside + gathered * unit) + grad_bytes * (counts.outside + reducing * unit)


def strategy_state(counts: ParamCounts, strategy: str, shards: int, fsdp_grad_bytes: int = 2,
                   offload_fraction: float = 1.0, ddp_grad_bytes: int = 4) -> StateTerms:
    """Per-GPU state of `strategy` with bf16 weights, sharded over `shards` = DP x SP ranks (our
    SP ranks are in megatron-core's DP group).

    ddp: megatron-core DDP (fp32 grad buffer) + distributed optimizer (fp32 master + moments
    sharded; `ddp_grad_bytes` 2 with --grad-reduce-in-bf16, whose fp32 copies for the
    optimizer step are left out: the activations are gone by then). offload: the same with
    --use-precision-aware-optimizer --optimizer-cpu-offload: HybridDeviceOptimizer keeps fp32
    master + moments of `offload_fraction` of the shard on the host and a pinned fp32 copy of
    its grads; the first one megatron-core builds (on the whole model, before the distributed
    optimizer re-builds it on the shard) pins bf16 copies of f x P, left in torch's
    pinned-memory cache. Megatron-FSDP (`fsdp_grad_bytes`: 2 for
    Megatron-LM's default --megatron-fsdp-main-grads-dtype auto = the bf16 params', 4 for fp32):
    optim shards master + moments, optim_grads also the grads (but, with no FSDP unit and no
    --ddp-bucket-size, all of them form one bucket, whole during the backward), and
    optim_grads_params also the weights (see `fsdp_transient`). One shard: nothing is split."""
    P, N = counts.total, shards
    if strategy in ("ddp", "offload"):
        f = offload_fraction if strategy == "offload" else 0.0
        # HybridDeviceOptimizer casts a bf16 grad shard to an fp32 copy for the GPU share and
        # keeps it (the fp32 param's .grad) until the next step.
        copies = 4 * (1 - f) * P / N if strategy == "offload" and ddp_grad_bytes < 4 else 0.0
        return StateTerms(weights=2 * P, grads=ddp_grad_bytes * P + copies,
                          master=4 * (1 - f) * P / N,
                          moments=8 * (1 - f) * P / N, host_optimizer=12 * f * P / N,
                          host_grads=4 * f * P / N, host_staging=2 * f * P)
    g = fsdp_grad_bytes
    master, moments = 4 * P / N, 8 * P / N
    if strategy == "optim":
        return StateTerms(2 * P, g * P, master, moments)
    sharded = N > 1
    if strategy == "optim_grads":
        return StateTerms(2 * P, g * P / N, master, moments, g * P if sharded else 0.0)
    if strategy == "optim_grads_params":
        return StateTerms(2 * P / N, g * P / N, master, moments,
                          fsdp_transient(counts, g) if sharded else 0.0)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


TE_PROFILE = Profile(e=2, spec="te", attention="te", norm="te", rope_fused=True,
                     swiglu_fused=True, cross_entropy="te", verified=True)
MEMORY_FEATURES = frozenset({"full", "tiled_mlp", "tiled_loss", "offload"})


def _pow2(nbytes: float) -> float:
    """torch's pinned-memory allocator rounds each block up to a power of two."""
    return float(1 << max(0, math.ceil(math.log2(nbytes)))) if nbytes > 0 else 0.0


def analytic_slope(shape, vocab: int, s_local: int) -> float:
    """Device bytes per token kept through the step with the memory features on (TE, bf16):
    what stays outside the layers plus one layer recomputed in backward (its no-recompute saves,
    TiledMLP's checkpoint for the MLP)."""
    kept = analytic(shape, vocab, s_local, TE_PROFILE, MEMORY_FEATURES, 0)
    layer = apply_features(layer_terms(shape, s_local, TE_PROFILE), shape, s_local, TE_PROFILE,
                           {"tiled_mlp"}, 0)
    return (sum(b["device"] for b in kept["outside"].values())
            + sum(t.per_token for t in layer if t.where == "device"))


def offloaded_host_bytes(shape, vocab: int, s_local: int, rounded: bool = True) -> float:
    """Pinned host bytes of the activation offload at `s_local` tokens per GPU: each offloaded
    tensor (every layer's input, the final norm's, the RoPE table), rounded up to a power of two
    as torch's pinned-memory cache does (`rounded`)."""
    kept = analytic(shape, vocab, s_local, TE_PROFILE, MEMORY_FEATURES,
                    activation_offload.DEFAULT_MIN_OFFLOAD_BYTES)
    size = _pow2 if rounded else float
    return sum((shape.layers if t["owner"] == "layer" else 1) * size(t["per_token"] * s_local)
               for t in kept["terms"] if t["where"] == "host")


@dataclass(frozen=True)
class Calibration:
    """The measured peak of `max_seq_len.py --model ours` (memory features on, SP 1) as
    intercept + slope x s; `extra` the slope's bytes per token beyond `analytic_slope` (grads and
    workspaces of the layer's backward), in units of h x e, assumed the same for other shapes."""
    slope: float
    intercept_gib: float
    static_gib: float
    extra: float
    source: str

    @classmethod
    def load(cls, path: str = MEASURED_PEAKS) -> "Calibration":
        with open(path) as f:
            data = json.load(f)
        points = [(r["s"], r["peak_alloc_gib"] * harness.GIB) for r in data["rows"]
                  if r.get("status") == "ok"]
        n = len(points)
        mean_s = sum(s for s, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        slope = (sum((s - mean_s) * (y - mean_y) for s, y in points)
                 / sum((s - mean_s) ** 2 for s, _ in points))
        shape = SHAPES[data["args"]["preset"]]
        extra = (slope - analytic_slope(shape, shape.vocab, points[0][0])) / (shape.hidden * 2)
        return cls(slope=slope, intercept_gib=(mean_y - slope * mean_s) / harness.GIB,
                   static_gib=data["static_gib"], extra=extra,
                   source=f"{path} ({data['versions'].get('gpu')}, s = "
                          f"{', '.join(str(s) for s, _ in points)})")

    def slope_of(self, shape, vocab: int, s_local: int) -> float:
        return analytic_slope(shape, vocab, s_local) + self.extra * shape.hidden * 2


def longest_sequence(shape, vocab: int, state: StateTerms, sp: int, card_gib: float,
                     cal: Calibration, step: int = 4096, host_gib: Optional[float] = None,
                     rounded: bool = True) -> int:
    """The longest s (a multiple of `step` x sp) whose per-GPU peak, state + s/sp x slope, fits
    `card_gib` less CARD_RESERVE_GIB, and (with `host_gib`) whose host bytes fit too; 0 if none."""
    free = (card_gib - CARD_RESERVE_GIB) * harness.GIB - state.device
    if free <= 0:
        return 0
    s_local = int(free / cal.slope_of(shape, vocab, 1 << 20)) // step * step
    while s_local > 0 and (
            s_local * cal.slope_of(shape, vocab, s_local) > free
            or (host_gib is not None and host_bytes(shape, vocab, state, s_local, rounded)
                > (host_gib - HOST_OVERHEAD_GIB) * harness.GIB)):
        s_local -= step
    return max(s_local, 0) * sp


def host_bytes(shape, vocab: int, state: StateTerms, s_local: int, rounded: bool = True) -> float:
    """Host bytes per GPU beside the process itself: optimizer offload + activation offload."""
    return state.host + offloaded_host_bytes(shape, vocab, s_local, rounded)


def _strategy(key: str) -> tuple:
    """"offload:0.5" -> ("offload", 0.5); other keys take fraction 1."""
    name, _, fraction = key.partition(":")
    if name not in STRATEGIES or (fraction and name != "offload"):
        raise SystemExit(f"--strategies: unknown {key!r}; choose from {', '.join(STRATEGIES)} "
                         "(offload:F for an offload fraction F)")
    return name, float(fraction) if fraction else 1.0


def strategy_rows(models, layouts, keys, cal: Calibration, fsdp_grad_bytes: int,
                  host_gib_per_gpu: float) -> list:
    """One row per model x (DP, SP) x strategy: the state terms (GiB per GPU), the longest s on
    each card (GPU memory only), the host bytes per GPU at that s, and the longest s within
    `host_gib_per_gpu` of host memory too."""
    rows = []
    for model in models:
        shape = SHAPES[model]
        counts = ParamCounts.of(shape, shape.vocab)
        for dp, sp in layouts:
            for key in keys:
                name, fraction = _strategy(key)
                state = strategy_state(counts, name, dp * sp, fsdp_grad_bytes, fraction)
                row = {"model": model, "params": counts.total, "dp": dp, "sp": sp,
                       "strategy": key, "label": STRATEGY_LABELS[name]
                       + (f" (f = {fraction:g})" if name == "offload" else ""),
                       "state_gib": {k: v / harness.GIB
                                     for k, v in dataclasses.asdict(state).items()},
                       "device_gib": state.device / harness.GIB,
                       "host_state_gib": state.host / harness.GIB, "cards": {}}
                for card, gib in CARDS.items():
                    s = longest_sequence(shape, shape.vocab, state, sp, gib, cal)
                    capped = longest_sequence(shape, shape.vocab, state, sp, gib, cal,
                                              host_gib=host_gib_per_gpu)
                    row["cards"][card] = {"longest_s": s, "host_gib": host_bytes(
                        shape, shape.vocab, state, s // sp) / harness.GIB if s else None,
                        "longest_s_host_capped": capped}
                rows.append(row)
    return rows


ONE_GPU_VARIANTS = (  # (label, grad buffer bytes, pinned blocks rounded to powers of two)
    ("as is", 4, True),
    ("--grad-reduce-in-bf16", 2, True),
    ("exact-size pinned blocks", 4, False),
)


def one_gpu_plans(model: str, cal: Calibration, host_gib: float, step: float = 0.05) -> list:
    """For one GPU (DP = SP = 1) with optimizer offload, per card and ONE_GPU_VARIANTS: the
    offload fraction that leaves room for the longest sequence within the card and `host_gib`."""
    shape = SHAPES[model]
    counts = ParamCounts.of(shape, shape.vocab)
    plans = []
    for card, gib in CARDS.items():
        for label, grad_bytes, rounded in ONE_GPU_VARIANTS:
            best = {"card": card, "variant": label, "fraction": None, "longest_s": 0}
            for i in range(int(round(1 / step)) + 1):
                fraction = round(i * step, 6)
                state = strategy_state(counts, "offload", 1, offload_fraction=fraction,
                                       ddp_grad_bytes=grad_bytes)
                s = longest_sequence(shape, shape.vocab, state, 1, gib, cal, host_gib=host_gib,
                                     rounded=rounded)
                if s > best["longest_s"]:
                    best.update(fraction=fraction, longest_s=s, device_gib=(
                        state.device + s * cal.slope_of(shape, shape.vocab, s)) / harness.GIB,
                        host_gib=host_bytes(shape, shape.vocab, state, s, rounded)
                        / harness.GIB + HOST_OVERHEAD_GIB)
            plans.append(best)
    return plans


def _k(s: int) -> str:
    return f"{s // 1024:,}K" if s else "does not fit"


def print_strategy_tables(rows, plans, cal: Calibration, args) -> None:
    print(f"Calibration: {cal.source}: peak = {cal.intercept_gib:.2f} GiB + "
          f"{cal.slope:,.0f} B/token (static state measured {cal.static_gib:.2f} GiB); beyond the "
          f"analytic terms the backward keeps {cal.extra:.2f} x h x e bytes per token. Cards: "
          + ", ".join(f"{k} = {v} GiB" for k, v in CARDS.items())
          + f", less {CARD_RESERVE_GIB} GiB reserve. Megatron-FSDP grads: "
          f"{'fp32' if args.fsdp_grad_bytes == 4 else 'bf16'}.")
    print("\n### Per-GPU model + optimizer state (GiB)")
    print("| model | DP x SP | strategy | weights | grads | fp32 master | Adam moments | "
          "transient unsharded | **GPU total** | host |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        st = r["state_gib"]
        print(f"| {r['model']} ({r['params'] / 1e9:.2f}B) | {r['dp']} x {r['sp']} | {r['label']} "
              f"| {st['weights']:.1f} | {st['grads']:.1f} | {st['master']:.1f} | "
              f"{st['moments']:.1f} | {st['transient']:.1f} | **{r['device_gib']:.1f}** | "
              f"{r['host_state_gib']:.1f} |")
    print("\n### Longest sequence with full recompute + TiledMLP + tiled loss + activation "
          "offload: within GPU memory (host GiB per GPU it needs), and within "
          f"{args.host_gib_per_gpu:g} GiB of host memory per GPU too")
    print("| model | DP x SP | strategy | " + " | ".join(
        f"{card}: longest s | host GiB | host-capped" for card in CARDS) + " |")
    print("|---|---|---|" + "---|---|---|" * len(CARDS))
    for r in rows:
        cells = []
        for card in CARDS:
            c = r["cards"][card]
            cells += [_k(c["longest_s"]), f"{c['host_gib']:.0f}" if c["host_gib"] else "",
                      _k(c["longest_s_host_capped"])]
        print(f"| {r['model']} | {r['dp']} x {r['sp']} | {r['label']} | " + " | ".join(cells)
              + " |")
    print(f"\n### {args.one_gpu}, one GPU, optimizer offload: best fraction within "
          f"{args.host_gib:g} GiB of host memory ({HOST_OVERHEAD_GIB:g} GiB of it the process)")
    print("| card | variant | --optimizer-offload-fraction | longest s | GPU GiB | host GiB |")
    print("|---|---|---|---|---|---|")
    for p in plans:
        if not p["longest_s"]:
            print(f"| {p['card']} | {p['variant']} | | does not fit | | |")
            continue
        print(f"| {p['card']} | {p['variant']} | {p['fraction']:g} | {_k(p['longest_s'])} "
              f"({p['longest_s']:,}) | {p['device_gib']:.1f} | {p['host_gib']:.1f} |")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="?", const=DEFAULT_STRATEGIES,
                        default=DEFAULT_STRATEGIES,
                        help="the strategies whose per-GPU state and longest-sequence tables "
                        f"are printed (default {DEFAULT_STRATEGIES}; offload:F = offload "
                        "fraction F)")
    parser.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b",
                        help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--layouts", default="1x8,8x8", help="DPxSP, ...")
    parser.add_argument("--fsdp-grad-bytes", type=int, choices=(2, 4), default=2,
                        help="Megatron-FSDP main grads, 2 (bf16: Megatron-LM's default 'auto') "
                        "or 4 (--megatron-fsdp-main-grads-dtype fp32)")
    parser.add_argument("--one-gpu", default="llama-3.1-8b", choices=sorted(SHAPES),
                        help="the model of the one-GPU offload plan")
    parser.add_argument("--host-gib", type=float, default=125.0,
                        help="host memory of the one-GPU machine")
    parser.add_argument("--host-gib-per-gpu", type=float, default=256.0,
                        help="host memory per GPU of the multi-GPU nodes (an 8-GPU DGX H100 / "
                        "H200 node has 2 TiB)")
    parser.add_argument("--calibration", default=MEASURED_PEAKS,
                        help="max_seq_len.py's JSON the slope is fitted to")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def main() -> None:
    """The tables from the model alone (nothing is built or run)."""
    args = parse_args()
    cal = Calibration.load(args.calibration)
    keys = args.strategies.split(",")
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in args.layouts.split(",")]
    rows = strategy_rows(args.models.split(","), layouts, keys, cal, args.fsdp_grad_bytes,
                         args.host_gib_per_gpu)
    plans = one_gpu_plans(args.one_gpu, cal, args.host_gib)
    print_strategy_tables(rows, plans, cal, args)
    harness.write_json(args.json, {"calibration": dataclasses.asdict(cal), "cards": CARDS,
                                   "card_reserve_gib": CARD_RESERVE_GIB,
                                   "host_overhead_gib": HOST_OVERHEAD_GIB, "rows": rows,
                                   "one_gpu": plans})


if __name__ == "__main__":
    main()
