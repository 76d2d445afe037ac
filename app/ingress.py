"""The OpenAI-compatible front end: validation, chat messages, SSE framing, errors.

Requests pass ``app.http_guard.RequestGuard`` first (API key, admission of generation
requests, body size, body timeout), are validated here (pydantic, then ``SamplingParams``)
and by the engine replica (prompt length, token ids); the ingress waits for the engine's
first output before sending any header, so a bad streaming request gets the same status and
body as a non-streaming one.
"""

import asyncio
import uuid
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.admission import Admission, CachedCheck, ClosingStreamingResponse
from app.config import AppConfig
from app.errors import OpenAIError, from_exception, install_error_handlers, sse_error
from app.http_guard import RequestGuard
from app.metrics import HttpMetrics
from app.openai_format import DONE, ChatFormatter, ResponseFormatter
from app.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest, now
from engine.errors import excerpt
from engine.sampling_params import RequestOutputKind, SamplingParams

REPLICA_HEADER = "x-mini-infer-replica"
# /health and /ready share one probe's outcome for this long, so that callers (and anyone
# without the API key, for /health) cannot turn them into load on the engine.
HEALTH_CACHE_S = 0.5
READY_CACHE_S = 1.0
# An engine replica that cannot answer "is your step loop alive" in this time is not.
HEALTH_TIMEOUT_S = 5.0

fastapi_app = FastAPI(title="mini-infer", description="OpenAI-compatible LLM inference.")
install_error_handlers(fastapi_app)


def _cancel(stream: DeploymentResponseGenerator) -> None:
    """Stop a handle call. Serve's ``cancel()`` re-raises a failed assignment (a
    ``BackPressureError``) that the caller has already answered: ignore it."""
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - the call never reached a replica
        pass


class _EngineCall:
    """A request's stream from the engine deployment. ``close()`` stops the engine's work
    unless the stream ran to its end (at most once, however the response ended).

    Args:
        stream: from ``generate.remote``.
    """

    def __init__(self, stream: DeploymentResponseGenerator) -> None:
        self.stream = stream
        self.finished = False

    def close(self) -> None:
        if not self.finished:
            self.finished = True  # once
            _cancel(self.stream)


def _or_400(value_or_factory):
    """Call ``value_or_factory`` (a method or lambda); its ``ValueError`` becomes a 400."""
    try:
        return value_or_factory()
    except ValueError as exc:
        raise from_exception(exc) from exc


@serve.deployment
@serve.ingress(fastapi_app)
class OpenAIIngress:
    """Routes ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
    ``/ready`` and ``/stats`` to the engine deployment.

    Args:
        engine: handle to the ``EngineServer`` deployment.
        config: the application's settings.
    """

    def __init__(self, engine: DeploymentHandle, config: AppConfig) -> None:
        self.config = config
        self.engine = engine
        self.engine_stream = engine.options(stream=True)  # made once, used by every request
        self.http_metrics = fastapi_app.state.http_metrics = HttpMetrics()
        self._max_body_bytes = config.max_request_body_bytes
        self._health = CachedCheck(self._check_health, HEALTH_CACHE_S)
        self._ready = CachedCheck(self._check_ready, READY_CACHE_S)
        fastapi_app.add_middleware(RequestGuard, api_key=config.api_key,
                                   admission=Admission(config.max_admitted_requests),
                                   max_body_bytes=self.max_body_bytes,
                                   body_timeout_s=config.request_body_timeout_s)

    # ---- OpenAI endpoints ----------------------------------------------------------------

    @fastapi_app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        params = self._params(body, body.max_tokens, body.logprobs)
        prompt = body.single_prompt()
        engine_prompt = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        formatter = ResponseFormatter(self.config.model_name, body.n, body.logprobs, body.include_usage)
        return await self._respond(body, engine_prompt, params, formatter)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        num_logprobs = _or_400(body.num_logprobs)
        params = self._params(body, body.max_new_tokens(), num_logprobs)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        formatter = ChatFormatter(self.config.model_name, body.n, num_logprobs, body.include_usage)
        return await self._respond(body, {"messages": messages}, params, formatter, prompt_param="messages")

    @fastapi_app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "created": now(), "owned_by": "mini-infer"}]}

    # ---- operations ----------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self):
        """Liveness: some engine replica's step loop is alive. 503 at once while no engine
        replica is running (a restart), so that load balancers stop sending traffic."""
        return await self._health()

    @fastapi_app.get("/ready")
    async def ready(self):
        """Readiness: a real one-token generation succeeds (its outcome is reused for
        ``READY_CACHE_S``)."""
        return await self._ready()

    @fastapi_app.get("/stats")
    async def stats(self):
        """Every engine replica's counters (blocks, running, waiting, preemptions)."""
        try:
            return {"replicas": await self.engine.broadcast("stats").results_async()}
        except Exception as exc:  # noqa: BLE001 - Serve's own handler would answer in plain text
            raise from_exception(exc) from exc

    # ---- helpers -------------------------------------------------------------------------

    async def max_body_bytes(self) -> int:
        """The request-body limit (``AppConfig.max_body_bytes``), asking an engine replica
        for ``max_model_len`` the first time when the setting leaves it to the model.

        Raises:
            OpenAIError: 503 while no engine replica is running.
        """
        if self._max_body_bytes is None:
            max_model_len = self.config.max_model_len
            if max_model_len is None:
                try:
                    limits = await self.engine.broadcast("limits").results_async(timeout_s=HEALTH_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - no engine replica to ask
                    raise from_exception(exc) from exc
                max_model_len = limits[0]["max_model_len"]
            self._max_body_bytes = self.config.max_body_bytes(max_model_len)
        return self._max_body_bytes

    async def _check_health(self) -> dict:
        # broadcast() reaches every running engine replica past Serve's queue (a full
        # replica still answers) and fails at once when there is none.
        try:
            alive = await self.engine.broadcast("is_alive").results_async(
                timeout_s=HEALTH_TIMEOUT_S, return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - no engine replica, or none answered in time
            raise OpenAIError(503, f"unhealthy: {from_exception(exc).message}", code="unhealthy") from exc
        if True not in alive:
            raise OpenAIError(503, "unhealthy: no engine replica's step loop is alive", code="unhealthy")
        return {"status": "ok"}

    async def _check_ready(self) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.DELTA)
        try:
            await self._health()  # at once while no engine replica runs (else the call waits)
            async for _ in self.engine_stream.generate.remote({"prompt_token_ids": [0]}, params):
                pass
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            raise OpenAIError(503, f"not ready: {from_exception(exc).message}", code="not_ready") from exc
        return {"status": "ready"}

    def _check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise OpenAIError(404, f"model {excerpt(model)} does not exist; this server serves "
                              f"{self.config.model_name!r}", param="model", code="model_not_found")

    @staticmethod
    def _params(body: SamplingRequest, max_tokens, logprobs) -> SamplingParams:
        return _or_400(lambda: body.sampling_params(max_tokens, logprobs))

    async def _respond(self, body: SamplingRequest, prompt: dict, params: SamplingParams,
                       formatter: ResponseFormatter, prompt_param: str = "prompt"):
        call = _EngineCall(self.engine_stream.generate.remote(prompt, params, uuid.uuid4().hex))
        try:
            first = await call.stream.__anext__()  # accepted, or the engine's 4xx, before any header
        except BaseException as exc:
            call.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            error = from_exception(exc)
            if error.param == "prompt":  # the engine says "prompt"; a chat request sent messages
                error.param = prompt_param
            raise error from exc
        headers = {REPLICA_HEADER: first["replica_id"]}
        if body.stream:
            return ClosingStreamingResponse(self._sse(first, call, formatter), call.close,
                                            headers=headers, media_type="text/event-stream")
        try:
            formatter.add(first)
            async for output in call.stream:
                formatter.add(output)
            call.finished = True
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
            raise from_exception(exc) from exc
        finally:  # also when the client went away (CancelledError): stop the engine's work
            call.close()
        return JSONResponse(formatter.response(), headers=headers)

    async def _sse(self, first: dict, call: "_EngineCall",
                   formatter: ResponseFormatter) -> AsyncIterator[str]:
        try:
            for chunk in formatter.chunks(first, first=True):
                yield chunk
            async for output in call.stream:
                for chunk in formatter.chunks(output, first=False):
                    yield chunk
            call.finished = True
            for chunk in formatter.final_chunks():
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the headers are gone: an SSE error event
            error = from_exception(exc)
            self.http_metrics.record_error(error.status_code)
            yield sse_error(error)
            yield DONE
        finally:  # disconnected or failed: abort the request in the engine
            call.close()
