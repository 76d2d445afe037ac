"""Sampling through the engine: seeds, n > 1 sharing blocks, stop strings, logprobs."""
import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampling_params import RequestOutputKind
from tests.engine.conftest import assert_idle

PROMPT = "Tell me a story about a dragon."


def texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


def test_a_seed_repeats_alone_in_a_mixed_batch_and_on_a_rerun(llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=24)
    (alone,) = llm.generate(PROMPT, seeded, use_tqdm=False)
    others = [SamplingParams(temperature=1.0, max_tokens=24), SamplingParams(temperature=0.7, seed=7, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=10)]
    prompts = [PROMPT, "Once upon a time", PROMPT, "The weather today", PROMPT, "Hi", "Why is the sky blue?", PROMPT]
    params = [others[0], others[1], seeded, others[2], others[0], others[1], others[2], seeded]
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert batch[2].outputs[0].text == batch[7].outputs[0].text == alone.outputs[0].text
    assert batch[2].outputs[0].token_ids == alone.outputs[0].token_ids
    (rerun,) = llm.generate(PROMPT, seeded, use_tqdm=False)
    assert rerun.outputs[0].token_ids == alone.outputs[0].token_ids
    (other_seed,) = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=43, max_tokens=24), use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids
    # vLLM's range is a signed 64-bit integer: a negative seed repeats too, and is a seed of its own
    negative = SamplingParams(temperature=1.0, seed=-42, max_tokens=24)
    first, second = (llm.generate(PROMPT, negative, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2))
    assert first == second and first != alone.outputs[0].token_ids
    assert_idle(llm)


def test_n_completions_repeat_with_a_seed_and_differ_from_each_other(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16)
    (first,) = llm.generate(PROMPT, params, use_tqdm=False)
    (second,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert_idle(llm)


def test_n_shares_the_prompt_blocks_and_copies_only_the_partial_one():
    llm = LLM(dtype="float32", num_gpu_blocks=64)
    engine = llm.llm_engine
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 and one partial
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8,
                                                   ignore_eos=True))
    engine.step()  # prefill once, fork into 3 sequences
    bm = engine.block_manager
    assert bm.num_free_blocks == 64 - 3
    table = bm.block_table("r")
    assert [bm.ref_counts[b] for b in table] == [3, 3, 3]
    engine.step()  # each sequence writes position 40 in the partial block: 2 copies
    assert bm.num_free_blocks == 64 - 5
    assert [bm.ref_counts[b] for b in table[:2]] == [3, 3]
    assert {tuple(bm.block_table(s)[:2]) for s in ("r", "r#1", "r#2")} == {tuple(table[:2])}
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(llm)


def test_n_greedy_sequences_equal_one_greedy_sequence(llm):
    (out,) = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=12), use_tqdm=False)
    (single,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == single.outputs[0].token_ids


def test_streamed_deltas_and_final_text_agree_with_a_stop_string(llm):
    prompt = "Count from 1 to 20: 1, 2, 3,"
    params = dict(temperature=0, max_tokens=40, stop=[" 9,"])
    (final,) = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == " 9,"
    assert final.outputs[0].text.endswith(" 8,") and " 9" not in final.outputs[0].text
    engine = llm.llm_engine
    engine.add_request("s", prompt, SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].text for o in engine.step()]
    assert "".join(deltas) == final.outputs[0].text
    assert_idle(llm)


def test_held_back_text_is_released_when_max_tokens_ends_the_request(llm):
    prompt = "Count from 1 to 20: 1, 2, 3,"
    (plain,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert plain.outputs[0].text == " 4, 5,"  # " ", "4", ",", " ", "5", ","
    # " 5, 6" would stop; the text ends in " 5," which could grow into it: held, then released
    engine = llm.llm_engine
    engine.add_request("h", prompt, SamplingParams(temperature=0, max_tokens=6, stop=[" 5, 6"],
                                                   output_kind=RequestOutputKind.DELTA))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [(o.outputs[0].text, o.finished) for o in engine.step()]
    assert deltas[-1] == (" 5,", True)
    assert "".join(t for t, _ in deltas[:-1]) == " 4,"
    assert "".join(t for t, _ in deltas) == plain.outputs[0].text


def test_stop_token_ids_and_logprobs(llm):
    greedy_params = dict(temperature=0, max_tokens=10, ignore_eos=True)
    (greedy,) = llm.generate(PROMPT, SamplingParams(**greedy_params), use_tqdm=False)
    ids = greedy.outputs[0].token_ids
    stop_at = next(i for i in range(2, 10) if ids[i] not in ids[:i])
    (out,) = llm.generate(PROMPT, SamplingParams(**greedy_params, stop_token_ids=[ids[stop_at]], logprobs=3),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == ids[stop_at]
    assert c.token_ids == ids[:stop_at + 1]
    assert len(c.logprobs) == stop_at + 1
    for token_id, entry in zip(c.token_ids, c.logprobs, strict=True):
        first = next(iter(entry))
        assert first == token_id and entry[token_id].rank == 1  # greedy picks rank 1
        values = [lp.logprob for lp in entry.values()]
        assert values == sorted(values, reverse=True) and len(entry) == 3
    chosen = [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)]
    assert c.cumulative_logprob == pytest.approx(sum(chosen))
    assert out.metrics.first_token_time >= out.metrics.arrival_time
    assert out.metrics.last_token_time >= out.metrics.first_token_time


def test_invalid_parameters_name_the_field_and_range():
    cases = [(dict(temperature=-1), "temperature must be a finite number >= 0"),
             (dict(temperature=float("inf")), "temperature must be a finite number"),
             (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
             (dict(top_k=-2), "top_k must be"), (dict(n=0), r"n must be an integer in \[1, 128\]"),
             (dict(max_tokens=0), "max_tokens must be >= 1"), (dict(min_p=2), r"min_p must be in \[0, 1\]"),
             (dict(presence_penalty=3), r"presence_penalty must be in \[-2, 2\]"),
             (dict(repetition_penalty=1e-45), r"repetition_penalty must be in \[0.01, 100\]"),
             (dict(logprobs=21), r"logprobs must be in \[0, 20\]"),
             (dict(stop=[""]), "stop must be at most 16 non-empty strings"),
             (dict(stop=["ok", "\ud800"]), r"stop must be valid Unicode \(a lone surrogate has no UTF-8"),
             (dict(logit_bias={1: 101}), r"bias in \[-100, 100\]"),
             (dict(min_tokens=5, max_tokens=4), r"min_tokens must be >= 0 and <= max_tokens \(4\)"),
             (dict(seed=2**63), r"seed must be in \[-2\*\*63, 2\*\*63\)"),
             (dict(seed=-2**63 - 1), r"seed must be in \[-2\*\*63, 2\*\*63\)")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    # a trial: logprobs=1.5 failed the step with torch.topk's TypeError, max_tokens=1.5 gave 2 tokens
    (dict(logprobs=1.5), "logprobs must be an integer or None; got 1.5"),
    (dict(max_tokens=1.5), "max_tokens must be an integer or None; got 1.5"),
    (dict(min_tokens=2.5), "min_tokens must be an integer; got 2.5"),
    (dict(seed="7"), "seed must be an integer or None; got '7'"),
    (dict(n=True), "n must be an integer; got True"),
    (dict(prompt_logprobs=1.0), "prompt_logprobs must be an integer or None; got 1.0"),
    (dict(temperature="0.5"), "temperature must be a number; got '0.5'"),
    (dict(top_p=None), "top_p must be a number; got None"),
    (dict(skip_special_tokens="no"), r"skip_special_tokens must be a bool \(True or False\); got 'no'"),
    (dict(stop=5), "stop must be a string or a list of strings; got 5"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids; got 5"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must be a list of token ids"),
    (dict(logit_bias={"x": 1}), "logit_bias must be a map of token id to a number"),
    (dict(logit_bias={1: "2"}), "logit_bias must be a map of token id to a number"),
    (dict(output_kind=1), "output_kind must be a RequestOutputKind; got 1"),
])
def test_a_value_of_the_wrong_type_names_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=f"^{message}") as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))


def test_numbers_of_any_kind_become_the_fields_type():
    params = SamplingParams(max_tokens=np.int64(5), seed=np.int32(-3), temperature=1, top_p=np.float32(0.5),
                            logit_bias={"42": 1, 7: -2}, stop=("a", "b"))
    assert (params.max_tokens, params.seed, params.temperature, params.top_p) == (5, -3, 1.0, 0.5)
    assert [type(v) for v in (params.max_tokens, params.seed, params.temperature, params.top_p)] == \
        [int, int, float, float]
    assert (params.logit_bias, params.stop) == ({42: 1.0, 7: -2.0}, ["a", "b"])


def test_a_prompt_or_a_conversation_of_another_type_names_the_field(llm):
    for prompt in (5, [None], {"x": 1}, None):
        with pytest.raises(InvalidRequestError, match=r"^prompt") as info:
            llm.generate(prompt, use_tqdm=False)
        assert info.value.param == "prompt"
    cases = [("hi", "messages"), ([], "messages"), ([{"content": "x"}], "messages[0]"),
             ([{"role": "system", "content": "Be brief."}, {"role": "user"}], "messages[1].content"),
             ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content")]
    for messages, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            llm.chat(messages, use_tqdm=False)
        assert info.value.param == param, messages
    assert_idle(llm)


def test_text_parts_are_joined_as_the_http_api_joins_them(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+"}, {"type": "text", "text": "2?"}]}]
    joined = [{"role": "user", "content": "What is 2+2?"}]
    assert llm.chat(parts, greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.chat(joined, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.llm_engine.chat_prompt(parts) == llm.llm_engine.chat_prompt(joined)


def test_token_ids_outside_the_vocabulary_are_rejected_at_add(llm):
    with pytest.raises(ValueError, match=r"logit_bias: token id 49152 is outside the vocabulary \[0, 49152\)"):
        llm.generate("hi", SamplingParams(logit_bias={49152: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\]: token id 100000") as info:
        llm.generate("hi", SamplingParams(stop_token_ids=[2, 100000]), use_tqdm=False)
    assert info.value.param == "stop_token_ids[1]"
    assert_idle(llm)


def test_mixed_batch_greedy_rows_equal_their_solo_runs(llm):
    prompts = ["The capital of France is", "Why is the sky blue?", "def add(a, b):", "Name three colours:"]
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=6),
              SamplingParams(temperature=1e-5, top_k=5, max_tokens=12),
              SamplingParams(temperature=0.8, top_k=40, min_tokens=12, max_tokens=12, seed=3),
              SamplingParams(temperature=0, max_tokens=12)]
    batch = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 3):
        (solo,) = llm.generate(prompts[i], params[i], use_tqdm=False)
        assert batch[i].outputs[0].token_ids == solo.outputs[0].token_ids
    assert len(batch[2].outputs[0].token_ids) == 12  # min_tokens held EOS off
    assert_idle(llm)


@pytest.mark.slow
def test_a_seeded_request_is_unchanged_by_preemption():
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    prompts = [list(range(200 + 30 * i, 240 + 30 * i)) for i in range(6)]
    roomy = LLM(dtype="float32").generate(prompts, params, use_tqdm=False)
    tight = LLM(dtype="float32", num_gpu_blocks=12)  # 6 x 60 tokens do not fit in 12 x 16
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats()["num_preemptions"] >= 1
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in roomy]
    assert_idle(tight)
