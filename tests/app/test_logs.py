"""What the service logs (captured from the shared service's output): a client error and a
client that disconnects are one line each with the request id, status and reason; nothing
the clients do leaves a traceback."""
import asyncio
import re
import time
import uuid

import aiohttp
import requests

from tests.app.conftest import MODEL

TRACEBACK_MARKS = ("Traceback (most recent call last)", "Task exception was never retrieved",
                   "TaskCancelledError", "ERROR")


def _lines_of(api, request_id: str, mark: str, timeout: float = 20.0) -> list[str]:
    """The log lines with ``request_id`` and ``mark``, once there is one (Ray forwards the
    replicas' output to the driver within a second or so)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in api.log_path.read_text(errors="replace").splitlines()
                 if request_id in line and mark in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.5)


def _no_tracebacks(api) -> None:
    log = api.log_path.read_text(errors="replace")
    assert not [mark for mark in TRACEBACK_MARKS if mark in log], log[-5000:]


def test_a_client_error_is_one_info_line(api):
    body = {"model": MODEL, "prompt": "hello " * 9000}
    for stream in (False, True):
        response = requests.post(api.url + "/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 400
        request_id = response.headers["x-request-id"]
        lines = _lines_of(api, request_id, " -> ")
        assert len(lines) == 1, lines
        assert " INFO " in lines[0]
        assert "-> 400 context_length_exceeded (param prompt): prompt (9001 tokens)" in lines[0]
    response = requests.post(api.url + "/v1/completions", data=b"{}", timeout=30,
                             headers={"content-type": "text/plain"})
    lines = _lines_of(api, response.headers["x-request-id"], " -> ")
    assert len(lines) == 1 and "-> 400 unsupported_content_type" in lines[0], lines
    _no_tracebacks(api)


def test_a_client_that_disconnects_is_one_info_line(api):
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 500, "ignore_eos": True}

    async def leave_after_the_first_event(session) -> str:
        async with session.post(api.url + "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    return response.headers["x-request-id"]

    async def leave_before_the_reply(session, request_id: str) -> None:
        try:
            async with session.post(api.url + "/v1/completions", json=body, headers={"x-request-id": request_id},
                                    timeout=aiohttp.ClientTimeout(total=0.5)) as response:
                await response.read()
        except asyncio.TimeoutError:
            pass

    async def main() -> list[str]:
        async with aiohttp.ClientSession() as session:
            ids = list(await asyncio.gather(*(leave_after_the_first_event(session) for _ in range(4))))
            ids += [f"leaves-early-{uuid.uuid4().hex}" for _ in range(2)]
            await asyncio.gather(*(leave_before_the_reply(session, i) for i in ids[4:]))
            return ids

    ids = asyncio.run(main())
    for request_id in ids:
        lines = _lines_of(api, request_id, " -> ")
        assert len(lines) == 1, (request_id, lines)
        assert " INFO " in lines[0] and "-> 499 client_closed_request: the client disconnected" in lines[0]
        # when: a stream after the events it got; a request not streamed during its generation
        # (its only record is the whole result), which the log once called "being admitted"
        when = r"after \d+ events" if request_id in ids[:4] else "before the response was complete"
        assert re.search(rf"the client disconnected {when}; the request was aborted", lines[0]), lines[0]
    _no_tracebacks(api)


def test_the_engine_replica_logs_how_its_engine_started(api):
    """The engine's own INFO lines reach ``serve run``'s output through Serve's logger
    (``app.engine_server.log_engine_through_serve``), so the README's "the engine logs which
    kernels" holds for ``make run``."""
    from engine.device import cpu_has_bf16_matmul
    from engine.models import can_prepack_weights

    log = api.log_path.read_text(errors="replace")
    ready = [line for line in log.splitlines() if "engine ready: smollm2-135m-instruct" in line]
    assert ready and " INFO " in ready[0], log[-3000:]
    if "attention cpu" in ready[0]:
        assert "CPU attention: the " in log
    if cpu_has_bf16_matmul() and can_prepack_weights() and "torch.bfloat16 on cpu" in ready[0]:
        assert "bf16 weights prepacked for oneDNN" in log
