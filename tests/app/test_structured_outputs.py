"""Structured outputs and tool calls over HTTP, through the official ``openai`` client:
``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` and its
``guided_*`` aliases, ``tools`` with ``tool_choice`` required / named / auto, streamed and
not; bad constraints are 400s naming the field, streamed or not, before any SSE byte."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests
import xgrammar

from app.tool_calls import ToolCallStream, ToolMode, final_message, tool_constraint
from tests.app.conftest import MODEL

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CAT = "Describe a cat as a small JSON object with keys name and age."
QUESTION = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                  "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _chat(client, stream: bool, **kwargs):
    """A chat completion through the openai client: ``(message-like dict, finish_reason)``,
    the stream's deltas put back together the way OpenAI's documentation does."""
    kwargs = {"model": MODEL, "messages": QUESTION, "max_tokens": 200, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "tool_calls": calls}, choice.finish_reason
    content, calls, finish_reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": None, "arguments": ""})
            entry["name"] = entry["name"] or call.function.name
            entry["arguments"] += call.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}, finish_reason


def _concurrently(fn, args) -> list:
    """``[fn(a) for a in args]``, the calls made at once from threads (the openai client is
    thread-safe); the first exception raised is raised here."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(fn, args))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_and_json_object(client, stream):
    people = _concurrently(lambda seed: _chat(
        client, stream, messages=[{"role": "user", "content": "A person as JSON."}], temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}),
        range(3))
    for message, finish_reason in people:
        assert finish_reason == "stop"
        jsonschema.validate(json.loads(message["content"]), PERSON)
    message, finish_reason = _chat(client, stream, messages=[{"role": "user", "content": CAT}],
                                   temperature=0, response_format={"type": "json_object"})
    assert finish_reason == "stop" and isinstance(json.loads(message["content"]), dict)


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ("structured_outputs", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ("structured_outputs", {"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("structured_outputs", {"grammar": 'root ::= ("ab" | "cd") ("ab" | "cd")? "!"'},
     lambda t: re.fullmatch(r"(ab|cd){1,2}!", t)),
    ("guided_regex", r"[a-z]{5}", lambda t: re.fullmatch(r"[a-z]{5}", t)),
    ("guided_choice", ["red", "blue"], lambda t: t in ("red", "blue")),
    ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("guided_grammar", 'root ::= [0-9] [0-9]? "." [0-9]', lambda t: re.fullmatch(r"[0-9]{1,2}\.[0-9]", t)),
])
def test_vllm_constraints_on_completions(client, field, value, check):
    for seed in range(2):
        completion = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=100, temperature=1.0,
                                               seed=seed, extra_body={field: value})
        text = completion.choices[0].text
        assert completion.choices[0].finish_reason == "stop" and check(text), text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_and_named(client, stream):
    # parallel_tool_calls false: one call (this 135M model, greedy, repeats calls without end)
    for tool_choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        message, finish_reason = _chat(client, stream, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                                       parallel_tool_calls=False)
        # a call forced by name ends with stop, as OpenAI's and vLLM's do
        assert finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
        assert message["content"] is None and message["tool_calls"], message
        for call in message["tool_calls"]:
            assert call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        if isinstance(tool_choice, dict):
            assert [c["name"] for c in message["tool_calls"]] == ["get_time"]
        assert len(message["tool_calls"]) == 1
    # Sampled, several calls allowed: three seeds at once, one batch in the engine (the
    # longest of them sets the time, not their sum: 28 s for this test instead of 32).
    sampled = _concurrently(lambda seed: _chat(client, stream, tools=TOOLS, tool_choice="required", temperature=1.0,
                                               seed=seed, max_tokens=160), range(3))
    for message, finish_reason in sampled:
        assert finish_reason in ("tool_calls", "length") and message["content"] is None
        assert len(message["tool_calls"]) >= 1
        # Cut by max_tokens (more calls than it holds), the last call's arguments are cut too.
        for call in message["tool_calls"][:-1] if finish_reason == "length" else message["tool_calls"]:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_and_none_and_a_conversation_with_tool_results(client):
    # The conversation carries an assistant call and its result; the model answers in text.
    history = [*QUESTION,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "unit": "celsius", "days": 3}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 24 C"}'}]
    for tool_choice in ["auto", "none"]:
        message, finish_reason = _chat(client, False, messages=history, tools=TOOLS, tool_choice=tool_choice,
                                       temperature=0, max_tokens=30)
        assert finish_reason in ("stop", "length", "tool_calls")
        assert message["content"] or message["tool_calls"]
    # Greedy, whole and streamed agree (what auto parses is the same text either way).
    whole = _chat(client, False, tools=TOOLS, temperature=0, max_tokens=60)
    streamed = _chat(client, True, tools=TOOLS, temperature=0, max_tokens=60)
    assert [(c["name"], c["arguments"]) for c in whole[0]["tool_calls"]] == \
        [(c["name"], c["arguments"]) for c in streamed[0]["tool_calls"]]
    assert whole[0]["content"] == streamed[0]["content"] and whole[1] == streamed[1]


def test_hermes_blocks_in_a_reply_become_tool_calls():
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    message = final_message(ToolMode("auto"), text)
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_time", '{"timezone": "UTC"}')]
    # Streamed in pieces of any size: the same content and call, the tag never leaks.
    for size in (1, 4, 11):
        stream = ToolCallStream(ToolMode("auto"))
        deltas = [stream.delta(text[i:i + size], i + size >= len(text)) for i in range(0, len(text), size)]
        assert "".join(d.get("content", "") for d in deltas) == "Let me check."
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [("get_time", '{"timezone": "UTC"}')]
    # Not a call: stays content.
    assert final_message(ToolMode("auto"), "<tool_call>not json</tool_call>")["content"] == \
        "<tool_call>not json</tool_call>"


def test_an_unclosed_last_block_is_a_call_where_it_holds_a_whole_one():
    """A reply ended by EOS, ``max_tokens`` or a stop sequence such as ``</tool_call>`` right
    after a call's JSON: vLLM's hermes parser takes the unclosed last block; a trial found
    it left as content here. A block cut inside its JSON stays content. The finish is
    ``tool_calls`` once auto made calls and stopped, at a stop sequence too (vLLM's)."""
    from app.openai_format import ChatFormatter

    call = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n'
    for text, content, calls in (
            ("Checking. " + call, "Checking. ", [("get_time", '{"timezone": "UTC"}')]),
            (call + "</tool_call> and " + call, " and ", [("get_time", '{"timezone": "UTC"}')] * 2),
            ("Checking. " + call[:-8], "Checking. " + call[:-8], [])):  # cut inside the JSON
        _assert_whole_and_streamed_agree(text, content, calls)
    finishes = {kind: [ChatFormatter("m", 1, None, False, ToolMode(kind, name="f"))._ended_by_model(*end)
                       for end in (("stop", None), ("stop", "</tool_call>"), ("stop", 2), ("length", None))]
                for kind in ("auto", "required", "named")}
    assert finishes == {"auto": [True, True, True, False], "required": [True, False, False, False],
                        "named": [False] * 4}


def _assert_whole_and_streamed_agree(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    """``auto``'s message for ``text`` and its stream in pieces of 1, 5 and all characters:
    the same calls, and the stream's content joined is the message's (none as empty)."""
    message = final_message(ToolMode("auto"), text)
    assert (message["content"], [(c["function"]["name"], c["function"]["arguments"])
                                 for c in message.get("tool_calls", [])]) == (content, calls)
    for size in (1, 5, len(text)):
        stream = ToolCallStream(ToolMode("auto"))
        deltas = [stream.delta(text[i:i + size], i + size >= len(text)) for i in range(0, len(text), size)]
        streamed = [(c["function"]["name"], c["function"]["arguments"])
                    for d in deltas for c in d.get("tool_calls", [])]
        assert ("".join(d.get("content", "") for d in deltas), streamed) == (content or "", calls), size


def test_a_call_cut_inside_its_closing_tag_and_whitespace_beside_calls():
    """A sixth trial: max_tokens cutting "</tool_call>" after a whole call lost the call (28-30
    tokens, where 27 kept it), and two calls with only a newline between them streamed content
    "\n" where the whole reply had none."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n'
    get_time = ("get_time", '{"timezone": "UTC"}')
    for cut in ("</", "</tool", "</tool_call"):
        _assert_whole_and_streamed_agree("Checking. " + call + cut, "Checking. ", [get_time])
    _assert_whole_and_streamed_agree(call + "</tool_call>\n" + call + "</tool_call>\n", None, [get_time] * 2)
    _assert_whole_and_streamed_agree("\n\n" + call + "</tool_call>", None, [get_time])
    _assert_whole_and_streamed_agree("  \n", "  \n", [])  # no calls: the text is the content, blank or not
    _assert_whole_and_streamed_agree("\n\nSure. " + call + "</tool_call>\n", "\n\nSure. \n", [get_time])


def test_auto_without_parallel_tool_calls_keeps_the_first_call():
    call = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "%s"}}\n</tool_call>'
    text = "Checking." + call % "UTC" + " and " + call % "CET"
    calls = [("get_time", '{"timezone": "UTC"}'), ("get_time", '{"timezone": "CET"}')]
    for parallel, expected in ((True, calls), (False, calls[:1])):
        mode = ToolMode("auto", parallel=parallel)
        message = final_message(mode, text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == expected
        assert message["content"] == "Checking. and "
        for size in (1, 7, len(text)):
            stream = ToolCallStream(mode)
            deltas = [stream.delta(text[i:i + size], i + size >= len(text)) for i in range(0, len(text), size)]
            streamed = [c for d in deltas for c in d.get("tool_calls", [])]
            assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
                [(i, name, arguments) for i, (name, arguments) in enumerate(expected)]
            assert "".join(d.get("content", "") for d in deltas) == "Checking. and "


def test_required_calls_are_cut_from_the_stream_as_they_arrive():
    text = '[{"name": "get_time", "parameters": {"timezone": "A\\"}"}}, {"name":"get_weather","parameters":{}}]'
    for size in (1, 3, 50):
        stream = ToolCallStream(ToolMode("required"))
        calls: dict[int, dict] = {}
        for i in range(0, len(text), size):
            for item in stream.delta(text[i:i + size], False).get("tool_calls", []):
                entry = calls.setdefault(item["index"], {"name": item["function"].get("name"), "arguments": ""})
                entry["arguments"] += item["function"]["arguments"]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [("get_time", '{"timezone": "A\\"}"}'), ("get_weather", "{}")]
    assert [c["function"]["arguments"] for c in final_message(ToolMode("required"), text)["tool_calls"]] == \
        ['{"timezone": "A\\"}"}', "{}"]
    cut = final_message(ToolMode("required"), text[:text.index("{}}]") + 1])  # cut by max_tokens: as streamed
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in cut["tool_calls"]] == \
        [("get_time", '{"timezone": "A\\"}"}'), ("get_weather", "{")]
    assert cut["content"] is None


ADDRESS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
# as openai.pydantic_function_tool writes a model with a field of another model: "$defs" and "$ref"s into it
SHIP = {"type": "function", "function": {"name": "ship", "description": "Ship a parcel.", "strict": True,
                                         "parameters": {
    "type": "object", "$defs": {"Address": ADDRESS},
    "properties": {"to": {"$ref": "#/$defs/Address"}, "weight_kg": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["to", "weight_kg"], "additionalProperties": False}}}
SHIP_AGAIN = {"type": "function", "function": {"name": "ship_back", "parameters": {
    "type": "object", "$defs": {"Address": ADDRESS}, "properties": {"from": {"$ref": "#/$defs/Address"}},
    "required": ["from"], "additionalProperties": False}}}


def test_required_calls_keep_each_tools_definitions():
    # Inside the array of calls a tool's "#/$defs/Address" pointed at the array's schema, which
    # had none: xgrammar refused it (a 400 on a valid tool). Each tool's references are rebased.
    constraint = tool_constraint([SHIP["function"], SHIP_AGAIN["function"]], ToolMode("required"), True)
    schema = constraint["json"]
    assert "$defs" not in schema
    ship, ship_back = (call["properties"]["parameters"] for call in schema["items"]["anyOf"])
    assert ship["properties"]["to"] == {"$ref": "#/items/anyOf/0/properties/parameters/$defs/Address"}
    assert ship_back["properties"]["from"] == {"$ref": "#/items/anyOf/1/properties/parameters/$defs/Address"}
    assert SHIP["function"]["parameters"]["properties"]["to"] == {"$ref": "#/$defs/Address"}  # not changed
    calls = [{"name": "ship", "parameters": {"to": {"city": "Oslo"}, "weight_kg": 2}},
             {"name": "ship_back", "parameters": {"from": {"city": "Rome"}}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ship", "parameters": {"to": {"town": "Oslo"}, "weight_kg": 2}}], schema)
    # Two tools may define one name differently: each reference finds its own tool's.
    other = {"name": "g", "parameters": {"type": "object", "$defs": {"Address": {"type": "string"}},
                                         "properties": {"a": {"$ref": "#/$defs/Address"}}}}
    schema = tool_constraint([SHIP["function"], other], ToolMode("required"), True)["json"]
    jsonschema.validate([calls[0], {"name": "g", "parameters": {"a": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {"a": {"city": "Oslo"}}}], schema)
    # a tool forced by name keeps its schema whole
    named = tool_constraint([SHIP["function"]], ToolMode("named", "ship"), True)["json"]
    assert named == SHIP["function"]["parameters"]
    # a reference at the top gets no "type" beside it (xgrammar would apply only the reference)
    ref = {"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    assert tool_constraint([{"name": "r", "parameters": ref}], ToolMode("named", "r"), True)["json"] == ref
    assert tool_constraint([{"name": "p", "parameters": {}}], ToolMode("named", "p"), True)["json"] == {
        "type": "object"}
    # no parameters at all: none to give (OpenAI: an empty parameter list), not any object
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    assert tool_constraint([{"name": "q"}], ToolMode("named", "q"), True)["json"] == empty
    assert tool_constraint([{"name": "q"}], ToolMode("required"), True)["json"]["items"]["anyOf"][0][
        "properties"]["parameters"] == empty


def test_a_function_without_parameters_is_called_with_none(client):
    # It got whatever arguments the model made up ({"location": "Paris", ...}) before.
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time now."}}]
    for tool_choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        message, _ = _chat(client, False, tools=tools, tool_choice=tool_choice, temperature=0,
                           parallel_tool_calls=False, max_tokens=40)
        assert [(c["name"], c["arguments"]) for c in message["tool_calls"]] == [("get_time", "{}")], message


def test_references_into_a_tools_own_properties_and_root_are_rebased():
    tree = {"name": "tree", "parameters": {
        "type": "object", "properties": {
            "label": {"type": "string", "maxLength": 3}, "alias": {"$ref": "#/properties/label"},
            "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
            # data is not rebased: a "$ref" key in a const or an enum is a value
            "kind": {"const": {"$ref": "#/x"}}, "enum": {"enum": [{"$ref": "#"}]}},
        "required": ["label"], "additionalProperties": False}}
    schema = tool_constraint([TOOLS[0]["function"], tree], ToolMode("required"), True)["json"]
    properties = schema["items"]["anyOf"][1]["properties"]["parameters"]["properties"]
    base = "#/items/anyOf/1/properties/parameters"
    assert properties["alias"] == {"$ref": base + "/properties/label"}
    assert properties["children"]["items"] == {"$ref": base}
    assert properties["kind"] == {"const": {"$ref": "#/x"}} and properties["enum"] == {"enum": [{"$ref": "#"}]}
    good = {"label": "a", "alias": "b", "children": [{"label": "c", "children": [{"label": "d"}]}]}
    jsonschema.validate([{"name": "tree", "parameters": good}], schema)
    for bad in ({"label": "a", "alias": "long"}, {"label": "a", "children": [{"label": "a", "x": 1}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "tree", "parameters": bad}], schema)
    # and xgrammar compiles it
    xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def test_an_error_in_the_calls_schema_names_the_tool_and_its_own_pointer():
    from app.protocol import ChatCompletionRequest
    from engine.errors import InvalidRequestError
    from engine.structured_outputs import grammar_of

    request = ChatCompletionRequest.model_validate({
        "model": MODEL, "messages": QUESTION, "tool_choice": "required",
        "tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}}]})
    with pytest.raises(InvalidRequestError) as raised:  # the engine's compile, xgrammar's words
        grammar_of(request.structured_outputs_params())
    engine_message = str(raised.value)
    assert "#/items/anyOf/1/properties/parameters/$defs/A" in engine_message
    assert request.client_param(engine_message, raised.value.param) == (
        "tools[1].function.parameters: Cannot find field '$defs' in #/$defs/A", "tools[1].function.parameters")
    # a keyword xgrammar would not enforce, in the second tool: named with the tool's own pointer
    request = ChatCompletionRequest.model_validate({
        "model": MODEL, "messages": QUESTION, "tool_choice": "required",
        "tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]})
    with pytest.raises(InvalidRequestError) as raised:
        grammar_of(request.structured_outputs_params())
    assert request.client_param(str(raised.value), raised.value.param) == (
        'tools[1].function.parameters: "uniqueItems": true at #/properties/a is not enforced by the grammar '
        "engine (xgrammar), so the output would not be checked against it; remove it",
        "tools[1].function.parameters")
    # an error that names no tool's schema stays the tools' (the calls' array as a whole)
    assert request.client_param("structured_outputs.json: too deep", "structured_outputs.json") == (
        "tools: too deep", "tools")


def test_a_tool_with_definitions_is_called_when_required(client):
    message, finish_reason = _chat(client, False, tools=[SHIP, SHIP_AGAIN], tool_choice="required", temperature=0,
                                   parallel_tool_calls=False, max_tokens=60,
                                   messages=[{"role": "user", "content": "Ship 2 kg to Oslo."}])
    assert finish_reason == "tool_calls" and len(message["tool_calls"]) == 1, message
    [call] = message["tool_calls"]
    tool = {"ship": SHIP, "ship_back": SHIP_AGAIN}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex"),
    ("/v1/completions", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
    # was a 500 (the required array's scanner found no object where a call's arguments begin)
    ("/v1/chat/completions", {"tools": [TOOLS[0], {"type": "function", "function": {
        "name": "g", "parameters": {"type": "string"}}}], "tool_choice": "required"}, "tools[1].function.parameters"),
    # references xgrammar would leave unconstrained (an anchor): refused, naming the field
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#a"}}, "$defs": {"A": {"$anchor": "a"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#a"}}, "$defs": {"A": {"$anchor": "a"}}}}}],
        "tool_choice": "required"}, "tools[1].function.parameters"),
    # schemas their metaschema refuses (xgrammar compiled them: an empty answer "stop"ped)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "required": ["a"], "properties": {"a": {"anyOf": []}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"guided_json": {"type": []}}, "guided_json"),
    # keywords xgrammar would leave unenforced: refused, naming the field
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}],
        "tool_choice": "required"}, "tools[1].function.parameters"),
    # a reference to nothing, in the second tool: the calls' schema is the tools' together, and
    # the error names the tool whose schema failed
    ("/v1/chat/completions", {"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
    # draft 7's tuple items, which xgrammar refuses: the 400 says to write prefixItems
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "integer"}]}}}},
     "response_format.json_schema.schema"),
    # constraints no text matches: they compile, and allow no first token (a hostile trial's 500s)
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"guided_regex": "[^\\s\\S]"}, "guided_regex"),
]


@pytest.mark.parametrize("path, fields, param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_a_bad_constraint_is_a_400_naming_the_field_streamed_or_not(api, path, fields, param):
    base = {"model": MODEL, "max_tokens": 5,
            **({"prompt": "x"} if path == "/v1/completions" else {"messages": QUESTION})}
    for stream in (False, True):
        response = requests.post(api.url + path, json={**base, **fields, "stream": stream}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["error"]["param"] == param, response.text


def test_a_constraint_that_dead_ends_after_a_token_is_a_400_or_its_sse_error(api):
    """A string whose pattern no character matches allows the opening quote, then nothing: not
    streamed, a 400 naming the field; streamed, the quote's chunk and then the SSE error event."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 5, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[^\\s\\S]"}}}}
    message = ("response_format.json_schema.schema: no text matches the constraint: it allows no token after the 1 "
               "generated")
    response = requests.post(api.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": message, "type": "invalid_request_error",
                                        "param": "response_format.json_schema.schema", "code": None}
    response = requests.post(api.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"] == {"message": message, "type": "invalid_request_error",
                                               "param": "response_format.json_schema.schema", "code": None}
    content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert content == '"'

