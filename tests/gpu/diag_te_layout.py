"""Scratch (not committed): TE DotProductAttention on split views of one fused buffer."""
import torch, torch.nn.functional as F
from transformer_engine.pytorch import DotProductAttention as TE

torch.manual_seed(0)
S, B, D = 512, 2, 64

def ref(q, k, v):
    h, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2); v = v.repeat_interleave(h // g, dim=2)
    q, k, v = (t.float().permute(1, 2, 0, 3) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.permute(2, 0, 1, 3)

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

for hr, kr, expand in [(2, 1, False), (3, 1, False), (4, 1, False), (4, 2, True), (7, 1, False), (6, 2, False)]:
    buf = torch.randn(S, B, hr + 2 * kr, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = buf.split([hr, kr, kr], dim=2)
    if expand:  # 3 + 1 repeats as rank 1 of 14/2 at P 4
        k, v = (torch.cat([t[:, :, 0:1].expand(-1, -1, 3, -1), t[:, :, 1:2]], dim=2) for t in (k, v))
    g = k.shape[2]
    te = TE(num_attention_heads=hr, kv_channels=D, num_gqa_groups=g, qkv_format="sbhd",
            attn_mask_type="causal", attention_dropout=0.0)
    r = ref(q, k, v)
    for name, args in [("views", (q, k, v)), ("contig", tuple(t.contiguous() for t in (q, k, v)))]:
        out = te(*args).view(S, B, hr, D)
        print(f"hr={hr} kr={kr} expand={expand} {name}: rel {rel(out, r):.2e}", flush=True)
