"""Request bodies are validated as OpenAI's API does (``app.protocol.RequestModel``): a value
keeps its JSON type, ``null`` is a non-nullable field's default, and errors name the field the
client sent. The formatters' shapes that follow OpenAI where vLLM's docs are silent. No
service: the models and formatters in-process (tests/app/test_errors.py sends the same
mistakes over HTTP)."""
import json
import re

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from app.errors import _validation_error, from_http_exception
from app.openai_format import ChatFormatter, ResponseFormatter
from app.protocol import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest, json_depth
from app.records import LogprobEntry
from app.tool_calls import ToolMode
from engine.errors import InvalidRequestError
from tests.app.conftest import nested_objects

MODEL = "smollm2-135m-instruct"
COMPLETION = {"model": MODEL, "prompt": "Hi"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def _error(model, body) -> tuple[tuple, str]:
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(body)
    deepest = max(info.value.errors(), key=lambda e: len(e["loc"]))  # the one the 400 reports (app.errors)
    return deepest["loc"], deepest["msg"]


@pytest.mark.parametrize(("field", "value", "msg"), [
    ("max_tokens", "10", "Input should be a valid integer"),
    ("n", 2.0, "Input should be a valid integer"),
    ("n", True, "Input should be a valid integer"),
    ("temperature", "0.5", "Input should be a valid number"),
    ("temperature", True, "Input should be a valid number"),
    ("stream", "yes", "Input should be a valid boolean"),
    ("stream", 1, "Input should be a valid boolean"),
    ("echo", 0, "Input should be a valid boolean"),
    # before: false became logprobs 0, a logprobs object nobody asked for
    ("logprobs", False, "Input should be a valid integer"),
    ("seed", "7", "Input should be a valid integer"),
    ("stop", 5, "Input should be a valid string"),
])
def test_completion_values_keep_their_json_type(field, value, msg):
    loc, message = _error(CompletionRequest, {**COMPLETION, field: value})
    assert (loc[0], message) == (field, msg)


@pytest.mark.parametrize(("body", "loc", "msg"), [
    ({"logprobs": 1}, ("logprobs",), "Input should be a valid boolean"),
    ({"parallel_tool_calls": "false"}, ("parallel_tool_calls",), "Input should be a valid boolean"),
    ({"logit_bias": {"42": "5"}}, ("logit_bias", "42"), "Input should be a valid number"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, ("stream_options", "include_usage"),
     "Input should be a valid boolean"),
    # what OpenAI defines (include_obfuscation) and this server does not serve: refused, not ignored
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     ("stream_options", "include_obfuscation"),
     "Value error, true is not supported: stream events are not padded (send false or leave it out)"),
    ({"stream": True, "stream_options": {"include_obfuscation": 0}},
     ("stream_options", "include_obfuscation"), "Input should be a valid boolean"),
    ({"stream": True, "stream_options": {"obfuscation": False}}, ("stream_options", "obfuscation"),
     "Extra inputs are not permitted"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}},
     ("stream_options", "continuous_usage_stats"), "Input should be a valid boolean"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     ("messages", 0, "content", "list[TextPart]", 0, "text"), "Input should be a valid string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     ("tools", 0, "function", "strict"), "Input should be a valid boolean"),
])
def test_chat_values_keep_their_json_type_in_nested_objects_too(body, loc, msg):
    assert _error(ChatCompletionRequest, {**CHAT, **body}) == (loc, msg)


def test_an_integer_is_a_number():
    request = CompletionRequest.model_validate({**COMPLETION, "temperature": 1, "top_p": 1, "logit_bias": {"7": 2}})
    assert (request.temperature, request.top_p, request.sampling_params().logit_bias) == (1.0, 1.0, {7: 2.0})


def test_null_is_the_default_unless_the_field_takes_null():
    nulls = dict.fromkeys(["n", "temperature", "top_p", "stream", "presence_penalty", "frequency_penalty",
                           "echo", "top_k", "ignore_eos", "max_tokens", "logprobs", "stop", "seed"])
    request = CompletionRequest.model_validate({**COMPLETION, **nulls})
    assert (request.n, request.temperature, request.top_p, request.stream, request.echo, request.top_k) == \
        (1, 1.0, 1.0, False, False, -1)
    # max_tokens: null is "as many as fit" (the default is 16), logprobs: null is none
    assert (request.max_tokens, request.logprobs, request.stop, request.seed) == (None, None, None, None)
    assert request.sampling_params().max_tokens is None
    chat = ChatCompletionRequest.model_validate({**CHAT, "logprobs": None, "parallel_tool_calls": None,
                                                 "stream_options": None, "tool_choice": None})
    assert (chat.logprobs, chat.parallel_tool_calls, chat.stream_options, chat.num_logprobs()) == \
        (False, True, None, None)


def test_a_messages_name_reaches_the_chat_template():
    # (an assistant message as the openai client hands it back carries refusal: null: ignored)
    messages = [{"role": "user", "content": "Hi", "name": "ada"},
                {"role": "assistant", "content": "Hello", "refusal": None}]
    request = ChatCompletionRequest.model_validate({**CHAT, "messages": messages})
    assert request.engine_prompts()[0]["messages"] == [{"role": "user", "content": "Hi", "name": "ada"},
                                                   {"role": "assistant", "content": "Hello"}]


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("body", "loc", "msg"), [
    # each was accepted with the key ignored: an empty user turn, an unconstrained call, no schema
    ({"messages": [{"role": "user", "contents": "Hi"}]}, ("messages", 0, "content"),
     "Value error, a user message needs content (a string or text parts); only an assistant's may be null or "
     "left out"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]},
     ("messages", 0, "content"), "Value error, a system message needs content (a string or text parts); only an "
     "assistant's may be null or left out"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]}]},
     ("messages", 0, "content", "list[TextPart]", 0, "cache_control"), "Extra inputs are not permitted"),
    ({"tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]},
     ("tools", 0, "function", "paramters"), "Extra inputs are not permitted"),
    ({"tools": [{"type": "function", "name": "f", "function": {"name": "f"}}]}, ("tools", 0, "name"),
     "Extra inputs are not permitted"),
    ({"tool_choice": {"type": "function", "function": {"name": "f", "arguments": "{}"}}},
     ("tool_choice", "NamedToolChoice", "function", "arguments"), "Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "sunny"}]},
     ("messages", 1, "tool_call_id"), "Value error, a tool message needs tool_call_id, the id of the call it answers"),
    ({"response_format": {"type": "json_object", "schema": {"type": "object"}}}, ("response_format", "schema"),
     "Extra inputs are not permitted"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "a"}}}, ("response_format", "json_schema"),
     "Value error, only type json_schema takes a json_schema; type is json_object"),
    # checked before json_schema's own fields (it said "json_schema.name is required")
    ({"response_format": {"type": "text", "json_schema": {}}}, ("response_format", "json_schema"),
     "Value error, only type json_schema takes a json_schema; type is text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema_": {}}}},
     ("response_format", "json_schema", "schema_"), "Extra inputs are not permitted"),
])
def test_a_key_a_nested_object_does_not_define_is_refused_not_ignored(body, loc, msg):
    assert _error(ChatCompletionRequest, {**CHAT, **body}) == (loc, msg)


def test_a_json_schemas_name_follows_openais_rule():
    # accepted before: a name of any characters or length
    for name in ("not a name!!", "x" * 65, ""):
        assert _error(ChatCompletionRequest, {**CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": name, "schema": {}}}}) == \
            (("response_format", "json_schema", "name"), "String should match pattern '^[a-zA-Z0-9_-]{1,64}$'")
    ChatCompletionRequest.model_validate({**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a-b_C9" + "x" * 58, "schema": {}}}})


@pytest.mark.parametrize(("body", "mode", "message"), [
    # a choice other than none without tools: refused, as OpenAI and vLLM do (auto was accepted)
    ({"tool_choice": "auto"}, None, "tool_choice: 'auto' needs tools, which this request does not give"),
    ({"tool_choice": "required"}, None, "tool_choice: 'required' needs tools, which this request does not give"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, None,
     "tool_choice: function 'f' needs tools, which this request does not give"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, None,
     "tool_choice: function 'g' is not among tools (f)"),
    ({"tool_choice": "none"}, None, None),  # vLLM's rule (OpenAI refuses it)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, ToolMode("auto"), None),
])
def test_the_tool_mode_and_its_errors(body, mode, message):
    request = ChatCompletionRequest.model_validate({**CHAT, **body})
    if message is None:
        assert request.tool_mode() == mode
        return
    with pytest.raises(InvalidRequestError) as error:
        request.tool_mode()
    assert (error.value.param, str(error.value)) == ("tool_choice", message)


@pytest.mark.parametrize("tool_choice", ["auto", "required", "none"])
def test_an_empty_tools_is_refused(tool_choice):
    # as OpenAI refuses it (auto with [] answered in text, required was a 400 of its own)
    assert _error(ChatCompletionRequest, {**CHAT, "tools": [], "tool_choice": tool_choice}) == (
        ("tools",), "List should have at least 1 item after validation, not 0")


def test_an_assistant_message_may_leave_content_out():
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "assistant", "content": None}]
    request = ChatCompletionRequest.model_validate({**CHAT, "messages": messages})
    assert [m.text() for m in request.messages] == ["Weather?", "", "sunny", ""]


def _envelope(exc) -> dict:
    return exc.body()["error"]


@pytest.mark.parametrize(("body", "param", "message"), [
    # the union member's class name was part of param: tool_choice.NamedToolChoice.function
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                 "function": None}},
     "tool_choice.function", "tool_choice.function: Input should be a valid dictionary or instance of NamedFunction"),
    ({"tool_choice": "any"}, "tool_choice",
     "tool_choice: must be 'none', 'auto', 'required' or an object; got a string"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",  # was "an array of TextPart objects"
     "messages[0].content: must be a string or an array of objects; got a number"),
    # an array is the right type: its length is what is wrong (was accepted, as an empty message)
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content",
     "messages[0].content: List should have at least 1 item after validation, not 0"),
    # a part of another type: its type is named (its other keys are unknown to a text part too)
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "messages[0].content[0].type: Input should be 'text'"),
])
def test_errors_about_a_union_field_name_it_in_jsons_words(body, param, message):
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, **body})
    errors = [{**error, "loc": ("body", *error["loc"])} for error in info.value.errors()]  # as FastAPI reports
    error = _envelope(_validation_error(RequestValidationError(errors)))
    assert (error["param"], error["message"]) == (param, message)


@pytest.mark.parametrize(("prompt", "param", "message"), [
    (["a", 5], "prompt[1]", "prompt[1]: Input should be a valid string"),  # was prompt[0], the "a"
    ([1, "a"], "prompt[1]", "prompt[1]: Input should be a valid integer"),
    ([[1, 2], [3, "a"]], "prompt[1][1]", "prompt[1][1]: Input should be a valid integer"),
    # a trial's: was "prompt[1]: Input should be a valid string", the array of strings' second refusal
    ([1.0, 2], "prompt[0]", "prompt[0]: Input should be a valid integer"),
])
def test_a_mixed_array_names_the_element_that_does_not_fit(prompt, param, message):
    with pytest.raises(pydantic.ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    errors = [{**error, "loc": ("body", *error["loc"])} for error in info.value.errors()]
    error = _envelope(_validation_error(RequestValidationError(errors)))
    assert (error["param"], error["message"]) == (param, message)


@pytest.mark.parametrize(("text", "message"), [
    ('{"seed": %s}' % ("9" * 5000), "the body could not be parsed as JSON: Exceeds the limit (4300 digits) for "
     "integer string conversion: value has 5000 digits"),
    ("[" * 5000 + "]" * 5000, f"the body could not be parsed: its JSON nests arrays and objects too deeply (a "
     f"request field may nest {MAX_JSON_DEPTH} levels)"),
    (b'"\xff"', "the body could not be parsed as JSON: 'utf-8' codec "
     "can't decode byte 0xff in position 1: invalid start byte"),
])
def test_json_that_pythons_parser_refuses_is_a_400_that_says_why(text, message):
    # FastAPI's own answer, for any of these: "There was an error parsing the body"
    with pytest.raises(Exception) as info:
        json.loads(text)
    assert not isinstance(info.value, json.JSONDecodeError)  # (that one FastAPI reports as invalid JSON)
    http_error = HTTPException(400, "There was an error parsing the body")
    http_error.__cause__ = info.value
    error = from_http_exception(http_error)
    assert (error.status_code, _envelope(error)) == (400, {"message": message, "type": "invalid_request_error",
                                                           "param": None, "code": None})


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1; got 0"),
    ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens",
     "min_tokens must be >= 0 and <= max_completion_tokens (4); got 5"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1; got 0"),
])
def test_token_limit_errors_name_the_field_the_client_sent(body, param, message):
    with pytest.raises(InvalidRequestError) as error:
        ChatCompletionRequest.model_validate({**CHAT, **body}).sampling_params()
    assert (error.value.param, str(error.value)) == (param, message)


def test_a_logit_bias_key_too_long_for_a_token_id_names_the_field():
    # 5,000 digits: int() of it raises Python's own digit-limit error, which named no field
    request = CompletionRequest.model_validate({**COMPLETION, "logit_bias": {"9" * 5000: 1}})
    with pytest.raises(InvalidRequestError) as error:
        request.sampling_params()
    assert error.value.param == "logit_bias"
    assert str(error.value).startswith("logit_bias keys must be token ids (integers of at most 10 digits, without "
                                       "leading zeros); got '999")
    assert CompletionRequest.model_validate({**COMPLETION, "logit_bias": {"49151": 1}}).sampling_params().logit_bias \
        == {49151: 1.0}


def test_logit_bias_keys_are_canonical_token_ids():
    # "0042" and "42" were one token: one bias silently replaced the other
    for key in ("0042", "00", "-0", "+42", " 42"):
        request = CompletionRequest.model_validate({**COMPLETION, "logit_bias": {key: 1}})
        with pytest.raises(InvalidRequestError, match=f"without leading zeros\\); got '{re.escape(key)}'"):
            request.sampling_params()
    request = CompletionRequest.model_validate({**COMPLETION, "logit_bias": {"0": 1, "42": -2, "1000000000": 3}})
    assert request.sampling_params().logit_bias == {0: 1.0, 42: -2.0, 1000000000: 3.0}


def test_include_obfuscation_false_asks_for_nothing_and_is_accepted():
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert ChatCompletionRequest.model_validate(body).sampling_params() is not None


def _entry(token_id: int, logprob: float, rank: int) -> LogprobEntry:
    return LogprobEntry(token_id, logprob, rank, f"t{token_id}", f"t{token_id}".encode())


def _output(logprobs: list[list[LogprobEntry]], text: str = "x", finish_reason: str | None = "length",
            stop_reason: int | str | None = None) -> dict:
    return {"replica_id": "r", "num_prompt_tokens": 1, "num_cached_tokens": 0, "finished": True, "error": None,
            "outputs": [{"index": 0, "text": text, "token_ids": [e[0].token_id for e in logprobs],
                         "finish_reason": finish_reason, "stop_reason": stop_reason, "logprobs": logprobs}]}


def test_legacy_top_logprobs_always_hold_the_sampled_token():
    # A sampled token of rank 3 with logprobs 1 and 0 (OpenAI: "up to logprobs+1 elements").
    entries = [[_entry(5, -2.5, 3), _entry(1, -0.2, 1), _entry(2, -1.9, 2)]]
    for num_logprobs, expected in ((2, {"t1": -0.2, "t2": -1.9, "t5": -2.5}), (1, {"t1": -0.2, "t5": -2.5}),
                                   (0, {"t5": -2.5})):
        formatter = ResponseFormatter(MODEL, 1, num_logprobs, False)
        formatter.add(_output(entries))
        logprobs = formatter.response()["choices"][0]["logprobs"]
        assert (logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]) == \
            (["t5"], [-2.5], [expected])
    # The chat shape keeps exactly top_logprobs alternatives, as OpenAI's does.
    chat = ChatFormatter(MODEL, 1, 1, False)
    chat.add(_output(entries))
    content = chat.response()["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["t1"]


def _prompt_output(num_prompt_tokens: int, num_cached_tokens: int, deltas: list[tuple[int, str, int]],
                   prompt_text: str | None = None) -> dict:
    """An engine record of one prompt: ``(index, text, number of tokens)`` per choice."""
    output = {"replica_id": "r", "num_prompt_tokens": num_prompt_tokens, "num_cached_tokens": num_cached_tokens,
              "finished": False, "error": None,
              "outputs": [{"index": i, "text": text, "token_ids": list(range(num_tokens)), "finish_reason": None,
                           "stop_reason": None, "logprobs": None} for i, text, num_tokens in deltas]}
    if prompt_text is not None:
        output["prompt_text"] = prompt_text
    return output


def test_a_batch_of_prompts_numbers_each_prompts_choices_after_the_previous_ones():
    # vLLM's order: prompt j's n choices are j*n .. j*n + n-1; usage sums the prompts
    formatter = ResponseFormatter(MODEL, 2, None, True, continuous_usage=True, num_prompts=3)
    formatter.add(_prompt_output(5, 0, [(0, "a", 1), (1, "b", 2)], prompt_text="P0"), 0)
    chunks = formatter.chunks(_prompt_output(7, 4, [(1, "c", 3)], prompt_text="P2"), False, 2)
    formatter.add(_prompt_output(6, 0, [(0, "d", 1), (1, "e", 1)], prompt_text="P1"), 1)
    (chunk,) = chunks
    body = json.loads(chunk.removeprefix("data: "))
    # choice 5 is prompt 2's second; its usage counts its own prompt and tokens (vLLM's per-choice usage)
    assert body["choices"][0]["index"] == 5 and body["choices"][0]["text"] == "P2c"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    response = formatter.response()
    assert [(c["index"], c["text"]) for c in response["choices"]] == \
        [(0, "P0a"), (1, "P0b"), (2, "P1d"), (3, "P1e"), (4, ""), (5, "P2c")]
    assert response["usage"] == {"prompt_tokens": 18, "completion_tokens": 8, "total_tokens": 26,
                                 "prompt_tokens_details": {"cached_tokens": 4}}


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", [{"prompt": "hi"}]),
    ([1, 2], [{"prompt_token_ids": [1, 2]}]),
    (["a", "b"], [{"prompt": "a"}, {"prompt": "b"}]),
    ([[1], [2, 3]], [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]),
    ([], [{"prompt_token_ids": []}]),  # one empty prompt: the engine's 400 names it
])
def test_a_completions_prompt_is_one_prompt_or_a_batch(prompt, expected):
    assert CompletionRequest.model_validate({**COMPLETION, "prompt": prompt}).engine_prompts() == expected


def test_a_batch_is_at_most_128_choices_and_its_errors_name_the_prompt():
    assert len(CompletionRequest.model_validate({**COMPLETION, "prompt": ["a"] * 32, "n": 4}).engine_prompts()) == 32
    with pytest.raises(InvalidRequestError) as error:
        CompletionRequest.model_validate({**COMPLETION, "prompt": ["a"] * 33, "n": 4}).engine_prompts()
    assert (error.value.param, str(error.value)) == ("prompt", "prompt: a batch of 33 prompts x n (4) is 132 "
                                                               "choices; at most 128")
    batch = CompletionRequest.model_validate({**COMPLETION, "prompt": [[1, 2], [3, -1]]})
    assert batch.client_param("prompt[1]: token id -1 is outside", "prompt[1]", 1) == \
        ("prompt[1][1]: token id -1 is outside", "prompt[1][1]")
    texts = CompletionRequest.model_validate({**COMPLETION, "prompt": ["a", "b" * 9000]})
    assert texts.client_param("prompt (9000 tokens) + max_tokens", "prompt", 1) == \
        ("prompt[1] (9000 tokens) + max_tokens", "prompt[1]")
    one = CompletionRequest.model_validate({**COMPLETION, "prompt": "b" * 9000})  # not a batch: as the engine said
    assert one.client_param("prompt (9000 tokens) + max_tokens", "prompt", 0) == \
        ("prompt (9000 tokens) + max_tokens", "prompt")


@pytest.mark.parametrize(("mode", "finish_reason"), [(ToolMode("named", "f"), "stop"),
                                                     (ToolMode("required"), "tool_calls")])
def test_a_call_forced_by_name_finishes_with_stop(mode, finish_reason):
    text = '{"x": 1}' if mode.kind == "named" else '[{"name": "f", "parameters": {"x": 1}}]'
    whole = ChatFormatter(MODEL, 1, None, False, mode)
    whole.add(_output([], text, "stop"))
    choice = whole.response()["choices"][0]
    assert (choice["finish_reason"], choice["message"]["tool_calls"][0]["function"]["arguments"]) == \
        (finish_reason, '{"x": 1}')
    streamed = ChatFormatter(MODEL, 1, None, False, mode)
    (chunk,) = streamed.chunks(_output([], text, "stop"), first=False)
    assert f'"finish_reason": "{finish_reason}"' in chunk


@pytest.mark.parametrize("stop_reason", ["Paris", 42])
def test_calls_cut_by_a_stop_sequence_finish_with_stop(stop_reason):
    # They said tool_calls, whose arguments a client parses: here cut, not JSON (a trial's finding)
    cut = '[{"name": "f", "parameters": {"city": "'
    whole = ChatFormatter(MODEL, 1, None, False, ToolMode("required"))
    whole.add(_output([], cut, "stop", stop_reason))
    choice = whole.response()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["message"]["tool_calls"][0]["function"]) == \
        ("stop", stop_reason, {"name": "f", "arguments": '{"city": "'})
    streamed = ChatFormatter(MODEL, 1, None, False, ToolMode("required"))
    (chunk,) = streamed.chunks(_output([], cut, "stop", stop_reason), first=False)
    assert '"finish_reason": "stop"' in chunk and '"name": "f"' in chunk


def test_a_streamed_reply_sends_no_chunk_with_nothing_in_it():
    # required's text is held back until a call's name is known: no chunk of "delta": {} meanwhile
    head, rest = '[{"na', 'me": "f", "parameters": {"x": 1}}]'
    formatter = ChatFormatter(MODEL, 1, None, False, ToolMode("required"))
    assert formatter.chunks(_output([], head, None), first=False) == []
    (chunk,) = formatter.chunks(_output([], rest, "stop"), first=False)
    assert '"name": "f"' in chunk and '"finish_reason": "tool_calls"' in chunk
    # with logprobs asked for, the held-back token's logprobs still go out
    with_logprobs = ChatFormatter(MODEL, 1, 0, False, ToolMode("required"))
    (chunk,) = with_logprobs.chunks(_output([[_entry(5, -0.1, 1)]], head, None), first=False)
    assert '"delta": {}' in chunk and '"logprob": -0.1' in chunk
    # plain text: an empty content delta is still sent, as before (the role chunk comes first)
    plain = ChatFormatter(MODEL, 1, None, False)
    assert len(plain.chunks(_output([], "", None), first=True)) == 2


def test_a_field_nested_deeper_than_the_limit_is_refused_by_name():
    # 100 nested objects in a tool's parameters ran jsonschema out of recursion (a 500), 600
    # nested arrays in structured_outputs broke Ray's pickling (a 500)
    deep_arrays = {}
    for _ in range(600):
        deep_arrays = {"type": "array", "items": deep_arrays}
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_objects(100)}}
    for body, param in (({"tools": [tool], "tool_choice": "none"}, "tools"),
                        ({"structured_outputs": {"json": deep_arrays}}, "structured_outputs"),
                        ({"guided_json": deep_arrays}, "guided_json"),
                        ({"metadata": deep_arrays}, "metadata")):  # a field no model declares
        request = ChatCompletionRequest.model_validate({**CHAT, **body})
        with pytest.raises(InvalidRequestError) as error:
            request.check_nesting()
        assert (error.value.param, str(error.value)) == \
            (param, f"{param}: nests objects and arrays more than {MAX_JSON_DEPTH} levels deep")
    # as deep as the limit allows: accepted (tools list, tool, function, then the schema's levels)
    fits = {"type": "function", "function": {"name": "f", "parameters": nested_objects((MAX_JSON_DEPTH - 4) // 2)}}
    ChatCompletionRequest.model_validate({**CHAT, "tools": [fits]}).check_nesting()
    assert json_depth([fits], 10**6) == MAX_JSON_DEPTH  # 1 + 1 + 1 + 2 * 62 + 1
    assert (json_depth(5, 3), json_depth([], 3), json_depth([[[[1]]]], 2)) == (0, 1, 3)
