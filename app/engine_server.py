"""The engine deployment: one ``AsyncLLM`` per replica, streaming plain-dict outputs."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
import uuid
from typing import AsyncIterator

import ray
from ray import serve

from app.config import AppConfig
from app.dashboard import RecentLatencies, node_id, replica_view
from app.errors import from_exception
from app.http_guard import shutting_down_error, stopping_now
from app.metrics import EngineMetrics, Families
from app.records import CompletionDelta, EngineOutput, LogprobEntry, Rejection
from engine.async_llm import AsyncLLM
from engine.detokenizer import TokenBytes
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.outputs import MAX_JOINED_VALUES, JoinedOutputs, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

_STATS_PERIOD_S = 1.0
_MIN_LOGPROB = -9999.0  # JSON has no -inf: a masked token's logprob is reported as this (vLLM's)


def replica_device(device: str) -> str:
    """The device an engine replica runs on, decided in the replica's own process.

    ``auto`` in a Ray worker: ``cuda`` when Ray assigned this replica a GPU, else ``cpu``
    (a replica without one must not use a GPU it happens to see: with ``num_gpus=0`` Ray
    leaves ``CUDA_VISIBLE_DEVICES`` as it is, so torch would see GPUs other replicas own).
    Outside Ray, and for ``cpu``/``cuda``: unchanged.
    """
    if device == "auto" and ray.is_initialized():
        return "cuda" if ray.get_gpu_ids() else "cpu"
    return device


def log_engine_through_serve() -> None:
    """In a Serve replica: the engine's and the kernels' log lines at INFO and above (the
    model, dtype, KV blocks and backend it started with, the CPU attention kernels, prepacked
    weights, compile times, a failed step) go where Serve's own go, its ``"ray.serve"``
    logger's handlers: the replica's log file and ``serve run``'s output. Serve sets up only
    that logger; without this, the engine's INFO lines reached no handler."""
    handlers = logging.getLogger("ray.serve").handlers
    for name in ("engine", "kernels"):
        library = logging.getLogger(name)
        library.setLevel(logging.INFO)
        library.propagate = False  # not twice, where the worker's root logger has a handler too
        for handler in handlers:
            if handler not in library.handlers:
                library.addHandler(handler)


class EngineServer:
    """Holds the model and its step loop; the ingress calls ``generate`` with a streaming
    handle. Everything crossing the Ray boundary is plain data.

    Args:
        config: the application's settings.
    """

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests): any unique name will do
            self.replica_id = uuid.uuid4().hex[:8]
        else:
            log_engine_through_serve()
        engine_config = config.engine_config()
        engine_config = dataclasses.replace(engine_config, device=replica_device(config.device))
        self.llm = AsyncLLM(config=engine_config)
        self.metrics = EngineMetrics(config.model_name, self.replica_id)
        self.latencies = RecentLatencies()  # the dashboard's TTFT and ITL percentiles
        self.node_id = node_id()
        tokenizer = self.llm.engine.tokenizer
        self.token_bytes = None if tokenizer is None else TokenBytes(tokenizer)
        self._num_in_flight = 0  # generate() calls not finished; only the replica's loop touches it
        self._request_ids: set[str] = set()  # of those calls, for a stop to end them
        self._stopping_now = False  # a stop's wait is over: the requests still running end with a 503
        self._stop_watch: asyncio.Task | None = None  # polls for that, started by the first request
        self._stop = threading.Event()
        threading.Thread(target=self._record_stats, name="engine-metrics", daemon=True).start()

    async def generate(self, prompt: dict, params: SamplingParams, request_id: str | None = None,
                       echo: bool = False, stream: bool = True, announce_added: bool = False,
                       probe: bool = False) -> AsyncIterator[EngineOutput | Rejection | dict]:
        """Stream a request's outputs as dicts (see ``output_to_dict``), or one ``Rejection``.

        A request that can never be served, or that finds the waiting queue full, gets a
        ``Rejection`` as its only record instead of an exception: what the client got wrong
        is not a fault of this replica to log with a traceback.

        Args:
            prompt: ``{"prompt": text}``, ``{"prompt_token_ids": ids}`` or ``{"messages":
                [...]}`` with ``LLMEngine.chat_prompt``'s options (a chat, through the
                tokenizer's chat template).
            params: sampling parameters; outputs are deltas.
            request_id: defaults to a random id.
            echo: the first record carries the prompt's text (``prompt_text``).
            announce_added: the first record is ``{"added": True, "replica_id": ...}`` once
                the engine has accepted the request, before its first output (a completions
                batch's streams start together: each prompt is known good without waiting
                for its first token, which may wait for a free place in the batch).
            probe: the ingress's readiness check (``GET /ready``): left out of the request
                counts and latency histograms, which a load balancer's probes would otherwise
                fill (a trial); its token is in the engine's sampled-token count.
            stream: ``True``: a record per engine output (what one step, or several steps
                where this replica is behind the engine, added); ``False``: one record with
                the whole result, so that a non-streaming request crosses Ray once, not once
                per token, or one record per ``MAX_JOINED_VALUES`` token ids and logprob
                entries where the result is larger (a record past gRPC's 4 MiB message limit
                failed the request after all its work).

        Raises:
            RequestFailedError: the engine failed the request after accepting it.
            EngineDeadError: the step loop has stopped.
        """
        # Requests in flight beyond a full batch are the waiting queue (counted here, not in
        # the engine, so that a burst arriving between two steps is counted too).
        # The ingress's admission (app.config.AppConfig.max_admitted_requests) keeps this from
        # happening behind it with one engine replica; with several, Serve's routing may send a
        # replica more than it holds (its max_ongoing_requests keeps places for control calls),
        # and this bounds direct callers of the deployment.
        num_waiting = self._num_in_flight - self.config.max_num_seqs
        if num_waiting >= self.config.max_waiting_requests:
            yield rejection(EngineOverloadedError(
                f"the engine is overloaded: {num_waiting} requests waiting "
                f"(max_waiting_requests={self.config.max_waiting_requests})"))
            return
        if self._stop_watch is None:
            self._stop_watch = asyncio.get_running_loop().create_task(self._watch_for_stop())
        request_id = request_id or uuid.uuid4().hex
        self._num_in_flight += 1
        self._request_ids.add(request_id)
        try:
            async for item in self._generate(prompt, params, request_id, echo, stream, announce_added, probe):
                yield item
        finally:
            self._num_in_flight -= 1
            self._request_ids.discard(request_id)

    async def _watch_for_stop(self, interval_s: float = 0.25) -> None:
        """Abort every request in flight once a stop's wait is over (``stopping_now``); each
        then ends with a ``Rejection`` of 503 ``shutting_down`` (``_generate``)."""
        while True:
            await asyncio.sleep(interval_s)
            if not self._stopping_now and stopping_now():
                self._stopping_now = True
            if self._stopping_now:
                for request_id in list(self._request_ids):
                    self.llm.abort(request_id)

    async def _generate(self, prompt: dict, params: SamplingParams, request_id: str | None, echo: bool,
                        stream: bool, announce_added: bool,
                        probe: bool = False) -> AsyncIterator[EngineOutput | Rejection | dict]:
        start = time.perf_counter()
        timing = _Timing(start, self.latencies)
        num_output_tokens, finish_reasons, num_prompt_tokens = 0, [], 0
        rejected = completed = False
        try:
            async with contextlib.aclosing(self._outputs(prompt, params, request_id, announce_added)) as outputs:
                try:
                    first = await anext(outputs)
                except ValueError as exc:  # the engine's "can never be served as sent"
                    rejected = True
                    yield rejection(exc)
                    return
                if first is None:  # accepted (announce_added)
                    yield {"added": True, "replica_id": self.replica_id}
                    first = await anext(outputs)
                joined = JoinedOutputs()  # not streamed: everything so far not yet sent
                sent_any = False
                source = _prepend(first, outputs)
                if stream and self.config.stream_batching_interval_ms > 0:
                    source = _batch_outputs(source, self.config.stream_batching_interval_ms / 1000)
                async with contextlib.aclosing(source):  # before outputs: it may be reading them
                    async for output in source:
                        if self._stopping_now and any(c.finish_reason == "abort" for c in output.outputs):
                            yield rejection(shutting_down_error(in_flight=True))  # aborted by the stop
                            return
                        if not probe:
                            timing.tick(self.metrics)
                        num_prompt_tokens = len(output.prompt_token_ids)
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        finish_reasons += [c.finish_reason for c in output.outputs if c.finish_reason]
                        if not stream:
                            taken = joined.add(output)
                            if taken is not None:  # one bounded record of a large result
                                for record in self._records(taken, echo and not sent_any):
                                    yield record
                                sent_any = True
                            if not output.finished:
                                continue
                            output = joined.take()
                        for record in self._records(output, echo and not sent_any):
                            yield record
                        sent_any = True
            completed = True
        except InvalidRequestError as exc:  # the request's own fault mid-way (the first is above): its 400
            rejected = True
            yield rejection(exc)
        finally:
            if not (completed or rejected):  # the client left (or the request failed) first
                finish_reasons += ["abort"] * (params.n - len(finish_reasons))
            if not (rejected or probe):  # rejected requests have no latency and no finish to report
                ttft = 0.0 if timing.first is None else timing.first - start  # (not observed without output)
                self._record_request(num_prompt_tokens, num_output_tokens, ttft, time.perf_counter() - start,
                                     finish_reasons)

    async def _outputs(self, prompt: dict, params: SamplingParams, request_id: str | None,
                       announce_added: bool = False) -> AsyncIterator[RequestOutput | None]:
        if "messages" in prompt:
            options = dict(prompt)
            prompt = await self.llm.chat_prompt(options.pop("messages"), **options)
        async with contextlib.aclosing(self.llm.generate(prompt, params, request_id, announce_added)) as outputs:
            async for output in outputs:
                yield output

    def _records(self, output: RequestOutput, echo: bool) -> list[EngineOutput]:
        """``output`` as the records sent to the ingress (one, or several for large prompt
        logprobs: ``split_prompt_logprobs``); ``echo``: the first with the prompt's text."""
        record = output_to_dict(output, self.replica_id, self.token_bytes)
        if echo:
            record["prompt_text"] = self._prompt_text(output)
        records = split_prompt_logprobs(record)
        for later in records[1:]:
            later.pop("prompt_text", None)
        return records

    def _prompt_text(self, output: RequestOutput) -> str:
        """The prompt as text: as sent, or its token ids decoded (vLLM's echo)."""
        if output.prompt is not None:
            return output.prompt
        tokenizer = self.llm.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(output.prompt_token_ids)

    def _record_request(self, *args) -> None:
        try:
            self.metrics.record_request(*args)
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            logger.exception("recording request metrics failed")

    def check_health(self) -> None:
        """Serve's periodic liveness check: raises once the step loop has died, so that
        Serve replaces the replica."""
        self.llm.check_health()

    async def is_alive(self) -> bool:
        try:
            self.llm.check_health()
        except Exception:  # noqa: BLE001 - any failure means not alive
            return False
        return True

    async def stats(self, blocks: bool = False) -> dict:
        """The engine's counters (``LLMEngine.stats``), this replica's id and its Ray node's id
        (the host name outside Ray); with ``blocks``, the dashboard's whole view
        (``app.dashboard.replica_view``), taken between two steps."""
        if blocks:
            return replica_view(await self.llm.snapshot(), self.replica_id, self.node_id, self.latencies)
        return {**self.llm.stats(), "replica_id": self.replica_id, "node_id": self.node_id}

    def limits(self) -> dict:
        """What the ingress sizes its own limits from: ``max_model_len`` (resolved from the
        model where the setting is unset)."""
        return {"max_model_len": self.llm.engine.config.scheduler.max_model_len}

    def metric_families(self) -> Families:
        """This replica's metrics as plain data, for the ingress's ``GET /metrics``."""
        return self.metrics.families()

    def _record_stats(self) -> None:
        while not self._stop.wait(_STATS_PERIOD_S):
            try:
                self.metrics.record_stats(self.llm.stats())
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.exception("recording engine metrics failed")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # None where __init__ failed before making it
        if stop is not None:
            stop.set()
        self.llm.shutdown(timeout=1.0)


async def _prepend(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def _batch_outputs(outputs: AsyncIterator[RequestOutput],
                         interval_s: float) -> AsyncIterator[RequestOutput]:
    """``outputs`` (deltas of one request) merged over windows of ``interval_s`` seconds
    (``RequestOutput.add``), as Ray Serve LLM's ``stream_batching_interval_ms`` batches a
    stream: an output that comes a window or more after the last one yielded is yielded at once
    (the first one, so TTFT is unchanged), later ones wait until the window since then is over;
    a finished one ends the window, and so does one that would take the window past
    ``MAX_JOINED_VALUES`` values (it is held for the next). Each yield is one record across Ray
    and one event to the client instead of one per step."""
    loop = asyncio.get_running_loop()
    pending = asyncio.ensure_future(anext(outputs))
    joined = JoinedOutputs()
    window_end = -math.inf  # when the next output may go out at once
    try:
        while True:
            timeout = None if joined.held is None else max(0.0, window_end - loop.time())
            done, _ = await asyncio.wait({pending}, timeout=timeout)
            if not done:  # the window is over: send what it gathered
                yield joined.take()
                window_end = loop.time() + interval_s
                continue
            try:
                output = pending.result()
            except StopAsyncIteration:
                if joined.held is not None:
                    yield joined.take()
                return
            pending = asyncio.ensure_future(anext(outputs))
            taken = joined.add(output)
            if taken is not None:  # the window's bound: what it held goes now
                yield taken
                window_end = loop.time() + interval_s
            if joined.held.finished or loop.time() >= window_end:
                yield joined.take()
                window_end = loop.time() + interval_s
    finally:  # the consumer left: stop waiting for the engine's next output
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pending


def rejection(exc: BaseException) -> Rejection:
    """A refused request's record: the HTTP error ``exc`` maps to."""
    error = from_exception(exc)
    return Rejection(status_code=error.status_code, message=error.message, param=error.param,
                     code=error.code)


class _Timing:
    """First-output time and inter-token latency of one request (also kept in
    ``latencies`` for the dashboard)."""

    def __init__(self, start: float, latencies: RecentLatencies) -> None:
        self.first: float | None = None
        self.start = self.last = start
        self.latencies = latencies

    def tick(self, metrics: EngineMetrics) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.latencies.ttft.append(now - self.start)
        else:
            metrics.record_itl(now - self.last)
            self.latencies.itl.append(now - self.last)
        self.last = now


def output_to_dict(output: RequestOutput, replica_id: str,
                   token_bytes: TokenBytes | None = None) -> EngineOutput:
    """A delta ``RequestOutput`` as plain data (``app.records``); ``token_bytes`` gives each
    logprob entry's raw bytes (``None``: no tokenizer)."""
    def entries(logprobs: dict[int, Logprob]) -> list[LogprobEntry]:
        return [LogprobEntry(token_id, max(lp.logprob, _MIN_LOGPROB), lp.rank, lp.decoded_token,
                             None if token_bytes is None else token_bytes(token_id))
                for token_id, lp in logprobs.items()]

    record = EngineOutput(
        replica_id=replica_id,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_cached_tokens=output.num_cached_tokens or 0,
        finished=output.finished,
        error=output.error,
        outputs=[CompletionDelta(
            index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=None if c.logprobs is None else [entries(entry) for entry in c.logprobs],
        ) for c in output.outputs],
    )
    if output.prompt_logprobs is not None:
        first_id = output.prompt_token_ids[0]
        data = None if token_bytes is None else token_bytes(first_id)
        first = LogprobEntry(first_id, None, None, None if data is None else data.decode("utf-8", "replace"), data)
        record["prompt_logprobs"] = [[first]] + [entries(entry) for entry in output.prompt_logprobs[1:]]
    return record


def split_prompt_logprobs(record: EngineOutput, max_values: int = MAX_JOINED_VALUES) -> list[EngineOutput]:
    """``record`` as records of at most about ``max_values`` prompt logprob entries each: the
    prompt's tokens in order over records with no outputs, then ``record`` with the last of
    them (the ingress joins them), so that no message across Serve's gRPC transport nears
    its 4 MiB limit (an 8,192-token prompt with 20 alternatives is 172,000 entries)."""
    prompt_logprobs = record.get("prompt_logprobs")
    if prompt_logprobs is None or sum(map(len, prompt_logprobs)) <= max_values:
        return [record]
    parts, part, size = [], [], 0
    for entry in prompt_logprobs:
        if part and size + len(entry) > max_values:
            parts.append(part)
            part, size = [], 0
        part.append(entry)
        size += len(entry)
    leading = [EngineOutput({**record, "finished": False, "error": None, "outputs": [], "prompt_logprobs": p})
               for p in parts]
    return [*leading, EngineOutput({**record, "prompt_logprobs": part})]
