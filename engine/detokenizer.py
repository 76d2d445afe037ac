"""Incremental, UTF-8-safe detokenization of generated tokens, and stop strings.

Built on tokenizers' ``DecodeStream``, which holds back bytes until they form whole UTF-8
characters. The stream is primed with the prompt's last tokens so that the first generated
token decodes in context (a leading space stays a space).
"""
from __future__ import annotations

from typing import Optional

from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams

# Enough prompt context for any decoder's prefix rules (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas, watching for stop strings.

    ``output_text`` is all text decoded so far (cut at a stop string once one appears).
    ``pop_delta`` hands out the part not yet emitted, except a tail that could still grow
    into a stop string; that tail is released when the sequence finishes for another reason.

    Args:
        tokenizer: a transformers fast tokenizer (its ``backend_tokenizer`` does the work).
        prompt_token_ids: the prompt, for context.
        params: the request's ``skip_special_tokens``, ``stop`` and
            ``include_stop_str_in_output``.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:],
                                    skip_special_tokens=params.skip_special_tokens)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self.output_text = ""
        self.num_emitted_chars = 0

    def step(self, token_id: int) -> Optional[str]:
        """Add one token. Returns the stop string it completed, if any (the text is then cut
        before it, or after it with ``include_stop_str_in_output``)."""
        delta = self._stream.step(self._tokenizer, token_id)
        if not delta:
            return None  # a partial character: nothing to decode yet
        # A new match must end inside the delta, so it starts at most longest-1 chars back.
        search_from = max(0, len(self.output_text) - self._longest_stop + 1)
        self.output_text += delta
        return self._cut_at_stop(search_from)

    def _cut_at_stop(self, search_from: int) -> Optional[str]:
        found = [(i, s) for s in self._stop if (i := self.output_text.find(s, search_from)) >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.output_text = self.output_text[: index + (len(stop) if self._include_stop else 0)]
        return stop

    def pop_delta(self, finished: bool) -> str:
        """The text not emitted yet; while running, minus a tail that may start a stop string."""
        end = len(self.output_text) if finished else len(self.output_text) - self._partial_stop_len()
        delta = self.output_text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return delta

    @property
    def emitted_text(self) -> str:
        return self.output_text[: self.num_emitted_chars]

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.output_text
        for length in range(min(self._longest_stop - 1, len(text)), 0, -1):
            if any(s.startswith(text[-length:]) for s in self._stop):
                return length
        return 0
