"""The OpenAI-compatible front end: validation, chat messages, SSE framing, errors.

Requests are validated here (pydantic, then ``SamplingParams``) and by the engine replica
(prompt length, token ids); the ingress waits for the engine's first output before sending
any header, so a bad streaming request gets the same status and body as a non-streaming one.
"""

import asyncio
import hmac
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.config import AppConfig
from app.errors import OpenAIError, error_response, from_exception, install_error_handlers, sse_error
from app.metrics import HttpMetrics
from app.openai_format import DONE, ChatFormatter, ResponseFormatter
from app.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest, now
from engine.sampling_params import RequestOutputKind, SamplingParams

REPLICA_HEADER = "x-mini-infer-replica"

fastapi_app = FastAPI(title="mini-infer", description="OpenAI-compatible LLM inference.")
install_error_handlers(fastapi_app)


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """Answer 401 to ``/v1/*`` requests without ``Authorization: Bearer <api_key>``, before
    their body is read (so before any 400)."""
    expected = f"Bearer {api_key}"

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if request.url.path.startswith("/v1/") and not hmac.compare_digest(
                request.headers.get("authorization", ""), expected):
            return error_response(request, OpenAIError(
                401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                code="invalid_api_key"))
        return await call_next(request)


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
        if config.api_key:
            _require_api_key(fastapi_app, config.api_key)

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
            async for _ in self.engine_stream.generate.remote({"prompt_token_ids": [0]}, params):
                pass
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            raise OpenAIError(503, f"not ready: {from_exception(exc).message}", code="not_ready") from exc
        return {"status": "ready"}

    @fastapi_app.get("/stats")
    async def stats(self):
        """Every engine replica's counters (blocks, running, waiting, preemptions)."""
        return {"replicas": await self.engine.broadcast("stats").results_async()}

    # ---- helpers -------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise OpenAIError(404, f"model {model!r} does not exist; this server serves "
                              f"{self.config.model_name!r}", param="model", code="model_not_found")

    @staticmethod
    def _params(body: SamplingRequest, max_tokens, logprobs) -> SamplingParams:
        return _or_400(lambda: body.sampling_params(max_tokens, logprobs))

    async def _respond(self, body: SamplingRequest, prompt: dict, params: SamplingParams,
                       formatter: ResponseFormatter, prompt_param: str = "prompt"):
        request_id = uuid.uuid4().hex
        stream = self.engine_stream.generate.remote(prompt, params, request_id)
        try:
            first = await stream.__anext__()  # accepted, or the engine's 4xx, before any header
        except BaseException as exc:
            stream.cancel()
            if isinstance(exc, asyncio.CancelledError):
                raise
            error = from_exception(exc)
            if error.param == "prompt":  # the engine says "prompt"; a chat request sent messages
                error.param = prompt_param
            raise error from exc
        headers = {REPLICA_HEADER: first["replica_id"]}
        if body.stream:
            return StreamingResponse(self._sse(first, stream, formatter), headers=headers,
                                     media_type="text/event-stream")
        try:
            formatter.add(first)
            async for output in stream:
                formatter.add(output)
        except asyncio.CancelledError:  # the client went away: stop the engine's work
            stream.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
            raise from_exception(exc) from exc
        return JSONResponse(formatter.response(), headers=headers)

    async def _sse(self, first: dict, stream: DeploymentResponseGenerator,
                   formatter: ResponseFormatter) -> AsyncIterator[str]:
        done = False
        try:
            for chunk in formatter.chunks(first, first=True):
                yield chunk
            async for output in stream:
                for chunk in formatter.chunks(output, first=False):
                    yield chunk
            done = True
            for chunk in formatter.final_chunks():
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the headers are gone: an SSE error event
            error = from_exception(exc)
            self.http_metrics.record_error(error.status_code)
            yield sse_error(error)
            yield DONE
        finally:
            if not done:  # disconnected or failed: abort the request in the engine
                stream.cancel()
