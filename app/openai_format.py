"""Engine output dicts (``app.engine_server.output_to_dict``) to OpenAI response bodies and
server-sent-event chunks, for completions and chat completions."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from app.protocol import new_id, now
from app.records import CompletionDelta, EngineOutput, LogprobEntry

DONE = "data: [DONE]\n\n"


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[list[LogprobEntry]] = field(default_factory=list)  # per token, sampled first
    finish_reason: str | None = None
    stop_reason: object = None


class ResponseFormatter:
    """Accumulates one request's outputs and renders OpenAI bodies and chunks.

    Args:
        model: the served model name.
        n: number of choices.
        num_logprobs: top alternatives per token, ``None`` when logprobs were not asked for.
        include_usage: streaming: end with a chunk carrying ``usage``.
    """

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, model: str, n: int, num_logprobs: int | None, include_usage: bool) -> None:
        self.id = new_id(self.id_prefix)
        self.created = now()
        self.model = model
        self.choices = [_Choice() for _ in range(n)]
        self.num_logprobs = num_logprobs
        self.include_usage = include_usage
        self.num_prompt_tokens = 0

    # ---- accumulate ----------------------------------------------------------------------

    def add(self, output: EngineOutput) -> list[tuple[int, CompletionDelta]]:
        """Record one engine output; returns ``(index, delta)`` per choice it touched."""
        self.num_prompt_tokens = output["num_prompt_tokens"]
        deltas = []
        for delta in output["outputs"]:
            choice = self.choices[delta["index"]]
            choice.text.append(delta["text"])
            choice.num_tokens += len(delta["token_ids"])
            choice.logprobs += delta["logprobs"] or []
            choice.finish_reason = delta["finish_reason"]
            choice.stop_reason = delta["stop_reason"]
            deltas.append((delta["index"], delta))
        return deltas

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion}

    # ---- render --------------------------------------------------------------------------

    def response(self) -> dict:
        """The whole non-streaming body."""
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "usage": self.usage(),
                "choices": [self._full_choice(i, c) for i, c in enumerate(self.choices)]}

    def chunks(self, output: EngineOutput, first: bool) -> list[str]:
        """SSE lines for one engine output."""
        return [self._sse([self._delta_choice(index, delta)]) for index, delta in self.add(output)]

    def final_chunks(self) -> list[str]:
        usage = [self._sse([], usage=self.usage())] if self.include_usage else []
        return usage + [DONE]

    def _sse(self, choices: list[dict], **extra) -> str:
        body = {"id": self.id, "object": self.chunk_object_name, "created": self.created,
                "model": self.model, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def _full_choice(self, index: int, choice: _Choice) -> dict:
        return {"index": index, "text": "".join(choice.text),
                "logprobs": self._logprobs(choice.logprobs), "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}

    def _delta_choice(self, index: int, delta: CompletionDelta) -> dict:
        return {"index": index, "text": delta["text"], "logprobs": self._logprobs(delta["logprobs"]),
                "finish_reason": delta["finish_reason"], "stop_reason": delta["stop_reason"]}

    def _top(self, entry: list[LogprobEntry]) -> list[LogprobEntry]:
        """The top ``num_logprobs`` alternatives of one token, most likely first."""
        return sorted(entry, key=lambda e: e.rank)[: self.num_logprobs]

    def _logprobs(self, entries: list[list[LogprobEntry]] | None) -> dict | None:
        """Completions' legacy shape: tokens, token_logprobs, top_logprobs, text_offset."""
        if self.num_logprobs is None or entries is None:
            return None
        offsets, offset = [], 0
        for entry in entries:
            offsets.append(offset)
            offset += len(entry[0].token or "")
        return {"tokens": [e[0].token for e in entries], "token_logprobs": [e[0].logprob for e in entries],
                "top_logprobs": [{alt.token: alt.logprob for alt in self._top(e)} for e in entries],
                "text_offset": offsets}


class ChatFormatter(ResponseFormatter):
    """Chat completions: ``message``/``delta`` objects and the chat logprobs shape."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def chunks(self, output: EngineOutput, first: bool) -> list[str]:
        # The first chunk of each choice carries the assistant role, as OpenAI's does.
        roles = [self._sse([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
                 for i in range(len(self.choices))] if first else []
        return roles + super().chunks(output, first)

    def _full_choice(self, index: int, choice: _Choice) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": self._logprobs(choice.logprobs), "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}

    def _delta_choice(self, index: int, delta: CompletionDelta) -> dict:
        return {"index": index, "delta": {"content": delta["text"]},
                "logprobs": self._logprobs(delta["logprobs"]),
                "finish_reason": delta["finish_reason"], "stop_reason": delta["stop_reason"]}

    def _logprobs(self, entries: list[list[LogprobEntry]] | None) -> dict | None:
        if self.num_logprobs is None or entries is None:
            return None

        def item(e: LogprobEntry) -> dict:
            text = e.token or ""
            return {"token": text, "logprob": e.logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(entry[0]), "top_logprobs": [item(a) for a in self._top(entry)]}
                            for entry in entries]}
