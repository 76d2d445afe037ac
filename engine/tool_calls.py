"""Tools in a chat prompt and tool calls in a reply, in the Hermes format (the format of
vLLM's ``hermes`` tool parser, and of Qwen's and NousResearch's chat templates).

A chat template that takes ``tools`` (its source names them) renders them itself. For one
that does not (SmolLM2's), ``conversation_with_tools`` writes them into the system message:
each function's JSON definition inside ``<tools></tools>``, and the instruction to answer a
call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. An assistant message
carrying ``tool_calls`` becomes its content followed by one such block per call, and a tool
result (``role: "tool"``) becomes ``<tool_response>{content}</tool_response>``, so that
the model sees a conversation in the format it is asked to write.

``parse_tool_calls`` reads the blocks back out of a reply: text outside them stays content;
a block whose JSON is not a call stays content too.
"""
from __future__ import annotations

import json
import re

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.DOTALL)


def template_takes_tools(chat_template: str) -> bool:
    """Whether a Jinja chat template renders a ``tools`` variable."""
    return re.search(r"\btools\b", chat_template) is not None


def tools_system_prompt(tools: list[dict]) -> str:
    """The Hermes-style instructions for ``tools`` (function definitions: ``name``,
    ``description``, ``parameters``)."""
    definitions = "\n".join(json.dumps({"type": "function", "function": tool}, ensure_ascii=False)
                            for tool in tools)
    return ("You can call functions to answer the user. Their definitions, one JSON object a "
            f"line, are inside <tools></tools>:\n<tools>\n{definitions}\n</tools>\n"
            "To call a function, reply with a JSON object of its name and arguments inside "
            "<tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>')


def conversation_with_tools(conversation: list[dict], tools: list[dict] | None) -> list[dict]:
    """``conversation`` for a template that does not take tools: the tools' instructions in
    the system message (the first one, or a new one), calls and results as text.

    Args:
        conversation: OpenAI chat messages (``role``, ``content``; ``tool_calls`` on an
            assistant message, ``tool_call_id`` on a tool message).
        tools: function definitions, or ``None`` to leave the system message alone.
    """
    messages = [_as_text(message) for message in conversation]
    if tools:
        instructions = tools_system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + instructions}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages


def _as_text(message: dict) -> dict:
    content = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or []
    blocks = [f"{TOOL_CALL_START}\n{json.dumps(_call_json(call), ensure_ascii=False)}\n{TOOL_CALL_END}"
              for call in calls]
    return {"role": message["role"], "content": "\n".join(([content] if content else []) + blocks)}


def _call_json(call: dict) -> dict:
    function = call["function"]
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, or JSON Python's parser refuses (too deep, huge numbers)
        pass  # the client's own text: shown as it was sent
    return {"name": function["name"], "arguments": arguments}


def conversation_for_template(conversation: list[dict]) -> list[dict]:
    """``conversation`` for a template that takes tools: call arguments as objects (the
    transformers convention for ``tool_calls`` in a chat template)."""
    messages = []
    for message in conversation:
        message = {key: value for key, value in message.items() if value is not None}
        if message.get("tool_calls"):
            message["tool_calls"] = [{**call, "function": _call_json(call)} for call in message["tool_calls"]]
        messages.append(message)
    return messages


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The Hermes blocks of a reply.

    A last block without its ``</tool_call>`` (the reply ended at EOS, a stop sequence or
    ``max_tokens`` right after the call, or inside the closing tag) counts where its content
    is a whole call, as in vLLM's hermes parser (which also takes the unclosed block, but not
    one cut inside its closing tag).

    Returns:
        ``(content, calls)``: the text outside the blocks that parsed (``None`` if only
        whitespace is left), and ``{"name": str, "arguments": JSON text}`` per block whose
        content is a JSON object with a string ``name`` (``arguments`` defaults to ``{}``).
    """
    calls, kept, end = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        call = _parse_call(match.group(1))
        if call is None:
            continue
        kept.append(text[end:match.start()])
        end = match.end()
        calls.append(call)
    start = text.find(TOOL_CALL_START, end)
    last = None
    if start >= 0 and TOOL_CALL_END not in text[start:]:
        body = text[start + len(TOOL_CALL_START):]
        last = _parse_call(body[:len(body) - partial_prefix(body, TOOL_CALL_END)])  # "}}\n</tool" cut by max_tokens
    if last is not None:  # an unclosed last block
        kept.append(text[end:start])
        end = len(text)
        calls.append(last)
    kept.append(text[end:])
    content = "".join(kept)
    return (content if content.strip() else None) if calls else text, calls


def partial_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _parse_call(body: str) -> dict | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or JSON Python's parser refuses (too deep, huge numbers)
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
