"""Block pool: exact block ids, ref counts and free counts, the prefix cache (no torch)."""
import hashlib
import struct

import pytest

from engine.block_manager import BlockManager, NoFreeBlocksError, hash_block_tokens, root_hash


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


def test_uncached_blocks_return_to_the_head_and_are_reused_first():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate("a", 40)  # blocks 0, 1, 2
    bm.free("a")  # released 2, 1, 0, each to the head
    assert list(bm.free_block_queue) == [0, 1, 2, 3]
    assert bm.ref_counts == [0, 0, 0, 0]
    assert bm.allocate("b", 20) == [0, 1]
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


# ---- prefix caching: hashes, the free-but-cached life cycle, eviction -----------------------

def _hashes(token_ids, block_size=4, salt=None):
    """Chained hashes of the full blocks of ``token_ids``."""
    hashes, parent = [], root_hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def _run(bm, seq_id, token_ids, hits=()):
    """Admit a sequence of ``token_ids`` from ``hits``, 'compute' it and cache its full blocks."""
    copy = bm.admit(seq_id, list(hits), len(hits) * bm.block_size, len(token_ids))
    bm.cache_full_blocks(seq_id, _hashes(token_ids, bm.block_size), len(token_ids))
    bm.check_invariants()
    return copy


def _freed_after_caching(num_blocks, prompt):
    """A pool where sequence "a" computed ``prompt`` and ended: its full blocks free, cached."""
    bm = BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True)
    _run(bm, "a", prompt)
    bm.free("a")
    return bm


def test_block_hash_is_sha256_of_the_parent_and_little_endian_int64_ids():
    root = root_hash(None)
    assert root == hashlib.sha256(b"mini-infer/prefix-root").digest()
    assert hash_block_tokens(root, [1, 2**40]) == hashlib.sha256(root + struct.pack("<2q", 1, 2**40)).digest()
    a, b = _hashes([5, 6, 7, 8, 9, 10, 11, 12]), _hashes([5, 6, 7, 8, 9, 10, 12, 11])
    assert a[0] == b[0] and a[1] != b[1]  # the first block is shared, the second differs
    assert _hashes([9, 9, 9, 9, 5, 6, 7, 8])[1] != a[0]  # a block's hash depends on its parent
    salted = _hashes([5, 6, 7, 8], salt="tenant-a")
    assert salted != a[:1] and salted != _hashes([5, 6, 7, 8], salt="tenant-b")
    assert root_hash("") != root  # an empty salt is still a salt (SamplingParams refuses it)


def test_freed_cached_blocks_wait_at_the_tail_and_are_found_again():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10, 20))  # 2 full blocks and a partial one
    _run(bm, "a", prompt)
    assert bm.block_table("a") == [0, 1, 2] and bm.num_cached_blocks == 2
    bm.free("a")  # 2 (partial: uncached) to the head; 1 then 0 (cached) to the tail
    assert list(bm.free_block_queue) == [2, 3, 4, 5, 1, 0]
    assert bm.num_free_blocks == 6 and bm.num_free_cached_blocks == 2
    hits = bm.find_cached_prefix(_hashes(prompt + [99, 98]))
    assert hits == [0, 1]
    assert bm.num_blocks_to_admit(hits, 8, 12) == 3  # 2 hits out of the free queue + 1 new
    assert bm.admit("b", hits, 8, 12) is None
    assert bm.block_table("b") == [0, 1, 2] and bm.ref_counts[:3] == [1, 1, 1]
    assert list(bm.free_block_queue) == [3, 4, 5]
    # a third sequence shares the in-use hits: ref count + 1, no free block taken for them
    assert bm.num_blocks_to_admit(hits, 8, 9) == 1
    bm.admit("c", hits, 8, 9)
    assert bm.block_table("c") == [0, 1, 3] and bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.check_invariants()


def test_allocation_evicts_from_the_head_a_sequences_tail_first():
    prompt = list(range(12))
    bm = _freed_after_caching(3, prompt)
    assert list(bm.free_block_queue) == [2, 1, 0] and bm.num_cached_blocks == 3
    assert bm.allocate("b", 8) == [2, 1]  # evicts a's last two blocks, keeps its first
    assert bm.find_cached_prefix(_hashes(prompt)) == [0]
    assert bm.num_cached_blocks == 1 and bm.block_hashes[1] is None
    bm.allocate("b", 12)
    assert bm.num_cached_blocks == 0 and bm.find_cached_prefix(_hashes(prompt)) == []
    bm.check_invariants()


def test_a_hit_ending_inside_its_last_block_copies_that_block_instead_of_writing_it():
    prompt = list(range(8))  # exactly 2 blocks
    bm = _freed_after_caching(4, prompt)
    assert list(bm.free_block_queue) == [2, 3, 1, 0]
    hits = bm.find_cached_prefix(_hashes(prompt))
    # 7 tokens reused, the 8th recomputed: block 1 is copied to a new block, not taken
    assert bm.num_blocks_to_admit(hits, 7, 8) == 2
    assert bm.admit("b", hits, 7, 8) == (1, 2)
    assert bm.block_table("b") == [0, 2] and bm.ref_counts == [1, 0, 1, 0]
    bm.check_invariants(written_blocks=[2])
    bm.cache_full_blocks("b", _hashes(prompt), 8)  # block 2 duplicates cached block 1: stays private
    assert bm.cached_blocks == dict(zip(_hashes(prompt), [0, 1], strict=True)) and bm.block_hashes[2] is None
    bm.free("b")
    assert list(bm.free_block_queue) == [2, 3, 1, 0]  # the private copy goes to the head
    bm.check_invariants()


def test_a_copy_whose_source_is_the_next_free_block_takes_it_whole():
    prompt = list(range(8))
    bm = _freed_after_caching(2, prompt)
    assert list(bm.free_block_queue) == [1, 0]
    hits = bm.find_cached_prefix(_hashes(prompt))
    assert bm.admit("b", hits, 7, 8) is None  # block 1 is evicted and taken: its K/V are already right
    assert bm.block_table("b") == [0, 1] and bm.block_hashes[1] is None
    bm.cache_full_blocks("b", _hashes(prompt), 8)
    assert bm.cached_blocks[_hashes(prompt)[1]] == 1
    bm.check_invariants()


def test_two_sequences_computing_the_same_block_cache_it_once():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    _run(bm, "a", [1, 2, 3, 4])
    _run(bm, "b", [1, 2, 3, 4])
    assert bm.cached_blocks == {_hashes([1, 2, 3, 4])[0]: 0} and bm.block_hashes[1] is None
    bm.free("b")
    bm.free("a")
    assert list(bm.free_block_queue) == [1, 2, 3, 0]
    bm.check_invariants()


def test_reset_prefix_cache_forgets_every_block():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    _run(bm, "a", list(range(8)))
    _run(bm, "b", list(range(100, 104)))
    bm.free("b")
    assert bm.reset_prefix_cache() == 3
    assert bm.num_cached_blocks == 0 and bm.find_cached_prefix(_hashes(list(range(8)))) == []
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == 4 and bm.num_free_cached_blocks == 0


def test_without_prefix_caching_nothing_is_cached_or_found():
    bm = BlockManager(num_blocks=4, block_size=4)
    _run(bm, "a", list(range(8)))
    assert bm.num_cached_blocks == 0 and bm.find_cached_prefix(_hashes(list(range(8)))) == []


def test_check_invariants_names_what_is_broken():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    _run(bm, "a", list(range(8)))
    bm.free_block_queue[0] = None  # referenced and free
    with pytest.raises(AssertionError, match=r"referenced and free \[0\]"):
        bm.check_invariants()
    del bm.free_block_queue[0]
    with pytest.raises(AssertionError, match="block 1 is written in place while shared or cached"):
        bm.check_invariants(written_blocks=[1])
    bm.block_tables["a"].pop()  # a leak: block 1 referenced by no table
    with pytest.raises(AssertionError, match="ref counts differ"):
        bm.check_invariants()
    bm.block_tables["a"].append(1)
    bm.cached_blocks[b"x" * 32] = 2  # a hash on a block that does not carry it
    with pytest.raises(AssertionError, match="block 2 is not under its hash"):
        bm.check_invariants()
