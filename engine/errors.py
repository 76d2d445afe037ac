"""Errors a caller can act on. Each is a ``ValueError`` naming the request field at fault."""
from __future__ import annotations

from typing import Optional


class InvalidRequestError(ValueError):
    """A request that can never be served as sent.

    Attributes:
        param: the request field at fault (``"temperature"``, ``"prompt"``, ...), if one is.
    """

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """The prompt plus ``max_tokens`` exceeds ``max_model_len`` or the whole KV cache."""


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full: retry later (HTTP 503 with Retry-After)."""
