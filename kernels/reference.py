"""Pure-torch reference kernels: the single source of truth for KV storage and paged attention.

Every other implementation (the Triton kernels, any fast CPU path) is tested against these
two functions, and the "torch" backend runs them directly. They favour obviousness over speed:
one Python loop over sequences, fp32 arithmetic inside.

Cache layout (vLLM's, see DESIGN.md): per layer, ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token position ``p`` of a sequence
lives in physical block ``block_table[p // block_size]`` at offset ``p % block_size``; its
flat slot is ``block_id * block_size + offset``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cdiv


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' keys and values into their cache slots, in place.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype, or any float dtype
            for an fp8 cache (``kv_cache_dtype`` ``"fp8_e5m2"``, ``"fp8_e4m3"``): rounded to it
            as ``Tensor.to`` rounds (nearest, ties to even; ``float8_e5m2`` past 57,344 to
            infinity), ``float8_e4m3fn`` saturating at +-448 (``_to_cache``).
        value: ``[num_tokens, num_kv_heads, head_dim]``, as ``key``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]``, int64 flat slot per token; a slot of -1 is skipped
            (a padding token that owns no slot). May be in host memory with the caches on
            a GPU (the engine passes it so for this backend): it is then read on the host
            and copied over without waiting for the device.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    if not keep.all():  # from host memory a free check; from the device a sync (tests only)
        slot_mapping = slot_mapping[keep]
        keep = keep.to(key.device, non_blocking=True)
        key, value = key[keep], value[keep]
    slots = slot_mapping.to(k_cache.device, non_blocking=True)
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = _to_cache(key, k_cache.dtype)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = _to_cache(value, v_cache.dtype)


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's ``dtype``: ``Tensor.to``, after clamping to +-448 for
    ``float8_e4m3fn``, which has no infinity (``Tensor.to`` would give NaN past 464): values
    saturate at its largest, as vLLM's fp8 conversion does."""
    if dtype == torch.float8_e4m3fn:  # NaN stays NaN with its sign (clamp may drop the sign)
        x = torch.where(x.isnan(), x, x.clamp(-448.0, 448.0))
    return x.to(dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flattened batch of query tokens over a paged KV cache.

    One op serves prefill chunks and decode tokens alike: the query tokens of sequence ``i``
    are ``query[query_start_loc[i]:query_start_loc[i + 1]]`` and are the *last*
    ``query_len_i`` positions of its ``seq_lens[i]`` tokens, whose K/V are already in the
    cache. Query token ``j`` (absolute position ``seq_lens[i] - query_len_i + j``) attends
    to cache positions ``0 ..= its own position``. Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)`` (grouped-query attention, any group size).

    Decode tokens (query length 1) are computed together over K/V gathered into one padded
    batch; longer queries one sequence at a time. Both use torch's
    ``scaled_dot_product_attention``, which accumulates in fp32.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, fp32, fp16 or bf16.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, ``query``'s dtype or
            fp8 (``float8_e5m2``, ``float8_e4m3fn``), whose values are widened (exactly) to
            ``query``'s dtype as read.
        v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks_per_seq]``, int32; entries past a sequence's
            last block are ignored (any value, -1 included), as are cache slots past its
            length (any value, NaN included).
        query_start_loc: ``[num_seqs + 1]``, int32, cumulative query lengths starting at 0.
            Read on the host (``.tolist()``): where it is in device memory, every call waits
            for the device; the engine passes host copies for this backend.
        seq_lens: ``[num_seqs]``, int32, each sequence's total length including its new
            tokens; read like ``query_start_loc``.
        scale: the softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype. Rows of tokens that
        belong to no sequence are unspecified.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decodes:
        _decode_attention(query, k_cache, v_cache, block_tables, starts, lens, decodes, scale, out)
    prefill_attention(query, k_cache, v_cache, block_tables, starts, lens, scale, out)
    return out


def prefill_attention(query, k_cache, v_cache, block_tables, starts: list[int], lens: list[int],
                      scale: float, out: torch.Tensor) -> None:
    """Write ``out`` for every sequence whose query is longer than one token (prompts and
    prefill chunks), one sequence at a time; ``starts``/``lens`` are ``query_start_loc`` and
    ``seq_lens`` as lists."""
    for i, seq_len in enumerate(lens):
        if starts[i + 1] - starts[i] > 1:
            blocks = block_tables[i, :cdiv(seq_len, k_cache.shape[1])].long()
            k = k_cache[blocks].flatten(0, 1)[:seq_len].to(query.dtype)  # [seq_len, num_kv_heads, head_dim]
            v = v_cache[blocks].flatten(0, 1)[:seq_len].to(query.dtype)
            q = query[starts[i]:starts[i + 1]]  # [query_len, num_heads, head_dim]
            # A whole prompt is plain causal attention (SDPA then skips the masked tiles); a
            # chunk after cached tokens needs the mask shifted by the prefix.
            allowed = None if q.shape[0] == seq_len else _causal_mask(q.shape[0], seq_len, q.device)
            o = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                      allowed, scale)
            out[starts[i]:starts[i + 1]] = o[0].transpose(0, 1)


def _decode_attention(query, k_cache, v_cache, block_tables, starts, lens, rows, scale, out) -> None:
    """Query-length-1 sequences ``rows`` at once, over K/V padded to the longest of them.

    Every index is built on the host from ``starts``/``lens`` and copied without waiting, so
    on a GPU this queues work and never waits for it (no ``nonzero``, no ``.item()``).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    device = query.device
    max_blocks = cdiv(max(lens[i] for i in rows), block_size)
    tables = block_tables[_to(rows, device), :max_blocks].long().clamp_(0, num_blocks - 1).flatten()
    padded_len = max_blocks * block_size
    # k, v: [num_rows, padded_len, num_kv_heads, head_dim]
    k = k_cache.index_select(0, tables).to(query.dtype).view(len(rows), padded_len, num_kv_heads, head_dim)
    v = v_cache.index_select(0, tables).to(query.dtype).view(len(rows), padded_len, num_kv_heads, head_dim)
    row_lens = [lens[i] for i in rows]
    valid = torch.arange(padded_len, device=device)[None, :] < _to(row_lens, device)[:, None]
    # A slot past a sequence's end may hold anything, NaN included, and a mask cannot hide
    # NaN (NaN - inf and 0 * NaN are NaN): zero the padding rows.
    padding = _to([r * padded_len + p for r, n in enumerate(row_lens) for p in range(n, padded_len)],
                  device)
    k.view(-1, num_kv_heads * head_dim).index_fill_(0, padding, 0)
    v.view(-1, num_kv_heads * head_dim).index_fill_(0, padding, 0)
    token_index = _to([starts[i] for i in rows], device)
    q = query[token_index][:, :, None]  # [num_rows, num_heads, 1, head_dim]
    o = _sdpa(q, k.transpose(1, 2), v.transpose(1, 2), valid[:, None, None, :], scale)
    out[token_index] = o[:, :, 0]


def _to(values: list[int], device) -> torch.Tensor:
    """An int64 tensor of host ints on ``device``, copied without blocking the host."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _sdpa(q, k, v, allowed, scale) -> torch.Tensor:
    """q: ``[batch, num_heads, query_len, head_dim]``; k, v: ``[batch, num_kv_heads, kv_len,
    head_dim]``; allowed: bool, broadcastable to ``[batch, num_heads, query_len, kv_len]``, or
    ``None`` for causal attention with ``query_len == kv_len``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None,
                                          scale=scale, enable_gqa=True)


def _causal_mask(query_len: int, seq_len: int, device) -> torch.Tensor:
    """``[query_len, seq_len]`` bool: query j (position seq_len - query_len + j) sees keys
    at positions up to its own."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
