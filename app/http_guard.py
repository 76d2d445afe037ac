"""The checks every HTTP request passes before FastAPI reads its body: the API key, admission
of a generation request (``app.admission.Admission``), the request-body size limit and the body
read timeout. A generation request is refused at once while the service is full, and takes its
place once its whole body has arrived (read here, then handed on).

A pure ASGI middleware (not ``BaseHTTPMiddleware``), so that a refused request is answered
without its body being read or parsed, and a streaming response is passed through untouched.
A body over the limit is refused from its ``Content-Length`` before any of it is read, or,
when it is sent in chunks, as soon as the bytes read pass the limit. Serve's HTTP proxy still
reads what the client sends while the request is open; only a reverse proxy in front can
refuse a body before it is read at all (docs/DEPLOYMENT.md).
"""
from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Awaitable, Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.admission import Admission
from app.errors import OpenAIError, error_response, from_http_exception
from engine.errors import excerpt

JSON = "application/json"

# Routes a load balancer probes without credentials (GET and HEAD).
OPEN_PATHS = frozenset({"/health"})
# Routes whose POST requests hold a place in the engine replicas until they are answered.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class RequestGuard:
    """ASGI middleware: 401 without the API key, 400 for a body not sent as JSON
    (``check_json_body``), 503 for a generation request while the service is stopping
    (``check_not_draining``) or the engine replicas are full,
    413 for a body over the limit, 408 for a body that stops arriving; each in OpenAI's error
    envelope, the first three before the body is read (413 from ``Content-Length``; for a
    chunked body, as soon as the bytes read pass the limit).

    Args:
        app: the wrapped ASGI app.
        api_key: when set, every request but ``GET``/``HEAD`` on ``OPEN_PATHS`` needs
            ``Authorization: Bearer <api_key>`` (compared in constant time).
        admission: a ``POST`` on ``GENERATION_PATHS`` is refused while it is full, and holds
            a place in it from when its body has arrived until its response has ended
            (streamed to the end, failed, or the client gone).
        max_body_bytes: returns the body limit in bytes; awaited only for requests that
            carry a body (the ingress learns the engine's ``max_model_len`` lazily).
        body_timeout_s: seconds to wait for each next part of a body.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, admission: Admission,
                 max_body_bytes: Callable[[], Awaitable[int]], body_timeout_s: float) -> None:
        self.app = app
        self.expected_authorization = f"Bearer {api_key}" if api_key else None
        self.admission = admission
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        release = None
        try:
            try:
                self._authorize(scope, headers)
                check_json_body(headers)
                if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
                    check_not_draining()
                    self.admission.check()  # full: refused at once, before the body is read
                    if has_body(headers):
                        receive = await self._read_body(headers, receive)
                        if receive is None:  # the client left before its body was complete
                            return
                    release = self.admission.admit()
                elif has_body(headers):
                    receive = await self._limit_body(headers, receive)
            except (OpenAIError, HTTPException) as error:
                if isinstance(error, HTTPException):
                    error = from_http_exception(error)
                await error_response(Request(scope), error)(scope, receive, send)
                return
            await self.app(scope, receive, send)
        finally:
            if release is not None:
                release()

    def _authorize(self, scope: Scope, headers: Headers) -> None:
        if self.expected_authorization is None:
            return
        if scope["path"] in OPEN_PATHS and scope["method"] in ("GET", "HEAD"):
            return
        if not hmac.compare_digest(headers.get("authorization", "").encode(),
                                   self.expected_authorization.encode()):
            raise OpenAIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")

    async def _read_body(self, headers: Headers, receive: Receive) -> Receive | None:
        """The whole body read now, under the size limit and the timeout, and handed to the
        app as it would have arrived (``None`` if the client left first): a generation
        request takes its place in admission only once its body is here, so that connections
        that never finish a body cannot hold every place (a trial's 8 sockets that sent
        headers and no body got every other request a 503 for 31 s)."""
        limited = await self._limit_body(headers, receive)
        parts = []
        while True:
            message = await limited()
            if message["type"] != "http.request":
                return None
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return _replay(b"".join(parts), receive)

    async def _limit_body(self, headers: Headers, receive: Receive) -> Receive:
        """Refuse a declared length over the limit now; count and time what arrives."""
        limit = await self.max_body_bytes()
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        timeout = self.body_timeout_s
        num_bytes, complete = 0, False

        async def limited_receive() -> Message:
            nonlocal num_bytes, complete
            if complete:  # after the body: a wait for http.disconnect, with no timeout
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout)
            except TimeoutError:
                raise HTTPException(408, f"the request body stopped arriving: nothing for "
                                         f"{timeout:g} s (request_body_timeout_s)") from None
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if num_bytes > limit:
                    raise _too_large(limit)
            else:
                complete = True
            return message

        return limited_receive


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app once the middleware has read the whole ``body``: the body as
    one message, then the client's own messages (a disconnect)."""
    pending: list[bytes] = [body]

    async def replayed_receive() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replayed_receive


def draining() -> bool:
    """Whether the service is stopping: ``MINI_INFER_DRAIN_FILE`` (which ``make run``'s
    ``scripts/serve_run.py`` sets, and creates on its first SIGTERM or Ctrl-C) exists."""
    path = os.environ.get("MINI_INFER_DRAIN_FILE")
    return bool(path) and os.path.exists(path)


# What the drain file holds once a stop's wait for the requests in flight is over.
STOP_NOW = "stop"


def stopping_now() -> bool:
    """Whether a stop's wait is over (``MINI_INFER_SHUTDOWN_TIMEOUT_S`` has passed): the
    drain file holds ``STOP_NOW``, which ``scripts/serve_run.py`` writes just before it stops
    Serve. The requests still running then end with 503 ``shutting_down``
    (``app.engine_server``): an SSE error event and ``[DONE]``, not a cut connection."""
    path = os.environ.get("MINI_INFER_DRAIN_FILE")
    try:
        with open(path or "", encoding="utf-8") as flag:
            return flag.read().strip() == STOP_NOW
    except OSError:
        return False


def shutting_down_error(in_flight: bool = False) -> OpenAIError:
    """503 ``shutting_down``: for a new request while ``draining()``, or (``in_flight``) for
    one still running when the wait is over (its time ran out, or a second signal came: the
    engine replicas see only the flag, so the message names both)."""
    if in_flight:
        return OpenAIError(503, "the service is shutting down and stopped this request: the wait for the requests "
                           "in flight (MINI_INFER_SHUTDOWN_TIMEOUT_S) ran out, or a second stop signal ended it; "
                           "retry later", code="shutting_down")
    return OpenAIError(503, "the service is shutting down: it finishes the requests in flight and takes no "
                       "new ones; retry later", code="shutting_down")


def check_not_draining() -> None:
    """Raises: OpenAIError: 503 ``shutting_down`` (with ``Retry-After``) while ``draining()``:
    the requests in flight finish, new ones go elsewhere or wait for the restart."""
    if draining():
        raise shutting_down_error()


def check_json_body(headers: Headers) -> None:
    """A body must be sent as JSON (``application/json`` or ``application/<x>+json``, any
    parameters): every body this service takes is a JSON object, and a form or plain-text
    body would otherwise fail with a message about the JSON instead of the header.

    Raises:
        OpenAIError: 400 ``unsupported_content_type`` for another or a missing type.
    """
    if not has_body(headers):
        return
    content_type = headers.get("content-type")
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type == JSON or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    got = "no Content-Type header" if content_type is None else f"Content-Type {excerpt(content_type)}"
    raise OpenAIError(400, f"the request body was sent with {got}; send it as JSON with "
                      f"'Content-Type: {JSON}'", code="unsupported_content_type")


def has_body(headers: Headers) -> bool:
    """Whether a request carries a body: chunked, or a ``Content-Length`` that is not 0."""
    return "transfer-encoding" in headers or headers.get("content-length", "0") != "0"


def _too_large(limit: int) -> HTTPException:
    # Raised inside FastAPI's body read, a starlette HTTPException reaches the app's handler,
    # which gives it the envelope (app.errors.from_http_exception).
    return HTTPException(413, f"the request body is larger than {limit} bytes "
                              "(max_request_body_bytes)")
