"""Plain causal attention on the whole sequence, the reference the Ulysses tests compare with
(torch only, so many-process tests that import it stay light)."""

import torch


def reference_attention(q, k, v, doc_ids=None):
    """q `[s, b, H, d]`, k, v `[s, b, G, d]` -> `[s, b, H, d]`; `doc_ids` `[b, s]` keeps
    attention inside documents."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    allowed = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()[None, None]
    if doc_ids is not None:  # [b, s]
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)
