"""Per-sequence state inside the engine, owned by the scheduler."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.outputs import SampleLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SampledToken, SamplingRow

if TYPE_CHECKING:
    from engine.structured_outputs import SequenceGrammar


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
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason``: 'stop', 'length' or 'abort' (an error is an abort)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence's mutable state, owned by the scheduler.

    A request with ``n > 1`` starts as its sequence 0; when its prompt is done the scheduler
    forks sequences 1..n-1, which share the prompt's KV blocks. ``num_computed_tokens``
    counts the leading tokens of prompt + output whose K/V are in the cache; preemption (by
    recompute) resets it to 0, keeping the output so far (and ``grammar``'s position, which
    follows the output).

    With prefix caching, ``block_hashes`` holds the hashes of its full blocks (prompt and
    output, extended by the scheduler as tokens come), and ``num_cached_tokens`` the prompt
    tokens found in the cache when it was first scheduled (``None`` before that).
    ``num_preemptions`` counts the times this sequence was preempted.

    With ``prompt_logprobs``, ``prompt_logprob_tokens[j]`` is prompt token ``j + 1`` with its
    log probability given the tokens before it (``add_prompt_logprobs``); a chunk computed
    again after a preemption adds nothing twice.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    index: int = 0
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_forks_pending: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None
    error_param: str | None = None  # the request field at fault where the client's input failed it
    output_logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0
    grammar: SequenceGrammar | None = None  # structured outputs: this sequence's matcher
    prompt_logprob_tokens: list[SampledToken] = field(default_factory=list)
    sampling_row: SamplingRow = field(init=False)

    def __post_init__(self) -> None:
        # The sampler's view of this sequence; its lists are this request's own, so it
        # stays current as tokens are appended.
        self.sampling_row = SamplingRow(self.sampling_params, self.prompt_token_ids,
                                        self.output_token_ids, self.index, self.eos_token_id,
                                        self.grammar)

    @property
    def is_ready(self) -> bool:
        """Whether it can be scheduled: no grammar, or its grammar's compile has finished."""
        return self.grammar is None or self.grammar.is_ready()

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

    def add_prompt_logprobs(self, index: int, tokens: list[SampledToken]) -> None:
        """Record prompt tokens ``index, index + 1, ...`` (``index >= 1``), skipping those
        already recorded."""
        skip = len(self.prompt_logprob_tokens) + 1 - index
        if skip >= 0:
            self.prompt_logprob_tokens += tokens[skip:]

    @property
    def has_prompt_logprobs(self) -> bool:
        """Whether every prompt token after the first has its entry."""
        return len(self.prompt_logprob_tokens) == max(len(self.prompt_token_ids) - 1, 0)

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
