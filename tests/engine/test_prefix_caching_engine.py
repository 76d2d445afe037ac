"""Invariant 6 on the real model: with prefix caching on, fp32 greedy token ids equal those
with it off (shared and nested prompts, whole-block prompts sent twice, preemption, chunked
prefill, n = 3, the w3 workload); cache_salt; num_cached_tokens, stats and reset."""
from __future__ import annotations

import json
import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import PASSAGE, assert_idle
from tests.serve_process import ROOT

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
W3 = ROOT.parent / "shared" / "workloads" / "w3_shared_prefix.json"


@pytest.fixture(scope="module")
def llm_off():
    return LLM(dtype="float32", enable_prefix_caching=False, num_gpu_blocks=1024)


@pytest.fixture(scope="module")
def passage_ids(tokenizer) -> list[int]:
    return tokenizer(PASSAGE).input_ids


@pytest.fixture(scope="module")
def shared_prompts(passage_ids) -> list[list[int]]:
    """Prompts that share prefixes: nested ones, one a prefix of another, one of exactly 4
    blocks of 16 twice, lengths around block boundaries."""
    ids = passage_ids
    return [ids[:64], ids[:100], ids[:40], ids[:64], ids[:100] + ids[300:340], ids[:17], ids[:16],
            ids[:33], ids[:200], ids[:150] + ids[400:420], ids[:64] + ids[64:65]]


def _token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def expected(llm_off, shared_prompts):
    return _token_ids(llm_off.generate(shared_prompts, GREEDY, use_tqdm=False))


def test_shared_and_nested_prompts_match_prefix_caching_off(llm, shared_prompts, expected):
    llm.reset_prefix_cache()
    first = llm.generate(shared_prompts, GREEDY, use_tqdm=False)  # in one batch
    again = llm.generate(shared_prompts, GREEDY, use_tqdm=False)  # now every full block is cached
    assert _token_ids(first) == expected and _token_ids(again) == expected
    lengths = [len(p) for p in shared_prompts]
    # the second time: every full block, capped at all tokens but the last
    assert [o.num_cached_tokens for o in again] == [min(n // 16 * 16, n - 1) for n in lengths]
    assert sum(o.num_cached_tokens for o in first) > 0  # nested prompts hit within the batch
    assert_idle(llm)


def test_a_prompt_of_exactly_4_blocks_sent_twice(llm, llm_off, passage_ids):
    llm.reset_prefix_cache()
    prompt = passage_ids[500:564]
    (reference,) = llm_off.generate(prompt, GREEDY, use_tqdm=False)
    (first,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    (second,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 63
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference.outputs[0].token_ids
    assert_idle(llm)


def test_preemption_with_prefix_caching_matches_off(shared_prompts, expected):
    llm = LLM(dtype="float32", num_gpu_blocks=16)  # 256 slots for 11 prompts of up to 216 tokens
    outputs = llm.generate(shared_prompts, GREEDY, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] >= 1 and stats["prefix_cache_hits"] > 0, stats
    assert _token_ids(outputs) == expected
    assert_idle(llm)


def test_chunked_prefill_with_prefix_caching_matches_off(shared_prompts, expected):
    llm = LLM(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks=256)
    outputs = llm.generate(shared_prompts, GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats()["prefix_cache_hits"] > 0
    assert _token_ids(outputs) == expected
    assert_idle(llm)


def test_n_3_shares_cached_blocks_and_matches_off(llm, llm_off, shared_prompts):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = shared_prompts[:4]
    reference = _token_ids(llm_off.generate(prompts, params, use_tqdm=False))
    llm.reset_prefix_cache()
    for _ in range(2):  # a miss, then hits on blocks the forks of the first round filled
        assert _token_ids(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert_idle(llm)


def test_cache_salt_only_shares_blocks_between_equal_salts(llm, passage_ids):
    llm.reset_prefix_cache()
    prompt = passage_ids[200:300]  # 6 full blocks and 4 tokens

    def cached(salt):
        params = SamplingParams(temperature=0.0, max_tokens=4, cache_salt=salt)
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    assert [cached("tenant-a"), cached("tenant-b"), cached(None), cached("tenant-a")] == [0, 0, 0, 96]
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")
    with pytest.raises(ValueError, match="cache_salt must be valid Unicode"):  # was: the step loop died
        SamplingParams(cache_salt="tenant-\udfff")
    assert_idle(llm)


def test_stats_count_queries_hits_and_cached_blocks_and_reset_forgets(passage_ids):
    llm = LLM(dtype="float32", num_gpu_blocks=64)
    prompt = passage_ids[:40]  # 2 full blocks
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    stats = llm.llm_engine.stats()
    # the second request: 32 of its 40 tokens; blocks: 2 of the prompt, 1 filled by decode
    # (40 + 16 tokens, the last one never computed: 55 -> 3 full blocks each)
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (80, 32)
    assert stats["prefix_cache_hit_rate"] == 32 / 80
    assert stats["num_cached_blocks"] == stats["num_free_cached_blocks"] == 3
    assert stats["num_free_blocks"] == 64
    assert llm.reset_prefix_cache() is True
    (output,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert output.num_cached_tokens == 0
    assert_idle(llm)


def test_without_prefix_caching_nothing_is_cached(llm_off, shared_prompts):
    outputs = llm_off.generate(shared_prompts[:2] * 2, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0] * 4
    stats = llm_off.llm_engine.stats()
    assert stats["num_cached_blocks"] == stats["prefix_cache_queries"] == 0
    assert_idle(llm_off)


def _w3_requests() -> list[dict]:
    """The first 24 requests of w3_shared_prefix; where ../shared is absent (a clone
    elsewhere), 24 of the same shape: 6 prefixes of 384 random ids, 16-64 more each."""
    if W3.exists():
        return json.loads(W3.read_text())["requests"][:24]
    rng = random.Random(2)
    prefixes = [[rng.randrange(100, 49000) for _ in range(384)] for _ in range(6)]
    return [{"prompt_token_ids": prefixes[i % 6] + [rng.randrange(100, 49000) for _ in range(rng.randint(16, 64))]}
            for i in range(24)]


@pytest.mark.slow
def test_w3_shared_prefix_requests_match_prefix_caching_off(llm, llm_off):
    prompts = [r["prompt_token_ids"] for r in _w3_requests()]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    reference = _token_ids(llm_off.generate(prompts, params, use_tqdm=False))
    llm.reset_prefix_cache()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert _token_ids(outputs) == reference
    # every request after the first of its prefix finds at least the prefix's 24 blocks
    assert all(o.num_cached_tokens >= 384 for o in outputs[6:])
    assert_idle(llm)
