"""Triton ``paged_attention`` against ``kernels.reference`` over a sweep of batch shapes.

On a machine without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (see conftest.py),
so shapes stay small. Every case uses shuffled, non-contiguous block tables padded with -1
and a NaN-poisoned cache. Each batch runs twice: as one prefill-kind launch
(``num_decodes=0``), and with its decodes first as separate decode and prefill launches.
"""
import pytest
import torch

from kernels import reference
from kernels.triton_paged_attention import MAX_SPLITS, paged_attention, plan_launches
from tests.kernels.paged_cases import CHUNKS, DECODE, DEVICE, MIXED, PROMPTS, TOLERANCES, make_batch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (seqs, num_heads, num_kv_heads, head_dim, block_size): GQA groups 1, 3, 7; head_dim 64,
# 128 and a non-power-of-two 80; block sizes 16 and 32; decode, whole prompts, partial
# prefill chunks and mixed batches (one with a sequence that has no query this step).
SHAPES = {
    "decode-g1-d64-b16": (DECODE, 2, 2, 64, 16),
    "decode-g7-d128-b32": (DECODE, 7, 1, 128, 32),
    "prompts-g3-d128-b32": (PROMPTS, 6, 2, 128, 32),
    "chunks-g7-d64-b16": (CHUNKS, 7, 1, 64, 16),
    "mixed-g3-d64-b32": (MIXED, 9, 3, 64, 32),
    "mixed-g7-d128-b16": (MIXED, 14, 2, 128, 16),
    "mixed-g1-d80-b16": (MIXED, 2, 2, 80, 16),
}


def _assert_matches_reference(batch, **kwargs):
    expected = reference.paged_attention(*batch.args())
    out = paged_attention(*batch.args(), **kwargs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.isfinite(out).all(), "NaN from an unused cache slot leaked into the output"
    torch.testing.assert_close(out, expected, **TOLERANCES[out.dtype])


def decodes_first(seqs):
    """``seqs`` reordered as the engine orders a batch (query length 1 first, stable), and
    the number of decodes."""
    ordered = sorted(seqs, key=lambda s: s[1] != 1)
    return ordered, sum(q == 1 for _, q in seqs)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_reference(shape, dtype):
    seqs, num_heads, num_kv_heads, head_dim, block_size = shape
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(seqs))
    _assert_matches_reference(batch)
    ordered, num_decodes = decodes_first(seqs)
    batch = make_batch(ordered, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(seqs))
    _assert_matches_reference(batch, num_decodes=num_decodes)


@pytest.mark.parametrize("num_splits", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_split_context_matches_reference(seqs, dtype, num_splits):
    """Flash-decoding path: key range split across the decode programs, then the reduce
    kernel; in the mixed batch the prefill launch runs beside it.

    With 4 splits most short sequences leave some splits empty, which the reduce must
    weigh as zero; 3 is not a power of two (the reduce masks its padding splits).
    """
    ordered, num_decodes = decodes_first(seqs)
    batch = make_batch(ordered, 6, 2, 64, 16, dtype, seed=num_splits)
    _assert_matches_reference(batch, num_decodes=num_decodes, num_splits=num_splits)


def test_long_context_decode_splits_by_default():
    """Few sequences over a long block table take the split path without being told, and a
    prefill chunk at a non-zero start rides along in its own launch."""
    seqs = [(700, 1), (513, 1), (300, 45)]
    batch = make_batch(seqs, 7, 1, 64, 32, torch.float16, seed=7)
    launches = plan_launches(47, 3, 2, 7, 1, 64, batch.block_tables.shape[1] * 32, num_cores=16)
    assert [(p.is_decode, p.num_splits > 1) for p in launches] == [(True, True), (False, False)]
    _assert_matches_reference(batch, num_decodes=2)


def test_plan_launches_per_kind():
    """Decodes get small q blocks and splits on long contexts; prefill gets neither; a
    mixed batch gets one launch of each over its own sequences."""
    (decode,) = plan_launches(num_tokens=4, num_seqs=4, num_decodes=4, num_heads=28,
                              num_kv_heads=4, head_dim=128, max_context=8192, num_cores=132)
    assert decode.is_decode and (decode.seq_lo, decode.seq_hi) == (0, 4)
    assert (decode.block_m, decode.group_pad, decode.head_dim_pad, decode.num_warps) == (16, 8, 128, 4)
    assert decode.num_splits == MAX_SPLITS and decode.grid == (4, 4, MAX_SPLITS)
    (prefill,) = plan_launches(num_tokens=4096, num_seqs=2, num_decodes=0, num_heads=28,
                               num_kv_heads=4, head_dim=128, max_context=8192, num_cores=132)
    assert (prefill.is_decode, prefill.block_m, prefill.tile_n, prefill.num_splits) == (False, 64, 64, 1)
    assert prefill.grid == (4096 // 8 + 2, 4, 1)
    # 30 decodes next to a 2000-token chunk: the decodes keep their own tiling and split
    # 2 * 132 // (30 * 4) = 2 ways; the chunk's grid covers only its own tokens.
    decode, prefill = plan_launches(num_tokens=2030, num_seqs=31, num_decodes=30, num_heads=28,
                                    num_kv_heads=4, head_dim=128, max_context=4096, num_cores=132)
    assert (decode.seq_lo, decode.seq_hi, decode.block_m, decode.num_splits) == (0, 30, 16, 2)
    assert decode.grid == (30, 4, 2)
    assert (prefill.seq_lo, prefill.seq_hi, prefill.block_m) == (30, 31, 64)
    assert prefill.grid == (2000 // 8 + 1, 4, 1)
    (short,) = plan_launches(num_tokens=1, num_seqs=1, num_decodes=1, num_heads=9, num_kv_heads=3,
                             head_dim=64, max_context=256, num_cores=132)
    assert short.num_splits == 1
    (busy,) = plan_launches(num_tokens=256, num_seqs=256, num_decodes=256, num_heads=28,
                            num_kv_heads=4, head_dim=128, max_context=8192, num_cores=132)
    assert busy.num_splits == 1


def test_plan_launches_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_decodes must be in"):
        plan_launches(4, 4, 5, 28, 4, 128, 8192, 132)
    with pytest.raises(ValueError, match="num_splits must be in"):
        plan_launches(4, 4, 4, 28, 4, 128, 8192, 132, num_splits=MAX_SPLITS + 1)


def test_strided_query_from_fused_qkv():
    """A query that is a strided view of a fused QKV projection needs no copy."""
    ordered, num_decodes = decodes_first(MIXED)
    batch = make_batch(ordered, 6, 2, 64, 16, torch.float32, seed=3)
    fused = torch.randn(batch.query.shape[0], 10, 64, device=DEVICE)
    fused[:, :6] = batch.query
    batch.query = fused[:, :6]
    assert not batch.query.is_contiguous()
    _assert_matches_reference(batch, num_decodes=num_decodes)


def test_int64_offsets_in_a_pool_past_2_31_elements():
    """Blocks whose first element lies past 2**31 elements are addressed correctly.

    The pool has ``(2**21 + 64) * 16 * 1 * 64 > 2**31`` fp16 elements per cache (4 GiB of
    address space each, allocated with ``torch.empty``, so only the few blocks the batch
    uses are ever touched), and the batch draws its blocks from both sides of the 2**31
    boundary. With int32 offsets ``block_id * stride`` would wrap and read outside the pool:
    a wrong result, or under the interpreter a crash of the test process.
    """
    num_blocks, first_block = 2**21 + 64, 2**21 - 32
    seqs = [(100, 1), (40, 40), (17, 5), (300, 1)]
    batch = make_batch(seqs, 4, 1, 64, 16, torch.float16, seed=31,
                       num_blocks=num_blocks, first_block=first_block)
    assert batch.k_cache.numel() > 2**31
    assert (batch.block_tables.long() * 16 * 64 >= 2**31).any()
    _assert_matches_reference(batch)
    _assert_matches_reference(batch, num_decodes=1, num_splits=2)


def test_empty_batch():
    batch = make_batch([(5, 1)], 2, 1, 64, 16, torch.float32)
    empty = batch.query[:0]
    out = paged_attention(empty, batch.k_cache, batch.v_cache, batch.block_tables[:0],
                          batch.query_start_loc[:1], batch.seq_lens[:0], batch.scale)
    assert out.shape == (0, 2, 64)


def test_rejects_head_counts_that_do_not_group():
    batch = make_batch([(5, 1)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(batch.query.new_zeros(1, 3, 64), *batch.args()[1:])
