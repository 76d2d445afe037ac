"""Inputs that cannot fit are refused before the work that would prove it, and tokenizing
never runs on the step loop or the caller's event loop."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine import SamplingParams
from engine.async_llm import AsyncLLM
from engine.errors import ContextLengthExceededError, InvalidRequestError, excerpt
from engine.llm_engine import max_prompt_chars
from engine.sampling_params import RequestOutputKind

MAX_MODEL_LEN = 8192  # SmolLM2's max_position_embeddings, the default


def _forbid(monkeypatch, obj, name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran on an input that cannot fit")

    monkeypatch.setattr(obj, name, refuse)


def test_the_character_bound_is_the_longest_token_times_max_model_len(llm):
    engine = llm.llm_engine
    # SmolLM2's byte-level vocabulary has no normalizer; its longest string is a newline
    # and 80 spaces (81 characters).
    assert max(map(len, engine.tokenizer.get_vocab())) == 81
    assert engine.max_prompt_chars == max_prompt_chars(engine.tokenizer, MAX_MODEL_LEN) == 81 * MAX_MODEL_LEN
    assert max_prompt_chars(None, MAX_MODEL_LEN) is None


def test_text_over_the_character_bound_is_refused_before_tokenizing(llm, monkeypatch):
    engine = llm.llm_engine
    _forbid(monkeypatch, engine, "tokenize")
    text = "hello world " * 60000  # 720,000 characters
    with pytest.raises(ContextLengthExceededError) as info:
        engine.process_prompt(text)
    assert str(info.value) == (f"prompt: 720000 characters cannot fit in max_model_len (8192) tokens: "
                               f"this tokenizer's tokens cover at most {81 * 8192} characters in all")
    assert info.value.param == "prompt"


def test_token_ids_over_max_model_len_are_refused_before_the_vocabulary_check(llm):
    with pytest.raises(ContextLengthExceededError, match=r"^prompt \(1000000 tokens\) \+ at least 1 "
                       r"output token exceeds max_model_len \(8192\)$"):
        llm.llm_engine.process_prompt([10**9] * 1_000_000)  # every id is also out of vocabulary
    with pytest.raises(InvalidRequestError, match=r"^prompt\[1\]: token id 1000000000 is outside the vocabulary") \
            as info:
        llm.llm_engine.process_prompt([1, 10**9])
    assert info.value.param == "prompt[1]"


def test_min_tokens_needs_a_token_that_stop_token_ids_and_eos_leave(llm):
    engine = llm.llm_engine
    vocab_size, eos = engine.model_config.vocab_size, engine.eos_token_id
    every_other = [t for t in range(vocab_size) if t != eos]
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("r1", [1, 2], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=every_other))
    assert str(info.value) == (f"min_tokens: stop_token_ids and EOS cover all {vocab_size} token ids, so no "
                               "token may come before min_tokens (2)")
    assert info.value.param == "min_tokens"
    # EOS is not held back with ignore_eos: it is the one token left (nothing was queued above)
    engine.add_request("r2", [1, 2], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=every_other,
                                                    ignore_eos=True))
    engine.abort_request("r2")
    assert not engine.has_unfinished_requests()


def test_a_chat_that_cannot_fit_is_refused_before_templating(llm, monkeypatch):
    engine = llm.llm_engine
    _forbid(monkeypatch, engine.tokenizer, "apply_chat_template")
    with pytest.raises(ContextLengthExceededError) as info:
        engine.chat_prompt([{"role": "user", "content": "hi"}] * 100_000)
    assert str(info.value) == ("messages: 100000 messages cannot fit in max_model_len (8192) tokens "
                               "(each message takes at least one)")
    assert info.value.param == "messages"
    with pytest.raises(ContextLengthExceededError, match="^messages: 700000 characters cannot fit"):
        engine.chat_prompt([{"role": "user", "content": "x" * 350_000}] * 2)


def test_a_chat_that_fits_is_templated_and_tokenized(llm):
    engine = llm.llm_engine
    conversation = [{"role": "user", "content": f"message {i}"} for i in range(100)]
    prompt = engine.chat_prompt(conversation)
    text = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert prompt == {"prompt": text,
                      "prompt_token_ids": engine.tokenizer(text, add_special_tokens=False).input_ids}


def test_tokenizing_and_templating_run_on_worker_threads(llm, monkeypatch):
    async_llm = AsyncLLM(engine=llm.llm_engine)
    calls = []  # (what, thread name, prompt's type)
    for name in ("process_prompt", "chat_prompt"):
        original = getattr(llm.llm_engine, name)

        def record(prompt, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, threading.current_thread().name, type(prompt).__name__))
            return _original(prompt, *args, **kwargs)

        monkeypatch.setattr(llm.llm_engine, name, record)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=2, output_kind=RequestOutputKind.DELTA)
        prompt = await async_llm.chat_prompt([{"role": "user", "content": "Hi"}])
        chat = [out async for out in async_llm.generate(prompt, params)]
        text = [out async for out in async_llm.generate("Hi there", params)]
        return chat, text

    try:
        chat, text = asyncio.run(main())
    finally:
        async_llm.shutdown()
    assert chat[-1].finished and text[-1].finished
    where = [(what, "worker" if thread.startswith("engine-tokenizer") else thread, kind)
             for what, thread, kind in calls]
    assert where == [
        # The chat: templated and tokenized on a worker (chat_prompt's own process_prompt),
        # checked again by generate on a worker; the step loop only checks its token ids.
        ("chat_prompt", "worker", "list"), ("process_prompt", "worker", "dict"),
        ("process_prompt", "worker", "dict"), ("process_prompt", "engine-step-loop", "dict"),
        # Text: tokenized by generate on a worker; the step loop gets token ids.
        ("process_prompt", "worker", "str"), ("process_prompt", "engine-step-loop", "dict")]


def test_error_messages_quote_an_excerpt_of_a_large_value():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop=[str(i) for i in range(10_000)])
    assert str(info.value) == ("stop must be at most 16 non-empty strings; got "
                               "['0', '1', '2', '3', ...] (10000 items)")
    assert excerpt("x" * 10**6).endswith("(1000000 characters)") and len(excerpt("x" * 10**6)) < 80
    assert excerpt(10**5000) == "<int too large to print>"


def test_a_kv_cache_smaller_than_max_model_len_is_a_warning_at_start(caplog):
    """vLLM refuses to start there; here the engine starts, says so once, and the requests
    that do not fit get the scheduler's 400."""
    import logging

    from engine import LLM

    with caplog.at_level(logging.WARNING, logger="engine.llm_engine"):
        small = LLM(model="dummy:tiny-llama", dtype="float32", enforce_eager=True, num_gpu_blocks=4,
                    max_model_len=128)
    assert ("the KV cache holds requests of up to 65 tokens (prompt + max_tokens), fewer than max_model_len "
            "(128): longer ones get a 400 (context_length_exceeded); raise kv_cache_memory_gb (or "
            "num_gpu_blocks) or lower max_model_len") in caplog.text
    with pytest.raises(ValueError, match=r"needs 5 KV blocks, more than the whole KV cache \(4 blocks of 16"):
        small.llm_engine.add_request("long", [1] * 60, SamplingParams(max_tokens=10))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.llm_engine"):
        LLM(model="dummy:tiny-llama", dtype="float32", enforce_eager=True, num_gpu_blocks=8, max_model_len=128)
    assert "the KV cache holds" not in caplog.text  # 8 x 16 + 1 = 129 tokens: every request fits
