"""The C++ CPU backend (``kernels.cpu_attention``) against ``kernels.reference`` over the same
sweep as the Triton kernels: shuffled block tables padded with -1, NaN-poisoned caches,
decode, prompts, chunks and mixed batches, GQA groups 1, 3, 7, head_dim 64/128/80."""
import pytest
import torch

import kernels
from kernels import cpu_attention, reference
from tests.kernels.paged_cases import CHUNKS, DECODE, MIXED, PROMPTS, TOLERANCES, make_batch

pytestmark = pytest.mark.skipif(not cpu_attention.is_available(), reason="the C++ kernel did not build")

SHAPES = {
    "decode-g1-d64-b16": (DECODE, 2, 2, 64, 16),
    "decode-g3-d64-b16": (DECODE, 9, 3, 64, 16),
    "decode-g7-d128-b32": (DECODE, 7, 1, 128, 32),
    "prompts-g3-d128-b32": (PROMPTS, 6, 2, 128, 32),
    "chunks-g7-d64-b16": (CHUNKS, 7, 1, 64, 16),
    "mixed-g3-d64-b32": (MIXED, 9, 3, 64, 32),
    "mixed-g1-d80-b16": (MIXED, 2, 2, 80, 16),
    "long-decode-g3-d64-b16": ([(1000, 1), (2047, 1), (513, 1)], 9, 3, 64, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_reference(shape, dtype):
    seqs, num_heads, num_kv_heads, head_dim, block_size = shape
    if torch.cuda.is_available():
        pytest.skip("CPU kernel")
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(seqs))
    expected = reference.paged_attention(*batch.args())
    out = kernels.paged_attention(*batch.args(), backend="cpu")
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_auto_backend_on_the_cpu_is_the_kernel():
    assert kernels.resolve_backend("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="'cpu' needs the CPU device"):
        kernels.resolve_backend("cpu", "cuda")
