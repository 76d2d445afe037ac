"""From sampled tokens to ``RequestOutput``s: text, stop strings, logprobs, n > 1, metrics."""
from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import RequestOutputKind
from engine.scheduler_output import SampledToken

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class RequestState:
    """A request's sequences (sequence 0, then its forks) and their detokenizers."""

    request_id: str
    sequences: dict[int, Request]
    detokenizers: dict[int, IncrementalDetokenizer]
    metrics: RequestMetrics
    changed: list[int] = field(default_factory=list)  # sequence indices with news this step
    num_reported_tokens: dict[int, int] = field(default_factory=dict)  # per sequence, for deltas
    prompt_logprobs: PromptLogprobs | None = None  # built once the prompt is done (prompt_logprobs)
    prompt_logprobs_sent: bool = False  # in a delta output already

    @property
    def first(self) -> Request:
        return self.sequences[0]

    @property
    def finished(self) -> bool:
        return self.first.num_forks_pending == 0 and all(
            s.status.is_finished for s in self.sequences.values())


class OutputProcessor:
    """Keeps per-request output state between steps and builds the outputs.

    Args:
        tokenizer: the model's tokenizer, or ``None`` (then texts are empty and stop strings
            are refused earlier, by the engine).
        stream_interval: a streamed request's first token is reported at once, later ones
            once one of its changed sequences has this many unreported tokens, or it ends.
    """

    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.states: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}
        self._failed: dict[str, str] = {}  # request id -> error, since the last pop_failed

    def add_request(self, request: Request) -> None:
        self.states[request.request_id] = RequestState(
            request.request_id, {0: request}, {}, RequestMetrics(arrival_time=request.arrival_time))

    def seq_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        return [] if state is None else [s.seq_id for s in state.sequences.values()]

    def add_token(self, sequence: Request, token: SampledToken) -> str | None:
        """Record a sequence's new token (already appended to its ids by the scheduler).

        Returns:
            The stop string the new text completed, if any: the caller finishes the sequence.
        """
        state = self.states[sequence.request_id]
        state.sequences.setdefault(sequence.index, sequence)
        state.changed.append(sequence.index)
        now = time.time()
        state.metrics.first_token_time = state.metrics.first_token_time or now
        state.metrics.last_token_time = now
        if token.logprob is not None:
            sequence.cumulative_logprob += token.logprob
            sequence.output_logprobs.append(self._logprob_dict(token))
        detokenizer = self._detokenizer(state, sequence)
        if detokenizer is None:
            return None
        stop_token = sequence.status is RequestStatus.FINISHED_STOPPED
        if stop_token and not sequence.sampling_params.include_stop_str_in_output:
            # EOS or one of stop_token_ids ended it (the scheduler has finished it already; a stop
            # string is found below, after this): its id is in token_ids, its text is not in the
            # output, as in vLLM V1's detokenizer ("<|im_end|>" with skip_special_tokens false)
            return None
        return detokenizer.step(token.token_id)

    def mark_finished(self, sequence: Request) -> None:
        """Note a sequence that ended without a new token (abort, error)."""
        state = self.states.get(sequence.request_id)
        if state is not None:
            state.sequences.setdefault(sequence.index, sequence)
            state.changed.append(sequence.index)

    def make_outputs(self, request_ids: Collection[str] | None = None) -> list[RequestOutput]:
        """Outputs of every request with news since the last call (of ``request_ids`` only,
        if given), per its ``output_kind``; finished requests are dropped from the state.

        A request whose output cannot be built (an exception from its detokenizer, say) is
        left out and listed by ``pop_failed``; the others are unaffected."""
        outputs = []
        for request_id in [r for r, s in self.states.items()
                           if s.changed and (request_ids is None or r in request_ids)]:
            state = self.states[request_id]
            try:
                if self._held_back(state):
                    continue
                output = self._make_output(state)
            except Exception as exc:  # noqa: BLE001 - one request's fault: the caller fails it
                logger.exception("request %s: building its output failed", request_id)
                self._failed[request_id] = f"{type(exc).__name__}: {exc}"
                state.changed.clear()
                continue
            state.changed.clear()
            if state.finished:
                del self.states[request_id]
            if output is not None:
                outputs.append(output)
        return outputs

    def pop_failed(self) -> dict[str, str]:
        """The requests ``make_outputs`` left out since the last call: request id -> error."""
        failed, self._failed = self._failed, {}
        return failed

    def drop(self, request_id: str, error: str) -> RequestOutput | None:
        """Forget a request that failed, and return its final output: finished, ``error``
        set, no completions (its text may be what failed). ``None`` if the request is
        unknown. The caller frees its sequences in the scheduler."""
        state = self.states.pop(request_id, None)
        self._failed.pop(request_id, None)
        if state is None:
            return None
        first = state.first
        return RequestOutput(request_id=request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=[], finished=True,
                             metrics=state.metrics, error=error, num_cached_tokens=first.num_cached_tokens)

    # ---- helpers -------------------------------------------------------------------------

    def _held_back(self, state: RequestState) -> bool:
        """Whether a streamed request's news waits for more tokens (``stream_interval``): it
        has started streaming, is not finished, and some changed sequence has fewer than
        ``stream_interval`` tokens not yet reported."""
        if self.stream_interval == 1 or state.finished:
            return False
        if state.first.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
            return False
        reported = state.num_reported_tokens
        return all(reported.get(i, 0) > 0 and
                   state.sequences[i].num_output_tokens - reported[i] < self.stream_interval
                   for i in state.changed)

    def _detokenizer(self, state: RequestState, sequence: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        if sequence.index not in state.detokenizers:
            state.detokenizers[sequence.index] = IncrementalDetokenizer(
                self.tokenizer, sequence.prompt_token_ids, sequence.sampling_params)
        return state.detokenizers[sequence.index]

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        first = state.first
        kind = first.sampling_params.output_kind
        finished = state.finished
        changed = list(dict.fromkeys(state.changed))
        # Advance every changed sequence's emitted text, whatever the kind.
        deltas = {i: self._pop_delta(state, i) for i in changed}
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            completions = [self._completion(state, i, deltas[i]) for i in changed]
        else:
            completions = [self._completion(state, i, None) for i in sorted(state.sequences)]
        failed = next((s for s in state.sequences.values() if s.error), None)
        return RequestOutput(request_id=state.request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=completions,
                             finished=finished, metrics=state.metrics,
                             error=failed.error if failed is not None else None,
                             error_param=failed.error_param if failed is not None else None,
                             num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=self._prompt_logprobs(state, kind))

    def _prompt_logprobs(self, state: RequestState, kind: RequestOutputKind) -> PromptLogprobs | None:
        """The request's prompt logprobs, once every prompt token has its entry: in each
        output, or in a delta request's first one only."""
        first = state.first
        if first.sampling_params.prompt_logprobs is None or not first.has_prompt_logprobs:
            return None
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None] + [self._logprob_dict(t) for t in first.prompt_logprob_tokens]
        if kind == RequestOutputKind.DELTA:
            if state.prompt_logprobs_sent:
                return None
            state.prompt_logprobs_sent = True
        return state.prompt_logprobs

    def _pop_delta(self, state: RequestState, index: int) -> str:
        detokenizer = state.detokenizers.get(index)
        if detokenizer is None:
            return ""
        return detokenizer.pop_delta(finished=state.sequences[index].status.is_finished)

    def _completion(self, state: RequestState, index: int, delta_text: str | None) -> CompletionOutput:
        """Sequence ``index``'s output: what is new since the last report when ``delta_text``
        is given, else everything so far."""
        sequence = state.sequences[index]
        start = 0
        if delta_text is not None:
            start, text = state.num_reported_tokens.get(index, 0), delta_text
        else:
            detokenizer = state.detokenizers.get(index)
            text = "" if detokenizer is None else detokenizer.emitted_text
        state.num_reported_tokens[index] = sequence.num_output_tokens
        wants_logprobs = sequence.sampling_params.logprobs is not None
        return CompletionOutput(
            index=index, text=text, token_ids=sequence.output_token_ids[start:],
            cumulative_logprob=sequence.cumulative_logprob if wants_logprobs else None,
            logprobs=sequence.output_logprobs[start:] if wants_logprobs else None,
            finish_reason=sequence.status.finish_reason, stop_reason=sequence.stop_reason)

    def _logprob_dict(self, token: SampledToken) -> dict[int, Logprob]:
        """The sampled (or prompt) token first, then the top alternatives (vLLM's layout)."""
        entries = {token.token_id: Logprob(token.logprob, token.rank, self._token_text(token.token_id))}
        for rank, (token_id, logprob) in enumerate(token.top_logprobs, start=1):
            entries.setdefault(token_id, Logprob(logprob, rank, self._token_text(token_id)))
        return entries

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        if token_id not in self._token_texts:
            self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return self._token_texts[token_id]
