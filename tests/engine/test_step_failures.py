"""A step that raises fails what it can be tied to and spares the rest (``LLMEngine.step``):
one request for a fault in its token's bookkeeping or its output, every request for a fault
in scheduling, and the exception stops the engine only when the engine cannot be trusted
(blocks still held) or the fault repeats."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import MAX_CONSECUTIVE_FAILED_STEPS
from engine.sampling_params import RequestOutputKind
from tests.engine.conftest import assert_idle

PROMPTS = {"a": [5, 6, 7, 8, 9], "bad": [11, 12, 13], "c": list(range(20, 60))}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:tiny-llama", dtype="float32", enforce_eager=True, num_gpu_blocks=64)


@pytest.fixture(scope="module")
def expected(llm) -> dict[str, list[int]]:
    """Each prompt's greedy tokens with no fault."""
    outputs = llm.generate(list(PROMPTS.values()), GREEDY, use_tqdm=False)
    return {name: o.outputs[0].token_ids for name, o in zip(PROMPTS, outputs, strict=True)}


def run(engine, prompts=PROMPTS) -> dict[str, list]:
    """Add ``prompts`` under their names and step until none is left: every output by name."""
    for name, ids in prompts.items():
        engine.add_request(name, ids, GREEDY)
    outputs = {name: [] for name in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def token_ids(outputs) -> list[int]:
    return [t for o in outputs for c in o.outputs for t in c.token_ids]


def test_a_fault_recording_one_requests_token_fails_that_request_only(llm, expected, monkeypatch):
    processor = llm.llm_engine.output_processor
    real_add_token = processor.add_token
    calls = {"bad": 0}

    def add_token(sequence, token):
        if sequence.request_id == "bad":
            calls["bad"] += 1
            if calls["bad"] == 3:
                raise RuntimeError("injected detokenizer fault")
        return real_add_token(sequence, token)

    monkeypatch.setattr(processor, "add_token", add_token)
    outputs = run(llm.llm_engine)
    final = outputs["bad"][-1]
    assert final.finished and final.error == "RuntimeError: injected detokenizer fault"
    assert calls["bad"] == 3  # not called again after the fault
    for name in ("a", "c"):
        assert outputs[name][-1].error is None
        assert token_ids(outputs[name]) == expected[name]
        assert outputs[name][-1].outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_a_fault_building_one_requests_output_fails_that_request_only(llm, expected, monkeypatch):
    processor = llm.llm_engine.output_processor
    real_make_output = processor._make_output
    calls = {"bad": 0}

    def make_output(state):
        if state.request_id == "bad":
            calls["bad"] += 1
            if calls["bad"] == 2:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_make_output(state)

    monkeypatch.setattr(processor, "_make_output", make_output)
    outputs = run(llm.llm_engine)
    final = outputs["bad"][-1]
    assert final.finished and final.outputs == []
    assert final.error.startswith("UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff")
    assert len(outputs["bad"]) == 2  # its first token, then the error
    assert processor.pop_failed() == {} and "bad" not in processor.states
    for name in ("a", "c"):
        assert token_ids(outputs[name]) == expected[name]
    assert_idle(llm)


def test_an_abort_builds_its_own_output_only(llm, monkeypatch):
    """Another request's news held back by stream_interval is not built during an abort: a
    fault building it reaches that request's client at the next step (it was lost before)."""
    engine, processor = llm.llm_engine, llm.llm_engine.output_processor
    monkeypatch.setattr(processor, "stream_interval", 4)
    for name in ("a", "b"):
        engine.add_request(name, PROMPTS[name if name == "a" else "c"], GREEDY)
    for _ in range(3):  # the first token each, then two held back
        engine.step()
    assert processor.states["b"].changed
    real_held_back = processor._held_back

    def held_back(state):
        if state.request_id == "b":
            raise RuntimeError("injected fault in b's output")
        return real_held_back(state)

    monkeypatch.setattr(processor, "_held_back", held_back)
    aborted = engine.abort_request("a")
    assert aborted.request_id == "a" and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert "b" in processor.states and engine.has_unfinished_requests()
    (failed,) = engine.step()
    assert failed.request_id == "b" and failed.finished and failed.error == "RuntimeError: injected fault in b's output"
    assert_idle(llm)


def test_a_scheduling_fault_fails_every_request_and_the_engine_serves_on(llm, expected, monkeypatch):
    scheduler = llm.llm_engine.scheduler
    real_schedule = scheduler.schedule
    calls = {"n": 0}

    def schedule():
        calls["n"] += 1
        if calls["n"] == 4:  # mid-way: every request holds blocks
            assert llm.llm_engine.stats()["num_free_blocks"] < 64
            raise KeyError("injected scheduler fault")
        return real_schedule()

    monkeypatch.setattr(scheduler, "schedule", schedule)
    outputs = run(llm.llm_engine)
    for name in PROMPTS:
        final = outputs[name][-1]
        assert final.finished and final.error == "KeyError: 'injected scheduler fault'", name
        assert len(token_ids(outputs[name])) < GREEDY.max_tokens
    assert_idle(llm)
    # The next requests are served as if nothing happened.
    outputs = run(llm.llm_engine)
    assert {name: token_ids(outputs[name]) for name in PROMPTS} == expected
    assert_idle(llm)


def test_a_repeated_scheduling_fault_stops_the_engine(llm, monkeypatch):
    def schedule():
        raise RuntimeError("persistent scheduler bug")

    engine = llm.llm_engine
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    for _ in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        engine.add_request("a", PROMPTS["a"], GREEDY)
        (output,) = engine.step()
        assert output.error == "RuntimeError: persistent scheduler bug"
    engine.add_request("a", PROMPTS["a"], GREEDY)
    with pytest.raises(RuntimeError, match="persistent scheduler bug"):
        engine.step()
    # (the engine is not trusted after this; the test's engine is cleaned up for the next)
    monkeypatch.undo()
    engine.abort_request("a")
    engine._num_failed_steps = 0
    assert_idle(llm)


def test_a_fault_that_leaves_blocks_in_use_stops_the_engine(llm, monkeypatch):
    engine = llm.llm_engine
    real_schedule = engine.scheduler.schedule
    calls = {"n": 0}

    def schedule():
        calls["n"] += 1
        if calls["n"] == 3:
            monkeypatch.setattr(engine.block_manager, "free", lambda seq_id: None)  # a leak
            raise RuntimeError("scheduler bug with a leak")
        return real_schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.step()
    engine.step()
    with pytest.raises(RuntimeError, match="scheduler bug with a leak") as raised:
        engine.step()
    assert "KV blocks still in use after failing every request" in str(raised.value.__cause__)
    monkeypatch.undo()
    for seq_id in list(engine.block_manager.block_tables):  # clean up for the next test
        engine.block_manager.free(seq_id)
    engine._num_failed_steps = 0
    assert_idle(llm)
