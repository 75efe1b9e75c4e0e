"""The two Ulysses all-to-alls: q, k, v in (one fused exchange) and the attention output out.

Glossary (shapes per rank, megatron's sequence-first layout):
    s    full sequence            s/P  local sequence shard
    b    micro batch              H    query heads on this TP rank
    G    kv heads (query groups) on this TP rank, G' = max(G, P) after replication
    d    head dim                 P    Ulysses SP size

In:  q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]`  ->  q `[s, b, H/P, d]`, k, v `[s, b, G'/P, d]`.
Out: o `[s, b, H/P, d]`  ->  `[s/P, b, H*d]`.

The layout functions (`pack_*`, `unpack_*`) and the shape checks (`check_*`, run before each
exchange, naming the flag that fixes a bad shape) are pure tensor math testable without a process
group; `AllToAll` is the only collective. The exchange is its own inverse, so its backward is the
same all-to-all on the gradient; autograd handles the pure permutations around it.
"""

import torch
import torch.distributed as dist


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp_size: int) -> None:
    """Raise ValueError unless q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]` split over P SP ranks:
    P | H, G | H, and P | G or G | P (kv heads split, or replicated when G < P)."""
    shapes = f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(f"Ulysses takes 4-d q [s/P, b, H, d], k, v [s/P, b, G, d]; got {shapes}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            "internal error: q [s/P, b, H, d], k, v [s/P, b, G, d] must agree in s/P, b and d, "
            f"and k with v in G; got {shapes}"
        )
    heads, groups = q.shape[2], k.shape[2]
    if heads % sp_size != 0:
        raise ValueError(
            f"q [s/P, b, H, d] {list(q.shape)}: H = {heads} heads on this tensor-parallel rank "
            "(--num-attention-heads / --tensor-model-parallel-size) is not divisible by "
            f"P = --ulysses-sp-size ({sp_size}): Ulysses gives every SP rank H/P heads; change "
            "--num-attention-heads, --tensor-model-parallel-size or --ulysses-sp-size"
        )
    if groups == 0 or heads % groups != 0:
        raise ValueError(
            f"{shapes}: H = {heads} query heads are not divisible by G = {groups} kv heads "
            "(--num-query-groups / --tensor-model-parallel-size); change --num-query-groups"
        )
    if groups % sp_size != 0 and sp_size % groups != 0:
        raise ValueError(
            f"k, v [s/P, b, G, d] {list(k.shape)}: G = {groups} kv heads on this tensor-parallel "
            "rank (--num-query-groups / --tensor-model-parallel-size) and P = --ulysses-sp-size "
            f"({sp_size}) must divide one another (kv heads are split over SP ranks, or "
            "replicated when G < P); change --num-query-groups or --ulysses-sp-size"
        )


def check_output_shape(out: torch.Tensor, sp_size: int) -> None:
    """Raise ValueError unless the attention output o `[s, b, H/P, d]` splits into P s/P-shards."""
    if out.dim() != 4:
        raise ValueError(
            f"Ulysses takes a 4-d attention output o [s, b, H/P, d]; got {list(out.shape)}"
        )
    if out.shape[0] % sp_size != 0:
        raise ValueError(
            f"attention output o [s, b, H/P, d] {list(out.shape)} has s = {out.shape[0]} tokens, "
            f"not divisible by P = --ulysses-sp-size ({sp_size}): every SP rank gets s/P of them; "
            "pad the sequence or change --seq-length"
        )


def replicate_kv_heads(kv: torch.Tensor, sp_size: int) -> torch.Tensor:
    """`[s/P, b, G, d]` -> `[s/P, b, max(G, P), d]`.

    With G < P each kv head is repeated P/G times, so SP rank r receives kv head r*G/P: the group
    its query heads `[r*H/P, (r+1)*H/P)` use. The backward of the repeat sums the replicas' grads.
    """
    groups = kv.shape[2]
    if groups >= sp_size:
        return kv
    return kv.repeat_interleave(sp_size // groups, dim=2)


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp_size: int) -> torch.Tensor:
    """q `[s/P, b, H, d]`, k, v `[s/P, b, G', d]` -> send buffer `[P, s/P, b, (H+2G')/P, d]`.

    Chunk j holds the q, k and v heads destined for SP rank j, contiguous, so one all-to-all
    moves all three.
    """
    s_local, b, _, d = q.shape
    parts = [t.reshape(s_local, b, sp_size, t.shape[2] // sp_size, d) for t in (q, k, v)]
    return torch.cat(parts, dim=3).permute(2, 0, 1, 3, 4).contiguous()


def unpack_qkv(buffer: torch.Tensor, num_q_heads: int, num_kv_heads: int):
    """Receive buffer `[P, s/P, b, (H+2G')/P, d]` -> q `[s, b, H/P, d]`, k, v `[s, b, G'/P, d]`.

    Chunk i came from SP rank i, i.e. holds tokens `[i*s/P, (i+1)*s/P)`; `num_q_heads` and
    `num_kv_heads` are the per-rank counts H/P and G'/P.
    """
    p, s_local, b, _, d = buffer.shape
    full = buffer.reshape(p * s_local, b, -1, d)
    return full.split([num_q_heads, num_kv_heads, num_kv_heads], dim=2)


def pack_output(out: torch.Tensor, sp_size: int) -> torch.Tensor:
    """o `[s, b, H/P, d]` -> send buffer `[P, s/P, b, H/P, d]` (chunk j: SP rank j's tokens)."""
    s, b, h_local, d = out.shape
    return out.reshape(sp_size, s // sp_size, b, h_local, d)


def unpack_output(buffer: torch.Tensor) -> torch.Tensor:
    """Receive buffer `[P, s/P, b, H/P, d]` (chunk j: head group j) -> `[s/P, b, H*d]`."""
    p, s_local, b, h_local, d = buffer.shape
    return buffer.permute(1, 2, 0, 3, 4).reshape(s_local, b, p * h_local * d)


class AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0 of `[P, ...]`; backward is the same exchange."""

    @staticmethod
    def forward(ctx, buffer: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(buffer, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(buffer: torch.Tensor, group) -> torch.Tensor:
    # Backends may hand back strided views (e.g. SDPA's permuted output); the collective needs
    # dense buffers, and empty_like would copy the input's strides.
    buffer = buffer.contiguous()
    out = torch.empty_like(buffer, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, buffer, group=group)
    return out


def qkv_to_head_sharded(q, k, v, group):
    """Sequence-sharded q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]` -> head-sharded
    q `[s, b, H/P, d]`, k, v `[s, b, G'/P, d]`, in one collective."""
    sp_size = dist.get_world_size(group)
    check_qkv_shapes(q, k, v, sp_size)
    k, v = replicate_kv_heads(k, sp_size), replicate_kv_heads(v, sp_size)
    received = AllToAll.apply(pack_qkv(q, k, v, sp_size), group)
    return unpack_qkv(received, q.shape[2] // sp_size, k.shape[2] // sp_size)


def output_to_sequence_sharded(out: torch.Tensor, group) -> torch.Tensor:
    """Head-sharded attention output `[s, b, H/P, d]` -> sequence-sharded `[s/P, b, H*d]`."""
    sp_size = dist.get_world_size(group)
    check_output_shape(out, sp_size)
    return unpack_output(AllToAll.apply(pack_output(out, sp_size), group))
