"""``AsyncLLM``: the engine's step loop on a background thread, behind ``async generate()``.

The loop thread owns the ``LLMEngine``. Callers talk to it only through a command queue
(add, abort) and receive outputs on a per-request ``asyncio.Queue``, so the event loop is
never blocked by a forward pass and the engine is never touched by two threads at once.
Prompts are tokenized and chat-templated on a small pool of worker threads before they reach
the loop, so that neither the loop nor the caller's event loop waits on a long input.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import JoinedOutputs, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.snapshot import SnapshotChannel

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Serve many concurrent ``generate()`` calls from one engine.

    Args:
        engine: the engine to drive; built from ``config`` when ``None``.
        config: used only when ``engine`` is ``None``.
    """

    def __init__(self, engine: LLMEngine | None = None,
                 config: EngineConfig | None = None) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig())
        # Two workers: one long input (bounded by LLMEngine.max_prompt_chars) leaves the other
        # to the next request. The tokenizer releases the GIL while it encodes.
        self._tokenizers = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="engine-tokenizer")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        self.snapshots = SnapshotChannel(self.engine, on_request=self._wakeup.set)
        self._thread = threading.Thread(target=self._run_loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    # ---- caller side ---------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       announce_added: bool = False) -> AsyncIterator[RequestOutput | None]:
        """Add a request and yield its outputs until it finishes; with ``announce_added``,
        first ``None`` once the engine has accepted it (checked and queued), before any output.

        With the default ``sampling_params`` each output is a delta: the text and token ids
        that step added. A caller slower than the step loop gets what several steps added as
        one output (deltas joined, cumulative outputs replaced by the latest), so that it
        never falls further behind (vLLM's ``RequestOutputCollector``). Cancelling the
        consuming task (or closing the generator) aborts the request; its blocks are freed
        within one step.

        Raises:
            ValueError: the request can never be served (see ``LLMEngine.add_request``).
            InvalidRequestError: the request failed through its own input mid-way (a
                structured output's constraint that no text matches), naming the field.
            RequestFailedError: the engine failed the request mid-way.
            EngineDeadError: the step loop has stopped.
        """
        self.check_health()
        # Tokenized (and checked) here, so that the step loop only checks the ids' length.
        prompt = await self._on_worker(self.engine.process_prompt, prompt)
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams(output_kind=RequestOutputKind.DELTA)
        stream: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished, pending = False, None
        try:
            self._send(("add", request_id, prompt, params, added))
            await asyncio.wrap_future(added)
            if announce_added:
                yield None
            while not finished:
                item, pending = (await stream.get() if pending is None else pending), None
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # the request's own fault (a 400), or the engine's
                    raise (InvalidRequestError(item.error, item.error_param) if item.error_param is not None
                           else RequestFailedError(item.error))
                item, pending = _coalesce(item, stream, params.output_kind)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # cancelled or failed: aborting an unknown id does nothing
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request at the start of the next step (a no-op if it already ended)."""
        self._send(("abort", request_id))

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` once the step loop has stopped."""
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine step loop has stopped: {self._dead!r}")

    async def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, tools: list[dict] | None = None) -> dict:
        """``LLMEngine.chat_prompt`` on a worker thread (the tokenizer is read-only: safe
        beside the loop): ``{"prompt": text, "prompt_token_ids": ids}`` for ``generate``.

        Raises:
            ValueError: as ``LLMEngine.chat_prompt``.
        """
        return await self._on_worker(self.engine.chat_prompt, conversation,
                                     add_generation_prompt, continue_final_message, tools)

    async def _on_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, *args)

    def stats(self) -> dict:
        """The engine's counters (read without locking; each value is a plain int or float)."""
        return self.engine.stats()

    async def snapshot(self) -> dict:
        """``engine.snapshot.engine_snapshot``, taken by the step loop between two steps
        (within one step's time; at once while the loop is idle)."""
        return await asyncio.wrap_future(self.snapshots.request())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; pending and later calls fail with ``EngineDeadError``."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()
        if self._dead is not None:  # no loop will read it: fail it here
            self._fail_pending()

    # ---- loop thread ---------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            with self.snapshots.driving():
                while not self._stopping:
                    self._wakeup.clear()
                    self._apply_commands()
                    self.snapshots.serve()
                    if not self.engine.has_unfinished_requests():
                        self._wakeup.wait()
                        continue
                    for output in self.engine.step():
                        self._publish(output.request_id, output)
            self._dead = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # noqa: BLE001 - report, then fail every waiter
            logger.exception("engine step loop died")
            self._dead = exc
        self._fail_pending()

    def _fail_pending(self) -> None:
        error = EngineDeadError(f"the engine step loop has stopped: {self._dead!r}")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add" and not command[-1].done():
                command[-1].set_exception(error)
        for request_id in list(self._streams):
            self._publish(request_id, error)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            else:
                output = self.engine.abort_request(command[1])
                if output is not None:
                    self._publish(command[1], output)

    def _add(self, request_id, prompt, params, added: concurrent.futures.Future) -> None:
        if not added.set_running_or_notify_cancel():
            return  # the caller was cancelled before its request got here: never add it
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the loop goes on
            added.set_exception(exc)
        else:
            added.set_result(None)

    def _publish(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the caller's event loop has closed: nobody is listening
                self._streams.pop(request_id, None)


def _coalesce(output: RequestOutput, stream: asyncio.Queue,
              kind: RequestOutputKind) -> tuple[RequestOutput, object]:
    """``output`` joined with the outputs already queued behind it, up to
    ``MAX_JOINED_VALUES`` values, and the first queued item that was not joined (a failure,
    which the caller raises next, or the output that would pass the bound, which it yields
    next), or ``None``."""
    joined = None  # made only where something is queued behind
    while not output.finished and not stream.empty():
        later = stream.get_nowait()
        if isinstance(later, BaseException) or later.error is not None:
            return output, later
        if kind != RequestOutputKind.DELTA:
            output = later
            continue
        if joined is None:
            joined = JoinedOutputs()
            joined.add(output)
        if joined.add(later) is not None:  # later would pass the bound: output as it is, later next
            return output, joined.take()
    return output, None
