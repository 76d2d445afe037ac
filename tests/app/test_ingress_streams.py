"""The ingress's reading of a completions batch's engine streams (``app.ingress``'s
``_first_records`` and ``_merged``), without a server: a refused prompt is answered without
waiting for the others, records come as each stream yields them, each stream ends
``finished``, an error in one is raised, and leaving early stops every reader."""
import asyncio
import gc

import pytest

from app.ingress import _EngineCall, _first_records, _merged


class _Stream:
    """Stands in for a ``DeploymentResponseGenerator``: yields ``records`` with a pause before
    each; raises ``error`` after them where given."""

    def __init__(self, records: list[dict], pause_s: float, error: Exception | None = None) -> None:
        self.records, self.pause_s, self.error = records, pause_s, error
        self.num_read = 0
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        try:
            await asyncio.sleep(self.pause_s)
        except asyncio.CancelledError:  # as Serve's: a cancelled read ends with an error of its own
            raise RuntimeError("RequestCancelledError") from None
        if self.num_read == len(self.records):
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        self.num_read += 1
        return self.records[self.num_read - 1]

    def cancel(self) -> None:
        self.cancelled = True


async def _collect(calls: list[_EngineCall]) -> list[tuple[int, dict]]:
    return [item async for item in _merged(calls)]


def test_records_come_from_every_stream_as_they_are_ready():
    slow = _EngineCall(_Stream([{"r": "a0"}, {"r": "a1"}], pause_s=0.5))  # far behind, on a busy host too
    fast = _EngineCall(_Stream([{"r": "b0"}, {"r": "b1"}, {"r": "b2"}], pause_s=0.005))
    merged = asyncio.run(_collect([slow, fast]))
    assert [index for index, _ in merged[:3]] == [1, 1, 1]  # the fast stream's, before the slow one's
    assert sorted((index, record["r"]) for index, record in merged) == \
        [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1"), (1, "b2")]
    assert slow.finished and fast.finished
    one = _EngineCall(_Stream([{"r": "c0"}], pause_s=0))
    assert asyncio.run(_collect([one])) == [(0, {"r": "c0"})] and one.finished


def test_an_error_in_one_stream_is_raised_and_the_others_are_not_finished():
    failing = _EngineCall(_Stream([{"r": "a0"}], pause_s=0.01, error=RuntimeError("replica died")))
    long = _EngineCall(_Stream([{"r": "b"}] * 100, pause_s=0.01))
    with pytest.raises(RuntimeError, match="replica died"):
        asyncio.run(_collect([failing, long]))
    assert not failing.finished and not long.finished  # the caller closes (cancels) them
    assert long.stream.num_read < 10


def test_leaving_early_stops_every_reader():
    streams = [_Stream([{"r": i}] * 1000, pause_s=0.001) for i in range(3)]

    async def main():
        merged = _merged([_EngineCall(stream) for stream in streams])
        async for _ in merged:
            break
        await merged.aclose()
        read = [stream.num_read for stream in streams]
        await asyncio.sleep(0.05)
        return read, [stream.num_read for stream in streams], len(asyncio.all_tasks())

    read, read_later, num_tasks = asyncio.run(main())
    assert read == read_later  # nothing read after the consumer left
    assert max(read) <= 2 and num_tasks == 1  # at most one record ahead each; only main() runs


def test_a_refused_prompt_is_answered_without_waiting_for_the_others_first_records():
    refusal = {"status_code": 400, "message": "prompt (9000 tokens) ...", "param": "prompt"}
    calls = [_EngineCall(_Stream([{"r": "whole result"}], pause_s=5.0)), _EngineCall(_Stream([refusal], pause_s=0.01))]

    async def main():
        started = asyncio.get_running_loop().time()
        firsts = await _first_records(calls)
        seconds = asyncio.get_running_loop().time() - started
        await asyncio.sleep(0.01)  # for the cancelled read to end
        return firsts, seconds, len(asyncio.all_tasks())

    firsts, seconds, num_tasks = asyncio.run(main())
    assert firsts == [None, refusal] and seconds < 2.5 and num_tasks == 1  # the slow read was cancelled
    ok = [_EngineCall(_Stream([{"r": i}], pause_s=0.01 * (3 - i))) for i in range(3)]
    assert asyncio.run(_first_records(ok)) == [{"r": 0}, {"r": 1}, {"r": 2}]  # in the calls' order
    failing = [_EngineCall(_Stream([], pause_s=0.01, error=RuntimeError("no replica"))),
               _EngineCall(_Stream([{"r": 1}], pause_s=5.0))]
    with pytest.raises(RuntimeError, match="no replica"):
        asyncio.run(_first_records(failing))


def test_reads_cut_short_leave_no_task_and_no_unretrieved_error():
    # a client that left: Serve ends each cancelled read with RequestCancelledError, which
    # asyncio logged with a traceback ("Task exception was never retrieved") when nobody took it
    unretrieved = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        slow = [_EngineCall(_Stream([{"r": i}] * 100, pause_s=5.0)) for i in range(3)]
        waiting = asyncio.create_task(_first_records(slow))
        await asyncio.sleep(0.05)
        waiting.cancel()  # the client left before the first records
        with pytest.raises(asyncio.CancelledError):
            await waiting
        merged = _merged([_EngineCall(_Stream([{"r": i}] * 100, pause_s=0.01 * (i + 1))) for i in range(3)])
        async for _ in merged:
            break
        await merged.aclose()  # the client left mid-stream
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0)
        return len(asyncio.all_tasks())

    assert asyncio.run(main()) == 1
    assert unretrieved == []
