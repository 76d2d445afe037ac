"""Builders for kernel tests: random K/V in a shuffled, NaN-poisoned paged KV cache.

Every slot a sequence does not own, and every unused slot of its last block, holds NaN, so
a kernel that reads past ``seq_len`` or through a stale block-table entry fails loudly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# One table per dtype. Both sides accumulate in fp32 and round once to the output dtype; the
# kernel also rounds the softmax probabilities to fp16/bf16 before P @ V (as flash attention
# does), so the bound is about two units in the last place of the output dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

# (seq_len, query_len) lists: each sequence's total length and how many of its last tokens
# are queries in this step.
DECODE = [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1)]
PROMPTS = [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100)]
CHUNKS = [(17, 2), (100, 37), (16, 15), (15, 8), (33, 16)]
MIXED = [(100, 1), (17, 17), (40, 23), (16, 1), (20, 0), (15, 15), (64, 31)]


@dataclass
class PagedBatch:
    """A flattened attention batch over a paged cache, plus the dense K/V it was built from."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq], int32, padded with -1
    query_start_loc: torch.Tensor  # [num_seqs + 1], int32
    seq_lens: torch.Tensor  # [num_seqs], int32
    keys: list  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list  # per sequence [seq_len, num_kv_heads, head_dim]
    scale: float

    def args(self) -> tuple:
        """Positional arguments of ``paged_attention``."""
        return (self.query, self.k_cache, self.v_cache, self.block_tables,
                self.query_start_loc, self.seq_lens, self.scale)


def shuffled_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                          gen: torch.Generator, first_block: int = 0) -> torch.Tensor:
    """Disjoint, shuffled physical blocks per sequence from ``[first_block, num_blocks)``.

    Returns ``[num_seqs, max_blocks + 1]`` int32 padded with -1 (one spare column, so a
    kernel that reads one entry too far sees -1).
    """
    counts = [-(-n // block_size) for n in seq_lens]
    pool = (torch.randperm(num_blocks - first_block, generator=gen) + first_block).tolist()
    assert sum(counts) <= len(pool), "pool too small for the batch"
    table = torch.full((len(seq_lens), max(counts) + 1), -1, dtype=torch.int32)
    for i, count in enumerate(counts):
        table[i, :count] = torch.tensor(pool[:count], dtype=torch.int32)
        pool = pool[count:]
    return table


def slots_of(block_table_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """``[seq_len]`` int64 flat slots of positions ``0 .. seq_len - 1``."""
    pos = torch.arange(seq_len)
    return block_table_row[pos // block_size].long() * block_size + pos % block_size


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0,
               num_blocks: int | None = None, first_block: int = 0,
               cache_dtype: torch.dtype | None = None) -> PagedBatch:
    """Random queries and a paged cache holding every sequence's full context.

    Args:
        seqs: ``(seq_len, query_len)`` per sequence.
        num_blocks: pool size; default a little more than the batch needs. A pool larger
            than needed is allocated with ``torch.empty`` (pages never touched cost no
            memory) and only the batch's blocks are poisoned and filled.
        first_block: lowest block id handed out (to place the batch high in a big pool).
        cache_dtype: the caches' dtype where it is not the query's (``torch.float8_e5m2``:
            keys and values drawn in ``dtype``, stored rounded to it).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in seqs]
    needed = sum(-(-n // block_size) for n in seq_lens)
    num_blocks = num_blocks or 2 * needed + 3
    tables = shuffled_block_tables(seq_lens, block_size, num_blocks, gen, first_block)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=cache_dtype or dtype, device=DEVICE)
    v_cache = torch.empty(shape, dtype=cache_dtype or dtype, device=DEVICE)
    used = tables[tables >= 0].long().to(DEVICE)
    k_cache[used] = float("nan")
    v_cache[used] = float("nan")
    if num_blocks < 4 * needed + 16:  # small pool: poison it all
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))

    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    slots = torch.cat([slots_of(tables[i], n, block_size) for i, n in enumerate(seq_lens)])
    reference.store_kv(torch.cat(keys).to(DEVICE), torch.cat(values).to(DEVICE),
                       k_cache, v_cache, slots.to(DEVICE))

    query_lens = torch.tensor([q for _, q in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        query=query.to(DEVICE), k_cache=k_cache, v_cache=v_cache,
        block_tables=tables.to(DEVICE), query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        keys=keys, values=values, scale=head_dim ** -0.5)
