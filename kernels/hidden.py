"""Attention for HIDDEN rows (Apt-Serve's hybrid cache): the contract between the runner, the
models and the kernels.

A HIDDEN request keeps each layer's QKV-projection input `x` in the pool instead of K/V
(`engine/kv/hidden.py` has the layout). In every layer the model calls `hidden_attention`
after its paged attention (which skips these rows: the runner leaves them out of decode
buckets and prefill spans and points their K/V writes at the null block). It

1. stores the new tokens' `x` at their hidden rows (`write_rows`);
2. gathers the stored `x` of every HIDDEN sequence's context from the pool into a scratch
   buffer that all layers of the step reuse (`units`, `ctx_rows`), and has the model rebuild
   K/V from it in one batched projection (`rebuild(x_ctx, *position_args)`: the K/V part of
   the QKV projection, then what the model applies to k (Qwen3's k-norm, RoPE at the tokens'
   original positions `ctx_positions`); OPT's learned positions are already in x);
3. attends each sequence's new rows over its rebuilt context plus its own new tokens' k, v
   with `kernels.reference.partial.attend_partial`, causal by absolute position.

Rebuilt K/V are step temporaries: never written to the pool. Everything here except the
`rebuild` callable is built once per step by the runner (`HiddenBatch`) and shared by all
layers. The reference is plain PyTorch (`kernels/reference/hidden.py`, the oracle and the CPU
path); `kernels/triton/hidden.py` runs the attention and the merge as Triton kernels (the
rebuild stays the model's projection in PyTorch).

Dispatch follows the step's attention kernel (`AttentionMetadata.decode_kernel`, which the
models pass along): "triton" (what `attention="auto"` resolves to on CUDA, or
forced on CPU under the interpreter in tests) takes the Triton path, anything else the
reference. Why the step's kernel and not the tensors' device: `attention="reference"` must
stay the PyTorch oracle on CUDA too, for HIDDEN rows as for paged ones, and the interpreter
tests must be able to run the Triton path on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels.reference import hidden as _ref


@dataclass(frozen=True)
class HiddenSeq:
    """One HIDDEN sequence of the step."""

    q_start: int  # first row of its new tokens in the flattened batch
    q_len: int
    ctx_start: int  # first row of its context in the step's rebuilt K/V
    ctx_len: int  # tokens already stored (positions 0..ctx_len-1)


@dataclass
class HiddenBatch:
    """Per-step inputs of `hidden_attention`, shared by all layers."""

    rows: torch.Tensor  # [Th] flattened-batch rows of every HIDDEN sequence's new tokens
    write_rows: torch.Tensor  # [Th, chunks] rows of the layer viewed as [-1, head_dim] to store them at
    units: torch.Tensor  # [Uc] flat units (of the layer viewed as [-1, bs*head_dim]) holding the contexts
    ctx_rows: torch.Tensor  # [sum ctx] rows of the gathered units' [-1, chunks*head_dim] view that are context
    ctx_positions: torch.Tensor  # [sum ctx] each context token's position
    seqs: list[HiddenSeq]
    hidden_size: int
    # per-token arguments of the model's rebuild at `ctx_positions` (RoPE tables; OPT: none)
    position_args: tuple[torch.Tensor, ...] = ()
    scratch: dict = field(default_factory=dict, repr=False)  # the gather buffer, reused by every layer


def hidden_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    kv_cache: torch.Tensor,
    hidden: HiddenBatch,
    rebuild: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    kernel: str,
) -> None:
    """Store the HIDDEN rows' layer inputs `x` ([T, d]) and fill their rows of `out` ([T,
    heads, D]) with attention over rebuilt context K/V plus their own `k`, `v`. `kernel` is the
    step's attention kernel (`AttentionMetadata.decode_kernel`)."""
    if kernel == "triton":
        from kernels.triton import hidden as _triton  # Triton is a GPU (and test) dependency only

        _triton.hidden_attention(out, q, k, v, x, kv_cache, hidden, rebuild, scale)
    else:
        _ref.hidden_attention(out, q, k, v, x, kv_cache, hidden, rebuild, scale)
