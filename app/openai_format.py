"""Engine output dicts (``app.engine_server.output_to_dict``) to OpenAI response bodies and
server-sent-event chunks, for completions and chat completions."""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field

from app.protocol import new_id, now
from app.records import CompletionDelta, EngineOutput, LogprobEntry
from app.tool_calls import ToolCallStream, ToolMode, final_message

DONE = "data: [DONE]\n\n"


class _TextOffsets:
    """Character offsets of a choice's tokens in its text, from the tokens' raw bytes: a
    token that ends inside a character starts where that character starts."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = 0

    def advance(self, entry: LogprobEntry) -> int:
        """The offset of ``entry``'s token; moves past it."""
        offset = self._num_chars
        data = entry.token_bytes if entry.token_bytes is not None else (entry.token or "").encode()
        self._num_chars += len(self._decoder.decode(data))
        return offset


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[list[LogprobEntry]] = field(default_factory=list)  # per token, sampled first
    finish_reason: str | None = None
    stop_reason: object = None
    offsets: _TextOffsets = field(default_factory=_TextOffsets)  # streamed legacy logprobs


def legacy_token(entry: LogprobEntry) -> str:
    """A token as the legacy completions ``logprobs`` name it: its text, or, for a token that
    is not whole UTF-8 by itself (part of an emoji), ``"bytes:"`` and its bytes escaped as
    ``\\xNN`` (OpenAI's form), so that the name gives the bytes back and two such tokens never
    share a name."""
    if entry.token_bytes is None:
        return entry.token or ""
    try:
        return entry.token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in entry.token_bytes)


class ResponseFormatter:
    """Accumulates one request's outputs and renders OpenAI bodies and chunks.

    Args:
        model: the served model name.
        n: number of choices per prompt.
        num_logprobs: top alternatives per token, ``None`` when logprobs were not asked for.
        include_usage: streaming: end with a chunk carrying ``usage``.
        continuous_usage: streaming: every chunk carries ``usage`` too (vLLM's
            ``continuous_usage_stats``): as vLLM's, a choice's chunk counts that choice's
            tokens so far, including the chunk's own (0 in a chat role chunk).
        num_prompts: a completions batch's prompts; prompt ``j``'s choices are numbered
            ``j * n`` to ``j * n + n - 1`` (vLLM's order), and ``usage`` sums the prompts.
        num_prompt_logprobs: top alternatives per prompt token in the body's
            ``prompt_logprobs`` (vLLM's field and shape: per choice for completions, one for
            chat), ``None`` without it.
        echo_logprobs: the echoed prompt's tokens lead each choice's ``logprobs`` (the
            first with a null logprob, as OpenAI's legacy completions), so that they index
            the returned text.
        echo_only: ``echo`` with ``max_tokens`` 0: the generated token the engine needed is
            left out (text, ids, logprobs and count); choices finish with ``length``.
    """

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, model: str, n: int, num_logprobs: int | None, include_usage: bool,
                 continuous_usage: bool = False, num_prompts: int = 1, num_prompt_logprobs: int | None = None,
                 echo_logprobs: bool = False, echo_only: bool = False) -> None:
        self.id = new_id(self.id_prefix)
        self.created = now()
        self.model = model
        self.n = n
        self.choices = [_Choice() for _ in range(n * num_prompts)]  # prompt j's at j*n .. j*n + n-1
        self.num_logprobs = num_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.num_prompt_tokens = [0] * num_prompts
        self.echo_text: list[str | None] = [None] * num_prompts  # each prompt, put before its choices' text (echo)
        self.num_cached_tokens = [0] * num_prompts
        self.num_prompt_logprobs = num_prompt_logprobs
        self.echo_logprobs = echo_logprobs
        self.echo_only = echo_only
        # each prompt's tokens (``EngineOutput.prompt_logprobs``, gathered over its records)
        self.prompt_logprobs: list[list[list[LogprobEntry]]] = [[] for _ in range(num_prompts)]

    # ---- accumulate ----------------------------------------------------------------------

    def add(self, output: EngineOutput, prompt_index: int = 0) -> list[tuple[int, CompletionDelta]]:
        """Record one engine output of the prompt at ``prompt_index``; returns ``(index,
        delta)`` per choice it touched (the response's index)."""
        self._add_prompt(output, prompt_index)
        echo_text, first = self.echo_text[prompt_index], prompt_index * self.n
        deltas = []
        for delta in output["outputs"]:
            index = first + delta["index"]
            choice = self.choices[index]
            if self.echo_only:  # the one token generated is not part of the reply
                delta = {**delta, "text": "", "token_ids": [], "finish_reason": delta["finish_reason"] and "length",
                         "stop_reason": None, "logprobs": None if delta["logprobs"] is None else []}
            if echo_text is not None and not choice.text:
                delta = {**delta, "text": echo_text + delta["text"]}
                if self.echo_logprobs:
                    delta["logprobs"] = self.prompt_logprobs[prompt_index] + (delta["logprobs"] or [])
            choice.text.append(delta["text"])
            choice.num_tokens += len(delta["token_ids"])
            choice.logprobs += delta["logprobs"] or []
            choice.finish_reason = delta["finish_reason"]
            choice.stop_reason = delta["stop_reason"]
            deltas.append((index, delta))
        return deltas

    def _add_prompt(self, output: EngineOutput, prompt_index: int = 0) -> None:
        """The prompt's part of ``output``: its token counts and (echo) text."""
        self.num_prompt_tokens[prompt_index] = output["num_prompt_tokens"]
        self.echo_text[prompt_index] = output.get("prompt_text", self.echo_text[prompt_index])
        self.num_cached_tokens[prompt_index] = output["num_cached_tokens"]
        self.prompt_logprobs[prompt_index] += output.get("prompt_logprobs", [])

    def usage(self, choice: int | None = None) -> dict:
        """Token counts: of every choice and prompt, or of the one choice at index ``choice``
        and its prompt."""
        prompts = slice(None) if choice is None else slice(choice // self.n, choice // self.n + 1)
        counted = self.choices if choice is None else [self.choices[choice]]
        completion = sum(c.num_tokens for c in counted)
        num_prompt_tokens = sum(self.num_prompt_tokens[prompts])
        return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": num_prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.num_cached_tokens[prompts])}}

    # ---- render --------------------------------------------------------------------------

    def response(self) -> dict:
        """The whole non-streaming body."""
        body = {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "usage": self.usage(),
                "choices": [self._full_choice(i, c) for i, c in enumerate(self.choices)]}
        if self.num_prompt_logprobs is not None:
            self._put_prompt_logprobs(body)
        return body

    def _put_prompt_logprobs(self, body: dict) -> None:
        """vLLM's completions: each choice has its prompt's ``prompt_logprobs``."""
        for i, choice in enumerate(body["choices"]):
            choice["prompt_logprobs"] = self._prompt_logprobs(i // self.n)

    def _prompt_logprobs(self, prompt_index: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: ``None`` for the first token, then per token a map of
        token id (a string in JSON) to ``{logprob, rank, decoded_token}``, the prompt's token
        first, then the top ``num_prompt_logprobs`` alternatives."""
        shown = []
        for entry in self.prompt_logprobs[prompt_index]:
            if entry[0].logprob is None:  # the first token: nothing before it
                shown.append(None)
                continue
            alternatives = sorted(entry[1:], key=lambda e: e.rank)[: self.num_prompt_logprobs]
            shown.append({str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}
                          for e in [entry[0], *alternatives]})
        return shown

    def chunks(self, output: EngineOutput, first: bool, prompt_index: int = 0) -> list[str]:
        """SSE lines for one engine output of the prompt at ``prompt_index`` (none for a
        choice whose delta carries nothing)."""
        choices = [self._delta_choice(index, delta) for index, delta in self.add(output, prompt_index)]
        return [self._sse([choice]) for choice in choices if self._carries_something(choice)]

    def _carries_something(self, choice: dict) -> bool:
        return True

    def final_chunks(self) -> list[str]:
        usage = [self._sse([], usage=self.usage())] if self.include_usage else []
        return usage + [DONE]

    def _sse(self, choices: list[dict], **extra) -> str:
        if self.continuous_usage and "usage" not in extra:  # a choice's chunk: that choice's count
            extra["usage"] = self.usage(choices[0]["index"] if len(choices) == 1 else None)
        body = {"id": self.id, "object": self.chunk_object_name, "created": self.created,
                "model": self.model, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def _full_choice(self, index: int, choice: _Choice) -> dict:
        return {"index": index, "text": "".join(choice.text),
                "logprobs": self._logprobs(choice.logprobs, _TextOffsets()),
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}

    def _delta_choice(self, index: int, delta: CompletionDelta) -> dict:
        return {"index": index, "text": delta["text"],
                "logprobs": self._logprobs(delta["logprobs"], self.choices[index].offsets),
                "finish_reason": delta["finish_reason"], "stop_reason": delta["stop_reason"]}

    def _top(self, entry: list[LogprobEntry]) -> list[LogprobEntry]:
        """The top ``num_logprobs`` alternatives of one token, most likely first."""
        return sorted(entry, key=lambda e: e.rank)[: self.num_logprobs]

    def _logprobs(self, entries: list[list[LogprobEntry]] | None, offsets: _TextOffsets) -> dict | None:
        """Completions' legacy shape: tokens, token_logprobs, top_logprobs, text_offset.

        ``top_logprobs`` maps each alternative's ``legacy_token`` to its logprob, and the
        sampled token's where it is not among the top ``logprobs`` (OpenAI: "up to
        logprobs+1 elements"); should two alternatives share a name (two token ids with the
        same bytes), the higher-ranked one keeps it: the shape cannot show both.
        """
        if self.num_logprobs is None or entries is None:
            return None
        top_logprobs: list[dict | None] = []
        for entry in entries:
            if entry[0].logprob is None:  # an echoed prompt's first token: nothing before it
                top_logprobs.append(None)
                continue
            top: dict[str, float] = {}
            for alternative in self._top(entry):
                top.setdefault(legacy_token(alternative), alternative.logprob)
            # OpenAI's legacy shape always has the sampled token: up to logprobs + 1 entries
            top.setdefault(legacy_token(entry[0]), entry[0].logprob)
            top_logprobs.append(top)
        return {"tokens": [legacy_token(e[0]) for e in entries], "token_logprobs": [e[0].logprob for e in entries],
                "top_logprobs": top_logprobs, "text_offset": [offsets.advance(e[0]) for e in entries]}


class ChatFormatter(ResponseFormatter):
    """Chat completions: ``message``/``delta`` objects and the chat logprobs shape; with
    tools, ``tool_calls`` (``app.tool_calls``) and ``finish_reason: "tool_calls"`` where the
    reply stopped having called a tool by its own choice (``auto``, ``required``; see
    ``_ended_by_model``); a call forced by name ends with ``stop``, as OpenAI's and vLLM's do.

    Args:
        tool_mode: how the replies hold tool calls (``ChatCompletionRequest.tool_mode``),
            ``None`` without tools.
    """

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, model: str, n: int, num_logprobs: int | None, include_usage: bool,
                 tool_mode: ToolMode | None = None, continuous_usage: bool = False,
                 num_prompt_logprobs: int | None = None) -> None:
        super().__init__(model, n, num_logprobs, include_usage, continuous_usage,
                         num_prompt_logprobs=num_prompt_logprobs)
        self.tool_mode = tool_mode
        self._tool_streams = [ToolCallStream(tool_mode) for _ in range(n)] if tool_mode else None

    def chunks(self, output: EngineOutput, first: bool, prompt_index: int = 0) -> list[str]:
        # The first chunk of each choice carries the assistant role, as OpenAI's does (with
        # continuous usage: the prompt's tokens, none generated yet, as vLLM's). One prompt.
        if first:
            self._add_prompt(output)
        roles = [self._sse([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None, "stop_reason": None}])
                 for i in range(len(self.choices))] if first else []
        return roles + super().chunks(output, first)

    def _full_choice(self, index: int, choice: _Choice) -> dict:
        text, finish_reason = "".join(choice.text), choice.finish_reason
        message = {"role": "assistant", "content": text}
        if self.tool_mode is not None:
            message = final_message(self.tool_mode, text)
            if message.get("tool_calls") and self._ended_by_model(finish_reason, choice.stop_reason):
                finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": self._logprobs(choice.logprobs, None),
                "finish_reason": finish_reason, "stop_reason": choice.stop_reason}

    def _put_prompt_logprobs(self, body: dict) -> None:
        """vLLM's chat: one ``prompt_logprobs`` beside ``choices`` (one prompt)."""
        body["prompt_logprobs"] = self._prompt_logprobs(0)

    def _ended_by_model(self, finish_reason: str | None, stop_reason: int | str | None) -> bool:
        """Whether a reply with calls finishes with ``tool_calls``: it called by its own
        choice and stopped, not at a length; for ``required`` not at a stop sequence either,
        which may cut the last call's arguments. ``auto``'s calls are whole JSON objects (a
        block counts only where it parses), so a stop sequence after one cuts none of them:
        ``tool_calls`` then, as vLLM's (a trial found ``stop`` at ``</tool_call>``)."""
        if finish_reason != "stop" or self.tool_mode.kind == "named":
            return False
        return stop_reason is None or self.tool_mode.kind == "auto"

    def _carries_something(self, choice: dict) -> bool:
        """False for an empty ``delta`` (tool calls' text held back until a call's name is
        known) with no logprobs and no finish: OpenAI sends no such chunk."""
        return bool(choice["delta"]) or choice["finish_reason"] is not None or choice["logprobs"] is not None

    def _delta_choice(self, index: int, delta: CompletionDelta) -> dict:
        message, finish_reason = {"content": delta["text"]}, delta["finish_reason"]
        if self._tool_streams is not None:
            stream = self._tool_streams[index]
            message = stream.delta(delta["text"], finish_reason is not None)
            if stream.num_calls and self._ended_by_model(finish_reason, delta["stop_reason"]):
                finish_reason = "tool_calls"
        return {"index": index, "delta": message, "logprobs": self._logprobs(delta["logprobs"], None),
                "finish_reason": finish_reason, "stop_reason": delta["stop_reason"]}

    def _logprobs(self, entries: list[list[LogprobEntry]] | None, offsets: None) -> dict | None:
        """The chat shape: per token its text, logprob, raw ``bytes`` (joined over the
        content's tokens they are the content's UTF-8) and ``top_logprobs``."""
        if self.num_logprobs is None or entries is None:
            return None

        def item(e: LogprobEntry) -> dict:
            data = e.token_bytes if e.token_bytes is not None else (e.token or "").encode("utf-8")
            return {"token": e.token or "", "logprob": e.logprob, "bytes": list(data)}

        return {"content": [{**item(entry[0]), "top_logprobs": [item(a) for a in self._top(entry)]}
                            for entry in entries]}
