"""Which heads each Ulysses SP rank attends over: pure arithmetic of H, G and P, no process group.

Glossary (per tensor-parallel rank): `H` query heads, `G` kv heads (query groups), `P` SP size,
`n = H/G` query heads per kv head; query head `h` uses kv head `h // n` (= floor(h*G/H)).

Query heads: SP rank r holds the contiguous range `[start_r, end_r)` of `H_r` heads, where ranks
`r < H % P` take ceil(H/P) and the others floor(H/P), so `sum H_r = H` and `|H_r - H_s| <= 1`.

kv heads: rank r holds exactly the kv heads its query heads use, the contiguous range
`[start_r // n, (end_r - 1) // n + 1)` of `K_r` heads. A kv head whose query heads span several
ranks goes to each of them (replication: with G < P every rank gets one, as the even layout's
P/G-fold repeat); with P | G every rank gets G/P. The exchange's backward sums the replicas' grads.

Backends run native GQA: local query head i uses local kv head i // (H_r/K_r). That holds when
rank r's query heads use its kv heads in equal runs (always with even heads). Otherwise, e.g.
28/4 heads at P 8, where rank 1 holds heads 4..7 (three of kv head 0, one of kv head 1), `expand_kv`
repeats the kv heads into equal runs first (there: 3 copies of kv head 0, 1 of kv head 1), on the
receiving rank after the exchange, so no extra bytes travel; it costs that rank's backend at most
H_r kv heads instead of K_r.
"""

import math
from dataclasses import dataclass
from typing import List

import torch


@dataclass(frozen=True)
class HeadLayout:
    """The head ranges of every SP rank for H query and G kv heads over P ranks (needs H >= P,
    G | H; `ParallelDims.validate_model` says so in flag terms first)."""

    heads: int
    groups: int
    sp_size: int

    def __post_init__(self):
        # The flag-naming checks (validate_model, all_to_all.check_qkv_shapes) run first.
        if self.groups <= 0 or self.heads % self.groups or self.heads < self.sp_size:
            raise ValueError(f"internal error: a head layout needs G | H and H >= P; got "
                             f"H = {self.heads}, G = {self.groups}, P = {self.sp_size}")

    def query_heads(self, rank: int) -> range:
        """Rank r's query heads `[start_r, end_r)`: ceil(H/P) of them for r < H % P."""
        base, extra = divmod(self.heads, self.sp_size)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))

    def kv_heads(self, rank: int) -> range:
        """The kv heads rank r's query heads use."""
        per_group = self.heads // self.groups
        heads = self.query_heads(rank)
        return range(heads.start // per_group, (heads.stop - 1) // per_group + 1)

    def kv_repeats(self, rank: int) -> List[int]:
        """Copies of each of rank r's kv heads its backend needs for native GQA: with `u` the gcd
        of how many local query heads use each kv head, kv head j used by `m_j * u` of them
        appears `m_j` times, and local query head i then uses backend kv head i // u. All ones
        when the query heads already use the kv heads in equal runs."""
        per_group, heads = self.heads // self.groups, self.query_heads(rank)
        runs = [len(range(max(heads.start, g * per_group), min(heads.stop, (g + 1) * per_group)))
                for g in self.kv_heads(rank)]
        unit = math.gcd(*runs)
        return [run // unit for run in runs]

    def attended_kv_heads(self, rank: int) -> int:
        """How many kv heads rank r's backend sees (it divides H_r): K_r, or more after
        `expand_kv` when rank r's query heads use its kv heads in unequal runs."""
        return sum(self.kv_repeats(rank))


def expand_kv(kv: torch.Tensor, layout: HeadLayout, rank: int) -> torch.Tensor:
    """k or v `[s, b, K_r, d]` -> `[s, b, attended_kv_heads(r), d]`, each kv head repeated
    `kv_repeats(r)` times (the backward sums over the copies); unchanged when all are 1."""
    repeats = layout.kv_repeats(rank)
    if all(n == 1 for n in repeats):
        return kv
    # Slices and expands, no index tensor: building one per call would copy it to the GPU and
    # synchronize the stream every layer.
    return torch.cat([kv[:, :, j:j + 1].expand(-1, -1, n, -1) for j, n in enumerate(repeats)],
                     dim=2)
