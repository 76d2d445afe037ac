"""Block pool: exact block ids, ref counts and free counts (no torch)."""
import pytest

from engine.block_manager import BlockManager, NoFreeBlocksError


@pytest.mark.parametrize("num_tokens, expected", [
    (1, 1), (15, 1), (16, 1), (17, 2), (31, 2), (32, 2), (33, 3), (0, 0),
])
def test_blocks_needed_at_boundaries(num_tokens, expected):
    assert BlockManager(num_blocks=8, block_size=16).num_blocks_for(num_tokens) == expected


def test_allocate_grows_the_table_only_across_a_boundary():
    bm = BlockManager(num_blocks=8, block_size=16)
    assert bm.allocate("a", 15) == [0]
    assert bm.allocate("a", 16) == []
    assert bm.allocate("a", 17) == [1]
    assert bm.allocate("b", 33) == [2, 3, 4]
    assert bm.block_table("a") == [0, 1]
    assert bm.block_table("b") == [2, 3, 4]
    assert bm.num_free_blocks == 3
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]


def test_free_returns_blocks_tail_first_and_reuses_them_in_that_order():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate("a", 40)  # blocks 0, 1, 2
    bm.free("a")
    assert list(bm.free_block_queue) == [3, 2, 1, 0]
    assert bm.ref_counts == [0, 0, 0, 0]
    assert bm.allocate("b", 20) == [3, 2]
    assert "a" not in bm.block_tables


def test_allocate_fails_whole_when_the_pool_is_short():
    bm = BlockManager(num_blocks=3, block_size=16)
    bm.allocate("a", 32)
    assert not bm.can_allocate("b", 17)
    with pytest.raises(NoFreeBlocksError, match="needs 2 blocks, 1 free"):
        bm.allocate("b", 17)
    assert bm.num_free_blocks == 1 and "b" not in bm.block_tables
    assert bm.can_allocate("a", 48) and bm.num_new_blocks("a", 48) == 1


def test_free_of_an_unknown_request_does_nothing():
    bm = BlockManager(num_blocks=2, block_size=16)
    bm.free("nobody")
    assert bm.num_free_blocks == 2


def test_shared_block_stays_allocated_until_its_last_reference_goes():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate("a", 16)
    bm.block_tables["b"] = [0]  # as a fork would share it
    bm.ref_counts[0] += 1
    bm.free("a")
    assert bm.num_free_blocks == 3 and bm.ref_counts[0] == 1
    bm.free("b")
    assert bm.num_free_blocks == 4 and bm.ref_counts[0] == 0


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0)])
def test_rejects_an_empty_pool(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size)
