"""What the engine deployment streams to the ingress: plain data with names (a
``NamedTuple`` per logprob entry, ``TypedDict`` records), so that nothing is read by index
across the Ray boundary."""
from __future__ import annotations

from typing import NamedTuple, NotRequired, TypedDict


class LogprobEntry(NamedTuple):
    """One candidate token at one position.

    Attributes:
        token_id: the token.
        logprob: its natural-log probability (floored at -9999.0: JSON has no -inf); ``None``
            for a prompt's first token (``EngineOutput.prompt_logprobs``).
        rank: 1 for the most likely token; ``None`` where ``logprob`` is.
        token: its text, ``tokenizer.decode([token_id])`` (``None`` without a tokenizer); U+FFFD
            for a token that holds part of a character.
        token_bytes: its own raw bytes (``engine.detokenizer.TokenBytes``; ``None`` without a
            tokenizer): a sequence's tokens' bytes join to the UTF-8 of its text.
    """

    token_id: int
    logprob: float | None
    rank: int | None
    token: str | None
    token_bytes: bytes | None


class CompletionDelta(TypedDict):
    """What one step added to one choice (vLLM's ``CompletionOutput`` as a delta)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    # per new token: the sampled token first, then the top alternatives
    logprobs: list[list[LogprobEntry]] | None


class EngineOutput(TypedDict):
    """One streamed record of a request."""

    replica_id: str
    num_prompt_tokens: int
    num_cached_tokens: int  # of the prompt, found in the prefix cache
    finished: bool
    error: str | None
    outputs: list[CompletionDelta]
    # the prompt's text, on the first record of a request that asked for it (echo)
    prompt_text: NotRequired[str]
    # prompt_logprobs: per prompt token (its own entry first, then the top alternatives; the
    # first token's alone, logprob None), on the first records, in order: a large prompt's
    # are split over several records (app.engine_server.split_prompt_logprobs)
    prompt_logprobs: NotRequired[list[list[LogprobEntry]]]


class Rejection(TypedDict):
    """The only record of a request the engine replica refused (a bad request, or a full
    waiting queue): sent as data rather than raised across Ray, because the client's fault is
    no server failure to log with a traceback. Fields as ``app.errors.OpenAIError``'s."""

    status_code: int
    message: str
    param: str | None
    code: str | None
