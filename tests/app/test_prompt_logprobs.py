"""The prompt's log probabilities over HTTP: vLLM's ``prompt_logprobs`` (completions and
chat), OpenAI's legacy ``echo`` with ``logprobs`` (the prompt's tokens lead the choice's
logprobs) and ``echo`` with ``max_tokens`` 0 (the prompt alone: a prompt's log-likelihood in
one request, as evaluation harnesses ask). The values are checked against transformers' in
tests/engine/test_prompt_logprobs.py (fp32); here the service's own dtype serves them."""
import json

import pytest
import requests

from app.engine_server import split_prompt_logprobs
from app.records import EngineOutput, LogprobEntry
from tests.app.conftest import MODEL

PROMPT = "The old lighthouse keeper kept a logbook for forty-one years"


def _post(api, path: str, body: dict) -> requests.Response:
    return requests.post(api.url + path, json={"model": MODEL, "temperature": 0, **body}, timeout=120)


def _ok(api, path: str, body: dict) -> dict:
    response = _post(api, path, body)
    assert response.status_code == 200, response.text[:500]
    return response.json()


def _streamed_choices(api, body: dict) -> dict[int, dict]:
    """A streamed completion's choices joined: text, legacy logprobs, finish_reason."""
    joined: dict[int, dict] = {}
    with requests.post(api.url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body,
                                                           "stream": True}, stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text[:500]
        for line in response.iter_lines(decode_unicode=True):
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                into = joined.setdefault(choice["index"], {"text": "", "tokens": [], "token_logprobs": [],
                                                           "top_logprobs": [], "finish_reason": None})
                into["text"] += choice["text"]
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    into[key] += (choice["logprobs"] or {}).get(key, [])
                into["finish_reason"] = choice["finish_reason"] or into["finish_reason"]
    return joined


def _assert_vllm_shape(prompt_logprobs: list, prompt_ids: list[int], top: int, tokenizer) -> None:
    """``None``, then per token a map of id -> {logprob, rank, decoded_token}: the prompt's
    token first, then the ``top`` best ranked 1..top."""
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for token_id, entry in zip(prompt_ids[1:], prompt_logprobs[1:], strict=True):
        ids = list(entry)
        assert ids[0] == str(token_id)
        own = entry[str(token_id)]
        assert own["decoded_token"] == tokenizer.decode([token_id])
        assert own["logprob"] <= 0 and own["rank"] >= 1
        assert sorted(e["rank"] for i, e in entry.items() if i != str(token_id) or own["rank"] <= top) == \
            list(range(1, top + 1))
        assert len(entry) == top + (own["rank"] > top)
        best = [e["logprob"] for e in sorted(entry.values(), key=lambda e: e["rank"])]
        assert best == sorted(best, reverse=True)


def test_completions_prompt_logprobs_in_each_choice(api, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    result = _ok(api, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2, "prompt_logprobs": 2})
    assert result["usage"]["prompt_tokens"] == len(ids)
    first = result["choices"][0]["prompt_logprobs"]
    _assert_vllm_shape(first, ids, 2, tokenizer)
    assert result["choices"][1]["prompt_logprobs"] == first
    # the greedy reply's first token, appended to the prompt, gets the same logprob as a prompt token
    reply = _ok(api, "/v1/completions", {"prompt": ids, "max_tokens": 1, "logprobs": 0})
    generated = reply["choices"][0]["logprobs"]
    extended = _ok(api, "/v1/completions", {"prompt": ids + [tokenizer(reply["choices"][0]["text"]).input_ids[0]],
                                            "max_tokens": 1, "prompt_logprobs": 0})
    last = extended["choices"][0]["prompt_logprobs"][-1]
    (own,) = last.values()
    assert own["rank"] == 1 and own["logprob"] == pytest.approx(generated["token_logprobs"][0], abs=0.05)
    assert "prompt_logprobs" not in _ok(api, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})["choices"][0]


def test_chat_prompt_logprobs_beside_the_choices(api, tokenizer):
    messages = [{"role": "user", "content": "Name a fruit."}]
    result = _ok(api, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert result["usage"]["prompt_tokens"] == len(ids)
    _assert_vllm_shape(result["prompt_logprobs"], ids, 1, tokenizer)
    assert "prompt_logprobs" not in result["choices"][0]


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "not available with stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0,
                              "stream": True}, "not available with stream"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21},
     "prompt_logprobs must be an integer in [0, 20]; got 21"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": -1},
     "prompt_logprobs must be an integer in [0, 20]; got -1"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21, "stream": True}, "not available with stream"),
])
def test_bad_prompt_logprobs_are_a_400_naming_it(api, path, body, message):
    response = _post(api, path, {"max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt_logprobs" and message in error["message"]


def _assert_legacy_indexes_text(logprobs: dict, text: str) -> None:
    assert "".join(logprobs["tokens"]) == text
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_with_logprobs_leads_with_the_prompts_tokens(api, tokenizer, max_tokens):
    ids = tokenizer(PROMPT).input_ids
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": max_tokens}
    result = _ok(api, "/v1/completions", body)
    choice = result["choices"][0]
    logprobs = choice["logprobs"]
    assert result["usage"]["completion_tokens"] == max_tokens
    assert len(logprobs["tokens"]) == len(ids) + max_tokens
    assert logprobs["tokens"][:len(ids)] == [tokenizer.decode([i]) for i in ids]
    assert choice["text"].startswith(PROMPT) and (max_tokens or choice["text"] == PROMPT)
    _assert_legacy_indexes_text(logprobs, choice["text"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    # the prompt's tokens: the values prompt_logprobs gives
    asked = _ok(api, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2})
    expected = [entry[str(i)]["logprob"] for i, entry in zip(ids[1:], asked["choices"][0]["prompt_logprobs"][1:],
                                                             strict=True)]
    assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-3)
    for token, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:], strict=True):
        assert len(top) in (2, 3) and token in top  # the top 2, and the token where it is not among them
    if max_tokens == 0:
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    streamed = _streamed_choices(api, body)[0]
    assert streamed["text"] == choice["text"] and streamed["finish_reason"] == choice["finish_reason"]
    assert streamed["tokens"] == logprobs["tokens"] and streamed["top_logprobs"] == logprobs["top_logprobs"]
    assert streamed["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=1e-3)


def test_echo_with_max_tokens_0_over_a_batch(api, tokenizer):
    prompts = ["Hello there", "The sea at dawn was grey"]
    result = _ok(api, "/v1/completions", {"prompt": prompts, "echo": True, "max_tokens": 0, "n": 2})
    assert [c["text"] for c in result["choices"]] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert [c["finish_reason"] for c in result["choices"]] == ["length"] * 4
    assert result["usage"]["completion_tokens"] == 0
    assert result["usage"]["prompt_tokens"] == sum(len(tokenizer(p).input_ids) for p in prompts)
    with_logprobs = _ok(api, "/v1/completions", {"prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 0})
    for prompt, choice in zip(prompts, with_logprobs["choices"], strict=True):
        assert len(choice["logprobs"]["tokens"]) == len(tokenizer(prompt).input_ids)
        _assert_legacy_indexes_text(choice["logprobs"], prompt)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1; got 0"),
    ({"prompt": "Hi", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens",
     "min_tokens must be 0 with max_tokens 0 (echo); got 1")])
def test_max_tokens_0_needs_echo(api, body, param, message, stream):
    response = _post(api, "/v1/completions", {**body, "stream": stream})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                        "code": None}


def test_a_long_prompts_logprobs_cross_in_several_records(api, tokenizer):
    # 1,000 tokens x 21 entries: 21,000 values, past the 16,384 one record carries
    ids = (tokenizer(PROMPT + ". ").input_ids * 100)[:1000]
    result = _ok(api, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 20})
    prompt_logprobs = result["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == 1000 and prompt_logprobs[0] is None
    assert [list(e)[0] for e in prompt_logprobs[1:]] == [str(i) for i in ids[1:]]
    assert all(len(e) in (20, 21) for e in prompt_logprobs[1:])


def test_split_prompt_logprobs_keeps_the_order_and_the_last_record_whole():
    def entry(token_id: int, size: int) -> list[LogprobEntry]:
        return [LogprobEntry(token_id, -1.0, 1, "x", b"x")] * size

    prompt_logprobs = [entry(0, 1)] + [entry(i, 3) for i in range(1, 8)]  # 22 values
    record = EngineOutput(replica_id="r", num_prompt_tokens=8, num_cached_tokens=0, finished=True, error=None,
                          outputs=[{"index": 0, "text": "a", "token_ids": [5], "finish_reason": "length",
                                    "stop_reason": None, "logprobs": None}], prompt_logprobs=prompt_logprobs)
    assert split_prompt_logprobs(record, max_values=22) == [record]
    parts = split_prompt_logprobs(record, max_values=9)
    assert [len(p["prompt_logprobs"]) for p in parts] == [3, 3, 2]  # 7, 9 and 6 values
    assert sum((p["prompt_logprobs"] for p in parts), []) == prompt_logprobs
    assert [(p["outputs"], p["finished"]) for p in parts[:-1]] == [([], False)] * 2
    assert parts[-1]["outputs"] == record["outputs"] and parts[-1]["finished"] is True
