"""Plain-PyTorch attention for HIDDEN rows (the contract is `kernels/hidden.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.reference.partial import attend_partial

if TYPE_CHECKING:
    from kernels.hidden import HiddenBatch


def store_hidden(kv_cache: torch.Tensor, x_rows: torch.Tensor, write_rows: torch.Tensor) -> None:
    """Write `x_rows` ([n, d]) cut into head_dim-wide chunks (zero-padded) at `write_rows` ([n, chunks])."""
    head_dim = kv_cache.shape[-1]
    chunks = write_rows.shape[1]
    pad = chunks * head_dim - x_rows.shape[1]
    if pad:
        x_rows = F.pad(x_rows, (0, pad))
    kv_cache.view(-1, head_dim).index_copy_(0, write_rows.reshape(-1), x_rows.reshape(-1, head_dim))


def gather_hidden(kv_cache: torch.Tensor, hidden: HiddenBatch) -> torch.Tensor:
    """The stored inputs of every context token, `[sum ctx, d]`, through the step's scratch buffer."""
    _, _, _, block_size, head_dim = kv_cache.shape
    units = kv_cache.view(-1, block_size * head_dim)
    buf = hidden.scratch.get("units")
    if buf is None or buf.dtype != kv_cache.dtype:
        buf = hidden.scratch["units"] = units.new_empty((hidden.units.numel(), block_size * head_dim))
    torch.index_select(units, 0, hidden.units, out=buf)
    chunks = -(-hidden.hidden_size // head_dim)
    rows = buf.view(-1, chunks, block_size, head_dim).transpose(1, 2).reshape(-1, chunks * head_dim)
    return rows.index_select(0, hidden.ctx_rows)[:, : hidden.hidden_size]


def hidden_attention(out, q, k, v, x, kv_cache, hidden: HiddenBatch, rebuild, scale: float) -> None:
    store_hidden(kv_cache, x.index_select(0, hidden.rows), hidden.write_rows)
    k_ctx = v_ctx = None
    if hidden.ctx_rows.numel():
        k_ctx, v_ctx = rebuild(gather_hidden(kv_cache, hidden), *hidden.position_args)
    for s in hidden.seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        keys, values = k[rows], v[rows]
        if s.ctx_len:
            ctx = slice(s.ctx_start, s.ctx_start + s.ctx_len)
            keys, values = torch.cat((k_ctx[ctx], keys)), torch.cat((v_ctx[ctx], values))
        part, _ = attend_partial(q[rows], keys, values, q_pos0=s.ctx_len, k_pos0=0, scale=scale)
        out[rows] = part.to(out.dtype)
