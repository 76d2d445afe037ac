"""The non-GPU logic of ``bench/kernel_bench.py``: byte accounting, skipping, the table."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "kernel_bench.py"
_spec = importlib.util.spec_from_file_location("kernel_bench", _PATH)
kb = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kb  # dataclasses look their module up while the file executes
_spec.loader.exec_module(kb)

SHAPE = kb.QWEN2_5_7B


def test_decode_bytes_counts_kv_and_query_out():
    # 1 sequence, 512 tokens: K and V are 2 * 512 * 4 * 128 * 2 bytes; q and out 2 * 28 * 128 * 2.
    assert kb.decode_bytes(1, 512, SHAPE) == 2 * 512 * 4 * 128 * 2 + 2 * 28 * 128 * 2
    assert kb.decode_bytes(256, 8192, SHAPE) == 256 * kb.decode_bytes(1, 8192, SHAPE)


def test_cache_bytes_rounds_up_to_whole_blocks():
    assert kb.cache_bytes(1, 17, SHAPE) == kb.cache_bytes(1, 32, SHAPE)
    assert kb.cache_bytes(2, 16, SHAPE) == 2 * 2 * 16 * 4 * 128 * 2


def test_fits_skips_what_free_memory_cannot_hold():
    need = kb.footprint_bytes(256, 8192, SHAPE)  # cache, gathered copy, SDPA copy: ~12.9 GB
    assert need > 3 * kb.cache_bytes(256, 8192, SHAPE)
    assert kb.fits(256, 8192, SHAPE, free_bytes=140 * 2**30)
    assert not kb.fits(256, 8192, SHAPE, free_bytes=15 * 2**30)
    assert kb.fits(1, 512, SHAPE, free_bytes=8 * 2**30)


def test_bench_row_reports_bandwidth_and_share_of_copy():
    row = kb.bench_row(1, 512, SHAPE, copy_gbps=1000.0, timings_ms={"triton": 0.01})
    expected_gbps = kb.decode_bytes(1, 512, SHAPE) / 0.01e-3 / 1e9
    assert row["triton_gbps"] == pytest.approx(expected_gbps, abs=0.1)
    assert row["triton_of_copy"] == pytest.approx(expected_gbps / 1000.0, abs=1e-3)
    table = kb.format_table([
        {**row, "gather_sdpa_ms": 0.02, "gather_sdpa_gbps": 52.6, "gather_sdpa_of_copy": 0.05},
        {"batch": 256, "context": 8192, "skipped": "needs 8.1 GiB, 4.0 GiB free"}])
    assert "skipped: needs 8.1 GiB" in table and len(table.splitlines()) == 3


def test_gather_sdpa_baseline_matches_reference():
    """The benchmark's torch baseline computes the same attention as the reference."""
    import torch

    from kernels import reference

    torch.manual_seed(0)
    shape = kb.AttentionShape(num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    inputs = kb.make_decode_inputs(3, 40, shape, device="cpu", dtype=torch.float32)
    args = [inputs[k] for k in ("query", "k_cache", "v_cache", "block_tables",
                                "query_start_loc", "seq_lens", "scale")]
    torch.testing.assert_close(kb.gather_sdpa_decode(inputs, 40, shape),
                               reference.paged_attention(*args), atol=1e-5, rtol=1e-5)
