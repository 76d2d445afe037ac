"""What the engine deployment streams to the ingress: plain data with names (a
``NamedTuple`` per logprob entry, ``TypedDict`` records), so that nothing is read by index
across the Ray boundary."""
from __future__ import annotations

from typing import NamedTuple, TypedDict


class LogprobEntry(NamedTuple):
    """One candidate token at one position.

    Attributes:
        token_id: the token.
        logprob: its natural-log probability (floored at -9999.0: JSON has no -inf).
        rank: 1 for the most likely token.
        token: its text (``None`` without a tokenizer).
    """

    token_id: int
    logprob: float
    rank: int
    token: str | None


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
    finished: bool
    error: str | None
    outputs: list[CompletionDelta]
