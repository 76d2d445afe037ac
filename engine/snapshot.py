"""The engine's state for the live dashboard (``app.dashboard``): the KV block pool block by
block, each running and waiting sequence with its block table, and the engine's counters.

``LLMEngine`` is not thread-safe, so the state is read on the thread that drives it, between
two steps, and only when someone asks: a ``SnapshotChannel`` hands a caller's request to that
thread, which answers it at its next loop iteration. Nobody asking costs the loop one
truthiness check per iteration.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
import time
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.request import Request

# Sequences listed per queue; the counts in ``stats`` are always complete. A waiting queue of
# thousands would make each answer hundreds of kilobytes for rows nobody reads.
MAX_LISTED_REQUESTS = 256


def engine_snapshot(engine: LLMEngine, max_requests: int = MAX_LISTED_REQUESTS) -> dict:
    """Everything the dashboard draws, as plain JSON-able data. Call it on the thread that
    drives ``engine`` (or while nothing does).

    Returns:
        ``{"time": unix seconds, "stats": LLMEngine.stats(), "block_size": tokens per block,
        "blocks": {"ref_counts": [int] * num_blocks, "cached": [block ids with a hash],
        "hits": {block id: requests that found it in the prefix cache since it was cached}},
        "running": [sequence], "waiting": [sequence]}``, each sequence as ``sequence_state``,
        at most ``max_requests`` per queue (running in admission order, waiting in the order
        they will be admitted).
    """
    bm, scheduler = engine.block_manager, engine.scheduler
    cached = [block_id for block_id, block_hash in enumerate(bm.block_hashes) if block_hash is not None]
    return {
        "time": time.time(),
        "stats": engine.stats(),
        "block_size": bm.block_size,
        "blocks": {
            "ref_counts": list(bm.ref_counts),
            "cached": cached,
            "hits": {block_id: bm.hit_counts[block_id] for block_id in cached if bm.hit_counts[block_id]},
        },
        "running": [sequence_state(r, bm.block_table(r.seq_id)) for r in scheduler.running[:max_requests]],
        "waiting": [sequence_state(r, []) for r in itertools.islice(scheduler.waiting, max_requests)],
    }


def sequence_state(request: Request, block_table: list[int]) -> dict:
    """One sequence's row: ids, status, token counts and its block table (a copy).

    ``num_computed_tokens`` counts the leading prompt + output tokens whose K/V are in the
    cache; ``num_cached_tokens`` the prompt tokens its first admission found in the prefix
    cache (``None`` before it was admitted).
    """
    return {
        "request_id": request.request_id,
        "seq_id": request.seq_id,
        "status": request.status.name.lower(),
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_output_tokens": request.num_output_tokens,
        "max_tokens": request.max_tokens,
        "num_cached_tokens": request.num_cached_tokens,
        "num_preemptions": request.num_preemptions,
        "arrival_time": request.arrival_time,
        "block_table": list(block_table),
    }


class SnapshotChannel:
    """Snapshots of one engine, asked for from any thread and taken on the thread driving it.

    The driving thread wraps its loop in ``driving()`` and calls ``serve()`` once per
    iteration (before it may sleep: a caller that asks wakes it through ``on_request``).
    While no thread drives the engine, ``request`` takes the snapshot on the caller's
    thread, holding the lock that keeps a driver from starting meanwhile.

    Args:
        engine: the engine to read.
        on_request: called after a request is queued for the driving thread (e.g. to wake
            an idle loop).
    """

    def __init__(self, engine: LLMEngine, on_request=None) -> None:
        self.engine = engine
        self.on_request = on_request
        self._lock = threading.Lock()
        self._pending: list[concurrent.futures.Future] = []
        self._driven = False

    def request(self) -> concurrent.futures.Future:
        """A future of ``engine_snapshot(engine)``, resolved at the driving thread's next
        ``serve()``, or already resolved when no thread drives the engine."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._driven:
                _resolve([future], self.engine)
                return future
            self._pending.append(future)
        if self.on_request is not None:
            self.on_request()
        return future

    def serve(self) -> None:
        """Answer every pending request with one snapshot (driving thread only)."""
        if self._pending:
            with self._lock:
                pending, self._pending = self._pending, []
            _resolve(pending, self.engine)

    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """Mark the calling thread as the engine's driver for the ``with`` block; requests
        still pending when it ends are answered then."""
        with self._lock:
            self._driven = True
        try:
            yield
        finally:
            with self._lock:
                self._driven = False
                pending, self._pending = self._pending, []
                _resolve(pending, self.engine)


def _resolve(futures: list[concurrent.futures.Future], engine: LLMEngine) -> None:
    if not futures:
        return
    try:
        snapshot = engine_snapshot(engine)
    except Exception as exc:  # noqa: BLE001 - the asker gets it; the loop goes on
        for future in futures:
            future.set_exception(exc)
        return
    for future in futures:
        future.set_result(snapshot)
