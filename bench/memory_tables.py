"""Markdown tables of memory_record.py's results: one layer's terms without recompute (analytic
vs measured), each variant's bytes per token, which feature removes which term, and the model +
optimizer state."""

from memory_model import OUTSIDE

# The layer's submodules in forward order (those a spec lacks are left out of the tables).
LAYER_SUBS = ("(block)", "input_layernorm", "self_attention.linear_qkv", "self_attention",
              "self_attention.core_attention", "self_attention.linear_proj", "pre_mlp_layernorm",
              "mlp.linear_fc1", "mlp", "mlp.linear_fc2", "(layer)")


def fmt(value) -> str:
    """Bytes for a table cell: integers with thousands separators, else 2 decimals."""
    if value is None:
        return ""
    if abs(value - round(value)) < 1e-9:
        return f"{int(round(value)):,}"
    text = f"{value:,.2f}"
    return "0.00" if text == "-0.00" else text


def ratio(measured, analytic_value) -> str:
    """measured / analytic to 3 decimals (empty when both are 0)."""
    if not analytic_value:
        return "" if not measured else "inf"
    return f"{measured / analytic_value:.3f}"


def _ordered_subs(subs) -> list:
    """Distinct submodule names, LAYER_SUBS order first, any others after."""
    subs = set(subs)
    return [sub for sub in LAYER_SUBS if sub in subs] + sorted(subs - set(LAYER_SUBS))


def print_tables(results, variants) -> None:
    """All tables of `results` (memory_record.py's JSON); `variants`: key -> (label, flags), in
    the order of the feature table's columns."""
    rows, shape = results["rows"], results["shape"]
    seqs = sorted({r["s"] for r in rows})
    by = {(r["key"], r["s"]): r for r in rows if "measured" in r}
    e = results["profile"]["e"]
    print(f"\nProfile: {results['profile']} (h={shape['hidden']}, ffn={shape['ffn']}, "
          f"H={shape['heads']}, G={shape['kv_heads']}, d={shape['hidden'] // shape['heads']}, "
          f"V={shape['padded_vocab']}, L={shape['layers']}, e={e}); bytes per token "
          "(per layer for layer terms), b = 1.")
    if all(("none", s) in by for s in seqs):
        print_layer_table(by, seqs)
    print_variant_table(rows, results["fits"], seqs)
    s = seqs[0]
    keys = [k for k in variants if (k, s) in by]
    if keys:
        print_feature_table(by, keys, s, variants)
    state = results.get("model_state")
    if state:
        print_state_table(state)


def print_layer_table(by, seqs) -> None:
    """One layer without recompute, analytic vs measured by submodule, then the buckets outside
    the layers (per token)."""
    print("\n### One layer, no recompute: analytic vs measured (mean over layers)")
    print("| submodule | terms (analytic) | " + " | ".join(
        f"analytic s={s} | measured s={s} | ratio" for s in seqs) + " |")
    print("|---|---|" + "---|---|---|" * len(seqs))
    terms = [t for t in by[("none", seqs[0])]["analytic"]["terms"] if t["owner"] == "layer"]
    subs = _ordered_subs([t["sub"] for t in terms] + [
        sub for s in seqs for sub in by[("none", s)]["per_token"]["layer"]["subs"]])
    for sub in subs:
        text = "; ".join(f"{t['name']} {t['formula']}" for t in terms if t["sub"] == sub)
        cells = []
        for s in seqs:
            a = by[("none", s)]["analytic"]["layer"]["subs"].get(sub, {}).get("device", 0)
            m = by[("none", s)]["per_token"]["layer"]["subs"].get(sub, {}).get("device", 0)
            cells += [fmt(a), fmt(m), ratio(m, a)]
        print(f"| {sub} | {text or '(none)'} | " + " | ".join(cells) + " |")
    cells = []
    for s in seqs:
        a = by[("none", s)]["analytic"]["layer"]["device"]
        m = by[("none", s)]["per_token"]["layer"]["device"]
        cells += [fmt(a), fmt(m), ratio(m, a)]
    print("| **layer total** | | " + " | ".join(cells) + " |")
    for name in OUTSIDE:
        text = "; ".join(f"{t['name']} {t['formula']}"
                         for t in by[("none", seqs[0])]["analytic"]["terms"]
                         if t["owner"] == name)
        cells = []
        for s in seqs:
            a = by[("none", s)]["analytic"]["outside"][name]["device"]
            m = by[("none", s)]["per_token"]["outside"][name]["device"]
            cells += [fmt(a), fmt(m), ratio(m, a)]
        if text or any(c not in ("0", "") for c in cells):
            print(f"| {name} (per token, not per layer) | {text or '(none)'} | "
                  + " | ".join(cells) + " |")


def print_variant_table(rows, fits, seqs) -> None:
    """Each variant at each length: kept, checkpoint, host and outside bytes per token, the fit
    a + c·s, the backward working set and (GPU) memory_allocated against what the hooks saw."""
    print("\n### Variants: bytes per token (layer terms per layer, mean over layers)")
    print("| variant | s | kept on device / layer (analytic) | measured | ratio | "
          "checkpoints / layer | host / layer | logits + loss | outside layers, device | "
          "outside, host | fit a + c·s: a | c (s^2 term) | c analytic | backward working set | "
          "GPU fwd Δalloc / hooked |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fit_of = {f["key"]: f for f in fits}
    for r in rows:
        if "measured" not in r:
            print(f"| {r['variant']} | {r['s']} | {r.get('error', '')[:60]} |" + " |" * 12)
            continue
        pt, an = r["per_token"], r["analytic"]
        out_dev = sum(b["device"] for b in pt["outside"].values())
        out_host = sum(b["host"] for b in pt["outside"].values())
        logits = sum(pt["outside"][k]["device"] + pt["outside"][k]["host"]
                     for k in ("output_layer", "loss"))
        fit = fit_of.get(r["key"], {})
        gpu = r["measured"]["gpu"]
        gpu_text = ""
        if gpu:
            hooked = r["measured"]["totals"]["device"]
            gpu_text = (f"{gpu['forward_allocated_delta'] / r['s']:,.0f} / "
                        f"{hooked / r['s']:,.0f}")
        first = r["s"] == seqs[0]
        kept, kept_analytic = pt["layer"]["device"], an["layer"]["device"]
        print(f"| {r['variant']} | {r['s']} | {fmt(kept_analytic)} | {fmt(kept)} | "
              f"{ratio(kept, kept_analytic)} | {fmt(pt['layer']['checkpoint'])} | "
              f"{fmt(pt['layer']['host'])} | "
              f"{fmt(logits)} | {fmt(out_dev)} | {fmt(out_host)} | "
              f"{fmt(fit.get('a')) if first else ''} | {fmt(fit.get('c')) if first else ''} | "
              f"{fmt(fit.get('analytic_c')) if first else ''} | "
              f"{fmt(pt['backward_working_set'])} | {gpu_text} |")


def print_feature_table(by, keys, s, variants) -> None:
    """Measured bytes per token of each term under each variant in `keys` at `s`, and what the
    variant removes against no recompute."""
    print(f"\n### Which feature removes which term (measured bytes per token at s={s}; "
          "h = on host)")
    print("| term | " + " | ".join(variants[k][0] for k in keys) + " |")
    print("|---|" + "---|" * len(keys))
    subs = _ordered_subs([sub for k in keys
                          for sub in by[(k, s)]["per_token"]["layer"]["subs"]])

    def cell(b):
        text = fmt(b["device"]) if b["device"] or not b["host"] else ""
        if b["host"]:
            text += (" + " if text else "") + f"{fmt(b['host'])} h"
        return text
    zero = {"device": 0, "host": 0}
    for sub in subs:
        print(f"| layer: {sub} | " + " | ".join(
            cell(by[(k, s)]["per_token"]["layer"]["subs"].get(sub, zero)) for k in keys)
            + " |")
    print("| **layer total** | " + " | ".join(
        cell(by[(k, s)]["per_token"]["layer"]) for k in keys) + " |")
    for name in OUTSIDE:
        cells = [cell(by[(k, s)]["per_token"]["outside"][name]) for k in keys]
        if any(c != "0" for c in cells):
            print(f"| {name} | " + " | ".join(cells) + " |")
    print("| backward working set | " + " | ".join(
        fmt(by[(k, s)]["per_token"]["backward_working_set"]) for k in keys) + " |")
    print("| removes (vs no recompute) | " + " | ".join(
        removed_text(by, k, s) for k in keys) + " |")


def print_state_table(state) -> None:
    """Model and optimizer state: formula against measured bytes."""
    print(f"\n### Model and optimizer state (P = {state['params']:,} parameters, "
          f"{state['param_tensors']} tensors)")
    print("| item | formula | analytic bytes | measured bytes | ratio |")
    print("|---|---|---|---|---|")
    for name in sorted(set(state["formula"]) | set(state["measured"])):
        f = state["formula"].get(name, {"formula": "", "bytes": 0})
        m = state["measured"].get(name, 0)
        print(f"| {name} | {f['formula']} | {fmt(f['bytes'])} | {fmt(m)} | "
              f"{ratio(m, f['bytes'])} |")
    print(f"| **total** | P·{state['bytes_per_param_formula']} (+ steps) | "
          f"{fmt(state['total_formula'])} | {fmt(state['total_measured'])} | "
          f"{ratio(state['total_measured'], state['total_formula'])} |")
    if "gpu_allocated_after_init" in state:
        print(f"| GPU memory_allocated after init | | | "
              f"{fmt(state['gpu_allocated_after_init'])} | |")


def removed_text(by, key, s) -> str:
    """The terms (layer submodules, outside buckets) `key` lowers on the device against no
    recompute, by how much per token ("every layer term" when none of them is left)."""
    if key == "none" or ("none", s) not in by:
        return ""
    base, other = by[("none", s)]["per_token"], by[(key, s)]["per_token"]
    parts = []
    layer_parts = []
    for sub, b in base["layer"]["subs"].items():
        now = other["layer"]["subs"].get(sub, {"device": 0})["device"]
        if b["device"] - now > 0.5:
            layer_parts.append((sub, b["device"] - now, now))
    if len(layer_parts) == len(base["layer"]["subs"]) and not any(n for _, _, n in layer_parts):
        parts.append(f"every layer term -{fmt(sum(d for _, d, _ in layer_parts))}/layer")
    else:
        parts += [f"{sub} -{fmt(delta)}" for sub, delta, _ in layer_parts]
    for name, b in base["outside"].items():
        now = other["outside"][name]["device"]
        if b["device"] - now > 0.5:
            parts.append(f"{name} -{fmt(b['device'] - now)}")
    return "; ".join(parts)
