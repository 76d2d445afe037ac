"""Triton ``store_kv``: scatter the new tokens' keys and values into the paged KV cache.

Same contract as ``kernels.reference.store_kv``. One program per token copies that token's
``[num_kv_heads, head_dim]`` tile of K and of V into its slot; a slot of -1 stores nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens], int64
    stride_kt, stride_kh,  # key strides (token, head), in elements
    stride_vt, stride_vh,  # value strides (token, head), in elements
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot, head), shared by K and V
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEADS_PAD: tl.constexpr,  # next power of two >= num_kv_heads
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= head_dim
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token that owns no slot
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    # int64 throughout: block * stride_cb passes 2**31 elements in a large pool.
    cache_off = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
                 + heads[:, None] * stride_ch + dims[None, :])
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k, mask=mask)
    tl.store(v_cache_ptr + cache_off, v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' keys and values into their cache slots, in place.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype; the last dim must
            be contiguous (a strided view of a fused QKV output is fine).
        value: ``[num_tokens, num_kv_heads, head_dim]``, like ``key``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same strides as
            ``k_cache``.
        slot_mapping: ``[num_tokens]``, int64 flat slot per token
            (``block_id * block_size + offset``); a slot of -1 is skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_store_args(key, value, k_cache, v_cache)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


def _check_store_args(key, value, k_cache, v_cache) -> None:
    """Fail loudly on layouts the kernel's pointer arithmetic does not cover."""
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("store_kv: key and value need a contiguous last dimension")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("store_kv: k_cache and v_cache need equal strides and a contiguous last dimension")
    if key.shape[1:] != k_cache.shape[2:] or value.shape != key.shape:
        raise ValueError(f"store_kv: key {tuple(key.shape)} / value {tuple(value.shape)} "
                         f"do not match cache {tuple(k_cache.shape)}")
