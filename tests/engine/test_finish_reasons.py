"""When the token that reaches ``max_tokens`` also ends the sequence otherwise (it completes a
stop string, or is a stop token or EOS), the stop wins: ``finish_reason`` 'stop' with its
``stop_reason``, for every sequence of the request, whatever the output kind."""
import pytest

from engine import SamplingParams
from engine.sampling_params import RequestOutputKind

COUNT = "Count: 1, 2, 3, 4,"  # greedy: " " then "5" (token 37)
YES = [{"role": "user", "content": "Say only the word yes."}]  # greedy: "Yes", ".", EOS


def _finals(llm, prompt, **params):
    output = llm.generate(prompt, SamplingParams(temperature=0, **params), use_tqdm=False)[0]
    return [(c.text, len(c.token_ids), c.finish_reason, c.stop_reason) for c in output.outputs]


@pytest.mark.parametrize("n", [1, 3])
def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm, n):
    assert _finals(llm, COUNT, max_tokens=2, stop=["5"], n=n) == [(" ", 2, "stop", "5")] * n
    assert _finals(llm, COUNT, max_tokens=2, stop=["5"], n=n, include_stop_str_in_output=True) \
        == [(" 5", 2, "stop", "5")] * n
    assert _finals(llm, COUNT, max_tokens=1, stop=["5"], n=n) == [(" ", 1, "length", None)] * n


@pytest.mark.parametrize("n", [1, 3])
def test_a_stop_token_or_eos_as_the_last_allowed_token_is_a_stop(llm, n):
    """The stop token's id is in token_ids and its text is not in the output unless
    include_stop_str_in_output, as vLLM V1's detokenizer (a trial found "<|im_end|>" at the
    end of a guided_choice answer with skip_special_tokens false)."""
    assert _finals(llm, COUNT, max_tokens=2, stop_token_ids=[37], n=n) == [(" ", 2, "stop", 37)] * n
    assert _finals(llm, COUNT, max_tokens=2, stop_token_ids=[37], n=n, include_stop_str_in_output=True) \
        == [(" 5", 2, "stop", 37)] * n
    for options, text in (({}, "Yes."), ({"skip_special_tokens": False}, "Yes."),
                          ({"skip_special_tokens": False, "include_stop_str_in_output": True}, "Yes.<|im_end|>")):
        replies = llm.chat(YES, SamplingParams(temperature=0, max_tokens=3, n=n, **options), use_tqdm=False)[0].outputs
        assert [(c.text, c.token_ids[-1], c.finish_reason, c.stop_reason) for c in replies] \
            == [(text, 2, "stop", None)] * n


def test_the_stop_wins_with_min_tokens(llm):
    assert _finals(llm, COUNT, max_tokens=2, min_tokens=1, stop=["5"]) == [(" ", 2, "stop", "5")]
    # vLLM V1's: no stop string within the first min_tokens tokens ("5" is the second)
    assert _finals(llm, COUNT, max_tokens=2, min_tokens=2, stop=["5"]) == [(" 5", 2, "length", None)]
    replies = llm.chat(YES, SamplingParams(temperature=0, max_tokens=3, min_tokens=2), use_tqdm=False)
    assert [(c.finish_reason, c.stop_reason) for c in replies[0].outputs] == [("stop", None)]


def test_streamed_deltas_end_with_the_stop(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, stop=["5"], n=3, output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta-stop", COUNT, params)
    last = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                last[completion.index] = (completion.finish_reason, completion.stop_reason)
    assert last == {0: ("stop", "5"), 1: ("stop", "5"), 2: ("stop", "5")}
