"""A Locust user that streams OpenAI completions with mixed prompt and output lengths.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000   # web UI on :8089
    python -m loadtest --users 4 --spawn-rate 4 --duration 20 --host http://127.0.0.1:8000

Prompts are token ids (``/v1/completions`` accepts them), so their lengths are exact. The
length mix comes from ``MINI_INFER_LOAD_MIX``: ``"weight:lo-hi,..."`` prompt-token ranges,
default ``50:16-64,35:200-600,15:1000-1800`` (short, medium, long); output lengths are
uniform in ``MINI_INFER_LOAD_OUTPUT`` (default ``16-256``), generated with ``ignore_eos`` so
that each request produces exactly its ``max_tokens``. Requests whose prompt plus output
would exceed ``MINI_INFER_LOAD_MAX_MODEL_LEN`` (default 8192) are shortened to fit.

Besides the request itself, each response fires custom events that Locust's stats, CSV and
web UI show: ``TTFT`` (time to the first token), ``ITL`` (each gap between tokens) and
``TPOT`` (mean time per output token after the first), all in milliseconds.
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


def sample_request(rng: random.Random) -> dict:
    """One completion request body with a prompt length from the mix."""
    _, lo, hi = rng.choices(PROMPT_MIX, weights=[w for w, _, _ in PROMPT_MIX])[0]
    prompt_len = rng.randint(lo, hi)
    max_tokens = rng.randint(*OUTPUT_RANGE)
    prompt_len = min(prompt_len, MAX_MODEL_LEN - max_tokens)
    return {"model": MODEL, "prompt": [rng.randrange(*VOCAB) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def _fire(environment, name: str, milliseconds: float) -> None:
    environment.events.request.fire(request_type="METRIC", name=name, response_time=milliseconds,
                                    response_length=0, exception=None, context={})


class OpenAIStreamingUser(HttpUser):
    """Streams completions back to back (with a short think time) and times every token."""

    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random(hash((os.getpid(), id(self))))

    @task
    def stream_completion(self) -> None:
        body = sample_request(self.rng)
        start = time.perf_counter()
        token_times, usage = [], None
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name="/v1/completions (stream)") as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            for line in _sse_data(response):
                if line == "[DONE]":
                    break
                data = json.loads(line)
                if "error" in data:
                    response.failure(f"SSE error: {data['error'].get('message')}")
                    return
                if data.get("choices"):
                    token_times.append(time.perf_counter())
                if data.get("usage"):
                    usage = data["usage"]
            if usage is None or usage["completion_tokens"] != body["max_tokens"]:
                response.failure(f"incomplete stream: usage {usage}, wanted {body['max_tokens']} tokens")
                return
            response.success()
        self._record(start, token_times, usage)

    def _record(self, start: float, token_times: list[float], usage: dict) -> None:
        env = self.environment
        _fire(env, "TTFT", 1000 * (token_times[0] - start))
        for earlier, later in zip(token_times, token_times[1:], strict=False):
            _fire(env, "ITL", 1000 * (later - earlier))
        if usage["completion_tokens"] > 1:
            tpot = (token_times[-1] - token_times[0]) / (usage["completion_tokens"] - 1)
            _fire(env, "TPOT", 1000 * tpot)
        env.events.request.fire(request_type="TOKENS", name="output_tokens",
                                response_time=1000 * (token_times[-1] - start),
                                response_length=usage["completion_tokens"], exception=None, context={})


def _sse_data(response):
    """The ``data:`` payloads of a server-sent-event stream, as they arrive."""
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            yield line[6:]
