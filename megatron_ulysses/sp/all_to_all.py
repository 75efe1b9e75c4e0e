"""The two Ulysses all-to-alls: q, k, v in (one fused exchange) and the attention output out.

Glossary (shapes per rank, megatron's sequence-first layout):
    s    full sequence            s/P  local sequence shard
    b    micro batch              H    query heads on this TP rank
    G    kv heads (query groups) on this TP rank
    d    head dim                 P    Ulysses SP size
    H_r, K_r   query and kv heads of SP rank r (`head_layout.HeadLayout`: H_r = ceil(H/P) for
               r < H % P, else floor(H/P); K_r = the kv heads those query heads use)

In:  q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]`  ->  q `[s, b, H_r, d]`, k, v `[s, b, K_r, d]`.
Out: o `[s, b, H_r, d]`  ->  `[s/P, b, H*d]`.

Each exchange is ONE `all_to_all_single` over flat buffers with per-rank split sizes (equal
splits when every rank has the same head counts). In: rank j's chunk of every sender is
`[s/P, b, H_j + 2*K_j, d]` (its q, k and v heads, contiguous), so receivers get P equal chunks.
Out: the inverse, equal chunks sent, `[s/P, b, H_i, d]` received from rank i. The layout
functions (`pack_*`, `unpack_*`) and the shape checks (`check_*`, run before each exchange,
naming the flag that fixes a bad shape) are pure tensor math testable without a process group;
`AllToAll` is the only collective. Its backward is the same exchange with the split sizes
swapped; autograd handles the pure slicing around it, including the sum over a replicated kv
head's copies.
"""

from typing import List, Tuple

import torch
import torch.distributed as dist

from .head_layout import HeadLayout


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp_size: int) -> None:
    """Raise ValueError unless q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]` split over P SP ranks:
    G | H and H >= P (every SP rank gets at least one query head)."""
    shapes = f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(f"Ulysses takes 4-d q [s/P, b, H, d], k, v [s/P, b, G, d]; got {shapes}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            "internal error: q [s/P, b, H, d], k, v [s/P, b, G, d] must agree in s/P, b and d, "
            f"and k with v in G; got {shapes}"
        )
    heads, groups = q.shape[2], k.shape[2]
    if groups == 0 or heads % groups != 0:
        raise ValueError(
            f"{shapes}: H = {heads} query heads are not divisible by G = {groups} kv heads "
            "(--num-query-groups / --tensor-model-parallel-size); change --num-query-groups"
        )
    if heads < sp_size:
        raise ValueError(
            f"q [s/P, b, H, d] {list(q.shape)}: H = {heads} query heads on this tensor-parallel "
            "rank (--num-attention-heads / --tensor-model-parallel-size) are fewer than "
            f"P = --ulysses-sp-size ({sp_size}): every SP rank needs at least one head; use "
            f"--ulysses-sp-size <= {heads} or a smaller --tensor-model-parallel-size"
        )


def check_output_shape(out: torch.Tensor, layout: HeadLayout, rank: int) -> None:
    """Raise ValueError unless the attention output o `[s, b, H_r, d]` has rank r's H_r heads and
    splits into P s/P-shards."""
    if out.dim() != 4:
        raise ValueError(
            f"Ulysses takes a 4-d attention output o [s, b, H_r, d]; got {list(out.shape)}"
        )
    num_heads = len(layout.query_heads(rank))
    if out.shape[2] != num_heads:
        raise ValueError(
            f"internal error: attention output o [s, b, H_r, d] {list(out.shape)} of SP rank "
            f"{rank} has {out.shape[2]} heads, expected H_r = {num_heads} (H = {layout.heads} "
            f"query heads over P = {layout.sp_size} SP ranks)"
        )
    if out.shape[0] % layout.sp_size != 0:
        raise ValueError(
            f"attention output o [s, b, H_r, d] {list(out.shape)} has s = {out.shape[0]} "
            f"tokens, not divisible by P = --ulysses-sp-size ({layout.sp_size}): every SP rank "
            "gets s/P of them; pad the sequence or change --seq-length"
        )


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             layout: HeadLayout) -> Tuple[torch.Tensor, List[int]]:
    """q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]` -> flat send buffer and its split sizes.

    Chunk j is `[s/P, b, H_j + 2*K_j, d]`: the q, k and v heads SP rank j attends over, so one
    all-to-all moves all three; a kv head used by several ranks is copied into each chunk.
    """
    chunks = []
    for j in range(layout.sp_size):
        heads, kv = layout.query_heads(j), layout.kv_heads(j)
        chunk = torch.cat([q[:, :, heads.start:heads.stop], k[:, :, kv.start:kv.stop],
                           v[:, :, kv.start:kv.stop]], dim=2)
        chunks.append(chunk.reshape(-1))
    return torch.cat(chunks), [chunk.numel() for chunk in chunks]


def qkv_chunk_sizes(layout: HeadLayout, rank: int, s_local: int, b: int, d: int) -> List[int]:
    """Split sizes SP rank r receives in the q/k/v exchange: P chunks `[s/P, b, H_r+2*K_r, d]`."""
    heads = len(layout.query_heads(rank)) + 2 * len(layout.kv_heads(rank))
    return [s_local * b * heads * d] * layout.sp_size


def unpack_qkv(buffer: torch.Tensor, layout: HeadLayout, rank: int, b: int, d: int):
    """Flat receive buffer of SP rank r (chunk i from SP rank i: tokens `[i*s/P, (i+1)*s/P)`)
    -> q `[s, b, H_r, d]`, k, v `[s, b, K_r, d]`."""
    num_heads, num_kv = len(layout.query_heads(rank)), len(layout.kv_heads(rank))
    full = buffer.view(-1, b, num_heads + 2 * num_kv, d)
    return full.split([num_heads, num_kv, num_kv], dim=2)


def pack_output(out: torch.Tensor) -> torch.Tensor:
    """o `[s, b, H_r, d]` -> flat send buffer; chunk j (equal splits) is SP rank j's tokens
    `[s/P, b, H_r, d]`."""
    return out.reshape(-1)


def output_chunk_sizes(layout: HeadLayout, s_local: int, b: int, d: int) -> List[int]:
    """Split sizes every rank receives in the output exchange: `[s/P, b, H_i, d]` from rank i."""
    return [s_local * b * len(layout.query_heads(i)) * d for i in range(layout.sp_size)]


def unpack_output(buffer: torch.Tensor, layout: HeadLayout, s_local: int, b: int,
                  d: int) -> torch.Tensor:
    """Flat receive buffer (chunk i: rank i's heads `[s/P, b, H_i, d]`) -> `[s/P, b, H*d]`."""
    chunks = buffer.split(output_chunk_sizes(layout, s_local, b, d))
    heads = [chunk.view(s_local, b, -1, d) for chunk in chunks]
    return torch.cat(heads, dim=2).view(s_local, b, layout.heads * d)


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` of a flat buffer with split sizes; the backward sends the gradient
    back the same way (the send and receive sizes swapped)."""

    @staticmethod
    def forward(ctx, buffer: torch.Tensor, send_sizes, recv_sizes, group) -> torch.Tensor:
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        return _all_to_all(buffer, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_sizes, recv_sizes = ctx.sizes
        return _all_to_all(grad, recv_sizes, send_sizes, ctx.group), None, None, None


def _all_to_all(buffer: torch.Tensor, send_sizes, recv_sizes, group) -> torch.Tensor:
    # Backends may hand back strided views (e.g. SDPA's permuted output); the collective needs
    # dense buffers.
    buffer = buffer.contiguous()
    out = buffer.new_empty(sum(recv_sizes))
    equal = len(set(send_sizes)) == 1 and len(set(recv_sizes)) == 1
    # Equal splits take the collective's plain path (as before uneven heads existed).
    dist.all_to_all_single(out, buffer, None if equal else recv_sizes,
                           None if equal else send_sizes, group=group)
    return out


def qkv_to_head_sharded(q, k, v, layout: HeadLayout, rank: int, group):
    """Sequence-sharded q `[s/P, b, H, d]`, k, v `[s/P, b, G, d]` -> head-sharded
    q `[s, b, H_r, d]`, k, v `[s, b, K_r, d]` of SP rank r, in one collective."""
    check_qkv_shapes(q, k, v, layout.sp_size)
    if (q.shape[2], k.shape[2]) != (layout.heads, layout.groups):
        raise ValueError(f"internal error: q {list(q.shape)}, k {list(k.shape)} do not carry the "
                         f"H = {layout.heads}, G = {layout.groups} heads of {layout}")
    s_local, b, _, d = q.shape
    buffer, send_sizes = pack_qkv(q, k, v, layout)
    recv_sizes = qkv_chunk_sizes(layout, rank, s_local, b, d)
    received = AllToAll.apply(buffer, send_sizes, recv_sizes, group)
    return unpack_qkv(received, layout, rank, b, d)


def output_to_sequence_sharded(out: torch.Tensor, layout: HeadLayout, rank: int,
                               group) -> torch.Tensor:
    """Head-sharded attention output `[s, b, H_r, d]` -> sequence-sharded `[s/P, b, H*d]`."""
    check_output_shape(out, layout, rank)
    s, b, num_heads, d = out.shape
    s_local = s // layout.sp_size
    send_sizes = [s_local * b * num_heads * d] * layout.sp_size
    recv_sizes = output_chunk_sizes(layout, s_local, b, d)
    received = AllToAll.apply(pack_output(out), send_sizes, recv_sizes, group)
    return unpack_output(received, layout, s_local, b, d)
