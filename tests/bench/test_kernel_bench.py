"""The non-GPU logic of ``bench/kernel_bench.py``: byte accounting, skipping, the table; and
its ``cpu`` subcommand (``bench/kernel_bench_cpu.py``) end to end on small shapes."""
import json

import pytest

from tests.bench import load_bench_module

kb = load_bench_module("kernel_bench")
kb_cpu = load_bench_module("kernel_bench_cpu")  # imports kernel_bench: loaded first

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


def test_cpu_bench_prefill_inputs_are_a_valid_batch():
    import torch

    from kernels import cpu_attention, reference

    shape = kb.AttentionShape(num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    args = kb_cpu.make_prefill_inputs([(40, 40), (33, 9), (17, 1)], shape, torch.float32)
    assert args[0].shape == (50, 6, 32) and args[3].shape == (3, 3)
    used = torch.cat([args[3][i, :count] for i, count in enumerate([3, 3, 2])])
    assert sorted(used.tolist()) == list(range(8))  # each block of the pool used once
    torch.testing.assert_close(cpu_attention.paged_attention(*args), reference.paged_attention(*args),
                               atol=1e-5, rtol=1e-5)


def test_cpu_bench_small_run_reports_every_combination():
    result = kb_cpu.run_cpu(batches=(1, 3), contexts=(16, 40), rounds=1,
                            prefill_cases=(("2 prompts", [(20, 20), (17, 17)]),),
                            copy_bytes=2**20, flush_bytes=2**20, log=lambda line: None)
    assert set(result["decode"]) == set(result["prefill"]) == {"bfloat16", "float32"}
    assert result["isa"] == result["supported_isas"][0] and result["threads"] >= 1 and result["clock"] == "wall"
    assert result["flush_bytes"] == 2**20
    for dtype, rows in result["decode"].items():
        assert [(r["batch"], r["context"]) for r in rows] == [(1, 16), (3, 16), (1, 40), (3, 40)]
        elem_size = 2 if dtype == "bfloat16" else 4
        for r in rows:
            shape = kb.AttentionShape(9, 3, 64, 16, elem_size)
            assert r["bytes"] == kb.decode_bytes(r["batch"], r["context"], shape)
            assert r["gbps"] > 0 and r["copy_gbps"] > 0
            # each of the three is rounded to 4 significant digits (5e-4 relative), so up to 1.5e-3 apart
            assert r["of_copy"] == pytest.approx(r["gbps"] / r["copy_gbps"], rel=2e-3)
            assert r["max_abs_diff"] < (2e-2 if dtype == "bfloat16" else 1e-5)
        (prefill,) = result["prefill"][dtype]
        assert prefill["query_tokens"] == 37
        assert prefill["speedup"] == pytest.approx(prefill["per_sequence_ms"] / prefill["kernel_ms"], rel=2e-3)
        assert prefill["tiles_ms"] > 0


def test_cpu_subcommand_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert kb.main(["cpu", "--dtypes", "float32", "--batches", "2", "--contexts", "20", "--rounds", "1",
                    "--no-prefill", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in result["decode"]["float32"]] == [(2, 20)]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "decode, float32" in capsys.readouterr().out


def test_bad_cpu_arguments_are_one_line(tmp_path, capsys):
    # a trial: --batches x and --isa bogus were tracebacks
    for flag, value, message in (("--batches", "x", "not comma-separated integers: 'x'"),
                                 ("--contexts", "512,0", "must be above 0; got 512,0")):
        with pytest.raises(SystemExit) as info:
            kb.main(["cpu", flag, value])
        assert info.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err
    out = tmp_path / "cpu.json"
    assert kb.main(["cpu", "--isa", "bogus", "--dtypes", "float32", "--batches", "2", "--contexts", "20",
                    "--rounds", "1", "--no-prefill", "--out", str(out)]) == 2
    assert "kernel_bench cpu: --isa 'bogus': this CPU runs auto, " in capsys.readouterr().err
    assert not out.exists()


def test_cpu_clock_times_one_thread_only(tmp_path, capsys):
    import torch

    out, threads = tmp_path / "cpu.json", torch.get_num_threads()
    common = ["cpu", "--dtypes", "float32", "--batches", "2", "--contexts", "20", "--rounds", "1", "--no-prefill",
              "--clock", "cpu", "--out", str(out)]
    try:
        assert kb.main(common + ["--threads", "2"]) == 2
        assert "--clock cpu times the calling thread only: add --threads 1" in capsys.readouterr().err
        assert not out.exists()
        assert kb.main(common + ["--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert result["clock"] == "cpu" and result["threads"] == 1
    assert f"decode, float32 ({result['isa']}, 1 threads, cpu time)" in capsys.readouterr().out


def test_flush_covers_twice_the_last_level_cache(tmp_path):
    assert [kb_cpu.cache_size_bytes(t) for t in ("491520K\n", "32M", "512", "1G")] == [
        480 * 2**20, 32 * 2**20, 512, 2**30]
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert kb_cpu.last_level_cache_bytes(tmp_path) == 480 * 2**20
    assert kb_cpu.last_level_cache_bytes(tmp_path / "missing") is None
    llc = kb_cpu.last_level_cache_bytes()
    assert kb_cpu.default_flush_bytes() == max(kb_cpu.FLUSH_BYTES, 2 * (llc or 0))
