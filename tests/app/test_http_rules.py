"""Rules every route follows: HEAD answered like GET without a body, a body that is not
sent as JSON refused with a message about its Content-Type, and CORS for browser pages."""
import pytest
import requests

from tests.app.conftest import MODEL


def test_every_get_endpoint_answers_head_with_an_empty_body(api):
    """Every GET route the service's OpenAPI schema lists, and the schema and docs pages."""
    schema = requests.get(api.url + "/openapi.json", timeout=30).json()
    paths = sorted(p for p, methods in schema["paths"].items() if "get" in methods)
    assert {"/health", "/ready", "/v1/models", "/v1/models/{model}", "/stats", "/metrics"} <= set(paths)
    for path in [p.replace("{model}", MODEL) for p in paths] + ["/openapi.json", "/docs"]:
        get = requests.get(api.url + path, timeout=60)
        head = requests.head(api.url + path, timeout=60)
        assert (path, get.status_code, head.status_code) == (path, 200, 200), (get.text, head.text)
        assert head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"], path


def test_a_browser_page_of_another_origin_can_call_the_api(api):
    """CORS as vLLM's defaults (any origin): through the service's front (HAProxy under
    ``make run``) a preflight gets 200 and the answers carry ``Access-Control-Allow-Origin``,
    streamed ones too (tests/app/test_http_guard.py has the rules themselves)."""
    page = {"Origin": "http://page.example:3000"}
    preflight = requests.options(api.url + "/v1/chat/completions", timeout=30, headers={
        **page, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert (preflight.status_code, preflight.headers["access-control-allow-origin"],
            preflight.headers["access-control-allow-headers"]) == (200, "*", "content-type")
    for stream in (False, True):
        answer = requests.post(api.url + "/v1/chat/completions", headers=page, timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": stream})
        assert (answer.status_code, answer.headers["access-control-allow-origin"]) == (200, "*"), answer.text
    refused = requests.post(api.url + "/v1/chat/completions", headers=page, timeout=30,
                            json={"model": MODEL, "messages": []})
    assert (refused.status_code, refused.headers["access-control-allow-origin"]) == (400, "*")


def test_head_on_a_post_endpoint_is_still_405(api):
    response = requests.head(api.url + "/v1/completions", timeout=30)
    assert response.status_code == 405 and response.content == b""


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/xml"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_body_not_sent_as_json_gets_a_400_about_the_content_type(api, content_type, stream):
    body = ('{"model": "%s", "prompt": "Hi", "max_tokens": 1, "stream": %s}'
            % (MODEL, str(stream).lower())).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = requests.post(api.url + path, data=body, headers=headers, timeout=30)
        assert response.status_code == 400
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert error["code"] == "unsupported_content_type" and error["param"] is None
        got = "no Content-Type header" if content_type is None else f"Content-Type '{content_type}'"
        assert got in error["message"] and "'Content-Type: application/json'" in error["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/merge+json"])
def test_json_content_types_with_parameters_or_suffixes_are_accepted(api, content_type):
    body = ('{"model": "%s", "prompt": "Hi", "max_tokens": 1}' % MODEL).encode()
    response = requests.post(api.url + "/v1/completions", data=body, timeout=60,
                             headers={"content-type": content_type})
    assert response.status_code == 200, response.text
