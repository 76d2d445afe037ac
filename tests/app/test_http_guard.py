"""RequestGuard in front of a FastAPI app, called over ASGI directly (no Serve): which routes
need the API key, a generation request holds a place until its response ends and is refused
while none is free, a body over the limit is refused before it is read, a stalled body gets
408, and every refusal is OpenAI's envelope. Then the guard among the service's other rules
(``install_middleware``): HEAD meets the key as GET does, the key comes before the content
type."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from app.admission import Admission
from app.errors import install_error_handlers
from app.http_guard import RequestGuard
from app.middleware import install_middleware

KEY = "secret-key"
LIMIT = 1000


class Body(BaseModel):
    text: str


def make_app(api_key: str | None = KEY, body_timeout_s: float = 5.0,
             admission: Admission | None = None, all_rules: bool = False, allowed_origins: list[str] = ()) -> FastAPI:
    """The routes below behind ``RequestGuard``, or with ``all_rules`` behind every rule of
    the service (``install_middleware``, with ``allowed_origins`` for CORS)."""
    app = FastAPI()
    admission = admission or Admission(limit=100)
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return {"replicas": []}

    @app.post("/v1/completions")
    async def completions(body: Body):
        return {"length": len(body.text)}

    @app.post("/v1/chat/completions")  # a streaming generation route
    async def stream(body: Body):
        async def chunks():
            for i in range(4):
                await asyncio.sleep(body_timeout_s)  # longer than the body timeout, in all
                yield f"{i}\n"
        return StreamingResponse(chunks())

    async def limit() -> int:
        return LIMIT

    if all_rules:
        install_middleware(app, api_key=api_key, admission=admission, max_body_bytes=limit,
                           body_timeout_s=body_timeout_s, allowed_origins=allowed_origins)
    else:
        app.add_middleware(RequestGuard, api_key=api_key, admission=admission, max_body_bytes=limit,
                           body_timeout_s=body_timeout_s)
    return app


def call(app, method: str, path: str, headers: dict | None = None, chunks: list[bytes] = (),
         content_length: bool = True, stall: bool = False):
    """One ASGI request: ``chunks`` as the body (then, with ``stall``, nothing more ever);
    returns (status, headers, body, number of body chunks the app read)."""
    body_messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    if not stall:
        body_messages.append({"type": "http.request", "body": b"", "more_body": False})
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if chunks:
        raw_headers.append((b"content-type", b"application/json"))
    if content_length and chunks:
        raw_headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    elif chunks:
        raw_headers.append((b"transfer-encoding", b"chunked"))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": raw_headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent, num_read = [], 0

    async def main():
        response_done = asyncio.Event()

        async def receive():
            nonlocal num_read
            if num_read < len(body_messages):
                num_read += 1
                return body_messages[num_read - 1]
            if stall:  # an upload that never continues
                await asyncio.sleep(3600)
            await response_done.wait()  # the client stays until the response ends
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                response_done.set()

        await asyncio.wait_for(app(scope, receive, send), 30)

    asyncio.run(main())
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body, num_read


def _error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


AUTH = {"Authorization": f"Bearer {KEY}"}
OK_BODY = [json.dumps({"text": "hi"}).encode()]


@pytest.mark.parametrize("method,path,chunks,status_with_key", [
    ("GET", "/stats", [], 200),
    ("GET", "/docs", [], 200),
    ("GET", "/openapi.json", [], 200),
    ("GET", "/metrics", [], 404),
    ("GET", "/no/such/route", [], 404),
    ("POST", "/v1/completions", OK_BODY, 200),
    ("POST", "/health", [], 405),
])
def test_every_route_but_health_needs_the_key(method, path, chunks, status_with_key):
    app = make_app()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, _, body, num_read = call(app, method, path, headers, chunks)
        assert status == 401 and num_read == 0  # refused before any body is read
        assert _error(body) == {"message": "a valid API key is required: send 'Authorization: Bearer <key>'",
                                "type": "authentication_error", "param": None, "code": "invalid_api_key"}
    assert call(app, method, path, AUTH, chunks)[0] == status_with_key


def test_health_is_open_to_get_and_head():
    app = make_app()
    assert call(app, "GET", "/health")[:3:2] == (200, b'{"status":"ok"}')
    assert call(app, "HEAD", "/health")[0] in (200, 405)  # HEAD is open; the route may not take it
    assert call(make_app(api_key=None), "GET", "/stats")[0] == 200  # no key configured: all open


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    status, headers, body, num_read = call(make_app(), "POST", "/v1/completions", AUTH, [b"x" * (LIMIT + 1)])
    assert (status, num_read) == (413, 0)
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"connection"] == b"close"  # the unread body must not be read as a request
    assert _error(body) == {"message": f"the request body is larger than {LIMIT} bytes (max_request_body_bytes)",
                            "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def test_a_chunked_body_is_refused_once_it_passes_the_limit():
    chunks = [b'{"text": "' + b"x" * 400] + [b"x" * 400] * 10
    status, headers, body, num_read = call(make_app(), "POST", "/v1/completions", AUTH, chunks, content_length=False)
    assert status == 413 and num_read == 3  # 410 + 400 + 400 bytes: the third passes 1000
    assert headers[b"connection"] == b"close"
    assert _error(body)["code"] == "request_too_large"


def test_a_body_at_the_limit_is_accepted():
    text = "x" * (LIMIT - len('{"text": ""}'))
    status, _, body, _ = call(make_app(), "POST", "/v1/completions", AUTH, [json.dumps({"text": text}).encode()])
    assert status == 200 and json.loads(body) == {"length": len(text)}


def test_a_stalled_body_gets_408():
    app = make_app(body_timeout_s=0.2)
    status, headers, body, _ = call(app, "POST", "/v1/completions", AUTH, [b'{"text": "'], stall=True)
    assert status == 408 and headers[b"connection"] == b"close"
    assert _error(body) == {"message": "the request body stopped arriving: nothing for 0.2 s "
                                       "(request_body_timeout_s)",
                            "type": "invalid_request_error", "param": None, "code": "request_timeout"}


def test_a_stream_outlives_the_body_timeout():
    # After the body, Starlette waits on receive() for a disconnect: no timeout there.
    status, _, body, _ = call(make_app(body_timeout_s=0.1), "POST", "/v1/chat/completions", AUTH, OK_BODY)
    assert (status, body) == (200, b"0\n1\n2\n3\n")


def test_a_generation_request_holds_its_place_until_its_response_ends():
    admission = Admission(limit=1)
    app = make_app(body_timeout_s=0.5, admission=admission)

    async def main():
        first = asyncio.create_task(asyncio.to_thread(call, app, "POST", "/v1/chat/completions", AUTH, OK_BODY))
        for _ in range(1000):  # until the first is admitted; then it streams for 2 s (4 chunks, 0.5 s apart)
            if admission.num_admitted:
                break
            await asyncio.sleep(0.01)
        during = admission.num_admitted
        refused = await asyncio.to_thread(call, app, "POST", "/v1/completions", AUTH, OK_BODY)
        return await first, during, refused

    (status, _, body, _), during, refused = asyncio.run(main())
    assert (status, body, during) == (200, b"0\n1\n2\n3\n", 1)
    assert refused[0] == 503 and refused[3] == 0  # refused before its body was read (full already)
    assert refused[1][b"retry-after"] == b"1" and _error(refused[2])["code"] == "overloaded"
    assert admission.num_admitted == 0
    # A refused or failed request gives its place back too.
    assert call(app, "POST", "/v1/completions", AUTH, [b"x" * (LIMIT + 1)])[0] == 413
    assert call(app, "POST", "/v1/completions", AUTH, [b"{}"])[0] == 400
    assert call(app, "POST", "/v1/completions", {}, OK_BODY)[0] == 401
    assert admission.num_admitted == 0 and call(app, "POST", "/v1/completions", AUTH, OK_BODY)[0] == 200


def test_a_body_still_arriving_holds_no_place():
    # a trial's 8 sockets that sent headers and no body held every place: 503s for 31 s
    admission = Admission(limit=1)
    app = make_app(body_timeout_s=0.5, admission=admission)

    async def main():
        stalled = asyncio.create_task(asyncio.to_thread(
            call, app, "POST", "/v1/completions", AUTH, [b'{"text": '], stall=True))
        await asyncio.sleep(0.1)  # its first part read, the rest never comes
        during = admission.num_admitted
        served = await asyncio.to_thread(call, app, "POST", "/v1/completions", AUTH, OK_BODY)
        return await stalled, during, served

    stalled, during, served = asyncio.run(main())
    assert during == 0 and served[:3] == (200, served[1], b'{"length":2}')
    assert stalled[0] == 408 and admission.num_admitted == 0
    # the body arrived whole before the place was taken: the app reads it as sent, in one part
    assert call(app, "POST", "/v1/completions", AUTH, [b'{"text": "ab', b'c"}'], content_length=False)[2] == \
        b'{"length":3}'


def test_a_405_says_which_methods_the_route_takes():
    # RFC 9110, 15.5.6: a 405 has Allow; the envelope dropped Starlette's (a trial's finding)
    for method, path, allowed in (("POST", "/health", b"GET"), ("GET", "/v1/completions", b"POST")):
        status, headers, body, _ = call(make_app(), method, path, AUTH)
        assert (status, headers[b"allow"], _error(body)["message"]) == (405, allowed, "Method Not Allowed")


def test_a_stopping_service_refuses_new_generation_requests_only(tmp_path, monkeypatch):
    flag = tmp_path / "draining"
    monkeypatch.setenv("MINI_INFER_DRAIN_FILE", str(flag))
    app = make_app()
    assert call(app, "POST", "/v1/completions", AUTH, OK_BODY)[0] == 200
    flag.touch()  # scripts/serve_run.py's first SIGTERM or Ctrl-C
    status, headers, body, num_read = call(app, "POST", "/v1/completions", AUTH, OK_BODY)
    assert (status, num_read, headers[b"retry-after"]) == (503, 0, b"1")
    assert _error(body) == {"message": "the service is shutting down: it finishes the requests in flight and takes "
                                       "no new ones; retry later",
                            "type": "service_unavailable_error", "param": None, "code": "shutting_down"}
    assert call(app, "GET", "/stats", AUTH)[0] == 200  # the operational routes still answer


def test_head_meets_the_api_key_as_get_does():
    app = make_app(all_rules=True)
    assert call(app, "HEAD", "/health")[:3:2] == (200, b"")  # open, as GET /health
    status, headers, body, _ = call(app, "HEAD", "/stats")
    assert (status, body) == (401, b"")  # the 401's status and headers, no body
    assert headers[b"content-type"] == b"application/json" and int(headers[b"content-length"]) > 0
    assert call(app, "HEAD", "/stats", AUTH)[:3:2] == (200, b"")
    assert call(app, "HEAD", "/v1/completions", AUTH)[:3:2] == (405, b"")  # a POST route


def test_the_api_key_is_checked_before_the_content_type():
    app = make_app(all_rules=True)
    plain = {"content-type": "text/plain"}  # listed before the helper's own JSON type
    status, _, body, num_read = call(app, "POST", "/v1/completions", plain, OK_BODY)
    assert (status, num_read, _error(body)["code"]) == (401, 0, "invalid_api_key")
    status, _, body, num_read = call(app, "POST", "/v1/completions", {**plain, **AUTH}, OK_BODY)
    assert (status, num_read, _error(body)["code"]) == (400, 0, "unsupported_content_type")


PAGE = {"Origin": "http://page.example:3000"}
PREFLIGHT = {**PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def _cors(headers: dict) -> dict:
    return {k.decode(): v.decode() for k, v in headers.items() if k.startswith(b"access-control-") or k == b"vary"}


def test_cors_any_origin_answers_the_preflight_before_the_key_and_marks_every_answer():
    """vLLM's default (``allowed_origins`` ``*``): a browser's preflight, which never carries
    the API key, is answered 200 before the key is asked for; the answers that follow,
    refusals included, carry ``Access-Control-Allow-Origin`` so that the page can read them.
    A request without ``Origin`` (not from a browser page) gets no ``Allow-Origin``."""
    app = make_app(all_rules=True, allowed_origins=["*"])
    status, headers, body, _ = call(app, "OPTIONS", "/v1/completions", PREFLIGHT)
    assert (status, body) == (200, b"OK")
    cors = _cors(headers)
    # any method: Starlette lists them all
    assert {"POST", "GET", "OPTIONS"} <= set(cors.pop("access-control-allow-methods").split(", "))
    assert cors.pop("vary").startswith("Origin")
    assert cors == {"access-control-allow-origin": "*", "access-control-max-age": "600",
                    "access-control-allow-headers": "authorization, content-type"}
    status, headers, body, _ = call(app, "POST", "/v1/completions", PAGE, OK_BODY)
    page_reads = {"access-control-allow-origin": "*", "vary": "Origin"}
    assert (status, _error(body)["code"], _cors(headers)) == (401, "invalid_api_key", page_reads)
    status, headers, body, _ = call(app, "POST", "/v1/completions", {**PAGE, **AUTH}, OK_BODY)
    assert (status, json.loads(body), _cors(headers)) == (200, {"length": 2}, page_reads)
    assert "access-control-allow-origin" not in _cors(call(app, "POST", "/v1/completions", AUTH, OK_BODY)[1])


def test_cors_for_listed_origins_only_and_none_without_the_setting():
    app = make_app(all_rules=True, allowed_origins=["http://page.example:3000"])
    status, headers, _, _ = call(app, "OPTIONS", "/v1/completions", PREFLIGHT)
    assert (status, _cors(headers)["access-control-allow-origin"]) == (200, "http://page.example:3000")
    status, headers, body, _ = call(app, "GET", "/stats", {**PAGE, **AUTH})
    assert (status, _cors(headers)) == (200, {"access-control-allow-origin": "http://page.example:3000",
                                              "vary": "Origin"})
    other = {"Origin": "http://other.example", "Access-Control-Request-Method": "POST"}
    status, headers, body, _ = call(app, "OPTIONS", "/v1/completions", other)
    assert (status, body, "access-control-allow-origin" in _cors(headers)) == (400, b"Disallowed CORS origin", False)
    status, headers, _, _ = call(app, "GET", "/stats", {**other, **AUTH})  # answered, but the page cannot read it
    assert (status, "access-control-allow-origin" in _cors(headers)) == (200, False)
    app = make_app(all_rules=True)  # allowed_origins empty: no CORS at all, as before the setting
    status, headers, body, _ = call(app, "OPTIONS", "/v1/completions", PREFLIGHT)
    assert (status, _error(body)["code"], _cors(headers)) == (401, "invalid_api_key", {})
    assert _cors(call(app, "GET", "/stats", {**PAGE, **AUTH})[1]) == {}
