"""KV write by slot: new tokens' K and V into the paged cache, every layer in one launch.

Same contract as `kernels.reference.attention.write_kv_cache_layers`: the cache is
`[layers, 2, kv_heads, blocks, block_size, head_dim]`, k and v are `[layers, T, kv_heads,
head_dim]`, token t goes to flat slot `slot_mapping[t] = block * block_size + offset` (the
runner has already applied BROS directions). A negative slot is skipped (a padding row, as
vLLM marks them), so a later fixed-size batch (CUDA graphs) can carry rows that write nothing.

One program per (token, layer) moves all KV heads of that token: kv_heads x head_dim values,
one contiguous row of head_dim per head on both sides. The K/V dtype must equal the
cache's (a copy, no rounding in the kernel).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv(
    k_ptr,
    v_ptr,
    cache_ptr,
    slots_ptr,
    stride_k_layer,
    stride_k_tok,
    stride_k_head,
    stride_v_layer,
    stride_v_tok,
    stride_v_head,
    stride_c_layer,
    stride_c_kv,
    stride_c_head,
    stride_c_slot,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    if slot >= 0:
        mask = (h[:, None] < KV_HEADS) & (d[None, :] < HEAD_DIM)
        tok = tok.to(tl.int64)
        k = tl.load(
            k_ptr + layer * stride_k_layer + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask
        )
        v = tl.load(
            v_ptr + layer * stride_v_layer + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask
        )
        dst = cache_ptr + layer * stride_c_layer + h[:, None] * stride_c_head + slot * stride_c_slot + d[None, :]
        tl.store(dst, k, mask=mask)
        tl.store(dst + stride_c_kv, v, mask=mask)


def write_kv_cache_layers(kv_data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    layers, two, kv_heads, blocks, block_size, head_dim = kv_data.shape
    if k.dtype != kv_data.dtype or v.dtype != kv_data.dtype:
        raise ValueError(f"K/V dtype {k.dtype}/{v.dtype} differs from the cache's {kv_data.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_data.stride(-1) != 1:
        raise ValueError("the kernels need head_dim contiguous in K, V and the cache")
    if kv_data.stride(3) != block_size * kv_data.stride(4):
        raise ValueError("slots are block * block_size + offset: the cache's blocks must hold their slots contiguously")
    tokens = slot_mapping.shape[0]
    if tokens == 0:
        return
    _write_kv[(tokens, layers)](
        k, v, kv_data, slot_mapping,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        kv_data.stride(0), kv_data.stride(1), kv_data.stride(2), kv_data.stride(4),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(kv_heads), D_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
