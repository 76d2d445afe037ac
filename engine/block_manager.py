"""The KV block pool: a free queue, ref counts and per-request block tables. No torch.

A request's block table lists the physical blocks holding its tokens in order: token
position ``p`` lives in ``block_table[p // block_size]`` at offset ``p % block_size``.
"""
from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NoFreeBlocksError(RuntimeError):
    """Raised by ``allocate`` when the pool cannot cover the request; callers check first."""


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
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add to the request's table so that it holds ``num_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's block table to hold ``num_tokens`` tokens.

        Returns:
            The newly added block ids (empty when the table already suffices).

        Raises:
            NoFreeBlocksError: when the pool has too few free blocks; nothing is allocated.
        """
        needed = self.num_new_blocks(request_id, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {request_id!r} needs {needed} blocks, {self.num_free_blocks} free")
        new_blocks = [self.free_block_queue.popleft() for _ in range(needed)]
        for block_id in new_blocks:
            self.ref_counts[block_id] = 1
        self.block_tables.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks whose count reaches 0 return to the pool.

        Blocks are released last-first, so a request's tail is reused before its head.
        Freeing an unknown request does nothing.
        """
        for block_id in reversed(self.block_tables.pop(request_id, [])):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_queue.append(block_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])
