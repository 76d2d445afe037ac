"""Incremental, UTF-8-safe detokenization of generated tokens.

Built on tokenizers' ``DecodeStream``, which holds back bytes until they form whole UTF-8
characters. The stream is primed with the prompt's last tokens so that the first generated
token decodes in context (a leading space stays a space).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Enough prompt context for any decoder's prefix rules (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas.

    Args:
        tokenizer: a transformers fast tokenizer (its ``backend_tokenizer`` does the work).
        prompt_token_ids: the prompt, for context.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:],
                                    skip_special_tokens=skip_special_tokens)
        self.output_text = ""

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is partial)."""
        delta = self._stream.step(self._tokenizer, token_id) or ""
        self.output_text += delta
        return delta
