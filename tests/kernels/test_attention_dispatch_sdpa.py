"""``kernels.paged_attention(..., backend="triton")`` against an independent reference.

The expected output is dense causal attention per sequence with
``torch.nn.functional.scaled_dot_product_attention`` over K/V tensors that never pass
through a block table, slot mapping or ``kernels.reference``. The cache is filled here by
plain indexing, position by position.
"""
import torch
import torch.nn.functional as F

import kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# (seq_len, query_len): decode tokens and prefill chunks that cross block boundaries.
SEQS = [(1, 1), (47, 1), (16, 1), (40, 25), (33, 33), (70, 18), (17, 2)]


def _dense_causal_attention(q, k, v, scale):
    """q: [query_len, num_heads, head_dim] = the last query_len positions; k, v:
    [seq_len, num_kv_heads, head_dim]. Returns [query_len, num_heads, head_dim]."""
    query_len, seq_len = q.shape[0], k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    # [1, heads, len, dim], each KV head repeated for its group of query heads
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    v4 = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
    allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=allowed, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def test_triton_backend_matches_dense_sdpa():
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s, _ in SEQS]
    num_blocks = sum(blocks_per_seq) + 5
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(SEQS), max(blocks_per_seq), dtype=torch.int32)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(cache_shape, float("nan"))
    v_cache = torch.full(cache_shape, float("nan"))
    queries, expected = [], []
    for i, (seq_len, query_len) in enumerate(SEQS):
        blocks = [physical.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, :len(blocks)] = torch.tensor(blocks)
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        for pos in range(seq_len):
            k_cache[blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            v_cache[blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
        q = torch.randn(query_len, NUM_HEADS, HEAD_DIM, generator=gen)
        queries.append(q)
        expected.append(_dense_causal_attention(q, k, v, HEAD_DIM ** -0.5))
    query_start_loc = torch.tensor([0] + [q for _, q in SEQS], dtype=torch.int32).cumsum(0)
    seq_lens = torch.tensor([s for s, _ in SEQS], dtype=torch.int32)

    out = kernels.paged_attention(
        torch.cat(queries).to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
        block_tables.to(DEVICE), query_start_loc.to(torch.int32).to(DEVICE),
        seq_lens.to(DEVICE), HEAD_DIM ** -0.5, backend="triton")

    torch.testing.assert_close(out.cpu(), torch.cat(expected), atol=1e-5, rtol=1e-5)
