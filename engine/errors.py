"""Errors a caller can act on. Each is a ``ValueError`` naming the request field at fault."""
from __future__ import annotations

import reprlib

_EXCERPT = reprlib.Repr()
_EXCERPT.maxlevel = 2
_EXCERPT.maxstring = _EXCERPT.maxother = _EXCERPT.maxlong = 40
_EXCERPT.maxlist = _EXCERPT.maxtuple = _EXCERPT.maxdict = _EXCERPT.maxset = 4


def excerpt(value: object) -> str:
    """A short ``repr`` of a bad value for an error message: at most 4 items of a container
    and 40 characters of a string or number (``reprlib``), with the full length when cut,
    so that a message never echoes a large input back (``['a', 'b', 'c', 'd', ...] (10000
    items)``)."""
    try:
        text = _EXCERPT.repr(value)
    except ValueError:  # an int over Python's 4300-digit str() limit
        text = f"<{type(value).__name__} too large to print>"
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 4:
        text += f" ({len(value)} items)"
    elif isinstance(value, str) and len(value) > 40:
        text += f" ({len(value)} characters)"
    return text


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
