"""Per-request state inside the engine, and the ``RequestOutput`` handed to callers."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> Optional[str]:
        """OpenAI's ``finish_reason``: 'stop', 'length' or 'abort' (an error is an abort)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "abort",
}


@dataclass(slots=True)
class Logprob:
    """A token's log probability (vLLM's ``Logprob``).

    Attributes:
        logprob: natural log of its probability after penalties and bias, before
            temperature and truncation.
        rank: 1 for the most likely token.
        decoded_token: the token's text, when a tokenizer is loaded.
    """

    logprob: float
    rank: int
    decoded_token: Optional[str] = None


@dataclass(slots=True)
class SampledToken:
    """What the sampler picked for one sequence in one step.

    Attributes:
        token_id: the new token.
        logprob: its log probability, when the request asked for logprobs.
        rank: its rank (1 = most likely), when the request asked for logprobs.
        top_logprobs: the top ``logprobs`` alternatives as ``(token_id, logprob)``, most
            likely first.
    """

    token_id: int
    logprob: Optional[float] = None
    rank: Optional[int] = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


# Per generated token: token id -> Logprob, the sampled token first, then the top
# alternatives in descending order.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True, eq=False)
class Request:
    """One sequence's mutable state, owned by the scheduler.

    A request with ``n > 1`` starts as its sequence 0; when its prompt is done the scheduler
    forks sequences 1..n-1, which share the prompt's KV blocks. ``num_computed_tokens``
    counts the leading tokens of prompt + output whose K/V are in the cache; preemption (by
    recompute) resets it to 0, keeping the output so far.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    max_tokens: int
    index: int = 0
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_forks_pending: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Union[int, str, None] = None
    error: Optional[str] = None
    output_logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0

    @property
    def seq_id(self) -> str:
        """The key of this sequence in the scheduler and the block manager."""
        return make_seq_id(self.request_id, self.index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]


def make_seq_id(request_id: str, index: int) -> str:
    """Sequence 0 is keyed by the request id, sequence i > 0 by ``"<request_id>#<i>"``."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (vLLM's ``CompletionOutput``).

    Attributes:
        index: the sequence's index among the request's ``n`` outputs.
        text: the generated text (cumulative, or this step's new text for a delta).
        token_ids: the generated token ids (cumulative, or this step's for a delta).
        cumulative_logprob: sum of the sampled tokens' log probabilities, when
            ``logprobs`` was asked for.
        logprobs: per token, the sampled token's and the top alternatives' ``Logprob``,
            when ``logprobs`` was asked for (cumulative or delta like ``token_ids``).
        finish_reason: 'stop', 'length', 'abort', or ``None`` while running.
        stop_reason: the stop string or stop token id that ended it; ``None`` for EOS,
            length, or while running.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.time()``, seconds) of a request's life."""

    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for a request after a step (vLLM's ``RequestOutput``).

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text, when it was given as text.
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput`` per generated sequence.
        finished: whether the request is done (all its sequences).
        metrics: arrival, first-token and last-token times.
        error: why the engine failed the request, if it did.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None
