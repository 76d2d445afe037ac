"""AsyncLLM: streamed deltas, concurrency, cancellation, failures that spare the loop."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine import EngineConfig, SamplingParams
from engine.async_llm import AsyncLLM
from engine.errors import EngineDeadError, RequestFailedError
from engine.llm_engine import MAX_CONSECUTIVE_FAILED_STEPS
from engine.sampling_params import RequestOutputKind
from tests.engine.conftest import assert_idle, hold_the_second_step

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "def fibonacci(n):", "Once upon a time", "The three primary colours are"]


@pytest.fixture(scope="module")
def async_llm():
    engine = AsyncLLM(config=EngineConfig(dtype="float32"))
    yield engine
    engine.shutdown()


def greedy(max_tokens, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          output_kind=RequestOutputKind.DELTA, **kwargs)


async def collect(async_llm, prompt, params, request_id=None):
    texts, token_ids, finish = [], [], None
    async for out in async_llm.generate(prompt, params, request_id):
        texts.append(out.outputs[0].text)
        token_ids += out.outputs[0].token_ids
        finish = out.outputs[0].finish_reason
    return texts, token_ids, finish


async def wait_idle(async_llm, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = async_llm.stats()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle after {timeout}s: {async_llm.stats()}")


def test_deltas_concatenate_to_the_offline_output(async_llm, llm):
    async def main():
        return await collect(async_llm, PROMPTS[0], greedy(24))

    texts, token_ids, finish = asyncio.run(main())
    (offline,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert 1 < len(texts) <= len(token_ids)  # at most one output per step
    assert token_ids == offline.outputs[0].token_ids
    assert "".join(texts) == offline.outputs[0].text
    assert finish == offline.outputs[0].finish_reason
    assert_idle(_Wrap(async_llm))


def test_a_consumer_behind_the_loop_gets_the_steps_it_missed_as_one_output(async_llm, llm, monkeypatch):
    release = hold_the_second_step(monkeypatch, async_llm)

    async def main():
        outputs = async_llm.generate(PROMPTS[1], greedy(20))
        first = await anext(outputs)
        release.set()
        await wait_idle(async_llm, timeout=120)  # the request ran to its end while nobody read
        rest = [out async for out in outputs]
        return first, rest

    first, rest = asyncio.run(main())
    (offline,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert len(first.outputs[0].token_ids) == 1
    assert len(rest) == 1 and rest[0].finished
    assert first.outputs[0].token_ids + rest[0].outputs[0].token_ids == offline.outputs[0].token_ids
    assert first.outputs[0].text + rest[0].outputs[0].text == offline.outputs[0].text
    assert rest[0].outputs[0].finish_reason == offline.outputs[0].finish_reason


def test_a_consumer_behind_the_loop_gets_at_most_max_joined_values_per_output(async_llm, llm, monkeypatch):
    """What a slow consumer missed is joined only up to ``MAX_JOINED_VALUES`` token ids and
    logprob entries an output (here 12: 4 tokens, each with its top 2 logprobs, the sampled
    token's among them), so that an output crossing between processes stays within gRPC's message limit."""
    monkeypatch.setattr("engine.outputs.MAX_JOINED_VALUES", 12)
    release = hold_the_second_step(monkeypatch, async_llm)

    async def main():
        outputs = async_llm.generate(PROMPTS[1], greedy(20, logprobs=2, ignore_eos=True))
        first = await anext(outputs)
        release.set()
        await wait_idle(async_llm, timeout=120)
        return [first] + [out async for out in outputs]

    outputs = asyncio.run(main())
    (offline,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                              use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [1, 4, 4, 4, 4, 3]
    assert [out.num_values() for out in outputs] == [3, 12, 12, 12, 12, 9]
    assert [out.finished for out in outputs] == [False] * 5 + [True]
    assert [t for out in outputs for t in out.outputs[0].token_ids] == offline.outputs[0].token_ids
    assert "".join(out.outputs[0].text for out in outputs) == offline.outputs[0].text


def test_concurrent_requests_each_match_their_solo_run(async_llm, llm):
    async def main():
        return await asyncio.gather(*(collect(async_llm, p, greedy(16)) for p in PROMPTS))

    results = asyncio.run(main())
    solo = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert [r[1] for r in results] == [o.outputs[0].token_ids for o in solo]
    assert_idle(_Wrap(async_llm))


def test_cancelling_the_consumer_aborts_and_frees_blocks(async_llm):
    async def main():
        first = asyncio.Event()

        async def consume(i):
            async for _ in async_llm.generate(PROMPTS[i], greedy(500, ignore_eos=True)):
                first.set()

        tasks = [asyncio.create_task(consume(i)) for i in range(4)]
        await first.wait()
        assert async_llm.stats()["num_running"] >= 1
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return await wait_idle(async_llm)

    stats = asyncio.run(main())
    assert stats["num_waiting"] == 0


def test_invalid_request_raises_value_error_and_the_loop_goes_on(async_llm):
    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await collect(async_llm, [], greedy(4))
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(async_llm, [1] * 10, greedy(9000))
        return await collect(async_llm, PROMPTS[2], greedy(4))

    texts, token_ids, finish = asyncio.run(main())
    assert len(token_ids) == 4 and finish == "length"
    async_llm.check_health()


def test_a_failing_step_fails_only_its_requests(async_llm, monkeypatch):
    runner = async_llm.engine.model_runner
    real_execute = runner.execute
    calls = {"n": 0}

    def execute_failing_once(output):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real_execute(output)

    monkeypatch.setattr(runner, "execute", execute_failing_once)

    async def main():
        with pytest.raises(RequestFailedError, match="RuntimeError: injected fault"):
            await collect(async_llm, PROMPTS[3], greedy(8))
        return await collect(async_llm, PROMPTS[3], greedy(8))

    texts, token_ids, finish = asyncio.run(main())
    assert len(token_ids) == 8
    async_llm.check_health()
    assert_idle(_Wrap(async_llm))


def test_a_scheduling_fault_fails_the_requests_in_flight_and_the_loop_goes_on(async_llm, monkeypatch):
    scheduler = async_llm.engine.scheduler
    real_schedule = scheduler.schedule
    fired = []

    def schedule_failing_once():
        if not fired and len(scheduler.requests) == 3:  # once all three are in
            fired.append(True)
            raise RuntimeError("injected scheduler fault")
        return real_schedule()

    monkeypatch.setattr(scheduler, "schedule", schedule_failing_once)

    async def main():
        failed = await asyncio.gather(*(collect(async_llm, p, greedy(8)) for p in PROMPTS[:3]),
                                      return_exceptions=True)
        return failed, await collect(async_llm, PROMPTS[3], greedy(8))

    failed, (texts, token_ids, finish) = asyncio.run(main())
    assert [str(e) for e in failed] == ["RuntimeError: injected scheduler fault"] * 3
    assert all(isinstance(e, RequestFailedError) for e in failed)
    assert len(token_ids) == 8 and finish == "length"
    async_llm.check_health()
    assert_idle(_Wrap(async_llm))


def test_a_dead_loop_is_reported():
    """A fault that every step meets stops the loop after MAX_CONSECUTIVE_FAILED_STEPS
    failed steps; the health check and every later call report it."""
    engine = AsyncLLM(config=EngineConfig(model="dummy:tiny-llama", dtype="float32"))

    def broken_schedule():
        raise RuntimeError("scheduler bug")

    engine.engine.scheduler.schedule = broken_schedule

    async def main():
        for _ in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
            with pytest.raises(RequestFailedError, match="RuntimeError: scheduler bug"):
                await collect(engine, [1, 2, 3], greedy(4))
        engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2, 3], greedy(4))
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2, 3], greedy(4))

    asyncio.run(main())
    with pytest.raises(EngineDeadError, match="scheduler bug"):
        engine.check_health()


class _Wrap:
    """Lets ``assert_idle`` read an AsyncLLM's engine like an ``LLM``'s."""

    def __init__(self, async_llm):
        self.llm_engine = async_llm.engine
