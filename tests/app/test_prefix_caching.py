"""Prefix caching over HTTP: OpenAI's usage.prompt_tokens_details.cached_tokens (a body and
the streamed usage chunk), cache_salt, and the counters in /stats."""
import uuid

import requests

from tests.app.conftest import MODEL

BLOCK_SIZE = 16  # the served default


def _system_prompt(tokenizer) -> str:
    """About 400 tokens no earlier request has sent (it starts with a fresh id)."""
    text = f"Session {uuid.uuid4().hex}. You are a patient tutor of geography. " + " ".join(
        f"Rule {i}: answer in one sentence and name the country." for i in range(27))
    assert 390 <= len(tokenizer(text).input_ids) <= 460
    return text


def _chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _num_shared_full_blocks_tokens(tokenizer, first: list[dict], second: list[dict]) -> int:
    """Tokens of the full blocks the two templated prompts have in common (templated and
    tokenized as the engine does)."""
    a, b = (tokenizer(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False).input_ids for m in (first, second))
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return common // BLOCK_SIZE * BLOCK_SIZE


def test_a_repeated_400_token_system_prompt_is_reported_as_cached(client, tokenizer):
    system = _system_prompt(tokenizer)
    first, second = _chat(system, "What is the capital of France?"), _chat(system, "And of Spain?")
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0)
    reply = client.chat.completions.create(messages=first, **kwargs)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    expected = _num_shared_full_blocks_tokens(tokenizer, first, second)
    assert expected >= 384
    chunks = list(client.chat.completions.create(messages=second, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected
    again = client.chat.completions.create(messages=second, **kwargs)  # all of it but the last token
    assert again.usage.prompt_tokens_details.cached_tokens == \
        min(again.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE, again.usage.prompt_tokens - 1)


def test_cache_salt_keeps_tenants_apart(api, client, tokenizer):
    system = _system_prompt(tokenizer)
    kwargs = dict(model=MODEL, max_tokens=2, temperature=0)
    first = client.chat.completions.create(messages=_chat(system, "Hi"), **kwargs)
    salted = [client.chat.completions.create(messages=_chat(system, "Hi"), extra_body={"cache_salt": salt}, **kwargs)
              for salt in ("tenant-a", "tenant-b", "tenant-a")]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in [first, *salted]]
    assert cached[:3] == [0, 0, 0] and cached[3] > 0
    bad = requests.post(api.url + "/v1/chat/completions", timeout=60,
                        json={**kwargs, "messages": _chat(system, "Hi"), "cache_salt": ""})
    assert bad.status_code == 400
    assert bad.json()["error"] == {"message": "cache_salt must be a non-empty string; got ''",
                                   "type": "invalid_request_error", "param": "cache_salt", "code": None}


def test_stats_report_prefix_cache_counters(api, client, tokenizer):
    prompt = _system_prompt(tokenizer)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    stats = requests.get(api.url + "/stats", timeout=10).json()["replicas"][0]
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_queries"] >= stats["prefix_cache_hits"]
    assert stats["prefix_cache_hit_rate"] == stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
    assert 0 < stats["num_free_cached_blocks"] <= stats["num_cached_blocks"]
