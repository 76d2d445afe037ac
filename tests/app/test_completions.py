"""The OpenAI API over real HTTP with the official client: completions and chat, streaming
and not, usage, n, seeds, logprobs, models, health."""
import requests

from tests.app.conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Later requests for QUESTION find its first blocks in the prefix cache. Where dtype=auto is
# bf16 (a CPU with bf16 units), the rest of the prompt then goes through matmuls of another
# shape, whose rounding may change the greedy text after a few tokens, as in vLLM (only fp32
# greedy output is exact: tests/engine/test_prefix_caching_engine.py): a cap keeps such a
# text from running to max_model_len. Each test compares requests with equal cache hits.
MAX_TOKENS = 24


def test_main_command_answers_the_capital_of_france(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.object == "chat.completion" and reply.model == MODEL


def test_streamed_greedy_text_equals_the_non_streamed_text(client):
    kwargs = dict(model=MODEL, prompt="The three largest cities of Europe are", temperature=0, max_tokens=40)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    chat_kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS)
    chat_full = client.chat.completions.create(**chat_kwargs)
    chat_chunks = list(client.chat.completions.create(**chat_kwargs, stream=True))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    # every choice of every chunk has the same fields, the role chunk's included (vLLM's shape)
    assert all(c.choices[0].model_extra == {"stop_reason": None} for c in chat_chunks[:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert streamed == chat_full.choices[0].message.content


def test_usage_counts_equal_the_tokenizer(client, tokenizer):
    prompt = "Write one sentence about the sea."
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS)
    templated = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert chat.usage.prompt_tokens == len(tokenizer(templated, add_special_tokens=False).input_ids)
    stream = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                                 max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}))
    # (the cached share of the prompt may differ: tests/app/test_prefix_caching.py checks it)
    exclude = {"prompt_tokens_details"}
    assert stream[-1].choices == []
    assert stream[-1].usage.model_dump(exclude=exclude) == chat.usage.model_dump(exclude=exclude)


def test_continuous_usage_stats_count_every_chunk(client, tokenizer):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far; the
    chat role chunks count the prompt and no completion token."""
    prompt = "Write one sentence about the sea."
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    num_prompt = len(tokenizer(prompt).input_ids)
    assert all(c.usage is not None and c.usage.prompt_tokens == num_prompt for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 12
    assert [c.usage.total_tokens - c.usage.prompt_tokens for c in chunks] == counts
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length" and counts[-2] == 12
    chat = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, n=2, stream=True, logprobs=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    templated = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    num_prompt = len(tokenizer(templated, add_special_tokens=False).input_ids)
    roles = [c for c in chat if c.choices and c.choices[0].delta.role == "assistant"]
    assert len(roles) == 2 and all((c.usage.prompt_tokens, c.usage.completion_tokens) == (num_prompt, 0)
                                   for c in roles)
    # as vLLM's: a choice's chunk counts that choice's tokens (a hostile trial saw the other's too)
    for index in (0, 1):
        mine = [c for c in chat if c.choices and c.choices[0].index == index]
        counts = [c.usage.completion_tokens for c in mine]
        assert counts[0] == 0 and counts[-1] == 6
        # each chunk adds the tokens it carries (its logprobs have one entry a token)
        steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
        assert steps == [len(c.choices[0].logprobs.content) for c in mine[1:]]
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 12  # two choices of 6
    without = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, stream=True,
                                                  stream_options={"include_usage": True}))
    assert [c.usage is None for c in without] == [True] * (len(without) - 1) + [False]


def test_n_choices_and_a_seed_that_repeats(client):
    kwargs = dict(model=MODEL, prompt="A name for a cat:", max_tokens=10, temperature=1.0, n=2, seed=1234)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text
    streamed = list(client.completions.create(**kwargs, stream=True))
    by_index = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] += choice.text
    assert [by_index[0], by_index[1]] == [c.text for c in first.choices]


def test_a_batch_of_prompts_gets_n_choices_per_prompt_in_order(client, tokenizer):
    # OpenAI's and vLLM's batch: prompt j's n choices are j*n .. j*n + n-1; usage sums them
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    num_prompt_tokens = sum(len(tokenizer(p).input_ids) for p in prompts)
    kwargs = dict(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0.8, seed=7, echo=True,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3, 4, 5]
    assert [prompts.index(next(p for p in prompts if c.text.startswith(p))) for c in out.choices] == [0, 0, 1, 1, 2, 2]
    assert [c.finish_reason for c in out.choices] == ["length"] * 6
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (num_prompt_tokens, 30)
    streamed = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = {}
    for chunk in streamed[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3, 4, 5]
    assert all(texts[i].startswith(prompts[i // 2]) and len(texts[i]) > len(prompts[i // 2]) for i in texts)
    assert (streamed[-1].usage.prompt_tokens, streamed[-1].usage.completion_tokens) == (num_prompt_tokens, 30)
    # token ids: each prompt's echo is its text
    ids = [tokenizer(p).input_ids for p in prompts]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True)
    assert [c.text[:len(p)] for c, p in zip(out.choices, prompts, strict=True)] == prompts
    assert out.usage.prompt_tokens == num_prompt_tokens


def test_logprobs_in_the_openai_shapes(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 3 and max(top.values()) == pytest_approx(tok) for top, tok in
               zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the top one
    assert bytes(content[0].bytes).decode() == content[0].token


def pytest_approx(value):
    import pytest

    return pytest.approx(value, abs=1e-6)


def test_models_health_and_readiness(api, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # vLLM's model card field: prompt plus output tokens, resolved from the model (no setting)
    (card,) = requests.get(api.url + "/v1/models", timeout=10).json()["data"]
    assert set(card) == {"id", "object", "created", "owned_by", "max_model_len"}
    assert card["max_model_len"] == 8192
    assert requests.get(api.url + f"/v1/models/{MODEL}", timeout=10).json()["max_model_len"] == 8192
    assert requests.get(api.url + "/health", timeout=10).json() == {"status": "ok"}
    assert requests.get(api.url + "/ready", timeout=60).json() == {"status": "ready"}
    replicas = requests.get(api.url + "/stats", timeout=10).json()["replicas"]
    assert len(replicas) == 1 and replicas[0]["num_total_blocks"] > 0


def test_chat_content_as_text_parts(client):
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content == plain.choices[0].message.content
