"""The one list of known request fields (``app.request_fields``), walked: implemented fields
are the request models' fields and each changes what the engine gets or how the reply is
shaped; each unsupported one is a 400 naming it, streaming or not, before any SSE byte; the
values that ask for nothing, and fields no API defines, are accepted. Then the three fields
implemented for this list, on the prompt tokens the engine receives."""
import json

import pytest
import requests

from app.protocol import ChatCompletionRequest, CompletionRequest
from app.request_fields import ENDPOINTS, KNOWN_FIELDS, known_fields, mistyped_field
from tests.app.conftest import MODEL

MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {"completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
        "chat": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}}
FRUIT = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit is"}]


def _effect(endpoint: str, body: dict) -> tuple:
    """Everything the ingress takes from a request: the engine's prompt and parameters, and
    the reply's shape."""
    request = MODELS[endpoint].model_validate(body)
    return (request.model, request.engine_prompts(), request.sampling_params(), request.stream,
            request.include_usage, request.num_logprobs(), getattr(request, "echo", False))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_implemented_fields_are_the_request_models_fields(endpoint):
    implemented = {f.name for f in known_fields(endpoint, "implemented")}
    assert implemented == set(MODELS[endpoint].model_fields)
    keys = [(f.name, f.endpoint) for f in KNOWN_FIELDS]
    assert len(keys) == len(set(keys)), "a field listed twice for one endpoint"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_each_implemented_field_changes_the_engine_input_or_the_reply(endpoint):
    for known in known_fields(endpoint):
        if known.status == "unsupported":
            continue
        base = {**BASE[endpoint], **known.requires}
        changed = _effect(endpoint, {**base, known.name: known.example}) != _effect(endpoint, base)
        assert changed == (known.status == "implemented"), known


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_no_effect_fields_take_only_their_type_or_null(endpoint):
    no_effect = known_fields(endpoint, "no_effect")
    assert {f.name for f in no_effect} == {"user", "safety_identifier"}
    for known in no_effect:
        assert known.value_type is str and isinstance(known.example, str)
        for value in (known.example, "", None):
            assert mistyped_field(endpoint, {known.name: value}) is None
        for value in (5, True, ["u"], {"id": "u"}):
            assert mistyped_field(endpoint, {"other": 1, known.name: value}) is known, value


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_unsupported_examples_ask_for_something_and_off_values_do_not(endpoint):
    for known in known_fields(endpoint, "unsupported"):
        assert not known.is_off(known.example), known
        assert all(known.is_off(value) for value in known.off), known
    best_of = next(f for f in known_fields(endpoint, "unsupported") if f.name == "best_of")
    assert best_of.is_off(1) and not best_of.is_off(True) and not best_of.is_off(1.0)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_each_unsupported_field_is_a_400_naming_it_before_any_sse_byte(api, endpoint):
    wrong = []
    with requests.Session() as session:
        for known in known_fields(endpoint, "unsupported"):
            for stream in (False, True):
                body = {**BASE[endpoint], known.name: known.example, "stream": stream}
                response = session.post(api.url + PATHS[endpoint], json=body, timeout=30)
                error = response.json().get("error", {}) if response.headers.get(
                    "content-type", "").startswith("application/json") else {}
                if (response.status_code, error.get("param"), error.get("code")) != (
                        400, known.name, "unsupported_parameter") \
                        or f"{known.name} is not supported" not in error.get("message", ""):
                    wrong.append((known.name, stream, response.status_code, response.text[:200]))
    assert not wrong


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_values_that_ask_for_nothing_and_unknown_fields_are_accepted(api, endpoint):
    unsupported = known_fields(endpoint, "unsupported")
    for k in range(max(len(f.off) for f in unsupported)):
        body = {**BASE[endpoint], **{f.name: f.off[min(k, len(f.off) - 1)] for f in unsupported}}
        response = requests.post(api.url + PATHS[endpoint], json=body, timeout=60)
        assert response.status_code == 200, (k, response.text)
    body = {**BASE[endpoint], "x_not_in_any_api": 1, "custom": {"a": [1]}}
    assert requests.post(api.url + PATHS[endpoint], json=body, timeout=60).status_code == 200


def _completion(api, **body) -> dict:
    response = requests.post(api.url + "/v1/completions", timeout=60,
                             json={"model": MODEL, "temperature": 0, "max_tokens": 6, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _streamed_text(api, path: str, body: dict) -> str:
    with requests.post(api.url + path, json={**body, "stream": True}, stream=True, timeout=60) as response:
        assert response.status_code == 200, response.text
        chunks = [json.loads(line[6:]) for line in response.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    return "".join(c["choices"][0].get("text", "") for c in chunks if c["choices"])


def test_echo_puts_the_prompt_before_the_completion(api, tokenizer):
    prompt = "The capital of France is"
    plain = _completion(api, prompt=prompt)
    echoed = _completion(api, prompt=prompt, echo=True)
    assert echoed["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"]
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 6, "echo": True}
    assert _streamed_text(api, "/v1/completions", body) == echoed["choices"][0]["text"]
    ids = tokenizer(prompt).input_ids
    by_ids = _completion(api, prompt=ids, echo=True)
    assert by_ids["choices"][0]["text"] == tokenizer.decode(ids) + plain["choices"][0]["text"]
    two = _completion(api, prompt=prompt, echo=True, n=2)
    assert [c["text"] for c in two["choices"]] == [echoed["choices"][0]["text"]] * 2


@pytest.mark.parametrize("options", [{}, {"add_generation_prompt": False},
                                     {"add_generation_prompt": False, "continue_final_message": True}],
                         ids=["default", "no_generation_prompt", "continue_final_message"])
def test_chat_template_options_set_the_prompt_tokens(api, tokenizer, options):
    template = dict(add_generation_prompt=options.get("add_generation_prompt", True),
                    continue_final_message=options.get("continue_final_message", False))
    text = tokenizer.apply_chat_template(FRUIT, tokenize=False, **template)
    if template["continue_final_message"]:
        assert text.endswith("The fruit is")  # left open: no end-of-turn token
    ids = tokenizer(text, add_special_tokens=False).input_ids
    chat = requests.post(api.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": FRUIT, "temperature": 0, "max_tokens": 6, **options})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    # Greedy: the reply equals a completion of exactly these token ids.
    assert chat.json()["choices"][0]["message"]["content"] == _completion(api, prompt=ids)["choices"][0]["text"]


def test_continue_final_message_with_the_generation_prompt_is_a_400(api):
    response = requests.post(api.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": FRUIT, "continue_final_message": True})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "continue_final_message" and "add_generation_prompt" in error["message"]
