"""The dashboard's view of the engine (engine.snapshot): exact block states, block tables,
prefix-cache hits per block, per-sequence preemptions; snapshots taken on the driving thread."""
from __future__ import annotations

import asyncio
import threading

from engine import LLM, SamplingParams
from engine.async_llm import AsyncLLM
from engine.block_manager import BlockManager
from engine.snapshot import SnapshotChannel, engine_snapshot
from tests.engine.conftest import hold_the_second_step
from tests.engine.test_block_manager import _hashes, _run
from tests.engine.test_scheduler import make_request, make_scheduler, run_step

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_hits_count_admissions_of_a_cached_block_and_reset_when_it_is_evicted():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10, 19))  # 2 full blocks (cached) and a partial one
    _run(bm, "a", prompt)
    bm.free("a")
    for seq_id in ("b", "c"):
        _run(bm, seq_id, prompt + [1], hits=bm.find_cached_prefix(_hashes(prompt)))
    assert bm.hit_counts == [2, 2, 0, 0]
    bm.free("b")
    bm.free("c")
    bm.allocate("d", 16)  # the whole pool: evicts both cached blocks
    assert bm.hit_counts == [0, 0, 0, 0] and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_reset_prefix_cache_clears_hits():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    _run(bm, "a", [1, 2, 3, 4, 5])
    _run(bm, "b", [1, 2, 3, 4, 6], hits=bm.find_cached_prefix(_hashes([1, 2, 3, 4])))
    assert bm.hit_counts[0] == 1
    bm.reset_prefix_cache()
    assert bm.hit_counts == [0, 0, 0, 0]
    bm.check_invariants()


def test_check_invariants_refuses_hits_on_an_uncached_block():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    bm.hit_counts[1] = 3
    try:
        bm.check_invariants()
    except AssertionError as exc:
        assert "blocks [1] count hits but are not cached" in str(exc)
    else:
        raise AssertionError("check_invariants passed")


def test_each_sequence_counts_its_own_preemptions():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    for request_id in "abcd":
        s.add_request(make_request(request_id, 4, max_tokens=8))
    run_step(s)
    run_step(s)  # a and b each need a block: d, then c, are preempted
    assert {r: s.requests[r].num_preemptions for r in "abcd"} == {"a": 0, "b": 0, "c": 1, "d": 1}
    assert s.num_preemptions == 2


def test_snapshot_of_a_running_request_has_its_exact_blocks_and_counts():
    llm = LLM(dtype="float32", num_gpu_blocks=16, block_size=16, enable_prefix_caching=True)
    engine = llm.llm_engine
    prompt = list(range(1000, 1040))  # 40 tokens: blocks 0, 1 full, 2 partial
    engine.add_request("r0", prompt, GREEDY)
    engine.add_request("r1", list(range(2000, 2010)), GREEDY)
    snapshot = engine_snapshot(engine)
    assert snapshot["blocks"]["ref_counts"] == [0] * 16
    assert [r["request_id"] for r in snapshot["waiting"]] == ["r0", "r1"] and snapshot["running"] == []
    engine.step()  # both prefilled in one step
    snapshot = engine_snapshot(engine)
    assert snapshot["block_size"] == 16 and snapshot["waiting"] == []
    assert snapshot["running"][0] == {
        "request_id": "r0", "seq_id": "r0", "status": "running", "num_prompt_tokens": 40,
        "num_computed_tokens": 40, "num_output_tokens": 1, "max_tokens": 4, "num_cached_tokens": 0,
        "num_preemptions": 0, "arrival_time": snapshot["running"][0]["arrival_time"],
        "block_table": [0, 1, 2]}
    assert snapshot["running"][1]["block_table"] == [3]
    assert snapshot["blocks"]["ref_counts"] == [1, 1, 1, 1] + [0] * 12
    assert snapshot["blocks"]["cached"] == [0, 1] and snapshot["blocks"]["hits"] == {}
    assert snapshot["stats"]["num_free_blocks"] == 12 and snapshot["stats"]["num_generation_tokens"] == 2
    while engine.has_unfinished_requests():
        engine.step()
    # the same prompt again: it finds blocks 0 and 1 in the cache
    engine.add_request("r2", prompt, GREEDY)
    engine.step()
    snapshot = engine_snapshot(engine)
    assert snapshot["running"][0]["num_cached_tokens"] == 32
    assert snapshot["running"][0]["block_table"][:2] == [0, 1]
    assert snapshot["blocks"]["hits"] == {0: 1, 1: 1}
    assert snapshot["stats"]["num_generation_tokens"] == 9
    while engine.has_unfinished_requests():
        engine.step()


def test_channel_answers_on_the_driving_thread_between_steps():
    """While a thread drives the engine, a request waits for its serve(); the snapshot is
    taken there, not on the caller's thread."""
    bm = BlockManager(num_blocks=2, block_size=4)
    engine = _FakeEngine(bm)
    channel = SnapshotChannel(engine)
    assert channel.request().result(timeout=0)["blocks"]["ref_counts"] == [0, 0]  # nobody drives it
    assert engine.threads == {"MainThread"}
    engine.threads.clear()
    started, step = threading.Event(), threading.Event()

    def drive():
        with channel.driving():
            started.set()
            step.wait(10)
            bm.allocate("a", 4)
            channel.serve()

    thread = threading.Thread(target=drive, name="driver")
    thread.start()
    started.wait(10)
    future = channel.request()
    assert not future.done()
    step.set()
    assert future.result(timeout=10)["blocks"]["ref_counts"] == [1, 0]
    thread.join(10)
    assert engine.threads == {"driver"}


def test_async_llm_snapshot_while_idle_and_while_a_request_runs(monkeypatch):
    async def main():
        llm = AsyncLLM(engine=LLM(dtype="float32", num_gpu_blocks=8, block_size=16).llm_engine)
        release = hold_the_second_step(monkeypatch, llm)  # the first snapshot sees it running
        try:
            idle = await llm.snapshot()
            assert idle["blocks"]["ref_counts"] == [0] * 8 and idle["running"] == []
            seen = []
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            async for _ in llm.generate(list(range(500, 520)), params, "q"):
                seen.append(await llm.snapshot())
                release.set()
            running = [s for s in seen if s["running"]]
            assert running and all(s["running"][0]["block_table"] == [0, 1] for s in running)
            assert (await llm.snapshot())["blocks"]["ref_counts"] == [0] * 8
        finally:
            llm.shutdown()

    asyncio.run(main())


class _FakeEngine:
    """What engine_snapshot reads, over a bare BlockManager, recording the reading thread."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.scheduler = type("S", (), {"running": [], "waiting": []})()
        self.threads: set[str] = set()

    def stats(self) -> dict:
        self.threads.add(threading.current_thread().name)
        return {}
