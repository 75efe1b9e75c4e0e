"""Memory of training a GPT (Llama shape) with the trainer, per token and per layer, measured on
the real model next to memory_model.py's formulas: the activations kept for backward, the
checkpoints (recompute inputs), the logits / loss, and the model + optimizer state, and which
memory feature removes which term.

Model (preset llama-1b): Llama-3.2-1B shape (see harness.py), bf16 on GPU (fp32 on CPU), micro
batch 1, SP=1, the trainer's build (`harness.Trainer("ours", ...)` from `harness.run_config`'s
Megatron-LM flags). Each variant is built once (for the longer sequence) and measured at s and 2s:

    none             no recompute
    selective        --recompute-granularity selective (megatron-core's default module: core_attn)
    full             full recompute (uniform, 1 layer per checkpoint)
    full-tiled-mlp   full recompute + TiledMLP
    tiled-mlp        TiledMLP alone
    tiled-loss       tiled loss alone
    full-all         full recompute + TiledMLP + tiled loss + activation offload

Method, per variant and sequence length: ONE forward of the model on `harness.random_batch`
(and the trainer's loss·mask sum) under saved_tensors.py's recorder, which attributes every
tensor saved for backward to a layer's submodule or a bucket outside the layers; then one
backward under the same hooks, whose new saved storages are the recompute working set (peak of
the live ones); everything saved must be released after it ("leaked" is 0). On GPU also
torch.cuda.memory_allocated() after minus before the forward (ground truth: it includes what TE
keeps in ctx attributes, which no hook sees, and the forward's outputs) and the backward's peak
over its start, after one unrecorded warm-up forward + backward per variant (workspaces, kernel
selection, Triton compiles).

Two lengths give the slope: bytes/token/layer = a + c*s, c being the s^2 term (materialized
attention scores). The analytic model is checked exactly on CPU (tests/integration/
test_memory_model.py) for the local and sdpa backends; for TE it is a prediction, which the GPU
run confirms or not (ratio column).

Model / optimizer state after one `trainer.init_optimizer_state()`: weights, the DDP grad buffer
(main_grad, fp32), master weights (fp32 copies held by the optimizer) and the optimizer's state
tensors (Adam moments, step), against params x (e weights + 4 main grad + 4 master (bf16 only)
+ 8 moments).

Output: markdown tables (memory_tables.py: terms of one layer without recompute, analytic vs
measured; each variant's kept / checkpoint / host / loss / working-set bytes per token; which
feature removes which term; model state) and --json {versions, args, shape, profile, rows, fits,
model_state}.

Command (H200; environment in bench/RESULTS.md, "Setup"; s = 8192 and 16384, ~1 min):
    python3 bench/memory_record.py --json $OUT/memory.json
CPU smoke test (tests/integration/test_memory_model.py; --offload-min-bytes 0 because the tiny
model's layer inputs are under the offload's 1 MiB threshold):
    python3 bench/memory_record.py --preset tiny --backend local --seq 64 --offload-min-bytes 0
"""

import argparse
import dataclasses
import gc

import torch

import harness
from megatron_ulysses.memory import activation_offload
from megatron_ulysses.sp.backends import resolve_backend
from megatron_ulysses.sp.loss import masked_sum
from megatron_ulysses.training.fsdp import torch_optimizers
from megatron_ulysses.training.loop import initialize_distributed
from megatron_ulysses.training.schedule import per_token_loss
from memory_model import Profile, analytic, features_of
from memory_tables import print_tables
from saved_tensors import SavedTensorRecorder, storage_of

VARIANTS = {  # key: (label, flags)
    "none": ("no recompute", ()),
    "selective": ("selective recompute (core_attn)", harness.SELECTIVE_RECOMPUTE),
    "full": ("full recompute", harness.FULL_RECOMPUTE),
    "full-tiled-mlp": ("full recompute + TiledMLP", harness.FULL_RECOMPUTE + harness.TILED_MLP),
    "tiled-mlp": ("TiledMLP", harness.TILED_MLP),
    "tiled-loss": ("tiled loss", harness.TILED_LOSS),
    "full-all": ("full recompute + TiledMLP + tiled loss + offload",
                 harness.FULL_RECOMPUTE + harness.TILED_MLP + harness.TILED_LOSS
                 + harness.OFFLOAD),
}


def warm_up(trainer, seq: int, shape) -> None:
    """One unrecorded forward + backward (GPU): kernel selection, cuBLAS / TE workspaces and
    Triton compiles happen here, not inside the measured forward's memory_allocated delta."""
    batch = harness.random_batch(shape.vocab, seq)
    loss_sum, _ = masked_sum(per_token_loss(trainer.model, batch), batch["loss_mask"])
    loss_sum.backward()
    del loss_sum, batch
    trainer.model.zero_grad_buffer()
    harness.reset_memory()


def measure(trainer, seq: int, shape, args) -> dict:
    """One forward + backward of `trainer.model` at `seq` tokens under the recorder."""
    model = trainer.model
    batch = harness.random_batch(shape.vocab, seq)
    recorder = SavedTensorRecorder(model)
    model.zero_grad_buffer()
    harness.reset_memory()
    cuda = torch.cuda.is_available()
    gpu = {}
    with recorder.installed(args.offload_min_bytes):
        harness.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        with recorder.recording("forward"):
            per_token = per_token_loss(model, batch)
            loss_sum, _ = masked_sum(per_token, batch["loss_mask"])
        harness.synchronize()
        if cuda:
            gpu["forward_allocated_delta"] = torch.cuda.memory_allocated() - before
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        with recorder.recording("backward"):
            loss_sum.backward()
        harness.synchronize()
        if cuda:
            gpu["backward_peak_delta"] = torch.cuda.max_memory_allocated() - start
        del per_token, loss_sum
    gc.collect()
    result = recorder.summary(len(harness.unwrap(model).decoder.layers))
    result["leaked"] = sum(entry[1] for entry in recorder.live.values())
    result["gpu"] = gpu
    model.zero_grad_buffer()
    del recorder, batch
    harness.reset_memory()
    return result


def model_state(trainer) -> dict:
    """Bytes of weights, grad buffer, master weights and optimizer state after one update,
    against params x bytes per param."""
    model = trainer.model
    trainer.init_optimizer_state()
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    weights, grads = {}, {}
    for param in params:
        key, nbytes = storage_of(param)
        weights[key] = nbytes
        if getattr(param, "main_grad", None) is not None:
            key, nbytes = storage_of(param.main_grad)
            grads[key] = nbytes
    master, state, step_tensors = {}, {}, 0
    for optimizer in torch_optimizers(trainer.optimizer):
        for group in optimizer.param_groups:
            for param in group["params"]:
                key, nbytes = storage_of(param)
                if key not in weights:
                    master[key] = nbytes
        for param_state in optimizer.state.values():
            for name, value in param_state.items():
                if torch.is_tensor(value):
                    key, nbytes = storage_of(value)
                    state.setdefault(name, {})[key] = nbytes
                    step_tensors += name == "step"
    e_w = params[0].element_size()
    master_e = 4 if e_w < 4 else 0
    measured = {"weights": sum(weights.values()), "main_grad": sum(grads.values()),
                "master_weights": sum(master.values())}
    measured.update({f"optimizer {name}": sum(v.values()) for name, v in state.items()})
    formula = {"weights": (f"P·{e_w}", count * e_w), "main_grad": ("P·4 (fp32 grad buffer)",
                                                                   count * 4),
               "master_weights": (f"P·{master_e}", count * master_e),
               "optimizer exp_avg": ("P·4", count * 4), "optimizer exp_avg_sq": ("P·4",
                                                                             count * 4)}
    if "step" in state:
        formula["optimizer step"] = ("4 per step tensor", 4 * step_tensors)
    result = {"params": count, "param_tensors": len(params), "measured": measured,
              "formula": {k: {"formula": f, "bytes": b} for k, (f, b) in formula.items()},
              "total_measured": sum(measured.values()),
              "total_formula": sum(b for _, b in formula.values()),
              "bytes_per_param_formula": e_w + 4 + master_e + 8}
    if torch.cuda.is_available():
        harness.reset_memory()
        result["gpu_allocated_after_init"] = torch.cuda.memory_allocated()
    return result


def per_token_row(result: dict, tokens: int) -> dict:
    """Measured bytes per token (layers: the mean over layers, per layer)."""
    layers = result["layers"]
    n = len(layers)

    def mean(field):
        return sum(layer[field] for layer in layers) / n / tokens
    subs = {}
    for layer in layers:
        for sub, b in layer["subs"].items():
            target = subs.setdefault(sub, {"device": 0.0, "host": 0.0, "checkpoint": 0.0})
            for field in target:
                target[field] += b[field] / n / tokens
    return {"layer": {"device": mean("device"), "host": mean("host"),
                      "checkpoint": mean("checkpoint"), "subs": subs,
                      "uniform": len({(l["device"], l["host"]) for l in layers}) == 1},
            "outside": {k: {f: v / tokens for f, v in b.items()}
                        for k, b in result["outside"].items()},
            "backward_working_set": result["backward_working_set"] / tokens}


def fit_rows(rows) -> list:
    """Per variant, bytes/token/layer (device + host) = a + c·s through the two lengths,
    measured and analytic; c is the s^2 term."""
    fits = []
    for key in VARIANTS:
        points = sorted(((r["s"], r["per_token"]["layer"], r["analytic"]["layer"])
                         for r in rows if r["key"] == key and "per_token" in r),
                        key=lambda point: point[0])
        if len(points) < 2:
            continue
        (s1, m1, a1), (s2, m2, a2) = points[0], points[-1]
        fit = {"key": key, "variant": VARIANTS[key][0], "s": [s1, s2]}
        for name, p1, p2 in (("", m1, m2), ("analytic_", a1, a2)):
            y1, y2 = p1["device"] + p1["host"], p2["device"] + p2["host"]
            c = (y2 - y1) / (s2 - s1)
            fit[name + "a"], fit[name + "c"] = y1 - c * s1, c
        fits.append(fit)
    return fits


def parse_args():
    """The command line, with the backend resolved and s defaulted for the device."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b", choices=sorted(harness.PRESETS))
    parser.add_argument("--backend", default="auto", help="te, sdpa, local or auto")
    parser.add_argument("--seq", type=int, default=None,
                        help="s: measured at s and 2s (default 8192 on GPU, 64 on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--offload-min-bytes", type=int, default=None,
                        help="the offload's smallest tensor moved (default: the trainer's, "
                        f"{activation_offload.DEFAULT_MIN_OFFLOAD_BYTES})")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    unknown = [key for key in args.variants.split(",") if key not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    args.backend = resolve_backend(args.backend)
    if args.seq is None:
        args.seq = 8192 if torch.cuda.is_available() else 64
    return args


def measure_row(trainer, config, profile, key: str, s: int, seqs: list, shape, vocab: int,
                args, min_bytes: int) -> dict:
    """One variant at `s` tokens: measured and analytic bytes, or the error that stopped it."""
    label, flags = VARIANTS[key]
    row = {"key": key, "variant": label, "flags": list(flags), "s": s, "tokens": s,
           "profile": dataclasses.asdict(profile)}
    try:
        if torch.cuda.is_available() and s == seqs[0]:
            warm_up(trainer, s, shape)
        row["measured"] = measure(trainer, s, shape, args)
        row["per_token"] = per_token_row(row["measured"], s)
        row["analytic"] = analytic(shape, vocab, s, profile, features_of(config), min_bytes)
        pt = row["per_token"]
        print(f"{label:50s} s={s:6d}: kept {pt['layer']['device']:12,.1f} B/token/layer"
              f" (analytic {row['analytic']['layer']['device']:12,.1f}), host "
              f"{pt['layer']['host']:10,.1f}, leaked {row['measured']['leaked']}",
              flush=True)
    except Exception as exc:  # OOM, or a broken variant: report, go on
        row["error"] = harness.describe_failure(exc)
        print(f"{label} s={s}: {row['error']}", flush=True)
    return row


def run_variant(key: str, shape, seqs: list, vocab: int, args, min_bytes: int,
                results: dict) -> None:
    """Build variant `key` once (for the longest s) and add its rows at every s to `results`
    (the profile and the model state from the first variant that builds)."""
    label, flags = VARIANTS[key]
    config = harness.run_config(shape, seqs[-1], args.backend, flags)
    try:
        trainer = harness.Trainer("ours", config)
    except Exception as exc:
        error = harness.describe_failure(exc)
        print(f"{label}: build failed: {error}", flush=True)
        results["rows"] += [{"key": key, "variant": label, "s": s, "error": error}
                            for s in seqs]
        return
    profile = Profile.of(config, harness.unwrap(trainer.model))
    if results["profile"] is None:
        results["profile"] = dataclasses.asdict(profile)
    if results["model_state"] is None:
        results["model_state"] = model_state(trainer)
    for s in seqs:
        results["rows"].append(measure_row(trainer, config, profile, key, s, seqs, shape,
                                           vocab, args, min_bytes))
    del trainer
    harness.reset_memory()


def main():
    args = parse_args()
    shape = harness.PRESETS[args.preset]
    if args.layers is not None:
        shape = dataclasses.replace(shape, layers=args.layers)
    seqs = [args.seq, 2 * args.seq]
    min_bytes = (activation_offload.DEFAULT_MIN_OFFLOAD_BYTES if args.offload_min_bytes is None
                 else args.offload_min_bytes)

    base_config = harness.run_config(shape, seqs[-1], args.backend)
    initialize_distributed(base_config)
    vocab = base_config.model.padded_vocab_size
    shape_info = dict(dataclasses.asdict(shape), padded_vocab=vocab)
    results = {"versions": harness.versions(), "args": vars(args), "shape": shape_info,
               "profile": None, "rows": [], "fits": [], "model_state": None}
    for key in args.variants.split(","):
        run_variant(key, shape, seqs, vocab, args, min_bytes, results)
        results["fits"] = fit_rows(results["rows"])
        harness.write_json(args.json, results)
    print_tables(results, VARIANTS)
    harness.shutdown()


if __name__ == "__main__":
    main()
