"""Hermes tool calls in a prompt and in a reply (``engine.tool_calls``): what Python's JSON
parser refuses although it is JSON (nesting past its recursion limit, an integer of more than
4,300 digits) stays text, as any text that is not a call does; it was a 500."""
import json

import pytest

from engine.tool_calls import conversation_for_template, conversation_with_tools, parse_tool_calls

DEEP = "[" * 5000 + "]" * 5000
HUGE = '{"n": ' + "9" * 5000 + "}"


def _assistant_call(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


@pytest.mark.parametrize("arguments", [DEEP, HUGE, "not json"])
def test_call_arguments_python_cannot_parse_are_shown_as_sent(arguments):
    [_, call] = conversation_with_tools(_assistant_call(arguments), None)[:2]
    assert call["content"] == f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    templated = conversation_for_template(_assistant_call(arguments))[1]["tool_calls"][0]["function"]
    assert templated == {"name": "f", "arguments": arguments}


def test_call_arguments_that_parse_are_an_object_for_the_template():
    templated = conversation_for_template(_assistant_call('{"city": "Oslo"}'))[1]["tool_calls"][0]["function"]
    assert templated == {"name": "f", "arguments": {"city": "Oslo"}}


@pytest.mark.parametrize("body", [f'{{"name": "f", "arguments": {DEEP}}}', f'{{"name": "f", "arguments": {HUGE}}}'])
def test_a_reply_block_python_cannot_parse_stays_content(body):
    text = f"Sure.<tool_call>{body}</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls(text + '<tool_call>{"name": "g", "arguments": {"a": 1}}</tool_call>') == \
        (text, [{"name": "g", "arguments": '{"a": 1}'}])
