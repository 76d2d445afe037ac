"""OpenAI ``tool_calls`` from a chat reply, whole and streamed.

Three ways a reply holds calls (``ToolMode.kind``):

- ``named`` (``tool_choice`` names a function): the reply is the call's arguments, a JSON
  object constrained by the function's ``parameters`` schema (``tool_constraint``).
- ``required``: the reply is a JSON array of at least one ``{"name": ..., "parameters":
  {...}}``, each constrained by its function's schema, in xgrammar's JSON without free
  whitespace, so that a stream can be cut into calls as it arrives (``_CallArrayScanner``).
- ``auto``: the reply is free text in which the model may write Hermes
  ``<tool_call>{...}</tool_call>`` blocks (``engine.tool_calls.parse_tool_calls``); with
  ``parallel_tool_calls`` false only the first block becomes a call (later ones are dropped,
  neither calls nor content).

Streamed calls follow OpenAI's chunk shape: the first chunk of a call carries ``index``,
``id``, ``type`` and ``function.name`` (with ``arguments`` so far), later ones
``{"index", "function": {"arguments": fragment}}``.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engine.json_schema import COMBINATORS, is_local_ref, map_schema_objects
from engine.tool_calls import TOOL_CALL_END, TOOL_CALL_START, parse_tool_calls, partial_prefix


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's reply holds tool calls.

    Attributes:
        kind: ``named``, ``required`` or ``auto``.
        name: the function, for ``named``.
        parallel: more than one call may be made (the request's ``parallel_tool_calls``).
    """

    kind: str
    name: str | None = None
    parallel: bool = True


def tool_constraint(functions: list[dict], mode: ToolMode, parallel_tool_calls: bool) -> dict | None:
    """``StructuredOutputsParams`` kwargs that force a call (``named``, ``required``),
    ``None`` for ``auto``. A schema without a ``type`` gets ``"type": "object"``, unless it
    is a reference or a combination (``$ref``, ``anyOf``, ``oneOf``, ``allOf``), where xgrammar
    would apply that and not the type (``engine.structured_outputs.check_enforceable``).
    A function without ``parameters`` takes none: its arguments are ``{}`` (OpenAI's API
    reference, ``tools[].function.parameters``: omitting it defines an empty parameter list).

    Args:
        functions: the tools' function definitions (``name``, ``parameters``), without the
            keys left out of the request (``model_dump(exclude_none=True)``).
    """
    parameters = {f["name"]: _object_schema(f.get("parameters")) for f in functions}
    if mode.kind == "named":
        return {"json": parameters[mode.name], "disable_any_whitespace": True}
    if mode.kind != "required":
        return None
    # Each tool's schema sits inside the array's: its local references ("#/$defs/Address",
    # "#/properties/to") are rebased to where it sits, so each keeps its own definitions.
    calls = [{"type": "object", "properties": {
                 "name": {"const": name},
                 "parameters": rebase_refs(schema, f"/items/anyOf/{i}/properties/parameters")},
              "required": ["name", "parameters"], "additionalProperties": False}
             for i, (name, schema) in enumerate(parameters.items())]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return {"json": schema, "disable_any_whitespace": True}


def _object_schema(schema: dict | None) -> dict:
    if schema is None:  # no parameters: an empty object
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if "type" in schema or any(key in schema for key in ("$ref", *COMBINATORS)):
        return schema
    return {"type": "object", **schema}


def rebase_refs(schema, base: str):
    """``schema`` with every local ``$ref`` (``"#"`` or ``"#/<JSON pointer>"``, JSON Schema
    2020-12 section 8.2.3.1, RFC 6901) moved under ``base``: the JSON pointer at which
    ``schema`` is placed inside a larger schema. Other references (``"#anchor"``, URIs) and
    data (``const``, ``enum``, ``default``, ``examples``) are left as they are; ``schema``
    is not changed (a copy of what is rebased is returned)."""
    def rebase(node: dict) -> dict:
        if is_local_ref(node.get("$ref")):
            node["$ref"] = "#" + base + node["$ref"][1:]
        return node

    return map_schema_objects(schema, rebase)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str, index: int | None = None) -> dict:
    call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def final_message(mode: ToolMode, text: str) -> dict:
    """The ``message`` of a whole reply: ``tool_calls`` where it holds calls (``content``
    then ``None``, or the text around Hermes blocks), else the text as ``content``. A forced
    call (``named``, ``required``) is never content: cut by ``max_tokens``, its calls are
    those begun, the last one's arguments cut too, as a stream delivers them."""
    calls: list[tuple[str, str]] = []
    content: str | None = text
    if mode.kind == "named":
        calls, content = [(mode.name, text)], None
    elif mode.kind == "required":  # cut short by max_tokens, the last call's arguments are too
        scanner = _CallArrayScanner()
        scanner.feed(text)
        calls, content = [(c.name, c.arguments) for c in scanner.calls], None
    else:
        content, parsed = parse_tool_calls(text)
        calls = [(c["name"], c["arguments"]) for c in parsed][:None if mode.parallel else 1]
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [_call(name, arguments) for name, arguments in calls]
    return message


@dataclass
class _ScannedCall:
    name: str
    arguments: str = ""  # so far
    closed: bool = False


# A call's opening as the grammar writes it ({"name": "...", "parameters": ): its order;
# xgrammar's JSON without "any whitespace" still puts one space after "," and ":".
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*(?=\{)')


@dataclass
class _CallArrayScanner:
    """Cuts ``[{"name": "f", "parameters": {...}}, ...]`` (``required``'s JSON) into
    calls as its text arrives: names once written, arguments as far as written."""

    text: str = ""
    calls: list[_ScannedCall] = field(default_factory=list)
    complete: bool = False  # the array's closing bracket was seen
    _pos: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _call_start: int | None = None  # where the open call's "{" is
    _args_start: int | None = None  # where its arguments begin

    def feed(self, delta: str) -> None:
        self.text += delta
        while self._pos < len(self.text):
            self._step(self.text[self._pos])
            self._pos += 1
        if self._args_start is not None:
            self.calls[-1].arguments = self.text[self._args_start:]
        elif self._call_start is not None:
            head = _CALL_HEAD.match(self.text, self._call_start)
            if head:
                self.calls.append(_ScannedCall(_json_string(head.group(1))))
                self._args_start = head.end()
                self.calls[-1].arguments = self.text[self._args_start:]

    def _step(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return
        if char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:
                self._call_start, self._args_start = self._pos, None
        elif char in "]}":
            self._depth -= 1
            if self._depth == 1 and self._call_start is not None:  # the call object closed
                self._close_call()
            elif self._depth == 0:
                self.complete = True

    def _close_call(self) -> None:
        if self._args_start is None:  # the head and its arguments arrived with the close
            head = _CALL_HEAD.match(self.text, self._call_start)
            self.calls.append(_ScannedCall(_json_string(head.group(1))))
            self._args_start = head.end()
        self.calls[-1].arguments = self.text[self._args_start:self._pos].rstrip()
        self.calls[-1].closed = True
        self._call_start = self._args_start = None


def _json_string(body: str) -> str:
    return json.loads(f'"{body}"')


class ToolCallStream:
    """One choice's streamed reply turned into ``delta`` objects.

    Args:
        mode: how the reply holds calls.
    """

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.num_calls = 0  # calls begun in the stream
        self._sent_arguments: list[int] = []  # characters of each call's arguments sent
        self._ids: list[str] = []
        self._scanner = _CallArrayScanner()
        self._held = ""  # auto: text that may be (the start of) a <tool_call> block
        self._blank = ""  # auto: content held back while all of it so far is whitespace
        self._content_shown = False  # auto: content with more than whitespace has been sent

    def delta(self, text: str, finished: bool) -> dict:
        """The ``delta`` for ``text``, the reply's next piece (``{}`` when all of it is held
        back); ``finished`` flushes what ``auto`` holds back."""
        if self.mode.kind == "named":
            return self._calls_delta([(self.mode.name, text)], append=True)
        if self.mode.kind == "required":
            self._scanner.feed(text)
            return self._calls_delta([(c.name, c.arguments) for c in self._scanner.calls])
        return self._auto_delta(text, finished)

    def _calls_delta(self, calls: list[tuple[str, str]], append: bool = False) -> dict:
        """Chunks for calls whose arguments grew: ``calls`` are all calls so far with their
        whole arguments, or (``append``) the one call with its new fragment."""
        items = []
        for index, (name, arguments) in enumerate(calls):
            if index == self.num_calls:  # a new call: its id, name and arguments so far
                self.num_calls += 1
                self._sent_arguments.append(0)
                self._ids.append(new_call_id())
                items.append({"index": index, "id": self._ids[index], "type": "function",
                              "function": {"name": name, "arguments": ""}})
            fragment = arguments if append else arguments[self._sent_arguments[index]:]
            self._sent_arguments[index] += len(fragment)
            if not fragment:
                continue
            if items and items[-1]["index"] == index:
                items[-1]["function"]["arguments"] = fragment
            else:
                items.append({"index": index, "function": {"arguments": fragment}})
        return {"tool_calls": items} if items else {}

    def _auto_delta(self, text: str, finished: bool) -> dict:
        self._held += text
        content, calls = [], []
        while self._held:
            start = self._held.find(TOOL_CALL_START)
            if start < 0:  # hold back only a tail that may begin a block
                keep = 0 if finished else partial_prefix(self._held, TOOL_CALL_START)
                content.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            content.append(self._held[:start])
            end = self._held.find(TOOL_CALL_END, start)
            if end < 0:
                if finished:  # an unclosed last block: a call where it holds a whole one, else text
                    rest, parsed = parse_tool_calls(self._held[start:])
                    calls += [(c["name"], c["arguments"]) for c in parsed]
                    content.append(rest or "")
                    self._held = ""
                else:
                    self._held = self._held[start:]
                break
            block = self._held[start:end + len(TOOL_CALL_END)]
            self._held = self._held[end + len(TOOL_CALL_END):]
            _, parsed = parse_tool_calls(block)
            if parsed:
                calls += [(c["name"], c["arguments"]) for c in parsed]
            else:
                content.append(block)
        if not self.mode.parallel:  # one call in all: what follows the first is dropped
            calls = calls[:max(0, 1 - self.num_calls)]
        text = "".join(content)
        if not self._content_shown:  # as final_message: content that is only whitespace beside calls is none
            self._blank += text
            if self._blank.strip() or (finished and not (self.num_calls or calls)):
                text, self._blank, self._content_shown = self._blank, "", True
            else:
                text = ""
        delta = {}
        if text:
            delta["content"] = text
        if calls:
            delta.update(self._calls_delta([(None, "")] * self.num_calls + calls))
        return delta

