"""Incremental, UTF-8-safe detokenization of generated tokens, and stop strings.

Built on tokenizers' ``DecodeStream``, which holds back bytes until they form whole UTF-8
characters. The stream is primed with the prompt's last tokens so that the first generated
token decodes in context (a leading space stays a space).
"""
from __future__ import annotations

import json
import re

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
        params: the request's ``skip_special_tokens``, ``stop``,
            ``include_stop_str_in_output`` and ``min_tokens``.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer.backend_tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        # DecodeStream takes the context as the text before the output only where it ends in a
        # whole character; a prompt that ends inside one (token ids cut mid-emoji) decodes to
        # U+FFFD there, and the stream's first text then repeats the context's (a trial: "Hi "
        # of the prompt began the completion). That first text is cut here (_drop_context).
        text = self._tokenizer.decode(context, skip_special_tokens=params.skip_special_tokens) if context else ""
        self._context_text = text if text.endswith("\ufffd") else None
        self._stops = [StopMatcher(stop) for stop in params.stop]
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self.output_text = ""
        self.num_emitted_chars = 0

    def step(self, token_id: int) -> str | None:
        """Add one token. Returns the stop string it completed, if any (the text is then cut
        before it, or after it with ``include_stop_str_in_output``); none within the first
        ``min_tokens`` tokens, as in vLLM V1 (a stop string that ends in a later token counts,
        wherever it starts)."""
        self._num_tokens += 1
        delta = self._stream.step(self._tokenizer, token_id)
        if delta and self._context_text is not None:
            delta = self._drop_context(delta)
        if not delta:
            return None  # a partial character: nothing to decode yet
        start = len(self.output_text)
        self.output_text += delta
        if not self._stops:
            return None
        checking = self._num_tokens > self._min_tokens
        # The earliest stop string to complete inside the delta wins.
        for offset, char in enumerate(delta):
            for matcher in self._stops:
                if matcher.feed(char) and checking:
                    end = start + offset + 1
                    cut = end if self._include_stop else end - len(matcher.stop)
                    self.output_text = self.output_text[:cut]
                    return matcher.stop
        return None

    def _drop_context(self, text: str) -> str:
        """The stream's first text without the context's: without it whole where the
        context's U+FFFD is still one (the bytes after it did not complete that character, or
        it was the character itself), else without its whole characters (the first generated
        token completed the last one, which is then the output's first character)."""
        context, self._context_text = self._context_text, None
        for prefix in (context, context[:-1]):
            if text.startswith(prefix):
                return text[len(prefix):]
        return text

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
        return max((m.matched for m in self._stops), default=0)


class StopMatcher:
    """Finds one stop string in text fed a character at a time, in O(1) amortized per
    character (the Knuth-Morris-Pratt automaton), however long the string is.

    ``matched`` is the length of the longest prefix of ``stop`` that the text ends with.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        # failure[i]: the longest proper prefix of stop[:i + 1] that is also its suffix
        self._failure = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._failure[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._failure[i] = k

    def feed(self, char: str) -> bool:
        """Advance by one character; True when the text now ends with the stop string."""
        k = self.matched
        while k and char != self.stop[k]:
            k = self._failure[k - 1]
        if char == self.stop[k]:
            k += 1
        if k == len(self.stop):
            self.matched = self._failure[k - 1]
            return True
        self.matched = k
        return False


_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token's own raw bytes, as OpenAI's logprob ``bytes`` field means them: the bytes
    that token adds to the UTF-8 text, so that a sequence's tokens' bytes join to exactly
    the UTF-8 of its text, even where one character spans several tokens (an emoji is often
    three). ``tokenizer.decode([token_id])`` cannot give them: a token that holds part of a
    character decodes to U+FFFD.

    How a token's string maps back to bytes depends on the tokenizer's decoder:

    - byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2): every byte was written as one printable
      character (GPT-2's ``bytes_to_unicode`` table, from transformers); the inverse table
      gives the bytes back.
    - SentencePiece with byte fallback (Llama 2, Mistral): ``<0xNN>`` tokens are the byte
      ``NN``; other pieces are UTF-8 text with "▁" for a space.
    - added tokens (``<|im_end|>``) and any other decoder: the UTF-8 of the token's text.

    Args:
        tokenizer: a transformers fast tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self._tokenizer = tokenizer
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        decoder_types = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self._byte_level = "ByteLevel" in decoder_types
        self._byte_decoder = {char: byte for byte, char in bytes_to_unicode().items()}
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        """The token's raw bytes (possibly an incomplete UTF-8 sequence)."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_level and all(char in self._byte_decoder for char in piece):
            return bytes(self._byte_decoder[char] for char in piece)
        if (match := _BYTE_FALLBACK_TOKEN.fullmatch(piece)) is not None:
            return bytes([int(match.group(1), 16)])
        if not self._byte_level and "▁" in piece:
            return piece.replace("▁", " ").encode("utf-8")
        return self._tokenizer.decode([token_id]).encode("utf-8")
