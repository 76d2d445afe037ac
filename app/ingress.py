"""The OpenAI-compatible front end: validation, chat messages, SSE framing, errors.

Requests are validated here (pydantic, then ``SamplingParams``) and by the engine replica
(prompt length, token ids); the ingress waits for the engine's first output before sending
any header, so a bad streaming request gets the same status and body as a non-streaming one.
"""

import asyncio
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.config import AppConfig
from app.errors import OpenAIError, client_closed, from_exception, install_error_handlers, log_error, sse_error
from app.metrics import HttpMetrics, render
from app.middleware import install_middleware
from app.openai_format import DONE, ChatFormatter, ResponseFormatter
from app.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest, now
from app.request_fields import Endpoint, unsupported_field
from engine.sampling_params import RequestOutputKind, SamplingParams

REPLICA_HEADER = "x-mini-infer-replica"

fastapi_app = FastAPI(title="mini-infer", description="OpenAI-compatible LLM inference.")
install_error_handlers(fastapi_app)
install_middleware(fastapi_app)


@serve.deployment
@serve.ingress(fastapi_app)
class OpenAIIngress:
    """Routes ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
    ``/ready``, ``/stats`` and ``/metrics`` to the engine deployment.

    Args:
        engine: handle to the ``EngineServer`` deployment.
        config: the application's settings.
    """

    def __init__(self, engine: DeploymentHandle, config: AppConfig) -> None:
        self.config = config
        self.engine = engine
        self.engine_stream = engine.options(stream=True)  # made once, used by every request
        self.http_metrics = fastapi_app.state.http_metrics = HttpMetrics()
        fastapi_app.state.api_key = config.api_key

    # ---- OpenAI endpoints ----------------------------------------------------------------

    @fastapi_app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check(body, "completions")
        if body.echo and body.logprobs is not None:
            raise OpenAIError(400, "echo with logprobs needs the prompt's logprobs (prompt_logprobs), "
                              "which this server does not compute", param="echo",
                              code="unsupported_parameter")
        formatter = ResponseFormatter(self.config.model_name, body.n, body.logprobs, body.include_usage)
        return await self._respond(request, body, formatter, echo=body.echo)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check(body, "chat")
        formatter = ChatFormatter(self.config.model_name, body.n, body.num_logprobs(), body.include_usage)
        return await self._respond(request, body, formatter, prompt_param="messages")

    @fastapi_app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "created": now(), "owned_by": "mini-infer"}]}

    # ---- operations ----------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self):
        """Liveness: an engine replica's step loop is alive."""
        try:
            alive = await self.engine.is_alive.remote()
        except Exception as exc:  # noqa: BLE001 - unreachable engine: not alive
            alive, detail = False, repr(exc)
        else:
            detail = "engine step loop stopped"
        if not alive:
            raise OpenAIError(503, f"unhealthy: {detail}", code="unhealthy")
        return {"status": "ok"}

    @fastapi_app.get("/ready")
    async def ready(self):
        """Readiness: a real one-token generation succeeds."""
        params = SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.DELTA)
        try:
            async for record in self.engine_stream.generate.remote({"prompt_token_ids": [0]}, params):
                if "status_code" in record:  # a Rejection: the engine refused it (overloaded)
                    raise OpenAIError(**record)
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            raise OpenAIError(503, f"not ready: {from_exception(exc).message}", code="not_ready") from exc
        return {"status": "ready"}

    @fastapi_app.get("/stats")
    async def stats(self):
        """Every engine replica's counters (blocks, running, waiting, preemptions)."""
        return {"replicas": await self.engine.broadcast("stats").results_async()}

    @fastapi_app.get("/metrics")
    async def metrics(self):
        """Prometheus text of every engine and ingress replica's series (``app.metrics``)."""
        engines = await self.engine.broadcast("metric_families").results_async()
        return Response(render([*engines, *await self._ingress_families()]), media_type=CONTENT_TYPE_LATEST)

    async def metric_families(self):
        """This ingress replica's series, for another ingress replica's ``/metrics``."""
        return self.http_metrics.families()

    async def _ingress_families(self) -> list:
        """Every ingress replica's series (this one's alone outside Serve)."""
        try:
            context = serve.get_replica_context()
        except Exception:  # noqa: BLE001 - not in a Serve replica (unit tests)
            return [self.http_metrics.families()]
        handle = serve.get_deployment_handle(context.deployment, context.app_name)
        return await handle.broadcast("metric_families").results_async()

    # ---- helpers -------------------------------------------------------------------------

    def _check(self, body: SamplingRequest, endpoint: Endpoint) -> None:
        """404 for another model; 400 for a field the API defines that is not honoured here
        (``app.request_fields``)."""
        if body.model != self.config.model_name:
            raise OpenAIError(404, f"model {body.model!r} does not exist; this server serves "
                              f"{self.config.model_name!r}", param="model", code="model_not_found")
        field = unsupported_field(endpoint, body.model_extra or {})
        if field is not None:
            note = f" ({field.note})" if field.note else ""
            raise OpenAIError(400, f"{field.name} is not supported by this server{note}; leave it out",
                              param=field.name, code="unsupported_parameter")

    async def _respond(self, request: Request, body: SamplingRequest, formatter: ResponseFormatter,
                       prompt_param: str = "prompt", echo: bool = False):
        prompt, params = body.engine_prompt(), body.sampling_params()
        stream = self.engine_stream.generate.remote(prompt, params, uuid.uuid4().hex, echo)
        try:
            first = await stream.__anext__()  # accepted, or the engine's 4xx, before any header
        except asyncio.CancelledError:
            self._client_gone(request, stream, "while the request was being admitted")
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
            stream.cancel()
            raise from_exception(exc) from exc
        if "status_code" in first:  # a Rejection
            error = OpenAIError(**first)
            if error.param == "prompt":  # the engine says "prompt"; a chat request sent messages
                error.param = prompt_param
            raise error
        headers = {REPLICA_HEADER: first["replica_id"]}
        if body.stream:
            return StreamingResponse(self._sse(request, first, stream, formatter), headers=headers,
                                     media_type="text/event-stream")
        try:
            formatter.add(first)
            async for output in stream:
                formatter.add(output)
        except asyncio.CancelledError:
            self._client_gone(request, stream, "before the response was complete")
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
            raise from_exception(exc) from exc
        return JSONResponse(formatter.response(), headers=headers)

    async def _sse(self, request: Request, first: dict, stream: DeploymentResponseGenerator,
                   formatter: ResponseFormatter) -> AsyncIterator[str]:
        num_events, finished = 0, False
        try:
            for chunk in formatter.chunks(first, first=True):
                num_events += 1
                yield chunk
            async for output in stream:
                for chunk in formatter.chunks(output, first=False):
                    num_events += 1
                    yield chunk
            finished = True
            for chunk in formatter.final_chunks():
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self._client_gone(request, stream, f"after {num_events} events")
            raise
        except Exception as exc:  # noqa: BLE001 - the headers are gone: an SSE error event
            stream.cancel()
            error = from_exception(exc)
            self.http_metrics.record_error(error.status_code)
            log_error(request, error, exc)
            yield sse_error(error)
            yield DONE

    def _client_gone(self, request: Request, stream: DeploymentResponseGenerator, when: str) -> None:
        """A client that disconnected: abort its request in the engine (its blocks are free
        within a step) and log one line."""
        stream.cancel()
        self.http_metrics.record_error(499)
        log_error(request, client_closed(when))
