"""Triton ``store_kv`` against ``kernels.reference.store_kv``: results must be bit-identical."""
import pytest
import torch

from kernels import reference
from kernels.triton_store_kv import store_kv
from tests.kernels.paged_cases import DEVICE, shuffled_block_tables, slots_of


def _random_slots(num_tokens, num_blocks, block_size, gen, num_skipped=0):
    """Distinct random slots with ``num_skipped`` of them replaced by -1."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_skipped]] = -1
    return slots


def _store_both(key, value, cache_shape, slots, gen):
    """Run both implementations on identical random caches; return both (k, v) pairs."""
    k_cache = torch.randn(cache_shape, generator=gen).to(key.dtype).to(DEVICE)
    v_cache = torch.randn(cache_shape, generator=gen).to(key.dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    return (k_cache, v_cache), (k_ref, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (3, 128, 32), (2, 80, 16)])
def test_matches_reference_with_skipped_slots(num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_tokens, num_blocks = 37, 9
    slots = _random_slots(num_tokens, num_blocks, block_size, gen, num_skipped=5).to(DEVICE)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    (k, v), (k_ref, v_ref) = _store_both(key, value, shape, slots, gen)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_all_slots_skipped_writes_nothing():
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    slots = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)
    (k, v), (k_ref, v_ref) = _store_both(key, key.clone(), (3, 16, 2, 64), slots, gen)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_strided_key_value_from_fused_qkv():
    """K and V as strided views of one fused projection output are written correctly."""
    gen = torch.Generator().manual_seed(2)
    fused = torch.randn(20, 3 + 2 * 2, 64, generator=gen).to(DEVICE)  # [tokens, q | k | v heads, dim]
    key, value = fused[:, 3:5], fused[:, 5:7]
    slots = _random_slots(20, 4, 16, gen, num_skipped=2).to(DEVICE)
    (k, v), (k_ref, v_ref) = _store_both(key, value, (4, 16, 2, 64), slots, gen)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_empty_batch_is_a_no_op():
    k_cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    empty = torch.empty(0, 1, 64, device=DEVICE)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert not k_cache.any() and not v_cache.any()


def test_slots_past_2_31_elements():
    """Slots whose element offset passes 2**31 land where the reference puts them.

    The pools are ``torch.empty`` (4 GiB of fp16 address space each, never touched beyond
    the test's blocks); blocks straddle the 2**31-element boundary.
    """
    block_size, num_kv_heads, head_dim = 16, 1, 64
    num_blocks, first_block = 2**21 + 64, 2**21 - 32
    gen = torch.Generator().manual_seed(3)
    seq_lens = [50, 33, 90]
    table = shuffled_block_tables(seq_lens, block_size, num_blocks, gen, first_block)
    slots = torch.cat([slots_of(table[i], n, block_size) for i, n in enumerate(seq_lens)])
    slots[::7] = -1
    assert (slots * num_kv_heads * head_dim >= 2**31).any()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).half().to(DEVICE)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).half().to(DEVICE)
    slots = slots.to(DEVICE)
    store_kv(key, value, k_cache, v_cache, slots)
    kept = slots >= 0
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    assert torch.equal(k_cache.view(flat)[slots[kept]], key[kept])
    assert torch.equal(v_cache.view(flat)[slots[kept]], value[kept])
