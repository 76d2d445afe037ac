"""Bad input gets its documented 4xx with OpenAI's error envelope, streaming or not, before
any SSE header; a normal request succeeds afterwards."""
import pytest
import requests

from tests.app.conftest import MODEL, nested_objects

LONG_PROMPT = "hello " * 9000  # > 8192 tokens
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _error_cases():
    ok = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    # (name, path, body or raw text, status, param, code, message fragment)
    return [
        ("malformed json", "/v1/completions", '{"model": "x", ', 400, None, None, "not valid JSON"),
        ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", None, "prompt is required"),
        ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages", None, "required"),
        ("missing model", "/v1/completions", {"prompt": "x"}, 400, "model", None, "model is required"),
        ("messages to completions", "/v1/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, 400, "prompt", None,
         "prompt is required (messages is a field of /v1/chat/completions)"),
        ("prompt to chat", "/v1/chat/completions", {"model": MODEL, "prompt": "Hi"},
         400, "messages", None, "messages is required (prompt is a field of /v1/completions)"),
        ("wrong type", "/v1/completions", {**ok, "max_tokens": "ten"}, 400, "max_tokens", None, "integer"),
        ("wrong type temperature", "/v1/completions", {**ok, "temperature": "hot"}, 400, "temperature", None, "number"),
        # accepted and unread, but typed as the API types them
        ("user a number", "/v1/completions", {**ok, "user": 5}, 400, "user", None,
         "user: must be a string; got a number"),
        ("safety_identifier an object", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "safety_identifier": {"id": 1}}, 400,
         "safety_identifier", None, "safety_identifier: must be a string; got an object"),
        ("temperature -1", "/v1/completions", {**ok, "temperature": -1}, 400, "temperature", None,
         "temperature must be a finite number >= 0"),
        ("temperature 5", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 5}, 400, "temperature",
         None, "temperature must be at most 2 (the OpenAI API's range [0, 2]); got 5"),
        ("top_p 1.5", "/v1/completions", {**ok, "top_p": 1.5}, 400, "top_p", None, "top_p must be in (0, 1]"),
        ("max_tokens -1", "/v1/completions", {**ok, "max_tokens": -1}, 400, "max_tokens", None,
         "max_tokens must be >= 1"),
        ("n 0", "/v1/completions", {**ok, "n": 0}, 400, "n", None, "n must be an integer in [1, 128]"),
        # checked before anything is sized by n (a billion choices once filled the host's memory)
        ("n a billion", "/v1/completions", {**ok, "n": 10**9}, 400, "n", None,
         "n must be an integer in [1, 128]; got 1000000000"),
        ("chat n a billion with tools", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 10**9, "tools": [WEATHER],
          "tool_choice": "required"}, 400, "n", None, "n must be an integer in [1, 128]"),
        ("tool schema not a schema", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": "auto",
          "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]},
         400, "tools[1].function.parameters", None,
         "tools[1].function.parameters is not a valid JSON schema: 'banana' is not valid under any of the given "
         "schemas (at parameters['type'])"),
        ("tool names twice", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER, WEATHER]}, 400,
         "tools[1].function.name", None,
         "tools[1].function.name: 'get_weather' is also tools[0]'s; function names must be unique"),
        ("empty prompt", "/v1/completions", {**ok, "prompt": ""}, 400, "prompt", None, "prompt is empty"),
        ("prompt a number", "/v1/completions", {**ok, "prompt": 5}, 400, "prompt", None,
         "prompt: must be a string, an array of integers, an array of strings or an array of arrays of integers; "
         "got a number"),
        ("stop an object", "/v1/completions", {**ok, "stop": {"a": 1}}, 400, "stop", None,
         "stop: must be a string or an array of strings; got an object"),
        ("prompt a float token", "/v1/completions", {**ok, "prompt": [1, 2.5]}, 400, "prompt[1]", None,
         "prompt[1]: Input should be a valid integer"),
        ("prompt over max_model_len", "/v1/completions", {**ok, "prompt": LONG_PROMPT}, 400, "prompt",
         "context_length_exceeded", "exceeds max_model_len (8192)"),
        ("chat over max_model_len", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
         "context_length_exceeded", "exceeds max_model_len"),
        # the length error names the field the client sent
        ("max_completion_tokens over max_model_len", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 8190}, 400,
         "messages", "context_length_exceeded", "+ max_completion_tokens (8190) = "),
        ("max_completion_tokens over max_model_len: the room left", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 8190}, 400,
         "messages", "context_length_exceeded", "): max_completion_tokens can be at most "),
        # a batch: the prompt at fault is named; the others' requests stop (no block is left)
        ("a batch's second prompt over max_model_len", "/v1/completions", {**ok, "prompt": ["Hi", LONG_PROMPT]},
         400, "prompt[1]", "context_length_exceeded", "prompt[1] ("),
        ("a batch's token id out of range", "/v1/completions", {**ok, "prompt": [[1, 2], [3, 10**6]]}, 400,
         "prompt[1][1]", None, "prompt[1][1]: token id 1000000 is outside the vocabulary [0, 49152)"),
        ("a batch of too many choices", "/v1/completions", {**ok, "prompt": ["a"] * 65, "n": 2}, 400, "prompt",
         None, "prompt: a batch of 65 prompts x n (2) is 130 choices; at most 128"),
        ("max_tokens over max_model_len", "/v1/completions", {**ok, "prompt": [1, 2], "max_tokens": 9000}, 400,
         "prompt", "context_length_exceeded",
         "prompt (2 tokens) + max_tokens (9000) = 9002 tokens exceeds max_model_len (8192): max_tokens can be "
         "at most 8190 after this prompt"),
        ("empty body", "/v1/completions", "", 400, None, None, "the request body (a JSON object) is required"),
        ("null body", "/v1/completions", "null", 400, None, None, "the request body must be a JSON object"),
        ("non-string text part", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]},
         400, "messages[0].content[0].text", None, "messages[0].content[0].text: Input should be a valid string"),
        ("image part", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "messages[0].content[0].type", None, "Input should be 'text'"),
        ("lone surrogate", "/v1/completions", '{"model": "%s", "prompt": "\\udfff hi"}' % MODEL, 400, "prompt",
         None, "not valid Unicode"),
        # a lone surrogate in cache_salt stopped the engine's step loop (hashed as UTF-8 there):
        # every request got 503 until Serve replaced the replica
        ("lone surrogate in cache_salt", "/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "cache_salt": "\\ud800"}' % MODEL, 400,
         "cache_salt", None, "cache_salt: not valid Unicode (surrogates not allowed at character 0)"),
        # fields accepted unread (user) or refused (unsupported) are still checked first
        ("lone surrogate in user", "/v1/completions", '{"model": "%s", "prompt": "x", "user": "\\ud800"}' % MODEL,
         400, "user", None, "user: not valid Unicode (surrogates not allowed at character 0)"),
        ("lone surrogate in chat", "/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL, 400, "messages[0].content",
         None, "messages[0].content: not valid Unicode (surrogates not allowed at character 0)"),
        ("lone surrogate in a text part", "/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}'
         % MODEL, 400, "messages[0].content[0].text", None, "messages[0].content[0].text: not valid Unicode"),
        ("lone surrogate in a tool call's arguments", "/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": '
         '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}}]}]}'
         % MODEL, 400, "messages[1].tool_calls[0].function.arguments", None,
         "messages[1].tool_calls[0].function.arguments: not valid Unicode (surrogates not allowed at character 7)"),
        ("lone surrogate in a schema's key", "/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", '
         '"function": {"name": "f", "parameters": {"type": "object", "properties": {"\\ud800": {}}}}}]}' % MODEL,
         400, "tools[0].function.parameters", None, "not valid Unicode (surrogates not allowed at character 0 in a "
         "string it holds)"),
        ("lone surrogate in a top-level key", "/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "\\ud800": 1}' % MODEL, 400, None, None,
         "the request body: holds a key that is not valid Unicode"),
        # would never match the decoded text (which has no lone surrogates): silently ignored
        ("lone surrogate in stop", "/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "stop": ["ok", "\\ud800"]}' % MODEL, 400,
         "stop", None, "stop: not valid Unicode (surrogates not allowed at character 0 in a string it holds)"),
        ("tiny repetition_penalty", "/v1/completions", {**ok, "repetition_penalty": 1e-45}, 400,
         "repetition_penalty", None, "repetition_penalty must be in [0.01, 100]"),
        ("infinite temperature", "/v1/completions",
         '{"model": "%s", "prompt": "Hi", "temperature": 1e309}' % MODEL, 400, "temperature", None,
         "temperature must be a finite number >= 0"),
        ("too many stop strings", "/v1/completions", {**ok, "stop": [str(i) for i in range(17)]}, 400, "stop",
         None, "at most 16 non-empty strings"),
        ("min_tokens beyond the room left", "/v1/completions",
         {"model": MODEL, "prompt": [7] * 8190, "max_tokens": None, "min_tokens": 5}, 400, "min_tokens", None,
         "min_tokens (5) exceeds the 2 tokens"),
        ("unknown model", "/v1/completions", {**ok, "model": "gpt-7"}, 404, "model", "model_not_found",
         "'gpt-7' does not exist"),
        ("bad chat role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
         400, "messages[0].role", None, "messages[0].role"),
        ("logit_bias key python would parse", "/v1/completions", {**ok, "logit_bias": {"1_0": 1}}, 400,
         "logit_bias", None, "logit_bias keys must be token ids (integers of at most 10 digits, without leading "
         "zeros); got '1_0'"),
        # a leading zero made a second key for one token, whose bias the later key replaced
        ("logit_bias key with a leading zero", "/v1/completions", {**ok, "logit_bias": {"42": 100, "0042": -100}},
         400, "logit_bias", None, "logit_bias keys must be token ids (integers of at most 10 digits, without "
         "leading zeros); got '0042'"),
        ("token id out of range", "/v1/completions", {**ok, "prompt": [1, 2, 10**6]}, 400, "prompt[2]", None,
         "prompt[2]: token id 1000000 is outside the vocabulary [0, 49152)"),
        ("negative token id in a wrapped prompt", "/v1/completions", {**ok, "prompt": [[1, -1]]}, 400,
         "prompt[0][1]", None, "prompt[0][1]: token id -1 is outside the vocabulary [0, 49152)"),
        ("stop token id out of range", "/v1/completions", {**ok, "stop_token_ids": [2, 10**6]}, 400,
         "stop_token_ids[1]", None, "stop_token_ids[1]: token id 1000000 is outside the vocabulary"),
        ("cache_salt not a string", "/v1/completions", {**ok, "cache_salt": 5}, 400, "cache_salt", None,
         "cache_salt: Input should be a valid string"),
        # JSON types are kept, as OpenAI's API keeps them (no "10" -> 10, false -> 0)
        ("max_tokens a string of digits", "/v1/completions", {**ok, "max_tokens": "10"}, 400, "max_tokens", None,
         "max_tokens: Input should be a valid integer"),
        ("logprobs false", "/v1/completions", {**ok, "logprobs": False}, 400, "logprobs", None,
         "logprobs: Input should be a valid integer"),
        ("chat logprobs 1", "/v1/chat/completions", {**CHAT, "logprobs": 1}, 400, "logprobs", None,
         "logprobs: Input should be a valid boolean"),
        ("stream_options key not served", "/v1/chat/completions",
         {**CHAT, "stream_options": {"include_obfuscation": True}}, 400, "stream_options.include_obfuscation",
         None, "stream_options.include_obfuscation: true is not supported: stream events are not padded (send "
         "false or leave it out)"),
        ("stream_options key unknown", "/v1/chat/completions",
         {**CHAT, "stream_options": {"include_usage": True, "include_usage_stats": True}}, 400,
         "stream_options.include_usage_stats", None, "stream_options.include_usage_stats: Extra inputs are not "
         "permitted"),
        # rendered into the prompt as calls the user had made (a 200 with 24 more prompt tokens)
        ("tool_calls in a user message", "/v1/chat/completions",
         {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}]}, 400,
         "messages[0].tool_calls", None, "messages[0].tool_calls: only an assistant message has tool_calls (the "
         "calls it made); this is a user message"),
        ("max_completion_tokens 0", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400,
         "max_completion_tokens", None, "max_completion_tokens must be >= 1; got 0"),
        # a deeper one was a 500 (jsonschema's recursion; Ray's pickling)
        ("tool parameters nested 100 objects deep", "/v1/chat/completions",
         {**CHAT, "tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                                                      nested_objects(100)}}]},
         400, "tools", None, "tools: nests objects and arrays more than 128 levels deep"),
        ("logit_bias key of 5000 digits", "/v1/completions", {**ok, "logit_bias": {"9" * 5000: 1}}, 400,
         "logit_bias", None, "logit_bias keys must be token ids (integers of at most 10 digits, without "
         "leading zeros)"),
        # unknown keys in nested objects were ignored: a misspelt key answered an empty message
        # or left a call unconstrained (200s)
        ("misspelt content", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "contents": "Hi"}]},
         400, "messages[0].content", None, "messages[0].content: a user message needs content (a string or text "
         "parts); only an assistant's may be null or left out"),
        ("misspelt parameters", "/v1/chat/completions",
         {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]}, 400,
         "tools[0].function.paramters", None, "tools[0].function.paramters: Extra inputs are not permitted"),
        ("json_schema under type text", "/v1/chat/completions",
         {**CHAT, "response_format": {"type": "text", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
         400, "response_format.json_schema", None,
         "response_format.json_schema: only type json_schema takes a json_schema; type is text"),
        # the missing or invalid type is what is told, not json_schema's own missing name
        ("json_schema without a type", "/v1/chat/completions", {**CHAT, "response_format": {"json_schema": {}}},
         400, "response_format.type", None, "response_format.type is required"),
        ("json_schema under an invalid type", "/v1/chat/completions",
         {**CHAT, "response_format": {"type": "bogus", "json_schema": {}}}, 400, "response_format.type", None,
         "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
        # the constraint's end allows only EOS: ignore_eos ran on unconstrained past it, min_tokens
        # went unheeded (a trial's findings)
        ("ignore_eos with a regex", "/v1/completions",
         {**ok, "ignore_eos": True, "structured_outputs": {"regex": "ab"}}, 400, "ignore_eos", None,
         "ignore_eos cannot be combined with structured_outputs: a constraint on the output decides where it ends "
         "(at its end only EOS is allowed); got true"),
        ("min_tokens with a required tool", "/v1/chat/completions",
         {**CHAT, "tools": [WEATHER], "tool_choice": "required", "min_tokens": 5}, 400, "min_tokens", None,
         "min_tokens cannot be combined with tool_choice: a constraint on the output decides where it ends"),
        ("tool_choice function null", "/v1/chat/completions",
         {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": None}}, 400,
         "tool_choice.function", None, "tool_choice.function: Input should be a valid dictionary"),
        ("tool_choice a number", "/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": 5}, 400,
         "tool_choice", None, "tool_choice: must be 'none', 'auto', 'required' or an object; got a number"),
        # Python's json refuses these although they are JSON: FastAPI said only "There was an error parsing the body"
        ("an integer of 5000 digits", "/v1/completions",
         '{"model": "%s", "prompt": "Hi", "seed": %s}' % (MODEL, "9" * 5000), 400, None, None,
         "the body could not be parsed as JSON: Exceeds the limit (4300 digits) for integer string conversion: "
         "value has 5000 digits"),
        ("JSON nested 5000 deep", "/v1/completions",
         '{"model": "%s", "prompt": "Hi", "user": %s}' % (MODEL, "[" * 5000 + "]" * 5000), 400, None, None,
         "the body could not be parsed: its JSON nests arrays and objects too deeply"),
        ("empty cache_salt", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "cache_salt": ""}, 400, "cache_salt",
         None, "cache_salt must be a non-empty string; got ''"),
    ]


def _post(api, path, body, stream):
    if isinstance(body, str):  # raw JSON text, sent as is (streaming added where it can be)
        if stream and body.endswith("}") and body.startswith("{"):
            body = body[:-1] + ', "stream": true}'
        return requests.post(api.url + path, data=body, headers={"content-type": "application/json"}, timeout=60)
    return requests.post(api.url + path, json={**body, "stream": stream}, timeout=60)


@pytest.mark.parametrize("case", _error_cases(), ids=lambda c: c[0])
def test_bad_input_gets_the_envelope_streaming_or_not(api, case):
    name, path, body, status, param, code, fragment = case
    responses = [_post(api, path, body, stream) for stream in (False, True)]
    for response in responses:
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert fragment in error["message"]
        assert (error["param"], error["code"]) == (param, code)
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert responses[0].json() == responses[1].json()


def test_stream_options_that_ask_for_nothing_are_refused_not_ignored(api):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        response = requests.post(api.url + path, timeout=60, json={
            "model": MODEL, **body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert response.status_code == 400
        assert response.json()["error"] == {"message": "stream_options is only allowed with stream: true",
                                            "type": "invalid_request_error", "param": "stream_options",
                                            "code": None}
        # vLLM ignores continuous_usage_stats without include_usage; refused here, not ignored
        response = requests.post(api.url + path, timeout=60, json={
            "model": MODEL, **body, "max_tokens": 2, "stream": True,
            "stream_options": {"continuous_usage_stats": True}})
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": "stream_options.continuous_usage_stats needs stream_options.include_usage: true",
            "type": "invalid_request_error", "param": "stream_options.continuous_usage_stats", "code": None}


def test_unknown_route_and_method_get_the_envelope(api):
    response = requests.get(api.url + "/v1/nothing", timeout=10)
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"
    response = requests.get(api.url + "/v1/completions", timeout=10)
    assert response.status_code == 405 and "error" in response.json()
    response = requests.get(api.url + "/v1/models/gpt-7", timeout=10)  # OpenAI's retrieve-model
    assert response.status_code == 404 and response.json()["error"] == {
        "message": f"model 'gpt-7' does not exist; this server serves '{MODEL}'", "type": "not_found_error",
        "param": "model", "code": "model_not_found"}


def test_null_is_the_default_of_a_field_that_has_one(api):
    # as OpenAI's API (clients that send every key send these): temperature null is 1, n 1, ...
    nulls = dict.fromkeys(["temperature", "n", "top_p", "stream", "presence_penalty", "frequency_penalty",
                           "logprobs", "top_logprobs", "parallel_tool_calls", "stream_options", "seed"])
    response = requests.post(api.url + "/v1/chat/completions", timeout=60, json={**CHAT, **nulls})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")


def test_a_normal_request_succeeds_after_the_bad_ones(api):
    response = requests.post(api.url + "/v1/completions", timeout=60,
                             json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200 and len(response.json()["choices"]) == 1
    stats = requests.get(api.url + "/stats", timeout=10).json()["replicas"][0]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
