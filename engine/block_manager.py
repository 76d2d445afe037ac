"""The KV block pool: a free queue, ref counts and per-sequence block tables. No torch.

A sequence's block table lists the physical blocks holding its tokens in order: token
position ``p`` lives in ``block_table[p // block_size]`` at offset ``p % block_size``.
Sequences forked from one prompt share its blocks by reference count; the first write into
a shared block copies it (copy-on-write), so only a partial last block is ever copied.
"""
from __future__ import annotations

from collections import deque

from engine.errors import NoFreeBlocksError
from kernels import cdiv


class BlockManager:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each.

    Invariant: a block is in ``free_block_queue`` exactly when its ref count is 0. Allocation
    takes from the queue's head and freeing appends to its tail, both O(1) per block, so ids
    come out in a fixed, testable order (0, 1, 2, ... on a fresh pool).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_queue: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}  # by seq id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, seq_id: str, num_tokens: int, write_position: int | None = None) -> int:
        """Free blocks needed so that the table holds ``num_tokens`` tokens, plus one if the
        block holding ``write_position`` (the first token to be written) is shared."""
        table = self.block_tables.get(seq_id, [])
        grow = max(0, self.num_blocks_for(num_tokens) - len(table))
        return grow + int(write_position is not None and self._is_shared(table, write_position))

    def can_allocate(self, seq_id: str, num_tokens: int, write_position: int | None = None) -> bool:
        return self.num_new_blocks(seq_id, num_tokens, write_position) <= self.num_free_blocks

    def _is_shared(self, table: list[int], position: int) -> bool:
        index = position // self.block_size
        return index < len(table) and self.ref_counts[table[index]] > 1

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
        new_blocks = [self.free_block_queue.popleft() for _ in range(needed)]
        for block_id in new_blocks:
            self.ref_counts[block_id] = 1
        self.block_tables.setdefault(seq_id, []).extend(new_blocks)
        return new_blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared: each gains a reference."""
        table = list(self.block_tables[parent_id])
        for block_id in table:
            self.ref_counts[block_id] += 1
        self.block_tables[child_id] = table

    def copy_on_write(self, seq_id: str, position: int) -> tuple[int, int] | None:
        """Make the block that will hold ``position`` private to the sequence before a write.

        Returns:
            ``(src, dst)``: the shared block and its new private copy, whose contents the
            model runner must copy before the step's forward; ``None`` when the block is
            already private or not allocated yet.

        Raises:
            NoFreeBlocksError: when a copy is needed and no block is free.
        """
        table = self.block_tables.get(seq_id, [])
        if not self._is_shared(table, position):
            return None
        if not self.free_block_queue:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs a block to copy, none free")
        index = position // self.block_size
        src, dst = table[index], self.free_block_queue.popleft()
        self.ref_counts[src] -= 1
        self.ref_counts[dst] = 1
        table[index] = dst
        return src, dst

    def free(self, seq_id: str) -> None:
        """Drop the sequence's references; blocks whose count reaches 0 return to the pool.

        Blocks are released last-first, so a sequence's tail is reused before its head.
        Freeing an unknown sequence does nothing.
        """
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_queue.append(block_id)

    def block_table(self, seq_id: str) -> list[int]:
        return self.block_tables.get(seq_id, [])
