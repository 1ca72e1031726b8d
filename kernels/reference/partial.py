"""Attention over K/V that are not in the paged pool, as a mergeable partial result.

Two cache forms give a step K/V that live outside the pool for the duration of one layer:
the hybrid cache (Apt-Serve) rebuilds a HIDDEN request's past K/V from its stored layer
inputs, and partial residency (eLLM) rebuilds or swaps in the oldest tokens' K/V. Both attend
the step's query rows over those *transient* K/V and over whatever else the request has (the
paged suffix, the step's own new tokens), and the pieces must combine exactly.

The contract, shared by both features and by the GPU kernels that will follow it:

- `attend_partial` attends query rows over one contiguous run of key positions and returns
  the *normalised* output of that part together with its log-sum-exp (natural log of the
  softmax denominator, scale included). Masking is causal by absolute position: a query at
  position p sees keys at positions <= p, so one function covers a transient prefix that lies
  wholly before the queries (eLLM) and a rebuilt context that ends with the queries
  themselves (a HIDDEN request's chunk).
- `merge_partials` combines any number of such parts into the result of attending over the
  union of their keys: `lse = logsumexp(lse_i)` and `out = sum(exp(lse_i - lse) * out_i)`.
  This is exact (up to float rounding): softmax over a union of disjoint key sets is the
  weighted mix of the per-set softmaxes. A row that sees no key in a part has `lse = -inf`
  and output 0 there, and so contributes nothing.

Outputs and log-sum-exps are float32 whatever the input dtype, so merging never loses
precision to bf16; the caller casts the merged output back. GQA: the query heads sharing a KV
head attend the same K/V (`enable_gqa`-style grouping, no K/V copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def attend_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos0: int, k_pos0: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend `q` `[q_len, heads, D]` (positions q_pos0, q_pos0+1, ...) over `k`, `v`
    `[kv_len, kv_heads, D]` (positions k_pos0, ...), causal by position.

    Returns `(out, lse)`: `out` `[q_len, heads, D]` float32, normalised over this part's
    visible keys (0 for a row that sees none), and `lse` `[q_len, heads]` float32 (-inf for
    such a row).
    """
    q_len, heads, head_dim = q.shape
    kv_len, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    group = heads // kv_heads
    qg = q.float().view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, g, q, D]
    kf = k.float().transpose(0, 1)  # [kvh, L, D]
    vf = v.float().transpose(0, 1)
    scores = torch.matmul(qg, kf.unsqueeze(1).transpose(-1, -2)) * scale  # [kvh, g, q, L]
    q_pos = torch.arange(q_pos0, q_pos0 + q_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(k_pos0, k_pos0 + kv_len, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kvh, g, q]
    # exp(-inf - -inf) would be nan for rows without keys: give them lse 0 there, then 0 out.
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.matmul(probs, vf.unsqueeze(1))  # [kvh, g, q, D]
    out = out.permute(2, 0, 1, 3).reshape(q_len, heads, head_dim)
    return out, lse.permute(2, 0, 1).reshape(q_len, heads)


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine `(out, lse)` parts over disjoint key sets into the attention over their union.

    Every part has the same shapes (`[rows, heads, D]` and `[rows, heads]`, float32). Rows that
    see no key in any part get output 0 and lse -inf.
    """
    if not parts:
        raise ValueError("merge_partials needs at least one part")
    lses = torch.stack([lse for _, lse in parts])  # [P, rows, heads]
    total = torch.logsumexp(lses, dim=0)
    safe_total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weights = torch.exp(lses - safe_total)  # exp(-inf) = 0 for parts a row does not see
    out = sum(w.unsqueeze(-1) * o for w, (o, _) in zip(weights, parts))
    return out, total
