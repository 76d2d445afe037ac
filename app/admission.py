"""What keeps load off the engine replicas at the ingress: a strict bound on the requests let
through (``Admission``), probes whose outcome is shared (``CachedCheck``), and a streaming
response that always gives its request back (``ClosingStreamingResponse``).

Each ingress replica runs one event loop, and nothing here awaits between a check and the
change it guards, so these need no locks.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import OpenAIError


class Admission:
    """The requests this ingress replica has let through to the engine replicas, at most
    ``limit``; one more is refused at once, before it waits anywhere.

    Serve's ``max_queued_requests`` cannot be this bound: Serve checks it before it counts a
    request as queued (a burst passes the check together), and a request that passed waits
    for a replica without limit.

    Args:
        limit: ``AppConfig.max_admitted_requests``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_admitted = 0

    def check(self, count: int = 1) -> None:
        """Whether ``count`` places are free now, taking none (a request is refused at once
        while the service is full, before its body is read, and admitted once it has arrived).

        Raises:
            OpenAIError: 503 ``overloaded`` (with ``Retry-After``) when fewer are free.
        """
        if self.num_admitted + count > self.limit:
            raise OpenAIError(503, f"the service is overloaded: {self.limit} requests are running or "
                              "waiting (max_num_seqs + max_waiting_requests per engine replica); "
                              "retry later", code="overloaded")

    def admit(self, count: int = 1) -> Callable[[], None]:
        """Let ``count`` requests through (a completions batch's other prompts: one engine
        request each); returns the function that gives their places back (once).

        Raises:
            OpenAIError: 503 ``overloaded`` (with ``Retry-After``) when fewer than ``count``
                places are free.
        """
        self.check(count)
        self.num_admitted += count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.num_admitted -= count

        return release


class CachedCheck:
    """An async check run at most once per ``ttl_s``: concurrent and later callers share its
    outcome (a result or an exception) until it is ``ttl_s`` old.

    Args:
        check: the coroutine function to run.
        ttl_s: seconds an outcome is reused.
    """

    def __init__(self, check: Callable[[], Awaitable[dict]], ttl_s: float) -> None:
        self._check = check
        self._ttl_s = ttl_s
        self._task: asyncio.Task | None = None
        self._done_at = -math.inf

    async def __call__(self) -> dict:
        expired = time.monotonic() - self._done_at > self._ttl_s
        if self._task is None or (self._task.done() and expired):
            self._task = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._task)  # a caller that leaves does not cancel it

    async def _run(self) -> dict:
        try:
            return await self._check()
        finally:
            self._done_at = time.monotonic()


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that calls ``on_close`` when it ends, however it ends: the body
    sent, the client gone, or cancelled before the first byte (when the body iterator never
    started, so that its own ``finally`` never runs).

    Args:
        content: the body iterator.
        on_close: called once the response is over (``self.on_close`` takes more).
        **kwargs: as ``StreamingResponse``.
    """

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = [on_close]  # called in order; a caller may add more

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for on_close in self.on_close:
                on_close()
