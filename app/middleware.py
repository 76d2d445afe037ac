"""HTTP rules that hold for every route, as ASGI middleware (so that routes added later
follow them too): a client's disconnect delivered as ASGI says, HEAD answered like GET, the
checks of ``app.http_guard.RequestGuard`` (API key, a JSON ``Content-Type`` on bodies,
admission, body size and timeout).

``install_middleware`` adds them in the order a request meets them (see there for why).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from ray.exceptions import TaskCancelledError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.admission import Admission
from app.errors import CLIENT_DISCONNECTED
from app.http_guard import RequestGuard


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


def install_middleware(app: FastAPI, api_key: str | None, admission: Admission,
                       max_body_bytes: Callable[[], Awaitable[int]], body_timeout_s: float,
                       allowed_origins: list[str] = ()) -> None:
    """Add the rules above to ``app``; ``allowed_origins`` is for CORS, the other arguments
    are ``RequestGuard``'s.

    A request meets them in this order (Starlette runs the last added first):

    0. With ``allowed_origins``, Starlette's ``CORSMiddleware`` (any method and header, no
       credentials, as vLLM's defaults): it answers a browser's preflight ``OPTIONS`` itself,
       before the API key, which browsers never send in one, and adds
       ``Access-Control-Allow-Origin`` to every answer, refusals included, so that a page can
       read the error. Without it, no CORS header (a page of another origin reads nothing).
    1. ``DisconnectAsMessage``: every later ``receive`` (the guard's body limit, FastAPI's
       body read) sees a client's leaving as ``http.disconnect``, not as Serve's exception.
    2. ``HeadAsGet``: the rules after it see a HEAD as the GET it stands for, and whatever
       they answer loses its body here: ``HEAD /health`` is as open as ``GET /health``, and a
       HEAD without the API key gets the 401's status and headers, no body.
    3. ``RequestGuard``: the API key first (a client without it learns nothing else), then a
       JSON ``Content-Type``, admission while full, all before any byte of the body is
       read, then the body's size and timeout (and a generation request's place once its
       body is here).
    """
    app.add_middleware(RequestGuard, api_key=api_key, admission=admission,
                       max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.add_middleware(HeadAsGet)
    app.add_middleware(DisconnectAsMessage)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
