"""Prefix caching in the scheduler: hits at admission and how they interplay with chunked
prefill, preemption, n > 1 forks, aborts, whole-prompt hits, a tiny pool and cache_salt.
Exact plans and block ids; no torch, no model (the fake model samples token 7).

Every step also runs the block manager's invariant check (tests/conftest.py turns it on),
which includes "no block written this step is shared or cached".
"""
import pytest

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ModelRunnerOutput, SampledToken
from tests.engine.test_scheduler import make_scheduler, plan, run_step

PROMPT = list(range(100, 112))  # 3 blocks of 4


def cached_scheduler(**kwargs):
    settings = {"num_blocks": 16, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 32,
                **kwargs}
    s = make_scheduler(enable_prefix_caching=True, **settings)
    assert s.block_manager.debug_checks
    return s


def req(request_id, token_ids, max_tokens=1, n=1, cache_salt=None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, n=n, cache_salt=cache_salt)
    return Request(request_id=request_id, prompt=None, prompt_token_ids=list(token_ids),
                   sampling_params=params, eos_token_id=None, max_tokens=max_tokens)


def run_all(s):
    while s.has_unfinished_requests():
        assert run_step(s).scheduled
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.block_tables == {}
    bm.check_invariants()


def test_a_second_request_starts_after_the_cached_blocks_of_its_prompt():
    s = cached_scheduler()
    s.add_request(req("a", PROMPT[:10]))
    assert plan(run_step(s)) == [("a", 10, 0, [0, 1, 2], True)]
    assert s.block_manager.num_cached_blocks == 2  # blocks 0 and 1 are full; 2 is not
    b = req("b", PROMPT[:10] + [50, 51, 52])
    s.add_request(b)
    assert plan(run_step(s)) == [("b", 5, 8, [0, 1, 2, 3], True)]
    assert b.num_cached_tokens == 8
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10 + 13, 8)
    run_all(s)


def test_requests_arriving_together_compute_a_shared_prefix_once():
    s = cached_scheduler()
    a, b, c = req("a", PROMPT, max_tokens=2), req("b", PROMPT + [1]), req("c", range(300, 304))
    for r in (a, b, c):
        s.add_request(r)
    # b's first block is being computed by a in this step: b waits (and c behind it)
    assert plan(run_step(s)) == [("a", 12, 0, [0, 1, 2], True)]
    assert plan(run_step(s)) == [("a", 1, 12, [0, 1, 2, 3], True), ("b", 1, 12, [0, 1, 2, 4], True),
                                 ("c", 4, 0, [5], True)]
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 12, 0)
    run_all(s)


def test_a_hit_ending_mid_budget_leaves_the_rest_of_the_budget_to_its_prefill_chunk():
    s = cached_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    s.add_request(req("a", PROMPT, max_tokens=8))
    assert plan(run_step(s)) == [("a", 8, 0, [0, 1], False)]
    assert plan(run_step(s)) == [("a", 4, 8, [0, 1, 2], True)]
    b = req("b", PROMPT + list(range(200, 210)))  # 22 tokens: 12 cached, 10 to compute
    s.add_request(b)
    # a decodes 1 token; b's 12 cached tokens cost no budget: it computes 7 of the 8
    assert plan(run_step(s)) == [("a", 1, 12, [0, 1, 2, 3], True), ("b", 7, 12, [0, 1, 2, 4, 5], False)]
    assert s.block_manager.ref_counts[:3] == [2, 2, 2]
    assert plan(run_step(s)) == [("a", 1, 13, [0, 1, 2, 3], True), ("b", 3, 19, [0, 1, 2, 4, 5, 6], True)]
    assert b.num_cached_tokens == 12
    run_all(s)


def test_a_preempted_request_finds_its_own_blocks_again():
    s = cached_scheduler(num_blocks=6, max_num_seqs=2)
    s.add_request(req("a", range(8), max_tokens=8))
    s.add_request(req("b", range(200, 208), max_tokens=8))
    assert plan(run_step(s)) == [("a", 8, 0, [0, 1], True), ("b", 8, 0, [2, 3], True)]
    for _ in range(4):  # positions 8..11: blocks 4 and 5, filled by decode and cached
        run_step(s)
    assert s.block_manager.num_cached_blocks == 6 and s.block_manager.num_free_blocks == 0
    out = run_step(s)  # a needs a block at position 12: b goes, its blocks free but cached
    assert out.preempted_seq_ids == ["b"] and plan(out) == [("a", 1, 12, [0, 1, 4, 5], True)]
    b = s.requests["b"]
    assert b.num_computed_tokens == 0 and b.num_tokens == 13
    while "a" in s.requests:
        run_step(s)
    # b's prompt blocks 2 and 3 survived; its decode-filled block 5 was evicted for a
    out = run_step(s)
    assert plan(out) == [("b", 5, 8, [2, 3, 5, 4], True)]
    assert b.num_cached_tokens == 0  # the first admission's count, as vLLM reports it
    assert s.prefix_cache_hits == 8 and s.num_preemptions == 1
    run_all(s)


def _prefill_and_fork_3(s, prompt, max_tokens):
    s.add_request(req("r", prompt, max_tokens=max_tokens, n=3))
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"r": [SampledToken(7), SampledToken(8), SampledToken(9)]}))
    return out


def test_forks_share_cached_prompt_blocks_and_copy_only_the_partial_one():
    s = cached_scheduler()
    assert plan(_prefill_and_fork_3(s, PROMPT[:10], max_tokens=4)) == [("r", 10, 0, [0, 1, 2], True)]
    bm = s.block_manager
    assert bm.ref_counts[:3] == [3, 3, 3] and bm.num_cached_blocks == 2
    out = run_step(s)  # position 10 is in the shared partial block 2: copied, never a cached one
    assert out.blocks_to_copy == [(2, 3), (2, 4)]
    assert bm.block_tables == {"r": [0, 1, 3], "r#1": [0, 1, 4], "r#2": [0, 1, 2]}
    q = req("q", PROMPT[:10], max_tokens=2)  # the same prompt, while the forks run
    s.add_request(q)
    assert plan(run_step(s)) == [("r", 1, 11, [0, 1, 3], True), ("r#1", 1, 11, [0, 1, 4], True),
                                 ("r#2", 1, 11, [0, 1, 2], True), ("q", 2, 8, [0, 1, 5], True)]
    assert bm.ref_counts[:2] == [4, 4] and q.num_cached_tokens == 8
    run_all(s)


def test_forks_of_a_prompt_of_whole_blocks_copy_nothing():
    s = cached_scheduler()
    _prefill_and_fork_3(s, PROMPT[:8], max_tokens=3)
    out = run_step(s)
    assert out.blocks_to_copy == [] and [x[3] for x in plan(out)] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    run_all(s)


def test_a_whole_prompt_of_full_blocks_recomputes_its_last_token_in_a_copy():
    s = cached_scheduler()
    s.add_request(req("a", PROMPT[:8]))
    run_step(s)
    b = req("b", PROMPT[:8], max_tokens=2)
    s.add_request(b)
    out = run_step(s)
    # blocks 0 and 1 hold all 8 tokens; the 8th is recomputed (its logits are needed) into
    # a copy of block 1, so the cached block 1 is never written in place
    assert plan(out) == [("b", 1, 7, [0, 2], True)] and out.blocks_to_copy == [(1, 2)]
    assert b.num_cached_tokens == 7
    bm = s.block_manager
    assert bm.cached_blocks[b.block_hashes[1]] == 1 and bm.block_hashes[2] is None
    run_all(s)
    assert bm.num_cached_blocks == 2


@pytest.mark.parametrize("when", ["waiting", "during-step", "mid-prefill", "decoding", "forked"])
def test_abort_at_any_point_frees_everything_and_keeps_the_cache_usable(when):
    s = cached_scheduler(max_num_batched_tokens=8)
    s.add_request(req("seed", PROMPT[:8]))
    run_all(s)
    victim = req("v", PROMPT + [1, 2, 3, 4, 5], max_tokens=4, n=2 if when == "forked" else 1)
    s.add_request(victim)  # 17 tokens: 8 cached, then chunks of 8 and 1
    pending = None
    if when == "during-step":  # admitted with its hit; aborted before the step's update
        pending = s.schedule()
        assert plan(pending) == [("v", 8, 8, [0, 1, 2, 3], False)]
    for _ in range({"mid-prefill": 1, "decoding": 3, "forked": 3}.get(when, 0)):
        run_step(s)
    assert victim.num_computed_tokens == {"waiting": 0, "during-step": 8, "mid-prefill": 16}.get(when, 17 + 1)
    if when == "forked":
        assert {"v", "v#1"} <= set(s.requests)
    for seq_id in [k for k in list(s.requests) if k.startswith("v")]:
        s.finish_request(seq_id, RequestStatus.FINISHED_ABORTED)
    if pending is not None:
        assert s.update(pending, ModelRunnerOutput()) == []
    s.block_manager.check_invariants()
    run_all(s)
    again = req("again", PROMPT[:8] + [0])
    s.add_request(again)
    run_all(s)
    assert again.num_cached_tokens == 8


def test_a_pool_too_small_to_keep_anything_cached_still_serves_everyone():
    s = cached_scheduler(num_blocks=2, max_num_seqs=1, max_num_batched_tokens=8)
    first, second = list(range(7)), list(range(500, 507))
    requests = [req(f"r{i}", first if i % 2 == 0 else second, max_tokens=2) for i in range(6)]
    for r in requests:
        s.add_request(r)
    run_all(s)
    # each request evicts the other prompt's blocks: nothing is ever found
    assert [r.num_cached_tokens for r in requests] == [0] * 6 and s.prefix_cache_hits == 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)


def test_cache_salt_separates_tenants():
    s = cached_scheduler()
    s.add_request(req("a", PROMPT, cache_salt="tenant-a"))
    run_all(s)
    others = [req("b", PROMPT, cache_salt="tenant-b"), req("none", PROMPT), req("a2", PROMPT, cache_salt="tenant-a")]
    for r in others:
        s.add_request(r)
        run_all(s)
    assert [r.num_cached_tokens for r in others] == [0, 0, 11]


def test_without_prefix_caching_nothing_is_looked_up():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    for rid in "ab":
        s.add_request(req(rid, PROMPT))
        run_all(s)
    assert s.requests == {} and (s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0)
    assert s.block_manager.num_cached_blocks == 0
