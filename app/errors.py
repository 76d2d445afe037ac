"""Every error the service returns is OpenAI's envelope
``{"error": {"message", "type", "param", "code"}}``; FastAPI's own 422 body never escapes.

Each error response is logged once: what the client got wrong (4xx) as one INFO line, a
full queue or restarting replica (503) as one WARNING line, and only a server fault (other
5xx) with its traceback. Serve's log format adds the request id to every line logged while a
request is handled."""
from __future__ import annotations

import asyncio
import functools
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.protocol import MAX_JSON_DEPTH, ErrorInfo, ErrorResponse, RequestModel
from engine.errors import ContextLengthExceededError, EngineDeadError, EngineOverloadedError, InvalidRequestError

logger = logging.getLogger("ray.serve")

RETRY_AFTER_S = "1"
CLIENT_DISCONNECTED = "mini_infer.client_disconnected"  # ASGI scope key: the client left mid-body
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 503: "service_unavailable_error"}
_HTTP_CODES = {408: "request_timeout", 413: "request_too_large"}
# An error body stays small whatever the input: messages quote bad values through
# engine.errors.excerpt, and these caps hold for anything else (a pydantic location built
# from a client's dict key, an exception's text).
MAX_MESSAGE_CHARS = 1024
MAX_PARAM_CHARS = 128


class OpenAIError(Exception):
    """An HTTP error with OpenAI's fields."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = error_type or _TYPES.get(status_code, "internal_server_error")
        self.headers = headers or {}  # the response's own (a 405's Allow)

    def body(self) -> dict:
        info = ErrorInfo(message=_cut(self.message, MAX_MESSAGE_CHARS), type=self.type,
                         param=None if self.param is None else _cut(self.param, MAX_PARAM_CHARS),
                         code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        """The envelope as a response: with ``Retry-After`` on 429 and 503, and with
        ``Connection: close`` on 408 and 413 (the guard's, sent with the body not read to its
        end: the rest of it would be read as the next request; RFC 9110, 15.5.9 and 15.5.14),
        and the error's own ``headers``."""
        headers = dict(self.headers)
        if self.status_code in (429, 503):
            headers["Retry-After"] = RETRY_AFTER_S
        elif self.status_code in (408, 413):
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def from_exception(exc: BaseException) -> OpenAIError:
    """Map an engine or Serve exception (possibly wrapped by Ray) to an ``OpenAIError``."""
    cause = _unwrap(exc)
    if isinstance(cause, OpenAIError):
        return cause
    if _is_cancellation(cause):  # the client went away; nobody reads this response
        return client_closed("before the response was complete")
    if isinstance(cause, ContextLengthExceededError):
        return OpenAIError(400, str(cause), cause.param, "context_length_exceeded")
    if isinstance(cause, InvalidRequestError):
        return OpenAIError(400, str(cause), cause.param)
    if isinstance(cause, ValueError):
        return OpenAIError(400, str(cause))
    if isinstance(cause, EngineOverloadedError):
        return OpenAIError(503, f"{cause}; retry later", code="overloaded")
    if isinstance(cause, BackPressureError):
        return OpenAIError(503, "the service is overloaded: every engine replica is busy and the "
                           "queue in front of them is full; retry later", code="overloaded")
    if isinstance(cause, DeploymentUnavailableError):
        return OpenAIError(503, "no engine replica is running (starting or restarting); "
                           "retry later", code="engine_unavailable")
    if isinstance(cause, EngineDeadError):
        return OpenAIError(503, f"the engine replica is not running: {cause}; retry (Serve "
                           "replaces it)", code="engine_dead")
    if isinstance(cause, RayActorError):
        return OpenAIError(503, "the engine replica serving this request died; retry "
                           f"(Serve restarts it): {type(cause).__name__}", code="replica_died")
    return OpenAIError(500, f"internal error: {type(cause).__name__}: {cause}", code="internal_error")


def from_http_exception(exc: StarletteHTTPException) -> OpenAIError:
    """Starlette's and FastAPI's HTTP errors (404, 405, the guard's 408 and 413, and FastAPI's
    400 for a body Python's ``json`` cannot read although it is JSON)."""
    if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
        return OpenAIError(400, "the body could not be parsed: its JSON nests arrays and objects too deeply "
                           f"(a request field may nest {MAX_JSON_DEPTH} levels)")
    if exc.status_code == 400 and isinstance(exc.__cause__, ValueError):
        # e.g. "Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits"
        reason = str(exc.__cause__).split("; use sys.set_int_max_str_digits", 1)[0]
        return OpenAIError(400, f"the body could not be parsed as JSON: {reason}")
    # Starlette's 405 carries Allow, which RFC 9110 (15.5.6) requires
    return OpenAIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code),
                       headers=dict(exc.headers or {}))


def client_closed(when: str) -> OpenAIError:
    """The outcome of a client that disconnected ``when`` (nginx's 499; nobody reads it)."""
    return OpenAIError(499, f"the client disconnected {when}; the request was aborted",
                       code="client_closed_request", error_type="client_closed_request")


def _cut(text: str, max_chars: int) -> str:
    """``text`` cut to exactly ``max_chars`` characters, saying how long it was."""
    if len(text) <= max_chars:
        return text
    suffix = f"... ({len(text)} characters)"
    return text[:max_chars - len(suffix)] + suffix


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, (asyncio.CancelledError, TaskCancelledError, RequestCancelledError))


def _unwrap(exc: BaseException) -> BaseException:
    """Ray re-raises a replica's exception as a ``RayTaskError`` whose ``cause`` is the
    original (its attributes, like ``param``, live there)."""
    while getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    # Of a union's per-member errors, the deepest is the one about what the client meant, and
    # at one depth a member whose type matched (an empty array of parts) says more than the
    # other members' "should be a string".
    errors = _first_in_each_array(exc.errors())
    # And of members that failed at one depth inside an array, the one that got further along
    # it ([1, "a"]: the array of integers at "a", not the array of strings at 1).
    first = max(errors, key=lambda e: (len(e.get("loc", ())), not _is_member_mismatch(e),
                                       [part for part in e.get("loc", ()) if isinstance(part, int)]), default={})
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    location = [part for part in first.get("loc", ())[1:]  # drop "body" / "query"
                if not _is_union_tag(part)]
    param = _cut(json_path(location), MAX_PARAM_CHARS) or None  # a dict key can be any length
    message = first.get("msg", "invalid request")
    members = _union_members(errors, first)
    if members:  # the value matched no member of a union: say what each would have been
        kinds = [kind for tag in members for kind in _describe_member(tag)]
        listed = ", ".join(kinds[:-1]) + " or " + kinds[-1]
        return OpenAIError(400, f"{param}: must be {listed}; got {json_kind(first.get('input'))}", param)
    if first.get("type") == "missing":
        message = f"{param} is required" if param else "the request body (a JSON object) is required"
        other = _OTHER_ENDPOINT.get(param)
        if other is not None and isinstance(getattr(exc, "body", None), dict) and other[0] in exc.body:
            message += f" ({other[0]} is a field of {other[1]})"
    elif first.get("type") == "string_unicode":  # a lone surrogate in an object key
        message = (f"{param or 'the request body'}: holds a key that is not valid Unicode (a lone "
                   "surrogate such as \\ud800 has no UTF-8 encoding)")
    elif not param:
        message = f"the request body must be a JSON object: {message}"
    elif isinstance(first.get("ctx", {}).get("error"), ValueError):
        message = f"{param}: {first['ctx']['error']}"
    else:
        message = f"{param}: {message}"
    return OpenAIError(400, message, param)


# A required field, and the field that takes its place on the other endpoint: a client that
# sent one to the wrong endpoint is told where it goes.
_OTHER_ENDPOINT = {"prompt": ("messages", "/v1/chat/completions"), "messages": ("prompt", "/v1/completions")}


def json_path(location) -> str:
    """A field's place in the body as the API's error messages write it: keys joined by dots,
    array indices in brackets (``messages[0].content``, ``tools[1].function.name``)."""
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _union_members(errors, first: dict) -> list[str]:
    """The union members (pydantic's tags, e.g. ``["str", "list[int]"]``) that each refused
    the value at ``first``'s location as a whole, when that is where ``first`` failed; else
    ``[]`` (a member that got further, into a list say, failed deeper and was picked)."""
    loc = tuple(first.get("loc", ()))
    if len(loc) < 2 or not _is_union_tag(loc[-1]) or not _is_type_mismatch(first):
        return []
    tags = [e["loc"][-1] for e in errors if len(e.get("loc", ())) == len(loc) and tuple(e["loc"][:-1]) == loc[:-1]
            and _is_union_tag(e["loc"][-1])]
    return tags if len(tags) > 1 else []


_TYPE_NAMES = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
               "bool": ("a boolean", "booleans"), "dict": ("an object", "objects")}


def _describe_member(tag: str) -> list[str]:
    """A union member's tag as the values it takes, in JSON's words: ``literal['a','b']`` ->
    ``["'a'", "'b'"]``, else ``[describe_type(tag)]``."""
    if tag.startswith("literal[") and tag.endswith("]"):
        return [choice.strip() for choice in tag[len("literal["):-1].split(",")]
    return [describe_type(tag)]


def describe_type(tag: str, plural: bool = False) -> str:
    """A union tag in JSON's words: ``list[list[int]]`` -> "an array of arrays of integers",
    ``list[TextPart]`` -> "an array of objects"."""
    if tag.startswith("list[") and tag.endswith("]"):
        return ("arrays of " if plural else "an array of ") + describe_type(tag[5:-1], plural=True)
    one, many = _TYPE_NAMES.get(tag, ("an object", "objects"))  # a request model: not its class name
    return many if plural else one


def json_kind(value) -> str:
    """What the client sent, in JSON's words."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "an array"),
                       (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _first_in_each_array(errors: list) -> list:
    """``errors`` without those of a union's array member past the first element it refused:
    how far along the array a member got is where it first failed ([1.0, 2]: the array of
    integers at 1.0, not the array of strings at 2, which it also refused)."""
    located = [(error, *_array_member(error)) for error in errors]
    first_index: dict[tuple, int] = {}
    for _, member, index in located:
        if member is not None:
            first_index[member] = min(first_index.get(member, index), index)
    return [error for error, member, index in located if member is None or index == first_index[member]]


def _array_member(error: dict) -> tuple[tuple | None, int]:
    """``(the location of the union member, the element index)`` where the error is inside
    an array member of a union, else ``(None, 0)``."""
    loc = tuple(error.get("loc", ()))
    tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag is None or tag + 1 >= len(loc) or not isinstance(loc[tag + 1], int):
        return None, 0
    return loc[: tag + 1], loc[tag + 1]


def _is_type_mismatch(error: dict) -> bool:
    """pydantic's error for a value of another type (``string_type``, ``model_type``, a
    literal's), not one about a value of the right type (``too_short``, ``value_error``)."""
    kind = error.get("type", "")
    return kind.endswith("_type") or kind in {"literal_error", "is_instance_of"}


def _is_member_mismatch(error: dict) -> bool:
    """A union member refused the value by its type (``("content", "str")``: string_type)."""
    loc = error.get("loc", ())
    return bool(loc) and _is_union_tag(loc[-1]) and _is_type_mismatch(error)


def _is_union_tag(part) -> bool:
    """pydantic names the member of a union in the error location (``str``, ``list[TextPart]``,
    ``NamedToolChoice``: a request model's class name)."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"}
                                      or part in _request_model_names())


@functools.cache
def _request_model_names() -> frozenset[str]:
    """The class names of ``app.protocol.RequestModel`` and its subclasses, at any depth."""
    names, pending = set(), [RequestModel]
    while pending:
        model = pending.pop()
        names.add(model.__name__)
        pending.extend(model.__subclasses__())
    return frozenset(names)


def log_error(request: Request, error: OpenAIError, exc: BaseException | None = None) -> None:
    """One line per error response (request id added by Serve's log format); the traceback of
    ``exc`` only for a server fault."""
    where = f"{request.method} {request.url.path}"
    param = f" (param {error.param})" if error.param else ""
    if error.status_code < 500:
        logger.info("%s -> %d %s%s: %s", where, error.status_code, error.code or error.type, param,
                    error.message)
    elif error.status_code == 503:
        logger.warning("%s -> 503 %s: %s", where, error.code, error.message)
    else:
        logger.error("%s -> %d: %s", where, error.status_code, error.message, exc_info=exc)


def error_response(request: Request, error: OpenAIError, exc: BaseException | None = None) -> JSONResponse:
    """The envelope response, logged (``log_error``) and counted in
    ``app.state.http_metrics`` when the app has one."""
    metrics = getattr(request.app.state, "http_metrics", None)
    if metrics is not None:
        metrics.record_error(error.status_code)
    log_error(request, error, exc)
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the envelope. ``ValueError`` (the engine's and
    ``SamplingParams``' "invalid as sent") is a 400 handled like the others, not a server
    error re-raised to the log."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if request.scope.get(CLIENT_DISCONNECTED):  # set by app.middleware
            return error_response(request, client_closed("while sending the request body"))
        return error_response(request, from_http_exception(exc))

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(request, exc, exc.__cause__)

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(request, from_exception(exc), exc)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, from_exception(exc), exc)


def sse_error(error: OpenAIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"
