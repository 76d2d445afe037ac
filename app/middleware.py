"""HTTP rules that hold for every route, as ASGI middleware (so that routes added later
follow them too): a client's disconnect delivered as ASGI says, HEAD answered like GET, the
API key, a JSON ``Content-Type`` on bodies.

``install_middleware`` adds them in the order a request meets them: the disconnect and HEAD
rewriting first, then the API key (before any body is read, so before any 400), then the
content type.
"""
from __future__ import annotations

import hmac

from fastapi import FastAPI
from ray.exceptions import TaskCancelledError
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import CLIENT_DISCONNECTED, OpenAIError, error_response

JSON = "application/json"


class DisconnectAsMessage:
    """Deliver a client's disconnect as the ``http.disconnect`` message ASGI specifies.

    Serve's ``receive`` raises ``TaskCancelledError`` instead once the proxy has cancelled a
    request whose client went away. Starlette's ``StreamingResponse`` listens for the
    disconnect in a task of its own; the exception escaped from there and Serve logged it as
    "Task exception was never retrieved", with a traceback, for every client that left in
    the middle of a stream.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except TaskCancelledError:
                scope[CLIENT_DISCONNECTED] = True  # a body cut short is the client's leaving
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


class HeadAsGet:
    """Answer ``HEAD`` like ``GET`` without the body (RFC 9110 §9.3.2): the status and
    headers (``content-length`` included) of the GET response, no body bytes. FastAPI routes
    declared with ``get`` do not take HEAD; load balancers and probes send it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


class _Rule:
    """A check on a request's scope; a failed check is answered with its ``OpenAIError``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self.check(Request(scope)) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
        else:
            await error_response(Request(scope), error)(scope, receive, send)

    def check(self, request: Request) -> OpenAIError | None:
        raise NotImplementedError


class RequireApiKey(_Rule):
    """401 for ``/v1/*`` without ``Authorization: Bearer <app.state.api_key>`` when a key
    is configured."""

    def check(self, request: Request) -> OpenAIError | None:
        api_key = getattr(request.app.state, "api_key", None)
        if not api_key or not request.url.path.startswith("/v1/"):
            return None
        if hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}"):
            return None
        return OpenAIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")


class RequireJsonBody(_Rule):
    """400 for a request with a body whose ``Content-Type`` is not JSON (``application/json``
    or ``application/<x>+json``, any parameters), or missing: every body this service takes
    is a JSON object, and a form or plain-text body would otherwise fail with a message about
    the JSON instead of the header."""

    def check(self, request: Request) -> OpenAIError | None:
        if not _has_body(request):
            return None
        content_type = request.headers.get("content-type")
        media_type = (content_type or "").split(";")[0].strip().lower()
        if media_type == JSON or (media_type.startswith("application/") and media_type.endswith("+json")):
            return None
        got = "no Content-Type header" if content_type is None else f"Content-Type {content_type!r}"
        return OpenAIError(400, f"the request body was sent with {got}; send it as JSON with "
                           f"'Content-Type: {JSON}'", code="unsupported_content_type")


def _has_body(request: Request) -> bool:
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        return True
    try:
        return int(request.headers.get("content-length", "0")) > 0
    except ValueError:
        return True


def install_middleware(app: FastAPI) -> None:
    """Add the rules above to ``app`` (Starlette runs the last added first)."""
    app.add_middleware(RequireJsonBody)
    app.add_middleware(RequireApiKey)
    app.add_middleware(HeadAsGet)
    app.add_middleware(DisconnectAsMessage)
