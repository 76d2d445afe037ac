"""Scheduler: admission, token budget, chunked prefill, preemption (no torch, no model).

A fake "model" samples token 7 for every request that asks for a sample.
"""
import subprocess
import sys

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelRunnerOutput, SampledToken


def make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                   max_model_len=64, enable_prefix_caching=False) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching))


def make_request(request_id, num_prompt_tokens, max_tokens=4, eos_token_id=None) -> Request:
    return Request(request_id=request_id, prompt=None,
                   prompt_token_ids=list(range(100, 100 + num_prompt_tokens)),
                   sampling_params=SamplingParams(max_tokens=max_tokens),
                   eos_token_id=eos_token_id, max_tokens=max_tokens)


def run_step(scheduler, token_id=7):
    output = scheduler.schedule()
    sampled = {s.seq_id: [SampledToken(token_id)] * s.num_samples for s in output.scheduled if s.do_sample}
    scheduler.update(output, ModelRunnerOutput(sampled))
    return output


def plan(output):
    return [(s.seq_id, len(s.token_ids), s.num_computed_tokens, s.block_table, s.do_sample)
            for s in output.scheduled]


def test_scheduler_and_block_manager_do_not_import_torch():
    code = "import sys, engine.scheduler, engine.block_manager; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_admits_by_free_blocks_in_arrival_order():
    s = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=32)
    for rid in "abc":
        s.add_request(make_request(rid, 6))  # 2 blocks each
    out = s.schedule()
    assert plan(out) == [("a", 6, 0, [0, 1], True), ("b", 6, 0, [2, 3], True)]
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.block_manager.num_free_blocks == 1


def test_decode_then_new_block_at_the_boundary():
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add_request(make_request("a", 3, max_tokens=5))
    assert plan(run_step(s)) == [("a", 3, 0, [0], True)]
    assert plan(run_step(s)) == [("a", 1, 3, [0], True)]        # position 3: still block 0
    assert plan(run_step(s)) == [("a", 1, 4, [0, 1], True)]     # position 4: a new block
    assert s.requests["a"].output_token_ids == [7, 7, 7]


def test_long_prompt_is_chunked_by_the_token_budget():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    s.add_request(make_request("a", 20))
    assert plan(run_step(s)) == [("a", 8, 0, [0, 1], False)]
    assert plan(run_step(s)) == [("a", 8, 8, [0, 1, 2, 3], False)]
    assert plan(run_step(s)) == [("a", 4, 16, [0, 1, 2, 3, 4], True)]
    assert s.requests["a"].output_token_ids == [7]


def test_running_decodes_come_before_new_prefills_within_the_budget():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    s.add_request(make_request("a", 2, max_tokens=8))
    s.add_request(make_request("b", 2, max_tokens=8))
    run_step(s)
    s.add_request(make_request("c", 30))
    out = run_step(s)
    assert [(r, n) for r, n, *_ in plan(out)] == [("a", 1), ("b", 1), ("c", 6)]
    out = run_step(s)  # c continues its prefill after the decodes
    assert [(r, n) for r, n, *_ in plan(out)] == [("a", 1), ("b", 1), ("c", 6)]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(num_blocks=32, max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 2))
    assert [p[0] for p in plan(s.schedule())] == ["a", "b"]
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_preemption_evicts_the_most_recently_admitted_and_requeues_it_first():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    s.add_request(make_request("a", 4, max_tokens=8))  # 1 block, then needs a 2nd
    s.add_request(make_request("b", 4, max_tokens=8))
    s.add_request(make_request("c", 4, max_tokens=8))
    s.add_request(make_request("d", 4, max_tokens=8))
    out = run_step(s)  # all four prefill, each in one block: the pool is full
    assert s.block_manager.num_free_blocks == 0
    out = run_step(s)  # a needs a block: d goes; b needs one: c goes
    assert out.preempted_seq_ids == ["d", "c"]
    assert plan(out) == [("a", 1, 4, [0, 3], True), ("b", 1, 4, [1, 2], True)]
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    assert all(s.requests[r].num_computed_tokens == 0 for r in "cd")
    assert s.requests["c"].status == RequestStatus.PREEMPTED
    assert s.num_preemptions == 2


def test_preempted_request_recomputes_its_prompt_and_output():
    s = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2)
    s.add_request(make_request("a", 4, max_tokens=8))
    s.add_request(make_request("b", 4, max_tokens=8))
    assert plan(run_step(s)) == [("a", 4, 0, [0], True), ("b", 4, 0, [1], True)]
    out = run_step(s)  # a takes the last free block; b needs one too and preempts itself
    assert out.preempted_seq_ids == ["b"]
    assert plan(out) == [("a", 1, 4, [0, 2], True)]
    b = s.requests["b"]
    assert b.output_token_ids == [7] and b.num_computed_tokens == 0
    while "a" in s.requests:
        run_step(s)
    # b returns with its prompt and its one generated token, and samples its second token
    # (in a's freed blocks, which returned to the head of the free queue)
    assert plan(run_step(s)) == [("b", 5, 0, [0, 2], True)]
    assert b.output_token_ids == [7, 7] and b.status == RequestStatus.RUNNING


def test_requests_that_can_never_fit_are_rejected_when_added():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add_request(make_request("empty", 0))
    with pytest.raises(ValueError, match=r"^prompt \(30 tokens\) \+ max_tokens \(3\) = 33 tokens exceeds "
                       r"max_model_len \(32\): max_tokens can be at most 2 after this prompt$"):
        s.add_request(make_request("long", 30, max_tokens=3))
    with pytest.raises(ValueError, match=r"^prompt \(32 tokens\) \+ max_tokens \(1\) = 33 tokens exceeds "
                       r"max_model_len \(32\)$"):  # no output token fits: nothing to suggest
        s.add_request(make_request("longer", 32, max_tokens=1))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks, more than the whole KV cache \(4 blocks"):
        s.add_request(make_request("big", 16, max_tokens=2))
    s.add_request(make_request("fits", 16, max_tokens=1))  # exactly 4 blocks: the pool
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("fits", 1))
    assert list(s.requests) == ["fits"]


def test_finish_and_abort_free_blocks():
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add_request(make_request("a", 5, max_tokens=2))
    s.add_request(make_request("b", 5, max_tokens=8))
    run_step(s)
    run_step(s)  # a reaches max_tokens
    assert "a" not in s.requests
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED).status.finish_reason == "abort"
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is None
    assert s.block_manager.num_free_blocks == 8 and not s.has_unfinished_requests()


def test_stop_reasons():
    s = make_scheduler()
    s.add_request(make_request("eos", 3, max_tokens=5, eos_token_id=7))
    r = s.requests["eos"]
    run_step(s)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [7]
    ignore = make_request("ignore", 3, max_tokens=2, eos_token_id=7)
    ignore.sampling_params.ignore_eos = True
    s.add_request(ignore)
    run_step(s)
    run_step(s)
    assert ignore.status == RequestStatus.FINISHED_LENGTH and ignore.output_token_ids == [7, 7]
    stop = make_request("stop", 3, max_tokens=5)
    stop.sampling_params.stop_token_ids = [7]
    s.add_request(stop)
    run_step(s)
    assert stop.status == RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_a_tiny_pool_never_spins_and_finishes_everything(enable_prefix_caching):
    # (every prompt starts with the same ids: with prefix caching, hits and evictions too)
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=8,
                       enable_prefix_caching=enable_prefix_caching)
    lengths = [1, 3, 4, 5, 9, 12, 2, 16, 7, 11]
    for i, n in enumerate(lengths):
        s.add_request(make_request(str(i), n, max_tokens=24 - n - 1 if n + 8 > 24 else 8))
    steps = 0
    while s.has_unfinished_requests():
        out = run_step(s)
        assert out.scheduled, "a step with unfinished requests scheduled nothing"
        steps += 1
        assert steps < 2000
    assert s.num_preemptions > 0
    assert s.block_manager.num_free_blocks == 6 and s.block_manager.block_tables == {}


def test_n_sequences_fork_after_the_prompt_and_share_its_blocks():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    request = make_request("r", 10, max_tokens=4)
    request.sampling_params.n = 3
    s.add_request(request)
    out = s.schedule()
    assert plan(out) == [("r", 10, 0, [0, 1, 2], True)] and out.scheduled[0].num_samples == 3
    s.update(out, ModelRunnerOutput({"r": [SampledToken(7), SampledToken(8), SampledToken(9)]}))
    assert [(r.seq_id, r.output_token_ids) for r in s.running] == [("r", [7]), ("r#1", [8]), ("r#2", [9])]
    bm = s.block_manager
    assert bm.block_tables == {"r": [0, 1, 2], "r#1": [0, 1, 2], "r#2": [0, 1, 2]}
    assert bm.ref_counts[:3] == [3, 3, 3] and bm.num_free_blocks == 13
    out = run_step(s)  # position 10 lies in the shared partial block 2: two copies, one in place
    assert out.blocks_to_copy == [(2, 3), (2, 4)]
    assert bm.block_tables == {"r": [0, 1, 3], "r#1": [0, 1, 4], "r#2": [0, 1, 2]}
    assert bm.ref_counts[:5] == [3, 3, 1, 1, 1] and bm.num_free_blocks == 11
    while s.has_unfinished_requests():
        run_step(s)
    assert bm.num_free_blocks == 16


def test_fork_ids_are_reserved_and_n_is_bounded_by_max_num_seqs():
    s = make_scheduler(max_num_seqs=4)
    request = make_request("r", 3)
    request.sampling_params.n = 2
    s.add_request(request)
    with pytest.raises(ValueError, match="'r#1' is already in use"):
        s.add_request(make_request("r#1", 3))
    big = make_request("big", 3)
    big.sampling_params.n = 5
    with pytest.raises(ValueError, match=r"n \(5\) exceeds max_num_seqs \(4\)"):
        s.add_request(big)
    s.finish_request("r", RequestStatus.FINISHED_ABORTED)  # before forking: releases r#1
    s.add_request(make_request("r#1", 3))
