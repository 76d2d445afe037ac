"""The KV block pool: a free queue, ref counts, per-sequence block tables and the prefix
cache (hash-addressed full blocks). No torch.

A sequence's block table lists the physical blocks holding its tokens in order: token
position ``p`` lives in ``block_table[p // block_size]`` at offset ``p % block_size``.
Sequences forked from one prompt share its blocks by reference count; the first write into
a shared block copies it (copy-on-write), so only a partial last block is ever copied.

Automatic prefix caching (``enable_prefix_caching``): once a block is full and its K/V are
in the cache, it is registered under a hash of its tokens chained to its parent's hash, so
a later sequence with the same leading tokens (and the same ``cache_salt``) reuses it
instead of recomputing it. A block whose ref count drops to 0 keeps its K/V and hash and
waits at the tail of the free queue; allocation takes from the head and evicts the hash of
the block it takes, so cached blocks are reused least recently freed first.
"""
from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections import OrderedDict
from typing import Iterable, Sequence

from engine.errors import NoFreeBlocksError
from kernels import cdiv

# Turned on by the test suite (tests/conftest.py): check_invariants() after every step.
DEBUG_CHECKS = os.environ.get("MINI_INFER_DEBUG_CHECKS") == "1"

BlockHash = bytes  # sha256 digest, 32 bytes


def root_hash(cache_salt: str | None) -> BlockHash:
    """The parent hash of a sequence's first block: one constant per ``cache_salt``, so that
    sequences with different salts (or a salt and none) never share a block."""
    if cache_salt is None:
        return hashlib.sha256(b"mini-infer/prefix-root").digest()
    return hashlib.sha256(b"mini-infer/prefix-salt\0" + cache_salt.encode("utf-8")).digest()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """``sha256(parent || token ids as little-endian int64)``: a full block's identity.

    SHA-256 rather than Python's ``hash()``: a collision would let one sequence read
    another's K/V, and ``hash()`` of a tuple collides easily and on purpose-built inputs
    (vLLM moved to SHA-256 for that reason). The encoding is fixed-width, so it is stable
    across processes and unambiguous.
    """
    ids = array("q", token_ids)  # signed 64-bit on every platform CPython supports
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256(parent + ids.tobytes()).digest()


class BlockManager:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each.

    Invariants (``check_invariants``): a block is in ``free_block_queue`` exactly when its
    ref count is 0, and its ref count is the number of block tables holding it; a block has
    a hash exactly when ``cached_blocks`` maps that hash to it (one block per hash).
    Allocation takes from the queue's head; a freed block goes to the tail if it is cached
    (least recently freed is evicted first) and to the head if not (it holds nothing worth
    keeping). All of it is O(1) per block, and ids come out in a fixed, testable order
    (0, 1, 2, ... on a fresh pool).

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: register full blocks by hash and reuse them.
        debug_checks: run ``check_invariants`` after every scheduler step (for tests).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 debug_checks: bool = DEBUG_CHECKS) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.debug_checks = debug_checks
        # An OrderedDict as a doubly linked list: O(1) pop at the head, append at either
        # end, and removal of a cached block found again from anywhere in the queue.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}  # by seq id
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks  # by block id
        self.cached_blocks: dict[BlockHash, int] = {}  # hash -> block id
        self._num_hashed: dict[str, int] = {}  # by seq id: leading table blocks already offered to the cache
        self._num_free_cached = 0  # kept as a count: stats() reads it from other threads
        # by block id: admissions that found the block in the cache since it was cached (the
        # dashboard's "hits" of a cached block)
        self.hit_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted when taken)."""
        return len(self.free_block_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self.cached_blocks)

    @property
    def num_free_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix block."""
        return self._num_free_cached

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return cdiv(num_tokens, self.block_size)

    # ---- growing and sharing tables ------------------------------------------------------

    def num_new_blocks(self, seq_id: str, num_tokens: int, write_position: int | None = None) -> int:
        """Free blocks needed so that the table holds ``num_tokens`` tokens, plus one if the
        block holding ``write_position`` (the first token to be written) must be copied."""
        table = self.block_tables.get(seq_id, [])
        grow = max(0, self.num_blocks_for(num_tokens) - len(table))
        return grow + int(write_position is not None and self._must_copy(table, write_position))

    def can_allocate(self, seq_id: str, num_tokens: int, write_position: int | None = None) -> bool:
        return self.num_new_blocks(seq_id, num_tokens, write_position) <= self.num_free_blocks

    def _must_copy(self, table: list[int], position: int) -> bool:
        """A shared block, or a cached one, is never written in place."""
        index = position // self.block_size
        if index >= len(table):
            return False
        block_id = table[index]
        return self.ref_counts[block_id] > 1 or self.block_hashes[block_id] is not None

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow the sequence's block table to hold ``num_tokens`` tokens.

        Returns:
            The newly added block ids (empty when the table already suffices).

        Raises:
            NoFreeBlocksError: when the pool has too few free blocks; nothing is allocated.
        """
        needed = self.num_new_blocks(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {needed} blocks, {self.num_free_blocks} free")
        new_blocks = [self._pop_free() for _ in range(needed)]
        self.block_tables.setdefault(seq_id, []).extend(new_blocks)
        return new_blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared: each gains a reference."""
        table = list(self.block_tables[parent_id])
        for block_id in table:
            self.ref_counts[block_id] += 1
        self.block_tables[child_id] = table
        self._num_hashed[child_id] = self._num_hashed.get(parent_id, 0)

    def copy_on_write(self, seq_id: str, position: int) -> tuple[int, int] | None:
        """Make the block that will hold ``position`` private and uncached before a write.

        Returns:
            ``(src, dst)``: the shared or cached block and its new private copy, whose
            contents the model runner must copy before the step's forward; ``None`` when
            the block is already private and uncached, or not allocated yet.

        Raises:
            NoFreeBlocksError: when a copy is needed and no block is free.
        """
        table = self.block_tables.get(seq_id, [])
        if not self._must_copy(table, position):
            return None
        if not self.free_block_queue:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs a block to copy, none free")
        index = position // self.block_size
        src, dst = table[index], self._pop_free()
        table[index] = dst
        self._release(src)
        return src, dst

    def free(self, seq_id: str) -> None:
        """Drop the sequence's references; blocks whose count reaches 0 return to the pool.

        Blocks are released last-first, so a sequence's tail is evicted before its head
        (a head block is worth more: every longer prefix starts with it). Freeing an
        unknown sequence does nothing.
        """
        self._num_hashed.pop(seq_id, None)
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self._release(block_id)

    def block_table(self, seq_id: str) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def _pop_free(self) -> int:
        """Take the head of the free queue, evicting its cached hash if it has one."""
        block_id, _ = self.free_block_queue.popitem(last=False)
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached_blocks[block_hash]
            self.block_hashes[block_id] = None
            self.hit_counts[block_id] = 0
            self._num_free_cached -= 1
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_queue[block_id] = None  # the tail: kept as long as possible
            if self.block_hashes[block_id] is None:
                self.free_block_queue.move_to_end(block_id, last=False)  # reused first
            else:
                self._num_free_cached += 1

    # ---- the prefix cache ----------------------------------------------------------------

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest leading run of ``block_hashes`` that is cached (empty
        without prefix caching). Changes nothing."""
        hits = []
        if self.enable_prefix_caching:
            for block_hash in block_hashes:
                block_id = self.cached_blocks.get(block_hash)
                if block_id is None:
                    break
                hits.append(block_id)
        return hits

    def num_blocks_to_admit(self, hits: Sequence[int], num_computed_tokens: int, num_tokens: int) -> int:
        """Free blocks a new table needs to start from the cached ``hits`` (of which
        ``num_computed_tokens`` tokens are used) and hold ``num_tokens`` tokens: new blocks,
        plus every hit taken out of the free queue."""
        taken = self._hits_taken(hits, num_computed_tokens)
        return sum(1 for b in taken if self.ref_counts[b] == 0) + self.num_blocks_for(num_tokens) - len(taken)

    def _hits_taken(self, hits: Sequence[int], num_computed_tokens: int) -> Sequence[int]:
        # When the hit ends inside its last block (a whole prompt found: its last token is
        # recomputed), that block is copied into a new one instead of being written.
        return hits if num_computed_tokens == len(hits) * self.block_size else hits[:-1]

    def admit(self, seq_id: str, hits: Sequence[int], num_computed_tokens: int,
              num_tokens: int) -> tuple[int, int] | None:
        """Start ``seq_id``'s table from the cached ``hits`` and grow it to ``num_tokens``.

        Args:
            seq_id: a sequence without blocks.
            hits: from ``find_cached_prefix``.
            num_computed_tokens: tokens of ``hits`` in use, ``len(hits) * block_size`` or
                less (then the last hit block is copied, not written in place).
            num_tokens: tokens the table must hold after this step.

        Returns:
            ``(src, dst)`` for the model runner to copy before the forward, or ``None``.

        Raises:
            NoFreeBlocksError: when ``num_blocks_to_admit`` exceeds the free blocks.
        """
        needed = self.num_blocks_to_admit(hits, num_computed_tokens, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {needed} blocks, {self.num_free_blocks} free")
        taken = list(self._hits_taken(hits, num_computed_tokens))
        for block_id in hits:
            self.hit_counts[block_id] += 1
        for block_id in taken:
            if self.ref_counts[block_id] == 0:
                del self.free_block_queue[block_id]
                self._num_free_cached -= 1
            self.ref_counts[block_id] += 1
        self.block_tables[seq_id] = taken
        self._num_hashed[seq_id] = len(taken)
        copy = None
        if len(taken) < len(hits):
            src, dst = hits[-1], self._pop_free()
            self.block_tables[seq_id].append(dst)
            copy = None if src == dst else (src, dst)  # src == dst: taken as the head, contents intact
        self.allocate(seq_id, num_tokens)
        return copy

    def cache_full_blocks(self, seq_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Register the sequence's blocks that ``num_computed_tokens`` filled since the last
        call, under ``block_hashes[i]`` for its ``i``-th block. A block whose hash is already
        cached (by another block that computed the same tokens) stays private."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(seq_id, [])
        start = self._num_hashed.get(seq_id, 0)
        end = min(num_computed_tokens // self.block_size, len(table))
        for index in range(start, end):
            block_id, block_hash = table[index], block_hashes[index]
            if self.block_hashes[block_id] is None and block_hash not in self.cached_blocks:
                self.block_hashes[block_id] = block_hash
                self.cached_blocks[block_hash] = block_id
        self._num_hashed[seq_id] = max(start, end)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (in use or free); their K/V are overwritten when reused.

        Returns:
            How many blocks were forgotten.
        """
        num_blocks = len(self.cached_blocks)
        for block_id in self.cached_blocks.values():
            self.block_hashes[block_id] = None
            self.hit_counts[block_id] = 0
        self.cached_blocks.clear()
        self._num_free_cached = 0
        return num_blocks

    # ---- debugging -----------------------------------------------------------------------

    def check_invariants(self, written_blocks: Iterable[int] = ()) -> None:
        """Raise ``AssertionError`` naming the broken invariant: ref counts equal the
        references in block tables; the free queue holds exactly the unreferenced blocks;
        ``cached_blocks`` and ``block_hashes`` agree, one block per hash; only cached blocks
        count hits; and each of
        ``written_blocks`` (those a step writes K/V into) is private and uncached."""
        for block_id in written_blocks:
            _require(self.ref_counts[block_id] == 1 and self.block_hashes[block_id] is None,
                     f"block {block_id} is written in place while shared or cached")
        refs = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                refs[block_id] += 1
        _require(refs == self.ref_counts, "ref counts differ from the block tables' references")
        unreferenced = {b for b in range(self.num_blocks) if refs[b] == 0}
        _require(set(self.free_block_queue) == unreferenced,
                 f"free queue != unreferenced blocks: referenced and free "
                 f"{sorted(set(self.free_block_queue) - unreferenced)}, leaked "
                 f"{sorted(unreferenced - set(self.free_block_queue))}")
        for block_hash, block_id in self.cached_blocks.items():
            _require(self.block_hashes[block_id] == block_hash, f"block {block_id} is not under its hash")
        num_hashed = sum(h is not None for h in self.block_hashes)
        _require(num_hashed == len(self.cached_blocks),
                 f"{num_hashed} blocks carry a hash, {len(self.cached_blocks)} hashes are cached")
        uncached_hits = [b for b in range(self.num_blocks) if self.hit_counts[b] and self.block_hashes[b] is None]
        _require(not uncached_hits, f"blocks {uncached_hits} count hits but are not cached")
        num_free_cached = sum(1 for b in self.cached_blocks.values() if refs[b] == 0)
        _require(num_free_cached == self._num_free_cached,
                 f"{num_free_cached} free cached blocks, counted {self._num_free_cached}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"block manager invariant broken: {message}")
