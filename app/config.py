"""The application's settings: one pydantic model, filled from (lowest to highest priority)
its defaults, ``MINI_INFER_<FIELD>`` environment variables, and ``serve run`` arguments or a
Serve config file's ``args``.

The engine's settings are not written here: ``AppConfig`` takes one field per engine
argument of ``engine.config`` (name, type, default, allowed values as a ``Literal``, help as
the description), so that a setting added there appears here too.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from engine.config import EngineConfig, engine_args

ENV_PREFIX = "MINI_INFER_"

# The MINI_INFER_* variables that are not AppConfig fields, each read where it acts. Any other
# MINI_INFER_* variable is an error in AppConfig.load (a misspelt MINI_INFER_API_KEY must not
# leave the service open without a word); tests/app/test_config.py keeps this list complete.
OTHER_SETTINGS = {
    "MINI_INFER_CACHE": "engine.loader: where converted weights and the built extension are kept",
    "MINI_INFER_CPU_ISA": "kernels.cpu_settings: the CPU attention's instruction set",
    "MINI_INFER_CPU_PREFILL": "kernels.cpu_settings: the CPU prefill attention path",
    "MINI_INFER_CPU_PREFETCH": "kernels.cpu_settings: the decode kernel's prefetch level",
    "MINI_INFER_DEBUG_CHECKS": "engine.block_manager: check the block pool after every change",
    "MINI_INFER_FIT_THREADS": "engine.threads: fit torch's threads to the free CPUs",
    "MINI_INFER_SHUTDOWN_TIMEOUT_S": "scripts/serve_run.py: how long a stop waits for requests in flight",
    "MINI_INFER_DRAIN_FILE": "app.http_guard: the file whose presence means the service is stopping",
    **{f"MINI_INFER_LOAD_{name}": "loadtest: the Locust load test's settings"
       for name in ("MODEL", "MIX", "OUTPUT", "MAX_MODEL_LEN", "CHAT_TURNS", "CHAT_OUTPUT", "API_KEY")},
}

# Default request-body limit: a prompt of max_model_len tokens sent as token ids takes at
# most 7 bytes a token ("49151, "), as JSON-escaped text rarely over 12 (\uXXXX per CJK
# character); 64 leaves room for escaped whitespace runs. The other fields (messages' framing,
# stop, logit_bias) get 1 MiB.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_OVERHEAD = 1 << 20
# Ingress concurrency beyond what the engine replicas hold: requests being refused (before
# their bodies are read: microseconds each), /health, /v1/models. Past it, requests wait in
# Serve's proxy, which retries every 0.5 s at most.
INGRESS_HEADROOM = 1024
# Engine replica places beyond the generation requests it holds, for the control calls of
# /health (is_alive), /stats and /metrics: Serve counts every call to a replica against its
# max_ongoing_requests, so without them those calls waited behind a full replica's
# generations (a 503 "unhealthy" after 5 s, /stats after 9.7 s, in a trial). Each takes
# milliseconds; the ingress shares one /health probe among its callers.
ENGINE_CONTROL_HEADROOM = 16


# An origin as browsers send it in ``Origin`` (RFC 6454 section 6.1): scheme://host[:port],
# the scheme and host in lowercase, no user info, a port of 1-65535; or "null" (a file:// page,
# a sandboxed frame).
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9._~%!$&'()*+,;=-]+)(:(?P<port>[0-9]{1,5}))?|null")


class ServiceSettings(BaseModel):
    """Settings of the service around the engine; ``AppConfig`` adds the engine's own."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    served_model_name: str | None = Field(None, description="The name clients pass as "
                                          "`model`; defaults to `model`.")
    max_waiting_requests: int = Field(512, ge=0, description="Requests an engine replica may "
                                      "queue before new ones get 503 with Retry-After.")
    num_engine_replicas: int = Field(1, ge=1, description="Engine replicas (each holds a model); "
                                     "with autoscaling, its max_replicas (the ingress admits "
                                     "what that many hold).")
    num_ingress_replicas: int = Field(1, ge=1, description="OpenAI front-end replicas.")
    engine_num_cpus: float | None = Field(
        None, ge=0, description="CPUs Ray reserves per engine replica on CPU-only nodes; its torch "
        "threads follow them. Default: the CPUs of the largest node shared among num_engine_replicas, "
        "floored, at least 1 (one replica computes on every core, as vLLM's CPU worker does).")
    request_router: Literal["prefix", "pow2"] | None = Field(
        None, description="How requests are spread over engine replicas: `prefix` sends a request "
        "to the replica that holds the longest part of its prompt prefix while load is balanced "
        "(app.router), `pow2` is Serve's power of two choices. Default: `prefix` with more than one "
        "engine replica (num_engine_replicas), else `pow2`.")
    router_imbalanced_threshold: int = Field(
        16, ge=0, description="`prefix` router: ongoing requests between the most and the least "
        "loaded engine replica beyond which load decides, not the prefix.")
    engine_transport: Literal["grpc", "ray"] = Field(
        "grpc", description="How the ingress calls the engine replicas and their records stream "
        "back: `grpc` is Serve's interdeployment gRPC transport (a gRPC stream per request, "
        "DeploymentHandle `_by_reference=False`), `ray` Ray's actor calls (an object in Ray's "
        "object store per streamed record), which cost the ingress and the engine replica more CPU "
        "per token (docs/DEPLOYMENT.md, \"How requests cross between Serve's processes\").")
    stream_batching_interval_ms: float = Field(
        0, ge=0, allow_inf_nan=False, description="Streamed outputs of a request that come within this many ms of the "
        "last record sent are merged into one record (Ray Serve LLM's setting of this name): fewer "
        "records across Ray and fewer SSE events, at up to this much added inter-token latency. "
        "The first token is sent at once. 0 (the default; Ray Serve LLM's is 50): a record per "
        "engine step, as vLLM streams. docs/PERFORMANCE.md has what 50 and 100 gave on w1_mixed.")
    api_key: str | None = Field(None, min_length=1, description="If set, every route but /health needs "
                                "`Authorization: Bearer <api_key>`; an empty one is an error (an unset shell "
                                "variable), not a service without a key.")
    max_request_body_bytes: int | None = Field(
        None, ge=1, description="Largest request body the ingress reads; a larger one gets 413 "
        "before it is parsed. Default: 64 bytes per token of max_model_len, plus 1 MiB.")
    request_body_timeout_s: float = Field(
        30.0, gt=0, description="Seconds the ingress waits for the next part of a request body "
        "before it answers 408 (a stalled or truncated upload).")

    allowed_origins: list[str] = Field(
        ["*"], description="Origins whose browser pages may call the API and read its answers "
        "(CORS; vLLM's --allowed-origins): `*` is any origin (the default, as vLLM's), else a JSON list or "
        "comma-separated `scheme://host[:port]`; empty: no CORS headers, so only pages served from this "
        "service's own origin can read its answers.")

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _origins_from_text(cls, value: Any) -> Any:
        """An environment variable's or ``serve run`` argument's text: a JSON list, or
        origins separated by commas."""
        if not isinstance(value, str):
            return value
        if value.strip().startswith("["):
            try:
                return json.loads(value)
            except ValueError as exc:  # pydantic reports it for the field
                raise ValueError(f"not a JSON list of origins ({exc})") from None
        return [origin.strip() for origin in value.split(",") if origin.strip()]

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        """Each ``*`` or an origin as a browser's ``Origin`` header has it (RFC 6454): one
        with a path or a trailing slash would never match."""
        for origin in origins:
            match = _ORIGIN.fullmatch(origin)
            if origin != "*" and not (match and 1 <= int(match["port"] or 1) <= 65535):
                raise ValueError(f"{origin!r} is not an origin as browsers send it: `*`, `null` or "
                                 "scheme://host[:port] in lowercase, a port of 1-65535, without user info, a path "
                                 "or a trailing slash")
        return origins

    @model_validator(mode="after")
    def _valid_engine_config(self):
        self.engine_config()  # its ValueError names the setting; pydantic reports it
        return self

    @classmethod
    def load(cls, args: dict[str, Any] | None = None) -> "AppConfig":
        """Defaults, overridden by ``MINI_INFER_*`` environment variables, overridden by
        ``args``.

        Raises:
            pydantic.ValidationError: naming the field, for a bad value or an unknown name
                (in ``args``, or a ``MINI_INFER_*`` variable that is neither a field nor one
                of ``OTHER_SETTINGS``: the closest known name is suggested).
        """
        errors = _environment_errors({ENV_PREFIX + name.upper() for name in cls.model_fields})
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        values = {name: os.environ[ENV_PREFIX + name.upper()] for name in cls.model_fields
                  if ENV_PREFIX + name.upper() in os.environ}
        values.update(args or {})
        return cls.model_validate(values)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def resolved_request_router(self) -> str:
        """``request_router``, or its default: ``prefix`` with more than one engine replica."""
        if self.request_router is not None:
            return self.request_router
        return "prefix" if self.num_engine_replicas > 1 else "pow2"

    def default_engine_num_cpus(self, node_cpus: float) -> float:
        """``engine_num_cpus``'s default for a node of ``node_cpus`` CPUs: those shared among
        ``num_engine_replicas`` (with autoscaling its most replicas), floored, at least 1.

        On a 2-core machine one replica reserves 2 CPUs and runs 2 threads; the proxy and the
        ingress reserve none, and ``engine.threads.FreeCpuThreads`` drops a thread while they
        (or anything else) need a core. Measured on an AMD EPYC with AVX512-BF16, w1_mixed's
        first 32 requests at once through HTTP: 277-290 output tok/s with 1 CPU (one thread),
        312-351 with 2 (docs/PERFORMANCE.md, "A lone engine replica on every core, and Serve's
        one-loop settings").
        """
        return float(max(1, math.floor(node_cpus / self.num_engine_replicas)))

    @property
    def engine_capacity(self) -> int:
        """Generation requests an engine replica holds: a full batch and its waiting queue;
        it refuses one more (503 ``overloaded``)."""
        return self.max_num_seqs + self.max_waiting_requests

    @property
    def engine_max_ongoing_requests(self) -> int:
        """Serve's ``max_ongoing_requests`` for an engine replica: its capacity, and
        ``ENGINE_CONTROL_HEADROOM`` places for control calls, which would otherwise wait
        behind a full replica's generations. The ingress admits no more generation requests
        than the replicas' capacity (``max_admitted_requests``), so with one engine replica
        generations never take those places; with several, Serve's routing may send one
        replica more than its capacity, and it refuses them (503 ``overloaded``)."""
        return self.engine_capacity + ENGINE_CONTROL_HEADROOM

    @property
    def max_admitted_requests(self) -> int:
        """Requests an ingress replica lets through to the engine replicas at once: what they
        hold, running and waiting. One more is refused at once (503), before it queues.

        Also Serve's ``max_queued_requests`` for the engine deployment, as a second bound:
        Serve checks its own before it counts a request as queued, so a burst can pass it,
        and a request that passed waits for a free replica without limit."""
        return self.num_engine_replicas * self.engine_capacity

    @property
    def ingress_max_ongoing_requests(self) -> int:
        """Serve's ``max_ongoing_requests`` (and ``max_queued_requests``) for an ingress
        replica: the admitted requests and ``INGRESS_HEADROOM`` more, so that overload is
        refused by the ingress in OpenAI's envelope rather than waiting in Serve's proxy."""
        return self.max_admitted_requests + INGRESS_HEADROOM

    def max_body_bytes(self, max_model_len: int) -> int:
        """``max_request_body_bytes``, or its default for the engine's ``max_model_len``."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return BODY_BYTES_PER_TOKEN * max_model_len + BODY_BYTES_OVERHEAD

    def engine_config(self) -> EngineConfig:
        """The engine's settings.

        Raises:
            ValueError: naming an invalid engine setting.
        """
        return EngineConfig.from_kwargs(**{arg.name: getattr(self, arg.name) for arg in engine_args()})


def _engine_fields() -> dict[str, Any]:
    """pydantic field definitions for every engine argument: text choices become a
    ``Literal``; numeric choices (``block_size``) stay numbers that ``MINI_INFER_*`` strings
    convert to, checked by ``EngineConfig``."""
    fields = {}
    for arg in engine_args():
        textual = arg.choices and all(isinstance(c, str) for c in arg.choices)
        annotation = Literal[arg.choices] if textual else arg.type
        fields[arg.name] = (annotation, Field(arg.default, description=arg.help))
    return fields


AppConfig = create_model("AppConfig", __base__=ServiceSettings, __module__=__name__,
                         __doc__="Settings of the OpenAI-compatible service "
                                 "(``serve run app:build_app key=value``).",
                         **_engine_fields())


def _environment_errors(fields: set[str]) -> list[InitErrorDetails]:
    """What is wrong with the ``MINI_INFER_*`` variables beyond the fields' values: each that
    is neither one of ``fields`` nor of ``OTHER_SETTINGS`` (exact names: ``MINI_INFER_api_key``
    is not read; ``loc`` the variable as written, not its value, which may be a secret); else
    the value of an ``OTHER_SETTINGS`` variable with choices (the CPU kernels', the thread
    fitting's) that its reader refuses, in the reader's words (``loc`` empty), so that
    ``make run`` refuses it in one line before Ray starts, not a failed deployment's tracebacks."""
    unknown = sorted(name for name in os.environ
                     if name.startswith(ENV_PREFIX) and name not in OTHER_SETTINGS and name not in fields)
    if unknown:
        return [InitErrorDetails(type=_unknown_setting(name), loc=(name,), input="") for name in unknown]
    from engine.threads import fit_threads_setting
    from kernels.cpu_settings import check_environment

    errors = []
    for check in (check_environment, fit_threads_setting):
        try:
            check()
        except ValueError as exc:
            errors.append(InitErrorDetails(type=PydanticCustomError("invalid_setting", "{reason}",
                                                                    {"reason": str(exc)}), loc=(), input=""))
    return errors


def _unknown_setting(variable: str) -> PydanticCustomError:
    """The error for a ``MINI_INFER_*`` variable that no setting has, with the closest name."""
    known = [ENV_PREFIX + name.upper() for name in AppConfig.model_fields] + list(OTHER_SETTINGS)
    close = [variable.upper()] if variable.upper() in known else \
        difflib.get_close_matches(variable.upper(), known, n=1, cutoff=0.8)
    hint = f"; did you mean {close[0]}?" if close else " (the settings are AppConfig's fields as MINI_INFER_<FIELD>)"
    return PydanticCustomError("unknown_setting", "not a mini-infer setting{hint}", {"hint": hint})
