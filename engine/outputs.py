"""What the engine hands to callers: ``RequestOutput``, ``CompletionOutput``, ``Logprob``
(vLLM's public output types and field names)."""
from __future__ import annotations

from dataclasses import dataclass


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
    decoded_token: str | None = None


# Per generated token: token id -> Logprob, the sampled token first, then the top
# alternatives in descending order.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: ``None`` for the first (nothing before it), then token id -> Logprob, the
# prompt's token first, then the top alternatives (vLLM's ``PromptLogprobs``).
PromptLogprobs = list[dict[int, Logprob] | None]

# Deltas of one request are joined (``RequestOutput.add``) only up to this many values
# (``RequestOutput.num_values``): an output crossing between processes stays far below gRPC's
# default message limit of 4 MiB, which Serve keeps for its replicas' streams
# (``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH``). Measured: a value is ~29 bytes in the
# serving record (n=16 x 600 tokens x 21 logprobs, 201,600 values, was a 5.9 MB message), so
# 16,384 values are ~0.5 MB.
MAX_JOINED_VALUES = 16_384


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
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.time()``, seconds) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None


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
        error_param: the request field at fault, where the failure was the request's own (a
            structured output's constraint that no text matches); ``None`` for the engine's faults.
        num_cached_tokens: prompt tokens whose K/V came from the prefix cache when the
            request was first scheduled (``None`` before that).
        prompt_logprobs: per prompt token, where the request asked for ``prompt_logprobs``:
            in every output, or in a delta request's first output only.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_param: str | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def num_values(self) -> int:
        """Token ids and logprob entries (the sampled token's and each alternative, the
        prompt's too) over its sequences: what its size across a process boundary grows with."""
        num_prompt_values = sum(len(entry or ()) for entry in self.prompt_logprobs or ())
        return num_prompt_values + sum(len(c.token_ids) + sum(map(len, c.logprobs or ())) for c in self.outputs)

    def add(self, later: RequestOutput) -> None:
        """Append ``later``, the next delta of the same request, to this one (vLLM's
        ``RequestOutput.add``): each sequence's text, token ids and logprobs are joined; its
        finish state, and the request's, become ``later``'s. For ``RequestOutputKind.DELTA``
        outputs only (a cumulative output already holds what came before it)."""
        mine = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            earlier = mine.get(completion.index)
            if earlier is None:
                self.outputs.append(completion)
                continue
            earlier.text += completion.text
            earlier.token_ids = earlier.token_ids + completion.token_ids
            if completion.logprobs is not None:
                earlier.logprobs = (earlier.logprobs or []) + completion.logprobs
            earlier.cumulative_logprob = completion.cumulative_logprob
            earlier.finish_reason, earlier.stop_reason = completion.finish_reason, completion.stop_reason
        self.finished = later.finished
        self.metrics = later.metrics or self.metrics
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        if later.error is not None:
            self.error, self.error_param = later.error, later.error_param


class JoinedOutputs:
    """Delta outputs of one request joined (``RequestOutput.add``) into one held output of at
    most ``MAX_JOINED_VALUES`` values (``RequestOutput.num_values``): what a record across a
    process boundary carries, however many steps it gathers."""

    def __init__(self) -> None:
        self.held: RequestOutput | None = None
        self._num_values = 0  # held.num_values(), counted as it grows

    def add(self, output: RequestOutput) -> RequestOutput | None:
        """Join ``output`` to the held one (which it then is, where nothing is held). Returns
        what was held before, now taken, where ``output`` would have joined it past
        ``MAX_JOINED_VALUES`` (the caller sends that first, ``output`` is held alone), else
        ``None``."""
        num_values = output.num_values()
        taken = None
        if self.held is not None and self._num_values + num_values > MAX_JOINED_VALUES:
            taken = self.take()
        if self.held is None:
            self.held = output
        else:
            self.held.add(output)
        self._num_values += num_values
        return taken

    def take(self) -> RequestOutput | None:
        """The held output (``None`` where nothing is held); nothing is held after."""
        held, self.held, self._num_values = self.held, None, 0
        return held
