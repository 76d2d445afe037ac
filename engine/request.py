"""Per-request state inside the engine, and the ``RequestOutput`` handed to callers."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

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


@dataclass(slots=True, eq=False)
class Request:
    """One request's mutable state, owned by the scheduler.

    ``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose K/V are
    in the cache. Preemption (by recompute) resets it to 0; the output so far is kept and
    recomputed with the prompt.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    error: Optional[str] = None

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


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: the sequence's index among the request's outputs.
        text: the generated text (cumulative, or this step's new text for a delta).
        token_ids: the generated token ids (cumulative, or this step's for a delta).
        finish_reason: 'stop', 'length', 'abort', or ``None`` while running.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for a request after a step (vLLM's ``RequestOutput``).

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text, when it was given as text.
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput`` per generated sequence.
        finished: whether the request is done.
        error: why the engine failed the request, if it did.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: Optional[str] = None
