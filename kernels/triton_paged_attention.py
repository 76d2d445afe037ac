"""Triton paged attention for a flattened batch of decode tokens and prefill chunks.

Same contract as ``kernels.reference.paged_attention``.

Organisation
------------
One kernel, launched once per kind of sequence in the batch (``plan_launches``):

- *decode* (query length 1; the engine puts these first, ``num_decodes`` of them): grid
  ``(num_decodes, num_kv_heads, num_splits)``, one program per sequence and KV head, small
  q tiles, and flash-decoding splits of the key range when few programs would cover a long
  context;
- *prefill* (every other sequence): grid ``(num_q_blocks, num_kv_heads, 1)``, large q tiles.

A program owns one *q block*: up to ``BLOCK_Q`` consecutive query tokens of one sequence
times all query heads of one KV group (the group padded to ``GROUP_PAD``, a power of two),
i.e. a ``[BLOCK_M = BLOCK_Q * GROUP_PAD, head_dim]`` tile of queries. It walks that
sequence's keys in tiles of ``TILE_N`` positions, reading K and V *in place* through the
block table (each row of a tile looks up its own physical block), so every K/V tile is
loaded once for all query heads of the group. Scores, the online softmax (base 2) and the
output accumulator are fp32.

In a prefill launch over sequences ``[seq_lo, seq_hi)``, sequence ``i`` owns program ids
``[(qsl[i] - qsl[seq_lo]) // BLOCK_Q + i - seq_lo, (qsl[i + 1] - qsl[seq_lo]) // BLOCK_Q
+ i + 1 - seq_lo)``, at least ``cdiv(query_len_i, BLOCK_Q)`` of them, so the grid size
``num_prefill_tokens // BLOCK_Q + num_prefill_seqs`` comes from shapes alone (no
device-to-host sync); a program finds its sequence by binary search over
``query_start_loc`` and returns at once when its q block lies past the sequence's queries.

Flash-decoding: with ``num_splits > 1`` each decode program takes only the ``split``-th
share of its key tiles and writes an unnormalised partial output with its running max and
sum; ``_reduce_splits_kernel`` then merges the splits of every ``(token, head)``. The split
count is picked on the host from shapes only (``block_tables.shape[1] * block_size`` stands
in for the longest context).

Compiled variants: Triton compiles one binary per distinct set of constexpr values and per
specialisation of the integer arguments (a value of 1 becomes a constant; a multiple of 16
gets a divisibility hint). The arguments that change from step to step (``seq_lo``,
``seq_hi``, ``num_splits``, the block-table stride) are marked ``do_not_specialize``, and
the split count is a runtime value, so serving one model compiles three kernels: decode,
prefill, and the split reduce (``kernels.triton_launches`` counts them without a GPU; the
engine compiles them at start-up, see ``engine.model_runner.ModelRunner.warm_up``).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# The oldest Triton these kernels support (pyproject.toml declares it): triton.knobs is 3.4's.
# scripts/check_triton_versions.sh runs the kernel tests under older releases' interpreters.
TRITON_MIN_VERSION = (3, 4)
if not hasattr(triton, "knobs"):
    raise ImportError(f"mini-infer's Triton kernels need triton>={'.'.join(map(str, TRITON_MIN_VERSION))}"
                      f" (triton.knobs); this is triton {triton.__version__}")

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
def _find_seq(query_start_loc_ptr, seq_lo, seq_hi, q_block, BLOCK_Q: tl.constexpr):
    """The sequence in ``[seq_lo, seq_hi)`` whose program-id range contains ``q_block``
    (binary search; program ids count from the launch's first sequence ``seq_lo``)."""
    base = tl.load(query_start_loc_ptr + seq_lo)
    lo = seq_lo
    hi = seq_hi
    while lo < hi:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_loc_ptr + mid) - base) // BLOCK_Q + mid - seq_lo
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1, base


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
    acc, m_i, l_i, token, head, row_mask, io_mask, split, num_splits, num_heads,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, stride_ot, stride_oh,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Store the normalised output, or with splits this split's unnormalised partials.

    ``acc``: [BLOCK_M, HEAD_DIM_PAD]; ``m_i``, ``l_i``, ``token`` (int64), ``head``,
    ``row_mask``: [BLOCK_M]; ``io_mask``: [BLOCK_M, HEAD_DIM_PAD].
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    if num_splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (token * num_heads + head) * num_splits + split  # [BLOCK_M], int64
        tl.store(part_max_ptr + part, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part, l_i, mask=row_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                 mask=row_mask[:, None])


# Arguments that change from step to step: no per-value specialisation (see the docstring).
_RUNTIME_ARGS = ["seq_lo", "seq_hi", "num_splits", "stride_bt"]


@triton.jit(do_not_specialize=_RUNTIME_ARGS)
def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq], int32
    query_start_loc_ptr,  # [num_seqs + 1], int32
    seq_lens_ptr,  # [num_seqs], int32
    out_ptr,  # [num_tokens, num_heads, head_dim]; written when num_splits == 1
    part_out_ptr,  # [num_decodes, num_heads, num_splits, HEAD_DIM_PAD], fp32, unnormalised
    part_max_ptr,  # [num_decodes, num_heads, num_splits], fp32, running max in log2 units
    part_sum_ptr,  # [num_decodes, num_heads, num_splits], fp32, running sum of exp2
    qk_scale,  # softmax scale * log2(e)
    seq_lo, seq_hi,  # this launch's sequences [seq_lo, seq_hi)
    num_splits,  # key-range splits per sequence (the grid's third dimension)
    num_heads, head_dim, group_size,
    stride_qt, stride_qh, stride_ot, stride_oh,  # query / out strides (token, head)
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot, head)
    stride_bt,  # block table stride (sequence)
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, TILE_N: tl.constexpr, IS_DECODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if IS_DECODE:  # one program per sequence, whose one query token is its last position
        seq = seq_lo + q_block
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = 1
        q_lo = 0
    else:
        seq, base = _find_seq(query_start_loc_ptr, seq_lo, seq_hi, q_block, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_lo = (q_block - ((q_start - base) // BLOCK_Q + seq - seq_lo)) * BLOCK_Q
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
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
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

    _write_output(acc, m_i, l_i, token, head, row_mask, io_mask, split, num_splits, num_heads,
                  out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, stride_ot, stride_oh,
                  HEAD_DIM_PAD)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_out_ptr,  # [num_decodes, num_heads, num_splits, HEAD_DIM_PAD], fp32
    part_max_ptr,  # [num_decodes, num_heads, num_splits], fp32, log2 units
    part_sum_ptr,  # [num_decodes, num_heads, num_splits], fp32
    out_ptr,  # [num_tokens, num_heads, head_dim]; rows 0 .. num_decodes - 1 are written
    num_splits, num_heads, head_dim,
    stride_ot, stride_oh,  # out strides (token, head)
    MAX_SPLITS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Merge the splits of one ``(token, head)``: rescale each to the common max and normalise."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, MAX_SPLITS)
    valid = splits < num_splits
    part = (token * num_heads + head) * num_splits + splits  # [MAX_SPLITS]
    dims = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_max_ptr + part, mask=valid, other=-1e30)
    # An empty split (and a padding one) has m = -1e30, l = 0: weight 0.
    weight = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(weight * tl.load(part_sum_ptr + part, mask=valid, other=0.0), 0)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
                  mask=valid[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


class LaunchPlan(NamedTuple):
    """One launch of ``_paged_attention_kernel``: its sequences, tile sizes and grid, all
    from host-side shapes."""

    is_decode: bool  # the decode kernel (query length 1 per sequence) or the prefill kernel
    seq_lo: int  # first sequence of the launch
    seq_hi: int  # one past its last sequence
    block_m: int  # query rows per program: block_m // group_pad tokens x group_pad heads
    group_pad: int  # query heads per KV group, padded to a power of two
    tile_n: int  # key positions per inner-loop step
    head_dim_pad: int
    num_splits: int  # flash-decoding splits of the key range (1: no split, no reduce)
    num_warps: int
    grid: tuple[int, int, int]


def plan_launches(num_tokens: int, num_seqs: int, num_decodes: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, max_context: int, num_cores: int,
                  is_fp32: bool = False, num_splits: int | None = None) -> list[LaunchPlan]:
    """The decode launch (sequences ``[0, num_decodes)``) and the prefill launch (the rest),
    each only when it has sequences; from shapes alone (no device sync).

    Args:
        num_tokens, num_seqs: query tokens and sequences in the batch.
        num_decodes: how many leading sequences have query length 1 (so they are also the
            first ``num_decodes`` tokens).
        num_heads, num_kv_heads, head_dim: the attention shape.
        max_context: an upper bound on any ``seq_lens[i]``, in tokens; the caller passes
            ``block_tables.shape[1] * block_size``. If the engine pads block tables far past
            the longest sequence this overestimates, which only costs a few empty splits.
        num_cores: streaming multiprocessors (or CPU programs) to fill.
        is_fp32: fp32 inputs (twice the registers per tile, so smaller tiles).
        num_splits: force the decode launch's split count (1 to ``MAX_SPLITS``); ``None``
            picks one.

    Raises:
        ValueError: ``num_decodes`` outside ``[0, num_seqs]`` or above ``num_tokens``, or
            ``num_splits`` outside ``[1, MAX_SPLITS]``.
    """
    if not 0 <= num_decodes <= min(num_seqs, num_tokens):
        raise ValueError(f"num_decodes must be in [0, min(num_seqs, num_tokens)] = "
                         f"[0, {min(num_seqs, num_tokens)}]; got {num_decodes}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}]; got {num_splits}")
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    launches = []
    if num_decodes:
        block_m = max(16, group_pad)  # tl.dot needs M >= 16
        if num_splits is None:
            # Fill about twice the cores; never split below MIN_KEYS_PER_SPLIT keys. This
            # also bounds the fp32 partials to about 2 * num_cores * group rows.
            by_cores = (2 * num_cores) // (num_decodes * num_kv_heads)
            by_length = max_context // MIN_KEYS_PER_SPLIT
            num_splits = max(1, min(MAX_SPLITS, by_cores, by_length))
        # No register spills at head_dim 128 (ptxas -v, sm_80 and sm_90; see the compile check).
        launches.append(LaunchPlan(True, 0, num_decodes, block_m, group_pad, 32, head_dim_pad,
                                   num_splits, 8 if is_fp32 else 4,
                                   (num_decodes, num_kv_heads, num_splits)))
    if num_decodes < num_seqs:
        # fp32 64 x 32 tiles spill registers at head_dim 128 (1 KB per thread on sm_90);
        # 32 x 16 spill none there and at most 12 bytes anywhere (ptxas -v, sm_80, sm_90).
        block_m = max(32 if is_fp32 else 64, group_pad)
        block_q = block_m // group_pad
        num_prefill_tokens = num_tokens - num_decodes
        launches.append(LaunchPlan(False, num_decodes, num_seqs, block_m, group_pad,
                                   16 if is_fp32 else 64, head_dim_pad, 1, 8,
                                   (num_prefill_tokens // block_q + num_seqs - num_decodes,
                                    num_kv_heads, 1)))
    return launches


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
    num_decodes: int = 0,
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
        num_decodes: keyword-only, host-side: the first ``num_decodes`` sequences have query
            length 1 and take the decode launch (split-K over long contexts); the others
            take the prefill launch. 0 (the default) is right for any batch, only slower
            for decodes. A wrong count gives wrong results: the kernel cannot check it
            without a device sync.
        num_splits: keyword-only, for tests and benchmarks: force the decode launch's
            key-range split count (1 to ``MAX_SPLITS``); ``None`` lets ``plan_launches``
            choose.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype; fp32 accumulation.
        Rows of tokens outside every sequence's query range are left unspecified.

    Raises:
        ValueError: for mismatched shapes, dtypes or layouts, or ``num_decodes`` /
            ``num_splits`` out of range.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_attention_args(query, k_cache, v_cache, block_tables)
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    is_fp32 = query.dtype == torch.float32
    for p in plan_launches(num_tokens, num_seqs, num_decodes, num_heads, num_kv_heads, head_dim,
                           block_tables.shape[1] * block_size, _num_cores(query.device),
                           is_fp32, num_splits):
        # Partials only exist for a split decode launch; otherwise a one-element fp32
        # placeholder keeps the pointer types, hence the compiled variant, the same.
        parts = _partials(query, p.seq_hi * num_heads * p.num_splits if p.num_splits > 1 else 1,
                          p.head_dim_pad)
        _paged_attention_kernel[p.grid](
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, *parts,
            scale * LOG2E, p.seq_lo, p.seq_hi, p.num_splits, num_heads, head_dim,
            num_heads // num_kv_heads,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            BLOCK_SIZE=block_size, BLOCK_M=p.block_m, GROUP_PAD=p.group_pad,
            HEAD_DIM_PAD=p.head_dim_pad, TILE_N=p.tile_n, IS_DECODE=p.is_decode,
            DOT_PRECISION="ieee" if is_fp32 else "tf32",
            UPCAST_DOT=_INTERPRET and query.dtype == torch.bfloat16,
            num_warps=p.num_warps,
        )
        if p.num_splits > 1:
            _reduce_splits_kernel[(p.seq_hi, num_heads)](
                *parts, out, p.num_splits, num_heads, head_dim, out.stride(0), out.stride(1),
                MAX_SPLITS=MAX_SPLITS, HEAD_DIM_PAD=p.head_dim_pad)
    return out


def _partials(query: torch.Tensor, rows: int, head_dim_pad: int):
    """fp32 ``(part_out [rows, head_dim_pad], part_max [rows], part_sum [rows])``."""
    part_out = query.new_empty((rows, head_dim_pad), dtype=torch.float32)
    part_max = query.new_empty((rows,), dtype=torch.float32)
    return part_out, part_max, torch.empty_like(part_max)


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
