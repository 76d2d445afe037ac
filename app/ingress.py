"""The OpenAI-compatible front end: validation, chat messages, SSE framing, errors.

Requests pass the HTTP rules of ``app.middleware`` first (the API key, admission of
generation requests, body size and timeout, a JSON ``Content-Type``: all before the body is
read), are validated here (pydantic, the known request fields of ``app.request_fields``, then
``SamplingParams``) and by the engine replica (prompt length, token ids); the ingress waits
for the engine's first output before sending any header, so a bad streaming request gets the
same status and body as a non-streaming one.
"""

import asyncio
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.admission import Admission, CachedCheck, ClosingStreamingResponse
from app.config import AppConfig
from app.dashboard import page
from app.errors import (
    OpenAIError,
    client_closed,
    describe_type,
    from_exception,
    install_error_handlers,
    json_kind,
    log_error,
    sse_error,
)
from app.http_guard import check_not_draining
from app.metrics import HttpMetrics, render
from app.middleware import install_middleware
from app.openai_format import DONE, ChatFormatter, ResponseFormatter
from app.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest, now, valid_unicode
from app.request_fields import Endpoint, mistyped_field, unsupported_field
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


def _refused(record: dict, body: SamplingRequest, prompt_param: str = "prompt", prompt_index: int = 0) -> OpenAIError:
    """A ``Rejection`` record as the client's error: the engine's ``prompt`` becomes
    ``prompt_param`` (a chat request sent ``messages``; in a completions batch, the prompt at
    ``prompt_index``), a constraint's field the request's own (``body.client_param``)."""
    error = OpenAIError(**record)
    if error.param == "prompt":
        error.param = prompt_param
    error.message, error.param = body.client_param(error.message, error.param, prompt_index)
    return error


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


def _close_all(calls: list[_EngineCall]) -> None:
    for call in calls:
        call.close()


async def _first_records(calls: list[_EngineCall]) -> list[dict | None]:
    """Each call's first record (an unstreamed call's is its whole result, or its first
    part), read together; returns as soon as one is a ``Rejection``, with ``None`` for those
    not come yet, so that one refused prompt of a batch is answered at once.

    Raises:
        Exception: the first error of any call (the others' reads are cancelled).
    """
    reads = {asyncio.ensure_future(call.stream.__anext__()): index for index, call in enumerate(calls)}
    firsts: list[dict | None] = [None] * len(calls)
    pending = set(reads)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            errors = [read.exception() for read in done if read.exception() is not None]  # each retrieved
            if errors:
                raise errors[0]
            for read in done:
                firsts[reads[read]] = read.result()
            if any("status_code" in firsts[reads[read]] for read in done):
                break
    finally:
        for read in pending:  # its stream is cancelled too (the caller closes the calls): the
            read.cancel()     # read ends with Serve's RequestCancelledError, retrieved here
            read.add_done_callback(_retrieved)
    return firsts


def _retrieved(task: asyncio.Future) -> None:
    """A done callback: mark the task's exception retrieved (asyncio logs a traceback for one
    nobody retrieved)."""
    if not task.cancelled():
        task.exception()


_END = object()  # a call's stream ran to its end


async def _merged(calls: list[_EngineCall]) -> AsyncIterator[tuple[int, dict]]:
    """``(prompt index, record)`` from every call's stream, in the order they come; each
    call is ``finished`` once its stream ran to its end. An error in any stream is raised
    here (the caller closes them all). Each stream is read no further ahead of the consumer
    than one record, so a slow client still slows the engine's records (as one stream's
    reader does).
    """
    if len(calls) == 1:  # the common case: no task, no queue
        async for output in calls[0].stream:
            yield 0, output
        calls[0].finished = True
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    closed = False

    async def pump(index: int, call: _EngineCall) -> None:
        try:
            async for output in call.stream:
                await queue.put((index, output))
            await queue.put((index, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, if it is still there
            if not closed:  # (Serve ends a cancelled read with RequestCancelledError)
                await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(index, call)) for index, call in enumerate(calls)]
    for task in tasks:
        task.add_done_callback(_retrieved)
    try:
        remaining = len(calls)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                calls[index].finished = True
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        closed = True
        for task in tasks:
            task.cancel()


@serve.deployment
@serve.ingress(fastapi_app)
class OpenAIIngress:
    """Routes ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
    ``/ready``, ``/stats``, ``/dashboard`` and ``/metrics`` to the engine deployment.

    Args:
        engine: handle to the ``EngineServer`` deployment.
        config: the application's settings.
    """

    def __init__(self, engine: DeploymentHandle, config: AppConfig) -> None:
        self.config = config
        self.engine = engine
        # made once, used by every request
        self.engine_stream = engine.options(stream=True, _by_reference=config.engine_transport == "ray")
        self.http_metrics = fastapi_app.state.http_metrics = HttpMetrics()
        self._max_body_bytes = config.max_request_body_bytes
        self._max_model_len = config.max_model_len
        self._health = CachedCheck(self._check_health, HEALTH_CACHE_S)
        self._ready = CachedCheck(self._check_ready, READY_CACHE_S)
        self.admission = Admission(config.max_admitted_requests)
        install_middleware(fastapi_app, api_key=config.api_key, admission=self.admission,
                           max_body_bytes=self.max_body_bytes,
                           body_timeout_s=config.request_body_timeout_s, allowed_origins=config.allowed_origins)

    # ---- OpenAI endpoints ----------------------------------------------------------------

    @fastapi_app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check(body, "completions")
        params = body.sampling_params()  # checked before n sizes anything
        prompts = body.engine_prompts()  # a batch's size checked against n
        formatter = ResponseFormatter(self.config.model_name, body.n, body.logprobs, body.include_usage,
                                      body.continuous_usage, num_prompts=len(prompts),
                                      num_prompt_logprobs=body.prompt_logprobs,
                                      echo_logprobs=body.echo and body.logprobs is not None,
                                      echo_only=body.echo_only())
        release = self._admit_batch(len(prompts))
        try:
            response = await self._respond(request, body, prompts, params, formatter, echo=body.echo)
        except BaseException:
            release()
            raise
        if isinstance(response, ClosingStreamingResponse):
            response.on_close.append(release)
        else:
            release()
        return response

    def _admit_batch(self, num_prompts: int) -> Callable[[], None]:
        """A batch's other prompts each take a place in admission, as requests of their own
        would (the middleware admitted the first): the bound on what waits for the engine
        replicas holds for batches too.

        Raises:
            OpenAIError: 400 naming ``prompt`` for a batch larger than the bound itself; 503
                ``overloaded`` when too few places are free now.
        """
        if num_prompts > self.admission.limit:
            raise OpenAIError(400, f"prompt: a batch of {num_prompts} prompts is more than the "
                              f"{self.admission.limit} requests this service runs or queues at once "
                              "(max_num_seqs + max_waiting_requests per engine replica)", param="prompt")
        try:
            return self.admission.admit(num_prompts - 1)
        except OpenAIError as error:  # say what the batch needs, not only the bound
            free = self.admission.limit - self.admission.num_admitted + 1  # this request's own place
            error.message = (f"the service is overloaded: a batch of {num_prompts} prompts needs {num_prompts} of the "
                             f"{self.admission.limit} places for requests running or waiting (max_num_seqs + "
                             f"max_waiting_requests per engine replica) and {free} are free; retry later")
            raise


    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check(body, "chat")
        body.check_tools()
        prompts, params = body.engine_prompts(), body.sampling_params()  # checked before n sizes anything
        formatter = ChatFormatter(self.config.model_name, body.n, body.num_logprobs(), body.include_usage,
                                  body.tool_mode(), body.continuous_usage, body.prompt_logprobs)
        return await self._respond(request, body, prompts, params, formatter, prompt_param="messages")

    @fastapi_app.get("/v1/models")
    async def models(self):
        """OpenAI's model list: the one served model."""
        return {"object": "list", "data": [await self._model_card()]}

    @fastapi_app.get("/v1/models/{model:path}")
    async def model(self, model: str):
        """OpenAI's retrieve-model (``client.models.retrieve``): the served model's card; 404
        ``model_not_found`` for any other name."""
        if model != self.config.model_name:
            raise self._model_not_found(model)
        return await self._model_card()

    async def _model_card(self) -> dict:
        """OpenAI's model object, with vLLM's ``max_model_len`` (prompt plus output tokens)
        once an engine replica has told it (left out before, while the model still loads)."""
        card = {"id": self.config.model_name, "object": "model", "created": now(), "owned_by": "mini-infer"}
        try:
            card["max_model_len"] = await self.max_model_len()
        except OpenAIError:  # no engine replica yet: the list answers before the engine can serve
            pass
        return card

    def _model_not_found(self, model: str) -> OpenAIError:
        return OpenAIError(404, f"model {excerpt(model)} does not exist; this server serves "
                           f"{self.config.model_name!r}", param="model", code="model_not_found")

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
    async def stats(self, blocks: bool = False):
        """Every engine replica's counters (blocks, running, waiting, preemptions); with
        ``?blocks=1`` also its block pool and sequences (``app.dashboard.replica_view``)."""
        try:
            return {"replicas": await self.engine.broadcast("stats", blocks).results_async()}
        except Exception as exc:  # noqa: BLE001 - Serve's own handler would answer in plain text
            raise from_exception(exc) from exc

    @fastapi_app.get("/dashboard")
    async def dashboard(self):
        """The live page of every engine replica's KV blocks and queues (``app.dashboard``)."""
        return HTMLResponse(page(), headers={"Cache-Control": "no-store"})

    @fastapi_app.get("/metrics")
    async def metrics(self):
        """Prometheus text of every engine and ingress replica's series (``app.metrics``)."""
        try:
            engines = await self.engine.broadcast("metric_families").results_async()
        except Exception as exc:  # noqa: BLE001 - Serve's own handler would answer in plain text
            raise from_exception(exc) from exc
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

    async def max_body_bytes(self) -> int:
        """The request-body limit (``AppConfig.max_body_bytes``).

        Raises:
            OpenAIError: 503 while no engine replica is running (``max_model_len``).
        """
        if self._max_body_bytes is None:
            self._max_body_bytes = self.config.max_body_bytes(await self.max_model_len())
        return self._max_body_bytes

    async def max_model_len(self) -> int:
        """The setting, or where it leaves it to the model, what an engine replica resolved
        (asked once).

        Raises:
            OpenAIError: 503 while no engine replica is running.
        """
        if self._max_model_len is None:
            try:
                limits = await self.engine.broadcast("limits").results_async(timeout_s=HEALTH_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - no engine replica to ask
                raise from_exception(exc) from exc
            self._max_model_len = limits[0]["max_model_len"]
        return self._max_model_len

    async def _check_health(self) -> dict:
        # broadcast() reaches every running engine replica past Serve's queue (a full
        # replica still answers: AppConfig.engine_max_ongoing_requests keeps places for it)
        # and fails at once when there is none.
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
            check_not_draining()  # stopping: a load balancer should send no more
            await self._health()  # at once while no engine replica runs (else the call waits)
            async for record in self.engine_stream.generate.remote({"prompt_token_ids": [0]}, params, probe=True):
                if "status_code" in record:  # a Rejection: the engine refused it (overloaded)
                    raise OpenAIError(**record)
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            raise OpenAIError(503, f"not ready: {from_exception(exc).message}", code="not_ready") from exc
        return {"status": "ready"}

    def _check(self, body: SamplingRequest, endpoint: Endpoint) -> None:
        """404 for another model; 400 for a field nested too deep (``check_nesting``) or one
        the API defines that is not honoured here (``app.request_fields``)."""
        if body.model != self.config.model_name:
            raise self._model_not_found(body.model)
        body.check_nesting()
        extra = body.model_extra or {}
        for name, value in extra.items():  # declared fields are checked by RequestModel
            try:
                valid_unicode(value)
            except ValueError as exc:
                shown = name.encode("utf-8", "backslashreplace").decode("utf-8")  # the name may be invalid too
                raise OpenAIError(400, f"{shown}: {exc}", param=shown) from None
        field = mistyped_field(endpoint, extra)
        if field is not None:  # accepted unread, but still the API's type (a model field's 400)
            expected = describe_type(field.value_type.__name__)
            raise OpenAIError(400, f"{field.name}: must be {expected}; got {json_kind(extra[field.name])}",
                              param=field.name)
        field = unsupported_field(endpoint, extra)
        if field is not None:
            note = f" ({field.note})" if field.note else ""
            raise OpenAIError(400, f"{field.name} is not supported by this server{note}; leave it out",
                              param=field.name, code="unsupported_parameter")

    async def _respond(self, request: Request, body: SamplingRequest, prompts: list[dict], params: SamplingParams,
                       formatter: ResponseFormatter, prompt_param: str = "prompt", echo: bool = False):
        """One engine request per prompt (a completions batch has several, run together,
        each routed by itself); no header before every prompt's first record (its first
        output; a streamed batch's prompts announce their acceptance), so that a refused
        prompt gets its 4xx, not a broken stream."""
        # a streamed batch's prompts each answer once accepted, so that its stream starts at
        # once, not when the last prompt gets a place in the batch
        announce_added = body.stream and len(prompts) > 1
        calls = [_EngineCall(self.engine_stream.generate.remote(prompt, params, uuid.uuid4().hex, echo, body.stream,
                                                                announce_added))
                 for prompt in prompts]
        try:
            if len(calls) == 1:  # accepted, or the engine's 4xx, before any header
                firsts = [await calls[0].stream.__anext__()]
            else:
                firsts = await _first_records(calls)
        except asyncio.CancelledError:
            _close_all(calls)
            # a stream's first record is its first output; an unstreamed request's, its whole result
            self._client_gone(request, "before the first token" if body.stream else "before the response was complete")
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
            _close_all(calls)
            raise from_exception(exc) from exc
        for index, first in enumerate(firsts):
            if first is not None and "status_code" in first:  # a Rejection: the engine's only record
                _close_all(calls)
                raise _refused(first, body, prompt_param, index)
        headers = {REPLICA_HEADER: ",".join(dict.fromkeys(first["replica_id"] for first in firsts))}
        if body.stream:
            return ClosingStreamingResponse(self._sse(request, body, firsts, calls, formatter),
                                            lambda: _close_all(calls), headers=headers,
                                            media_type="text/event-stream")
        try:  # the whole result: one record, or several where it is large (EngineServer.generate)
            for index, first in enumerate(firsts):
                formatter.add(first, index)
            async with aclosing(_merged(calls)) as outputs:
                async for index, output in outputs:
                    if "status_code" in output:  # a Rejection: the request's own fault mid-way (its last record)
                        calls[index].finished = True
                        raise _refused(output, body, prompt_param, index)
                    formatter.add(output, index)
        except asyncio.CancelledError:
            self._client_gone(request, "before the response was complete")
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
            raise from_exception(exc) from exc
        finally:  # also when the client went away: stop the engine's work
            _close_all(calls)
        return JSONResponse(formatter.response(), headers=headers)

    async def _sse(self, request: Request, body: SamplingRequest, firsts: list[dict], calls: list[_EngineCall],
                   formatter: ResponseFormatter) -> AsyncIterator[str]:
        num_events = 0
        try:
            for index, first in enumerate(firsts):
                if "added" in first:  # accepted, no output yet (announce_added)
                    continue
                for chunk in formatter.chunks(first, True, index):
                    num_events += 1
                    yield chunk
            async with aclosing(_merged(calls)) as outputs:
                async for index, output in outputs:
                    if "status_code" in output:  # a Rejection: the request's own fault mid-way (its last record)
                        calls[index].finished = True
                        raise _refused(output, body, prompt_index=index)
                    for chunk in formatter.chunks(output, False, index):
                        num_events += 1
                        yield chunk
            for chunk in formatter.final_chunks():
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            if not all(call.finished for call in calls):
                self._client_gone(request, f"after {num_events} events")
            raise
        except Exception as exc:  # noqa: BLE001 - the headers are gone: an SSE error event
            _close_all(calls)
            error = from_exception(exc)
            self.http_metrics.record_error(error.status_code)
            log_error(request, error, exc)
            yield sse_error(error)
            yield DONE
        finally:  # disconnected or failed: abort the requests in the engine (their blocks
            # are free within a step)
            _close_all(calls)

    def _client_gone(self, request: Request, when: str) -> None:
        """A client that disconnected: one log line and a 499 in the metrics (the caller
        aborts its request in the engine)."""
        self.http_metrics.record_error(499)
        log_error(request, client_closed(when))
