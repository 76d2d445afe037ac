"""Over HTTP: a stop completed by the last allowed token is a stop (streaming or not, n = 1
and 3); logprob bytes are each token's own raw bytes, so that they join to the reply's UTF-8
with emoji and CJK text; the legacy top_logprobs never lose an entry to a shared name."""
import json

import pytest
import requests

from tests.app.conftest import MODEL

COUNT = "Count: 1, 2, 3, 4,"  # greedy: " " then "5"
YES = [{"role": "user", "content": "Say only the word yes."}]  # greedy: "Yes", ".", EOS
EMOJI_CHAT = [{"role": "user", "content": "Repeat exactly: 猫🐱 犬🐶"}]  # greedy: repeats it
EMOJI_PROMPT = "Emoji list: 🐱 猫, 🐶 犬, 🐦"  # greedy: " 猫, 🐧 猫, 🐧"


def _choices(api, path: str, body: dict, stream: bool) -> list[dict]:
    """The choices of a response; streamed ones merged per index (text, logprobs content
    or legacy lists, the last finish_reason and stop_reason)."""
    if not stream:
        response = requests.post(api.url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"]
    merged: dict[int, dict] = {}
    with requests.post(api.url + path, json={**body, "stream": True}, stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines(decode_unicode=True):
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                _merge(merged.setdefault(choice["index"], {"index": choice["index"]}), choice)
    return [merged[i] for i in sorted(merged)]


def _content(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _merge(into: dict, choice: dict) -> None:
    text = choice.get("text", (choice.get("delta") or {}).get("content") or "")
    into["text"] = into.get("text", "") + text
    into["finish_reason"], into["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")
    logprobs = choice.get("logprobs")
    if logprobs is not None:
        old = into.setdefault("logprobs", {})
        for key, value in logprobs.items():
            old[key] = old.get(key, []) + value


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_a_stop_completed_by_the_last_allowed_token_is_a_stop(api, stream, n):
    completions = _choices(api, "/v1/completions", {"model": MODEL, "prompt": COUNT, "temperature": 0,
                                                    "max_tokens": 2, "stop": ["5"], "n": n}, stream)
    assert [(c["text"], c["finish_reason"], c["stop_reason"]) for c in completions] == [(" ", "stop", "5")] * n
    chat = _choices(api, "/v1/chat/completions", {"model": MODEL, "messages": YES, "temperature": 0,
                                                  "max_tokens": 2, "stop": ["."], "n": n}, stream)
    assert [(_content(c), c["finish_reason"], c["stop_reason"]) for c in chat] == [("Yes", "stop", ".")] * n
    eos = _choices(api, "/v1/chat/completions", {"model": MODEL, "messages": YES, "temperature": 0,
                                                 "max_tokens": 3, "min_tokens": 2, "n": n}, stream)
    assert [(c["finish_reason"], c["stop_reason"]) for c in eos] == [("stop", None)] * n


def _legacy_bytes(token: str) -> bytes:
    """A legacy completions token name back to its bytes: ``bytes:\\xNN...`` or UTF-8 text."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode("utf-8")


def _assert_joins_to(data: bytes, text: str) -> None:
    """``data`` is the UTF-8 of ``text``, plus at most the cut-off start of one character."""
    expected = text.encode("utf-8")
    assert data[: len(expected)] == expected, (data, text)
    tail = data[len(expected):]
    assert len(tail) <= 3
    if tail:
        with pytest.raises(UnicodeDecodeError):
            tail.decode("utf-8")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprob_bytes_join_to_the_content(api, tokenizer, stream):
    special = set(tokenizer.all_special_tokens)
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 3, "n": 3}):
        body = {"model": MODEL, "messages": EMOJI_CHAT, "max_tokens": 24, "logprobs": True,
                "top_logprobs": 3, **extra}
        choices = _choices(api, "/v1/chat/completions", body, stream)
        for choice in choices:
            tokens = choice["logprobs"]["content"]
            _assert_joins_to(b"".join(bytes(t["bytes"]) for t in tokens if t["token"] not in special),
                             _content(choice))
            for token in tokens:
                for alternative in token["top_logprobs"]:
                    assert bytes(alternative["bytes"]).decode("utf-8", "replace") == alternative["token"]
        if extra["temperature"] == 0:
            # the reply has an emoji (4 UTF-8 bytes, several tokens); which one is the model's
            # choice and moves with dtype and kernel (the service runs bf16 where the CPU has it)
            assert any(len(char.encode()) == 4 for char in _content(choices[0])), _content(choices[0])
            partial = [t for t in choices[0]["logprobs"]["content"] if t["token"] == "\ufffd"]
            assert partial and all(t["bytes"] != [0xEF, 0xBF, 0xBD] for t in partial)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_token_names_give_the_bytes_of_the_text(api, stream):
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 3, "n": 3}):
        body = {"model": MODEL, "prompt": EMOJI_PROMPT, "max_tokens": 16, "logprobs": 2, **extra}
        choices = _choices(api, "/v1/completions", body, stream)
        for choice in choices:
            lp = choice["logprobs"]
            _assert_joins_to(b"".join(_legacy_bytes(t) for t in lp["tokens"]), choice["text"])
            decoded = [len(b"".join(_legacy_bytes(t) for t in lp["tokens"][:i]).decode("utf-8", "ignore"))
                       for i in range(len(lp["tokens"]))]
            assert lp["text_offset"] == decoded
        if extra["temperature"] == 0:
            assert "猫" in choices[0]["text"] and "🐧" in choices[0]["text"]
            assert any(t.startswith("bytes:") for t in choices[0]["logprobs"]["tokens"])


def test_legacy_top_logprobs_keep_every_entry_and_the_best_rank(api):
    body = {"model": MODEL, "prompt": EMOJI_PROMPT, "max_tokens": 16, "logprobs": 5, "temperature": 0}
    lp = _choices(api, "/v1/completions", body, stream=False)[0]["logprobs"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 5, top
        assert top[token] == logprob == max(top.values())  # greedy: the sampled token is rank 1


@pytest.mark.slow
def test_a_non_streamed_result_past_grpcs_message_limit_is_served(api):
    """32 choices x 256 tokens x 20 logprobs: 180,000-odd token ids and logprob entries, ~5 MB
    as one record from the engine replica, past the 4 MiB message limit of Serve's gRPC
    transport. It was a 500 (RESOURCE_EXHAUSTED) after all the work; the engine now sends a
    large result in records of ``MAX_JOINED_VALUES`` (engine/outputs.py)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "n": 32, "max_tokens": 256, "ignore_eos": True,
            "logprobs": 20, "seed": 0}
    response = requests.post(api.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text[:500]
    assert len(response.content) > 4 * 2**20
    result = response.json()
    assert result["usage"]["completion_tokens"] == 32 * 256
    assert sorted(c["index"] for c in result["choices"]) == list(range(32))
    for choice in result["choices"]:
        lp = choice["logprobs"]
        assert choice["finish_reason"] == "length" and len(lp["tokens"]) == len(lp["top_logprobs"]) == 256
        assert all(len(top) >= 20 for top in lp["top_logprobs"]), choice["index"]
