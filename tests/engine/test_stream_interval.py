"""``stream_interval`` (vLLM's setting): a streamed request's first token at once, then one
record per ``stream_interval`` tokens, and the rest when it finishes; nothing lost."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import SchedulerConfig
from engine.sampling_params import RequestOutputKind
from tests.engine.conftest import assert_idle


def _stream(engine, request_id, prompt, **params):
    engine.add_request(request_id, prompt, SamplingParams(
        temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **params))
    records = []
    while engine.has_unfinished_requests():
        records += [o for o in engine.step() if o.request_id == request_id]
    return records


def test_records_come_every_stream_interval_tokens_and_join_to_the_whole_output(mixed_prompts):
    llm = LLM(dtype="float32", stream_interval=4)
    prompt = mixed_prompts[5]
    (whole,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    records = _stream(llm.llm_engine, "s", prompt, max_tokens=10)
    assert [len(r.outputs[0].token_ids) for r in records] == [1, 4, 4, 1]
    assert [r.finished for r in records] == [False, False, False, True]
    assert sum((r.outputs[0].token_ids for r in records), []) == whole.outputs[0].token_ids
    assert "".join(r.outputs[0].text for r in records) == whole.outputs[0].text
    assert records[-1].outputs[0].finish_reason == "length"
    # max_tokens 9 ends on a full interval: no empty record after it
    assert [len(r.outputs[0].token_ids) for r in _stream(llm.llm_engine, "t", prompt, max_tokens=9)] == [1, 4, 4]
    assert_idle(llm)


def test_the_default_streams_every_token(llm, mixed_prompts):
    records = _stream(llm.llm_engine, "d", mixed_prompts[5], max_tokens=5)
    assert [len(r.outputs[0].token_ids) for r in records] == [1, 1, 1, 1, 1]


def test_stream_interval_below_1_is_refused_with_its_name():
    with pytest.raises(ValueError, match="stream_interval must be >= 1; got 0"):
        SchedulerConfig(stream_interval=0)
