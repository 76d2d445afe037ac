"""Errors a caller can act on. Each is a ``ValueError`` naming the request field at fault."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that can never be served as sent.

    Attributes:
        param: the request field at fault (``"temperature"``, ``"prompt"``, ...), if one is.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """The prompt plus ``max_tokens`` exceeds ``max_model_len`` or the whole KV cache."""


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full: retry later (HTTP 503 with Retry-After)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (an exception in the step that ran it)."""


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served until the engine restarts
    (HTTP 503: Serve replaces the replica)."""


class NoFreeBlocksError(RuntimeError):
    """Raised by ``BlockManager.allocate`` when the pool cannot cover the request; callers
    check first, so this is a scheduler bug when it escapes."""
