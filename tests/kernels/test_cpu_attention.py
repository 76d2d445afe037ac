"""The C++ CPU backend (``kernels.cpu_attention``) against ``kernels.reference``: every
instruction-set path this CPU runs, forced one at a time, over shuffled block tables padded
with -1 and NaN-poisoned caches: decode tokens (with and without the context split across
threads, few and many sequences), whole prompts (prefill tasks of 15 to 64 query rows),
chunks after cached tokens and mixed batches; GQA groups 1, 3, 4, 5, 7; lengths 15, 16, 17
around a block boundary; head_dim 64, 128 and 80; fp32, bf16 and fp16. And the C++ store of
new K/V against the reference's."""
import functools
import re
import shutil
import sys

import pytest
import torch

import kernels
from kernels import cpu_attention, reference
from tests.kernels.paged_cases import CHUNKS, DECODE, MIXED, PROMPTS, TOLERANCES, make_batch

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_attention.is_available(),
                                reason="the C++ CPU kernel: CPU only, and it must build")

# (seqs, num_heads, num_kv_heads, head_dim, block_size)
SHAPES = {
    "decode-g1-d64-b16": (DECODE, 2, 2, 64, 16),
    "decode-g3-d64-b16": (DECODE, 9, 3, 64, 16),
    "decode-g7-d128-b32": (DECODE, 7, 1, 128, 32),
    "prompts-g3-d128-b32": (PROMPTS, 6, 2, 128, 32),
    # prefill tasks of 15, 16, 17, 36 and 64 query rows: around the 16-row vectors of the
    # native bf16 path's row-lane scores (attention_tile.h), with and without padding
    "prompts-g1-d64-b16": (PROMPTS, 2, 2, 64, 16),
    "chunks-g7-d64-b16": (CHUNKS, 7, 1, 64, 16),
    "mixed-g3-d64-b32": (MIXED, 9, 3, 64, 32),
    "mixed-g1-d80-b16": (MIXED, 2, 2, 80, 16),
    "mixed-g7-d128-b8": (MIXED, 14, 2, 128, 8),
    "long-decode-g3-d64-b16": ([(1000, 1), (2047, 1), (513, 1)], 9, 3, 64, 16),
    # enough tasks that each thread claims a sequence's KV heads together (run_plan), where
    # the decode tasks are one KV head: the AVX-512 kernels' at a head_dim that attend_decode
    # does not take (80); at 64 every kernel takes whole decode tokens
    "many-decodes-g3-d64-b16": ([(40 + 7 * (i % 24), 1) for i in range(48)], 9, 3, 64, 16),
    "many-decodes-g3-d80-b16": ([(40 + 7 * (i % 24), 1) for i in range(48)], 9, 3, 80, 16),
    # a decode task of all 8 KV heads (every instruction set takes whole decode tokens at
    # head_dim 64 and 128, through attend_decode): 32 query rows, each head's at its own offset
    "decode-g4-d128-kv8-b16": (DECODE, 32, 8, 128, 16),
    # attend_decode takes a head's query rows 3 at a time: group 5 is a pass of 3 and one of 2
    "decode-g5-d64-b16": (DECODE, 10, 2, 64, 16),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ISAS = cpu_attention.supported_isas() if cpu_attention.is_available() else []


@functools.cache
def _case(shape_id: str, dtype: torch.dtype):
    """A batch and the reference's output for it, shared by every instruction set."""
    seqs, num_heads, num_kv_heads, head_dim, block_size = SHAPES[shape_id]
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(seqs))
    return batch, reference.paged_attention(*batch.args())


def _assert_matches(out, expected):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.isfinite(out).all(), "NaN from an unused cache slot leaked into the output"
    torch.testing.assert_close(out, expected, **TOLERANCES[out.dtype])


def test_the_isa_names_checked_before_start_are_the_extensions():
    """``ISA_CHOICES`` (``make run``'s check of $MINI_INFER_CPU_ISA, without the extension) holds
    "auto" and the names of the C++ kernel tables."""
    from kernels.cpu_settings import ISA_CHOICES

    source = (cpu_attention._CSRC / "attention_kernels.cpp").read_text()
    tables = re.findall(r'MINI_INFER_KERNEL_TABLE\(isa_\w+, "(\w+)"', source)
    assert sorted(tables) == sorted(ISA_CHOICES[1:]) and ISA_CHOICES[0] == "auto"
    assert set(cpu_attention.supported_isas()) <= set(tables)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape_id", SHAPES)
@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_matches_reference(isa, shape_id, dtype):
    batch, expected = _case(shape_id, dtype)
    _assert_matches(cpu_attention.paged_attention(*batch.args(), isa=isa), expected)


DECODE_SHAPES = [s for s in SHAPES if "decode" in s or s.startswith("mixed")]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape_id", DECODE_SHAPES)
@pytest.mark.parametrize("isa", ISAS)
def test_decode_prefetch_into_l1_or_l2_gives_the_same_bits(isa, shape_id, dtype):
    """attend_decode is compiled twice per instruction set, prefetching into L1 or L2
    (``prefetch``): the same arithmetic, so the same bits, and the reference's values."""
    batch, expected = _case(shape_id, dtype)
    l1 = cpu_attention.paged_attention(*batch.args(), isa=isa, prefetch="l1")
    _assert_matches(l1, expected)
    assert torch.equal(l1, cpu_attention.paged_attention(*batch.args(), isa=isa, prefetch="l2"))


@pytest.mark.parametrize(("vendor", "family", "flags", "zen4"), [
    ("AuthenticAMD", "25", "fpu sse2 avx2 avx512f avx512_bf16", True),  # Zen 4
    ("AuthenticAMD", "25", "fpu sse2 avx2", False),  # Zen 3
    ("AuthenticAMD", "26", "fpu sse2 avx2 avx512f avx512_bf16", False),  # Zen 5
    ("GenuineIntel", "6", "fpu sse2 avx2 avx512f amx_bf16", False),
    (None, None, None, False),  # no /proc/cpuinfo
])
def test_zen4_is_told_from_proc_cpuinfo(monkeypatch, vendor, family, flags, zen4):
    fields = {} if vendor is None else {"vendor_id": vendor, "cpu family": family, "flags": flags}
    monkeypatch.setattr(cpu_attention, "_cpuinfo", lambda: fields)
    cpu_attention.is_zen4.cache_clear()
    try:
        assert cpu_attention.is_zen4() is zen4
    finally:
        cpu_attention.is_zen4.cache_clear()


# kv_cache_dtype "fp8_e5m2" / "fp8_e4m3": the caches hold fp8, widened to fp32 as the kernels
# read them; the reference widens them to the query's dtype (exactly) and computes as before.
FP8_SHAPES = ["decode-g3-d64-b16", "decode-g7-d128-b32", "prompts-g1-d64-b16", "chunks-g7-d64-b16",
              "mixed-g1-d80-b16", "many-decodes-g3-d64-b16", "many-decodes-g3-d80-b16",
              "decode-g4-d128-kv8-b16"]
FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]
FP8_IDS = ["e5m2", "e4m3"]


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape_id", FP8_SHAPES)
@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_matches_reference_over_an_fp8_cache(isa, shape_id, dtype, cache_dtype):
    seqs, num_heads, num_kv_heads, head_dim, block_size = SHAPES[shape_id]
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(seqs),
                       cache_dtype=cache_dtype)
    assert batch.k_cache.dtype == cache_dtype
    expected = reference.paged_attention(*batch.args())
    _assert_matches(cpu_attention.paged_attention(*batch.args(), isa=isa), expected)
    if shape_id.startswith("decode"):
        _assert_matches(cpu_attention.paged_attention(*batch.args(), isa=isa, num_splits=3), expected)


@pytest.mark.parametrize("isa", ISAS)
def test_every_fp8_value_widens_exactly(isa):
    """All 256 bit patterns of each fp8 format as a one-token cache read by a one-hot query:
    attention over a single key returns its value row, so the output is each value widened
    to fp32, NaN (and E5M2's infinities) included, as torch widens it."""
    for cache_dtype in FP8:
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype).view(4, 1, 1, 64)
        v_cache = every.clone()
        k_cache = torch.zeros_like(every)
        query = torch.zeros(4, 1, 64)
        out = cpu_attention.paged_attention(query, k_cache, v_cache, torch.arange(4, dtype=torch.int32).view(4, 1),
                                            torch.arange(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
                                            0.125, isa=isa)
        want = every.view(4, 1, 64).float()
        assert torch.equal(out.isnan(), want.isnan()), (isa, cache_dtype)
        assert torch.equal(out.nan_to_num(0.0), want.nan_to_num(0.0)), (isa, cache_dtype)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape_id", ["decode-g3-d64-b16", "mixed-g7-d128-b8", "long-decode-g3-d64-b16",
                                      "decode-g4-d128-kv8-b16"])
@pytest.mark.parametrize("isa", ISAS)
def test_split_context_matches_reference(isa, shape_id, dtype, num_splits):
    """Decode contexts split n ways and merged; short sequences get fewer, non-empty splits."""
    batch, expected = _case(shape_id, dtype)
    _assert_matches(cpu_attention.paged_attention(*batch.args(), isa=isa, num_splits=num_splits), expected)


# Prefill chunks of 128 query tokens or more, fresh and after cached tokens, beside decode
# tokens and shorter chunks (which stay tiles): the bf16 ones take torch's SDPA with
# prefill="sdpa" (cpu_attention.sdpa_prefill_default).
LONG_CHUNKS = [(300, 300), (400, 150), (129, 128), (50, 1), (200, 127), (17, 17), (160, 160)]
LONG_SHAPES = {"long-chunks-g3-d64-b16": (LONG_CHUNKS, 9, 3, 64, 16),
               "long-chunks-g7-d128-b8": (LONG_CHUNKS, 14, 2, 128, 8)}


@pytest.mark.parametrize("prefill", ["sdpa", "tiles"])
@pytest.mark.parametrize("cache_dtype", [None, *FP8], ids=["cache-as-query", *FP8_IDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape_id", LONG_SHAPES)
def test_long_prefill_chunks_match_reference_either_way(shape_id, dtype, cache_dtype, prefill):
    seqs, num_heads, num_kv_heads, head_dim, block_size = LONG_SHAPES[shape_id]
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=3, cache_dtype=cache_dtype)
    _assert_matches(cpu_attention.paged_attention(*batch.args(), prefill=prefill),
                    reference.paged_attention(*batch.args()))


def test_sdpa_prefill_takes_only_long_bf16_chunks():
    """fp32 chunks and chunks under 128 tokens are the tiles' whatever ``prefill`` says; a long
    bf16 chunk is computed differently (rounded differently) by SDPA."""
    short = make_batch([(100, 100), (300, 127), (40, 1)], 9, 3, 64, 16, torch.bfloat16, seed=1)
    assert torch.equal(cpu_attention.paged_attention(*short.args(), prefill="sdpa"),
                       cpu_attention.paged_attention(*short.args(), prefill="tiles"))
    fp32 = make_batch(LONG_CHUNKS, 9, 3, 64, 16, torch.float32, seed=1)
    assert torch.equal(cpu_attention.paged_attention(*fp32.args(), prefill="sdpa"),
                       cpu_attention.paged_attention(*fp32.args(), prefill="tiles"))
    long = make_batch(LONG_CHUNKS, 9, 3, 64, 16, torch.bfloat16, seed=1)
    assert not torch.equal(cpu_attention.paged_attention(*long.args(), prefill="sdpa"),
                           cpu_attention.paged_attention(*long.args(), prefill="tiles"))


# name: (setting function, its variable, its "auto" answer here, its choices as the error lists
# them, (choice that is on, choice that is off), a value that is no choice in the variable, and
# one as the argument)
SETTINGS = {
    "prefill": (cpu_attention.sdpa_prefill_default, cpu_attention.PREFILL_ENV, cpu_attention.has_amx,
                "auto, sdpa, tiles", ("sdpa", "tiles"), "flash", "SDPA"),
    "prefetch": (cpu_attention.decode_prefetch_l2_default, cpu_attention.PREFETCH_ENV, cpu_attention.is_zen4,
                 "auto, l1, l2", ("l2", "l1"), "l3", "L2"),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_setting_is_checked_and_read_from_the_environment(monkeypatch, name):
    setting, env, auto, choices, (on, off), bad_env, bad_arg = SETTINGS[name]
    monkeypatch.delenv(env, raising=False)
    assert setting() == auto()
    assert setting(on) and not setting(off)
    monkeypatch.setenv(env, off)
    assert not setting()
    assert setting(on)  # an argument beats the environment
    monkeypatch.setenv(env, bad_env)
    with pytest.raises(ValueError, match=re.escape(f"{env} must be one of {choices}; got {bad_env!r}")):
        setting()
    with pytest.raises(ValueError, match=re.escape(f"{name} must be one of {choices}; got {bad_arg!r}")):
        setting(bad_arg)


def test_backend_dispatch_matches_reference():
    batch, expected = _case("mixed-g3-d64-b32", torch.float32)
    _assert_matches(kernels.paged_attention(*batch.args(), backend="cpu"), expected)
    assert kernels.resolve_backend("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="'cpu' needs the CPU device"):
        kernels.resolve_backend("cpu", "cuda")


def test_isas_best_first_and_auto_falls_back_by_head_dim():
    assert ISAS[-1] == "scalar" and len(set(ISAS)) == len(ISAS)
    assert set(ISAS) <= {"avx512_bf16", "avx512", "avx2", "scalar"}
    assert cpu_attention.selected_isa(64) == ISAS[0]
    # head_dim 72: not a multiple of 16 (AVX-512's vector), a multiple of 8 (AVX2's)
    assert cpu_attention.selected_isa(72) == next(i for i in ISAS if i in ("avx2", "scalar"))
    assert cpu_attention.selected_isa(36) == "scalar"


def test_forced_isa_errors_name_the_problem():
    batch, _ = _case("decode-g1-d64-b16", torch.float32)
    with pytest.raises(RuntimeError, match=re.escape("unknown isa 'sse9' (the isa argument or $MINI_INFER_CPU_ISA); "
                                                       "this CPU runs: " + ", ".join(ISAS))):
        cpu_attention.paged_attention(*batch.args(), isa="sse9")
    if "avx512" in ISAS:
        odd = make_batch([(5, 1)], 2, 2, 72, 16, torch.float32)
        with pytest.raises(RuntimeError, match="'avx512' kernels need head_dim a multiple of 16; got 72"):
            cpu_attention.paged_attention(*odd.args(), isa="avx512")


def test_the_environment_picks_the_kernels_of_calls_that_name_none(monkeypatch):
    batch, _ = _case("mixed-g3-d64-b32", torch.bfloat16)
    for isa in ISAS:
        monkeypatch.setenv(cpu_attention.ISA_ENV, isa)
        assert cpu_attention.selected_isa(64) == isa
        assert torch.equal(cpu_attention.paged_attention(*batch.args()),
                           cpu_attention.paged_attention(*batch.args(), isa=isa))
    assert cpu_attention.selected_isa(64, "auto") == ISAS[0]  # an argument beats the environment
    monkeypatch.setenv(cpu_attention.ISA_ENV, "sse9")
    with pytest.raises(RuntimeError, match=re.escape("unknown isa 'sse9' (the isa argument or $MINI_INFER_CPU_ISA)")):
        cpu_attention.selected_isa(64)


def test_bad_block_table_and_lengths_are_errors_not_reads():
    batch, _ = _case("decode-g3-d64-b16", torch.float32)
    args = list(batch.args())
    tables = batch.block_tables.clone()
    tables[4, 1] = batch.k_cache.shape[0]  # sequence 4 (100 tokens) reads blocks 0..6
    args[3] = tables
    with pytest.raises(RuntimeError, match=rf"block_tables\[4\]\[1\] = {batch.k_cache.shape[0]} is outside"):
        cpu_attention.paged_attention(*args)
    args[3] = batch.block_tables
    args[5] = batch.seq_lens.clone()
    args[5][0] = 0  # sequence 0 has a query token but no length
    with pytest.raises(RuntimeError, match=r"sequence 0 has 1 query tokens but seq_lens\[0\] = 0"):
        cpu_attention.paged_attention(*args)


def test_extension_is_built_for_no_particular_cpu():
    """No -march/-m<isa> flag in the build (the kernels pick their instruction set at run
    time), and the cache name carries a hash of the sources."""
    cpu_attention.load()
    name = cpu_attention.extension_name()
    assert name.startswith("mini_infer_cpu_attention_") and len(name.rsplit("_", 1)[1]) == 12
    from torch.utils.cpp_extension import _get_build_directory

    build_file = (_get_build_directory(name, verbose=False) + "/build.ninja")
    flags = next(line for line in open(build_file) if line.startswith("cflags"))
    assert "-march" not in flags and "-mavx" not in flags and "-O3" in flags


def test_extension_name_changes_with_the_source(tmp_path, monkeypatch):
    shutil.copytree(cpu_attention._CSRC, tmp_path / "csrc")
    monkeypatch.setattr(cpu_attention, "_CSRC", tmp_path / "csrc")
    before = cpu_attention.extension_name()
    header = tmp_path / "csrc" / "vec_avx2.h"
    header.write_text(header.read_text() + "// changed\n")
    assert cpu_attention.extension_name() != before


def test_extension_name_changes_with_the_python_environment(monkeypatch):
    """A clone's own .venv beside the checkout's builds under a name of its own: with one
    name, each environment's engine start rebuilt the other's build (~70 s)."""
    before = cpu_attention.extension_name()
    monkeypatch.setattr(sys, "prefix", sys.prefix + "-clone")
    assert cpu_attention.extension_name() != before


def test_the_kernel_releases_the_gil():
    """Other Python threads run while a call computes (a served replica's Ray and asyncio
    threads beside its step loop): a thread that only records the time gets many samples
    inside the middle halves of the calls (as many as make 50 ms of middles, so a faster kernel
    or CPU still gives enough to tell); with the GIL held through each call it gets none."""
    import threading
    import time

    num_seqs, context, block_size = 64, 2048, 16
    blocks_per_seq = context // block_size
    k_cache = torch.randn(num_seqs * blocks_per_seq, block_size, 2, 64)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    args = (torch.randn(num_seqs, 6, 64), k_cache, v_cache, tables,
            torch.arange(num_seqs + 1, dtype=torch.int32), torch.full((num_seqs,), context, dtype=torch.int32), 0.125)
    span, samples, started = [], [], threading.Event()

    def call():
        started.set()
        middles = 0.0
        while middles < 0.05 and len(span) < 1000:
            begin = time.perf_counter()
            cpu_attention.paged_attention(*args)
            span.append((begin, time.perf_counter()))
            middles += (span[-1][1] - begin) / 2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a core left for the sampling thread
    try:
        worker = threading.Thread(target=call)
        worker.start()
        started.wait()
        while worker.is_alive():
            samples.append(time.perf_counter())
            time.sleep(0.0002)
        worker.join()
    finally:
        torch.set_num_threads(threads)
    middles = [(begin + (end - begin) / 4, end - (end - begin) / 4) for begin, end in span]
    assert sum(end - begin for begin, end in middles) > 0.02, "the calls are too short to tell"
    inside = [t for t in samples if any(begin < t < end for begin, end in middles)]
    assert len(inside) >= 10, f"{len(inside)} samples inside calls of {[round(1000 * (e - b)) for b, e in span]} ms"


@pytest.mark.parametrize("cache_dtype", [None, *FP8], ids=["cache-as-key", *FP8_IDS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_what_the_reference_writes(dtype, cache_dtype):
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 12, 16, 3, 64).to(cache_dtype or dtype).unbind(0)
    # k and v as the model makes them: views into one q/k/v projection output (rows 960 apart)
    qkv = torch.randn(20, 960).to(dtype)
    key, value = qkv[:, 576:768].view(20, 3, 64), qkv[:, 768:].view(20, 3, 64)
    slots = torch.randperm(12 * 16)[:20]
    slots[[3, 11]] = -1  # tokens that own no slot
    ours, theirs = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
    kernels.store_kv(key, value, *ours, slots, backend="cpu")
    reference.store_kv(key, value, *theirs, slots)
    bits = lambda t: t.view(torch.uint8) if t.dtype in FP8 else t  # noqa: E731
    assert torch.equal(bits(ours[0]), bits(theirs[0])) and torch.equal(bits(ours[1]), bits(theirs[1]))
    assert not torch.equal(bits(ours[0]), bits(k_cache))
    assert torch.equal(bits(ours[0].view(-1, 3, 64)[slots[0]]), bits(key[0].to(k_cache.dtype)))


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("isa", ISAS)
def test_store_kv_rounds_to_fp8_as_the_reference_does(isa, head_dim, cache_dtype):
    """Every bf16 value (NaN, infinities, subnormals included), fp32 values at and around the
    rounding ties, the largest finite values (E5M2: 57,344, and 61,440 up becoming infinity;
    E4M3: 448, and anything larger saturating there), and random fp32 and fp16 values over
    the formats' ranges, through each instruction set's vectors (and, at head_dim 72, the
    last 8 of each row one by one on AVX-512): the reference's bits (``Tensor.to``, after
    clamping to +-448 for E4M3)."""
    def stored(x):
        rows = torch.cat([x.flatten(), x.new_zeros(-x.numel() % head_dim)]).view(-1, 1, head_dim)
        k_cache = torch.zeros(rows.shape[0], 1, 1, head_dim, dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        cpu_attention.store_kv(rows, -rows, k_cache, v_cache, torch.arange(rows.shape[0]), isa=isa)
        n = x.numel()
        return k_cache.view(torch.uint8).flatten()[:n], v_cache.view(torch.uint8).flatten()[:n]

    def expected(x):
        k_cache = torch.zeros(x.numel(), 1, 1, 1, dtype=cache_dtype)
        reference.store_kv(x.reshape(-1, 1, 1), x.reshape(-1, 1, 1), k_cache, k_cache.clone(), torch.arange(x.numel()))
        return k_cache.view(torch.uint8).flatten()

    every_bf16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ties = torch.tensor([i * 2.0**-18 for i in range(80)] + [i * 2.0**-11 for i in range(40)]
                        + [m * 2.0**e for e in (-14, -6, -3, 0, 7, 8, 15)
                           for m in (1.0625, 1.125, 1.1875, 1.375, 1.625, 1.875, 1.9375, 1.1249999)]
                        + [440., 448., 456., 463.99, 464., 465., 480., 57344., 59392., 61439.996, 61440., 65535.,
                           65536., 1e30, float("inf")])
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(64, 1000, generator=generator) * torch.logspace(-7, 5, 64)[:, None]
    for x in (every_bf16, ties, -ties, spread, spread.half()):
        k, v = stored(x)
        assert torch.equal(k, expected(x)), (x.dtype, (k != expected(x)).nonzero()[:5])
        assert torch.equal(v, expected(-x)), x.dtype


def test_argmax_rows_is_torch_argmax():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(70, 49_152, generator=generator)
    logits[1, 700:] = 0.0  # ties: the first index, as torch's
    logits[1, :700] = -1.0
    logits[2, 31_000] = logits[2, 40_000] = 50.0  # a tie in two 256-element chunks
    logits[3] = float("-inf")  # nothing above -inf: index 0
    logits[4, 9] = logits[4, 5_000] = float("nan")  # the first NaN, as torch's
    logits[5, 49_151] = 99.0  # the last element, past the last full chunk
    logits[6, 3] = float("inf")
    logits[7] = -0.0
    logits[7, 10] = 0.0  # -0.0 == 0.0: the first
    expected = logits.argmax(dim=-1)
    assert expected[:8].tolist() == [int(logits[0].argmax()), 700, 31_000, 0, 9, 49_151, 3, 0]
    assert torch.equal(cpu_attention.argmax_rows(logits), expected)
    # bf16 and fp16 logits (the model's dtype): the argmax of their exact fp32 values, ties
    # that the rounding makes included
    for dtype in (torch.bfloat16, torch.float16):
        half = logits.to(dtype)
        assert torch.equal(cpu_attention.argmax_rows(half), half.float().argmax(dim=-1))
        assert cpu_attention.argmax_rows(half)[1:8].tolist() == [700, 31_000, 0, 9, 49_151, 3, 0]
        assert torch.equal(cpu_attention.argmax_rows(half[10:20, 5:300]), half[10:20, 5:300].float().argmax(-1))
    # rows of a larger tensor (a row stride), a single column, a vocabulary shorter than a chunk
    wide = torch.randn(9, 300, generator=generator)
    assert torch.equal(cpu_attention.argmax_rows(wide[:, :257]), wide[:, :257].argmax(-1))
    assert cpu_attention.argmax_rows(torch.ones(4, 1)).tolist() == [0, 0, 0, 0]
    assert cpu_attention.argmax_rows(torch.empty(0, 5)).shape == (0,)


def test_argmax_rows_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="2-D fp32, bf16 or fp16 CPU tensor; got 2-D Double"):
        cpu_attention.argmax_rows(torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="2-D fp32, bf16 or fp16 CPU tensor; got 1-D Float"):
        cpu_attention.argmax_rows(torch.zeros(5))
    with pytest.raises(RuntimeError, match="contiguous, non-empty last dimension"):
        cpu_attention.argmax_rows(torch.zeros(5, 4).t())


def test_silu_and_mul_rounds_torchs_fp32_result_on_every_instruction_set():
    """silu(gate) * up in fp32, rounded once to the input's dtype (Inductor's fused kernel
    computes that): the same value as torch's fp32 result rounded, or its neighbour where
    the kernel's exp (Cephes, ~1 ulp of fp32) lands on the other side of a rounding boundary."""
    generator = torch.Generator().manual_seed(0)
    n, dtype = 1536, torch.bfloat16
    x = (torch.randn(300, 2 * n, generator=generator) * 4).to(dtype)  # 460,800 outputs: threads
    x[0, :10] = torch.tensor([0.0, -0.0, 20.0, -20.0, 60.0, -60.0, 1e-3, -1e-3, 0.5, -0.5])
    x[1, :3] = torch.tensor([float("inf"), float("nan"), 3.0])
    x[1, n:n + 3] = torch.tensor([1.0, 1.0, float("nan")])
    expected = (torch.nn.functional.silu(x[:, :n].float()) * x[:, n:].float()).to(dtype)
    one_ulp = expected.float().abs() * 2.0 ** -7  # bf16: 8 significant bits
    cases = [(x, expected, one_ulp), (x[:5], expected[:5], one_ulp[:5]),  # threads, one thread
             (x[:2].reshape(2, 1, 2 * n), expected[:2].reshape(2, 1, n), one_ulp[:2].reshape(2, 1, n))]  # 3-D
    for isa in cpu_attention.supported_isas():
        for rows, want, ulp in cases:
            out = cpu_attention.silu_and_mul(rows, isa=isa)
            assert out.dtype == dtype and out.shape == want.shape, isa
            assert torch.equal(torch.isnan(out), torch.isnan(want)), isa
            infinite = torch.isinf(want)
            assert torch.equal(out[infinite], want[infinite]), isa
            finite = torch.isfinite(want)
            assert bool(((out.float() - want.float()).abs()[finite] <= ulp[finite]).all()), isa
            assert (out[finite] != want[finite]).float().mean() < 1e-3, isa
        assert cpu_attention.silu_and_mul(x[:2], isa=isa)[0, :10].tolist() == expected[0, :10].tolist()
        # Rows are computed alike on any thread: the split (every row its own chunk, the
        # engine's splits, one thread for all 300 rows) leaves the bits alone.
        whole = cpu_attention.silu_and_mul(x, isa=isa).view(torch.int16)  # bits: NaN rows too
        for parallel_from_rows in (1, 16, 128, 301):
            split = cpu_attention.silu_and_mul(x, isa=isa, parallel_from_rows=parallel_from_rows)
            assert torch.equal(split.view(torch.int16), whole), (isa, parallel_from_rows)


def test_silu_and_mul_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="x must be a bf16 CPU tensor; got Half"):
        cpu_attention.silu_and_mul(torch.zeros(2, 6, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"last dimension must be even \(gate and up halves\); got \[2, 5\]"):
        cpu_attention.silu_and_mul(torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="silu_and_mul: unknown isa 'sse9'"):
        cpu_attention.silu_and_mul(torch.zeros(2, 6, dtype=torch.bfloat16), isa="sse9")
    with pytest.raises(RuntimeError, match="silu_and_mul: parallel_from_rows must be >= 0; got -1"):
        cpu_attention.silu_and_mul(torch.zeros(2, 6, dtype=torch.bfloat16), parallel_from_rows=-1)
