"""Triton paged attention: one launch for a batch that mixes prefill chunks and decode tokens.

Same contract as ``kernels.reference.paged_attention``.

Organisation
------------
Grid ``(num_q_blocks, num_kv_heads, num_splits)``. A program owns one *q block*: up to
``BLOCK_Q`` consecutive query tokens of one sequence times all query heads of one KV group
(the group padded to ``GROUP_PAD``, a power of two), i.e. a ``[BLOCK_M = BLOCK_Q * GROUP_PAD,
head_dim]`` tile of queries. It walks that sequence's keys in tiles of ``TILE_N`` positions,
reading K and V *in place* through the block table (each row of a tile looks up its own
physical block), so every K/V tile is loaded once for all query heads of the group. Scores,
the online softmax (base 2) and the output accumulator are fp32.

Sequence ``i`` owns program ids ``[qsl[i] // BLOCK_Q + i, qsl[i + 1] // BLOCK_Q + i + 1)``,
at least ``cdiv(query_len_i, BLOCK_Q)`` of them, so the grid size
``num_tokens // BLOCK_Q + num_seqs`` comes from shapes alone (no device-to-host sync); a
program finds its sequence by binary search over ``query_start_loc`` and returns at once
when its q block lies past the sequence's queries.

Flash-decoding: when few programs would cover a long context, each program takes only the
``split``-th share of its key tiles and writes an unnormalised partial output with its
running max and sum; ``_reduce_splits_kernel`` then merges the splits of every
``(token, head)``. The split count is picked on the host from shapes only
(``block_tables.shape[1] * block_size`` stands in for the longest context; see ``plan``).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 256  # shorter splits are not worth the reduce launch (a guess, not measured)
MAX_SPLITS = 16
# The interpreter's tl.dot multiplies bf16 operands as their raw uint16 bits (Triton 3.9),
# so under TRITON_INTERPRET=1 bf16 operands are widened to fp32 first. Products of bf16
# values are exact in fp32, so this changes nothing but the instruction used.
_INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``a @ b`` accumulated in fp32."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence whose program-id range contains ``q_block`` (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, tile, q_pos, kv_len, kv_head,
    k_cache_ptr, v_cache_ptr, block_table_ptr, qk_scale,
    stride_cb, stride_cs, stride_ch, head_dim,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """One online-softmax step over key positions ``[tile * TILE_N, (tile + 1) * TILE_N)``.

    ``q``: [BLOCK_M, HEAD_DIM_PAD]; ``q_pos``: [BLOCK_M] absolute position of each query
    row; ``kv_len``: keys visible to the block's last query. ``m_i`` (log2 units), ``l_i``:
    [BLOCK_M]; ``acc``: [BLOCK_M, HEAD_DIM_PAD], fp32.
    """
    pos = tile * TILE_N + tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    kv_mask = pos < kv_len
    # Positions past kv_len (<= seq_len) are never read, so stale or NaN slots cannot leak.
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    kv_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    # k: [HEAD_DIM_PAD, TILE_N] (K transposed), v: [TILE_N, HEAD_DIM_PAD]
    k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None],
                mask=(dims[:, None] < head_dim) & kv_mask[None, :], other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :],
                mask=kv_mask[:, None] & (dims[None, :] < head_dim), other=0.0)

    s = _dot(q, k, DOT_PRECISION, UPCAST_DOT) * qk_scale  # [BLOCK_M, TILE_N]
    visible = (pos[None, :] <= q_pos[:, None]) & kv_mask[None, :]
    s = tl.where(visible, s, float("-inf"))
    # m_i starts finite (-1e30), so a row with nothing visible yet gives exp2(-inf) = 0, not NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return m_new, l_i, acc


@triton.jit
def _write_output(
    acc, m_i, l_i, token, head, row_mask, io_mask, split, num_heads,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, stride_ot, stride_oh,
    HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Store the normalised output, or with splits this split's unnormalised partials.

    ``acc``: [BLOCK_M, HEAD_DIM_PAD]; ``m_i``, ``l_i``, ``token`` (int64), ``head``,
    ``row_mask``: [BLOCK_M]; ``io_mask``: [BLOCK_M, HEAD_DIM_PAD].
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M], int64
        tl.store(part_max_ptr + part, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part, l_i, mask=row_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                 mask=row_mask[:, None])


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq], int32
    query_start_loc_ptr,  # [num_seqs + 1], int32
    seq_lens_ptr,  # [num_seqs], int32
    out_ptr,  # [num_tokens, num_heads, head_dim]; written when NUM_SPLITS == 1
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD], fp32, unnormalised
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS], fp32, running max in log2 units
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS], fp32, running sum of exp2
    qk_scale,  # softmax scale * log2(e)
    num_seqs, num_heads, head_dim, group_size,
    stride_qt, stride_qh, stride_ot, stride_oh,  # query / out strides (token, head)
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot, head)
    stride_bt,  # block table stride (sequence)
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_lo = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this block
    if q_lo >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - query_len

    # Row r of the tile is query q_lo + r // GROUP_PAD, head r % GROUP_PAD of the KV group.
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_lo + rows // GROUP_PAD
    head = kv_head * group_size + rows % GROUP_PAD
    row_mask = (q_idx < query_len) & (rows % GROUP_PAD < group_size)
    io_mask = row_mask[:, None] & (dims[None, :] < head_dim)
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)

    # Causal: the block's last query sees kv_len keys; earlier rows are masked per tile.
    kv_len = context_len + tl.minimum(q_lo + BLOCK_Q, query_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    q_pos = context_len + q_idx
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, q_pos, kv_len, kv_head,
            k_cache_ptr, v_cache_ptr, block_table_ptr, qk_scale,
            stride_cb, stride_cs, stride_ch, head_dim,
            BLOCK_SIZE, TILE_N, HEAD_DIM_PAD, DOT_PRECISION, UPCAST_DOT)

    _write_output(acc, m_i, l_i, token, head, row_mask, io_mask, split, num_heads,
                  out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, stride_ot, stride_oh,
                  HEAD_DIM_PAD, NUM_SPLITS)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD], fp32
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS], fp32, log2 units
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS], fp32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    num_heads, head_dim,
    stride_ot, stride_oh,  # out strides (token, head)
    NUM_SPLITS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Merge the splits of one ``(token, head)``: rescale each to the common max and normalise."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)  # [NUM_SPLITS]
    dims = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_max_ptr + part)
    weight = tl.exp2(m - tl.max(m, 0))  # an empty split has m = -1e30, l = 0: weight 0
    total = tl.sum(weight * tl.load(part_sum_ptr + part), 0)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


class LaunchPlan(NamedTuple):
    """Tile sizes and grid of one ``paged_attention`` call, all from host-side shapes."""

    block_m: int  # query rows per program: block_m // group_pad tokens x group_pad heads
    group_pad: int  # query heads per KV group, padded to a power of two
    tile_n: int  # key positions per inner-loop step
    head_dim_pad: int
    num_splits: int  # flash-decoding splits of the key range (1: no split, no reduce)
    num_warps: int
    grid: tuple[int, int, int]


def plan(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
         max_context: int, num_cores: int, is_fp32: bool = False,
         num_splits: int | None = None) -> LaunchPlan:
    """Choose tile sizes, the split count and the grid from shapes alone (no device sync).

    Args:
        num_tokens, num_seqs: query tokens and sequences in the batch.
        num_heads, num_kv_heads, head_dim: the attention shape.
        max_context: an upper bound on any ``seq_lens[i]``, in tokens; the caller passes
            ``block_tables.shape[1] * block_size``. If the engine pads block tables far past
            the longest sequence this overestimates, which only costs a few empty splits.
        num_cores: streaming multiprocessors (or CPU programs) to fill.
        is_fp32: fp32 inputs (twice the registers per tile, so smaller tiles).
        num_splits: force a split count (a power of two); ``None`` picks one.
    """
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    is_decode_heavy = num_tokens <= 2 * num_seqs
    block_m = max(16 if is_decode_heavy else 64, group_pad)  # tl.dot needs M >= 16
    # At head_dim 128 these compile without register spills (ptxas -v, sm_90; bf16 also sm_80).
    tile_n = 32 if is_decode_heavy or is_fp32 else 64
    num_warps = 4 if is_decode_heavy and not is_fp32 else 8
    block_q = block_m // group_pad
    if num_splits is None:
        # Decode-shaped batches only: prefill fills the machine. This also bounds the fp32
        # partials to about 4 * num_cores * group rows of head_dim_pad floats.
        busy = max(num_seqs, triton.cdiv(num_tokens, block_q)) * num_kv_heads
        by_cores = (2 * num_cores) // busy if is_decode_heavy else 1
        by_length = max_context // MIN_KEYS_PER_SPLIT
        num_splits = _floor_power_of_2(max(1, min(MAX_SPLITS, by_cores, by_length)))
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    return LaunchPlan(block_m, group_pad, tile_n, max(16, triton.next_power_of_2(head_dim)),
                      num_splits, num_warps, grid)


def _floor_power_of_2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@functools.cache
def _num_cores(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # interpreter: any modest number, so long-context tests take the split path


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened batch of query tokens over a paged KV cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, fp32, fp16 or bf16; last dim contiguous.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype.
        v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype and strides.
        block_tables: ``[num_seqs, max_blocks_per_seq]``, int32; entries past a sequence's
            last block are never read.
        query_start_loc: ``[num_seqs + 1]``, int32, cumulative query lengths from 0.
        seq_lens: ``[num_seqs]``, int32, total length of each sequence including its new
            tokens, in tokens.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        num_splits: keyword-only, for tests and benchmarks: force this many key-range splits
            (a power of two); ``None`` lets ``plan`` choose.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype; fp32 accumulation.
        Rows of tokens outside every sequence's query range are left unspecified.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_attention_args(query, k_cache, v_cache, block_tables)
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    p = plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim,
             block_tables.shape[1] * block_size, _num_cores(query.device),
             query.dtype == torch.float32, num_splits)
    part_out = part_max = part_sum = out  # unused placeholders when there is no split
    if p.num_splits > 1:
        part_out = query.new_empty((num_tokens, num_heads, p.num_splits, p.head_dim_pad),
                                   dtype=torch.float32)
        part_max = query.new_empty((num_tokens, num_heads, p.num_splits), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    _paged_attention_kernel[p.grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        out, part_out, part_max, part_sum,
        scale * LOG2E, num_seqs, num_heads, head_dim, num_heads // num_kv_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, BLOCK_M=p.block_m, GROUP_PAD=p.group_pad,
        HEAD_DIM_PAD=p.head_dim_pad, TILE_N=p.tile_n, NUM_SPLITS=p.num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_INTERPRET and query.dtype == torch.bfloat16,
        num_warps=p.num_warps,
    )
    if p.num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            part_out, part_max, part_sum, out, num_heads, head_dim,
            out.stride(0), out.stride(1), NUM_SPLITS=p.num_splits, HEAD_DIM_PAD=p.head_dim_pad)
    return out


def _check_attention_args(query, k_cache, v_cache, block_tables) -> None:
    """Fail loudly on shapes and layouts the kernel does not cover."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: num_heads {num_heads} is not a multiple of "
                         f"num_kv_heads {num_kv_heads}")
    if query.shape[2] != k_cache.shape[3] or query.dtype != k_cache.dtype:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} {query.dtype} does not "
                         f"match cache {tuple(k_cache.shape)} {k_cache.dtype}")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_attention: query and caches need a contiguous last dimension, "
                         "and k_cache and v_cache equal strides")
    if block_tables.stride(-1) != 1:
        raise ValueError("paged_attention: block_tables needs contiguous rows")
