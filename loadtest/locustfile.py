"""Locust users: completions with mixed prompt and output lengths, and multi-turn chats.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000   # web UI on :8089
    python -m loadtest --users 4 --spawn-rate 4 --duration 20 --host http://127.0.0.1:8000

Prompts are token ids (``/v1/completions`` accepts them), so their lengths are exact. The
length mix comes from ``MINI_INFER_LOAD_MIX``: ``"weight:lo-hi,..."`` prompt-token ranges,
default ``50:16-64,35:200-600,15:1000-1800`` (short, medium, long); output lengths are
uniform in ``MINI_INFER_LOAD_OUTPUT`` (default ``16-256``), generated with ``ignore_eos`` so
that each request produces exactly its ``max_tokens``. Requests whose prompt plus output
would exceed ``MINI_INFER_LOAD_MAX_MODEL_LEN`` (default 8192) are shortened to fit.

``ChatConversationUser`` (one user in four) holds a conversation: a system prompt shared by
every user, then up to ``MINI_INFER_LOAD_CHAT_TURNS`` (default 6) turns, each of which
resends the whole conversation so far with a new question, as chat clients do; the prefix
cache serves the part it has seen. Replies are ``MINI_INFER_LOAD_CHAT_OUTPUT`` tokens
(default ``16-64``). Against a service with an ``api_key``, set ``MINI_INFER_LOAD_API_KEY``.

Besides the request itself, each response fires custom events that Locust's stats, CSV and
web UI show: ``TTFT`` (time to the first token), ``ITL`` (each gap between tokens) and
``TPOT`` (mean time per output token after the first), all in milliseconds; and ``USAGE``
events whose lengths are its prompt tokens and, of those, the ones the prefix cache served
(``prompt_tokens``, ``cached_prompt_tokens``).
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

MODEL = os.environ.get("MINI_INFER_LOAD_MODEL", "smollm2-135m-instruct")
VOCAB = (100, 49000)  # token ids that decode to ordinary text in SmolLM2's vocabulary


def parse_mix(spec: str) -> list[tuple[float, int, int]]:
    """``"50:16-64,35:200-600"`` -> ``[(50.0, 16, 64), (35.0, 200, 600)]``."""
    mix = []
    for part in spec.split(","):
        weight, span = part.split(":")
        lo, hi = span.split("-")
        mix.append((float(weight), int(lo), int(hi)))
    return mix


PROMPT_MIX = parse_mix(os.environ.get("MINI_INFER_LOAD_MIX", "50:16-64,35:200-600,15:1000-1800"))
OUTPUT_RANGE = tuple(int(x) for x in os.environ.get("MINI_INFER_LOAD_OUTPUT", "16-256").split("-"))
MAX_MODEL_LEN = int(os.environ.get("MINI_INFER_LOAD_MAX_MODEL_LEN", "8192"))
CHAT_TURNS = int(os.environ.get("MINI_INFER_LOAD_CHAT_TURNS", "6"))
CHAT_OUTPUT = tuple(int(x) for x in os.environ.get("MINI_INFER_LOAD_CHAT_OUTPUT", "16-64").split("-"))
# The service's api_key, where it has one: sent as `Authorization: Bearer <key>`.
API_KEY = os.environ.get("MINI_INFER_LOAD_API_KEY")
WORDS = ("the lamp keeper wrote wind sea grey storm light tide harbour island boat rope stairs glass "
         "museum logbook winter summer birds engine clock lens night dawn coast weather record").split()
# About 300 tokens, the same for every chat user: the prefix every conversation shares.
SYSTEM_PROMPT = "You answer questions about a lighthouse museum. " + " ".join(
    random.Random(0).choice(WORDS) for _ in range(250))


def sample_request(rng: random.Random) -> dict:
    """One completion request body with a prompt length from the mix."""
    _, lo, hi = rng.choices(PROMPT_MIX, weights=[w for w, _, _ in PROMPT_MIX])[0]
    prompt_len = rng.randint(lo, hi)
    max_tokens = rng.randint(*OUTPUT_RANGE)
    prompt_len = min(prompt_len, MAX_MODEL_LEN - max_tokens)
    return {"model": MODEL, "prompt": [rng.randrange(*VOCAB) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def _fire(environment, name: str, milliseconds: float, request_type: str = "METRIC", length: int = 0) -> None:
    environment.events.request.fire(request_type=request_type, name=name, response_time=milliseconds,
                                    response_length=length, exception=None, context={})


class _StreamingUser(HttpUser):
    """Streams a request, checks that it produced ``max_tokens`` tokens, times every token."""

    abstract = True
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random(hash((os.getpid(), id(self))))
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def stream(self, path: str, body: dict, name: str) -> str | None:
        """POST ``body`` (streamed, with usage) and record its metrics.

        Returns:
            The generated text, or ``None`` for a failed request (reported to Locust).
        """
        start = time.perf_counter()
        token_times, usage, text = [], None, []
        with self.client.post(path, json=body, stream=True, catch_response=True, name=name) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return None
            for line in _sse_data(response):
                if line == "[DONE]":
                    break
                data = json.loads(line)
                if "error" in data:
                    response.failure(f"SSE error: {data['error'].get('message')}")
                    return None
                if data.get("choices"):
                    token_times.append(time.perf_counter())
                    choice = data["choices"][0]
                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                if data.get("usage"):
                    usage = data["usage"]
            if usage is None or usage["completion_tokens"] != body["max_tokens"]:
                response.failure(f"incomplete stream: usage {usage}, wanted {body['max_tokens']} tokens")
                return None
            response.success()
        self._record(start, token_times, usage)
        return "".join(text)

    def _record(self, start: float, token_times: list[float], usage: dict) -> None:
        env = self.environment
        _fire(env, "TTFT", 1000 * (token_times[0] - start))
        for earlier, later in zip(token_times, token_times[1:], strict=False):
            _fire(env, "ITL", 1000 * (later - earlier))
        if usage["completion_tokens"] > 1:
            tpot = (token_times[-1] - token_times[0]) / (usage["completion_tokens"] - 1)
            _fire(env, "TPOT", 1000 * tpot)
        _fire(env, "output_tokens", 1000 * (token_times[-1] - start), "TOKENS", usage["completion_tokens"])
        _fire(env, "prompt_tokens", 0, "USAGE", usage["prompt_tokens"])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        _fire(env, "cached_prompt_tokens", 0, "USAGE", cached)


class OpenAIStreamingUser(_StreamingUser):
    """Streams completions back to back (with a short think time) and times every token."""

    weight = 3

    @task
    def stream_completion(self) -> None:
        self.stream("/v1/completions", sample_request(self.rng), "/v1/completions (stream)")


class ChatConversationUser(_StreamingUser):
    """A multi-turn chat: each turn resends the conversation so far plus a new question."""

    weight = 1

    def on_start(self) -> None:
        super().on_start()
        self.messages = [{"role": "system", "content": SYSTEM_PROMPT}]

    @task
    def chat_turn(self) -> None:
        question = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(8, 24))) + "?"
        self.messages.append({"role": "user", "content": question.capitalize()})
        body = {"model": MODEL, "messages": self.messages, "max_tokens": self.rng.randint(*CHAT_OUTPUT),
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        reply = self.stream("/v1/chat/completions", body, "/v1/chat/completions (multi-turn stream)")
        if reply is None or len(self.messages) >= 2 * CHAT_TURNS:
            self.messages = self.messages[:1]  # a new conversation, after the same system prompt
        else:
            self.messages.append({"role": "assistant", "content": reply})


def _sse_data(response):
    """The ``data:`` payloads of a server-sent-event stream, as they arrive."""
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            yield line[6:]
