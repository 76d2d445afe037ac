"""The live dashboard: ``GET /dashboard`` (one self-contained page, ``app/static/
dashboard.html``) polls ``GET /stats?blocks=1`` once a second and draws each engine replica's
KV block pool, queues and rates.

The data of one replica is ``replica_view``: the engine's counters (``LLMEngine.stats``),
its block pool and sequences (``engine.snapshot.engine_snapshot``, taken between two steps
only when someone asks), where it runs, and its recent TTFT and ITL percentiles.

The same page and endpoint serve an offline run: ``python -m engine generate --workload FILE
--dashboard-port 8001`` (``serve_offline``), with the standard library's HTTP server.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import parse_qs, urlsplit

PAGE_PATH = Path(__file__).with_name("static") / "dashboard.html"
# Latency samples kept per replica for the page's percentiles: the most recent ones.
RECENT_SAMPLES = 1024
PERCENTILES = (50, 90, 99)

logger = logging.getLogger(__name__)


def page() -> bytes:
    """The dashboard's HTML (with its CSS and JavaScript inline; it loads nothing else)."""
    return PAGE_PATH.read_bytes()


class RecentLatencies:
    """The last ``RECENT_SAMPLES`` TTFTs and ITLs of one replica, in seconds.

    ``deque.append`` is atomic in CPython, so the replica's event loop appends while another
    thread reads a copy (``percentiles``).
    """

    def __init__(self, maxlen: int = RECENT_SAMPLES) -> None:
        self.ttft: collections.deque[float] = collections.deque(maxlen=maxlen)
        self.itl: collections.deque[float] = collections.deque(maxlen=maxlen)

    def view(self) -> dict:
        """``{"ttft_s": percentiles(...), "itl_s": percentiles(...), "num_samples": {...}}``."""
        ttft, itl = list(self.ttft), list(self.itl)
        return {"ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
                "num_samples": {"ttft": len(ttft), "itl": len(itl)}}


def percentiles(values: Iterable[float], points: Iterable[int] = PERCENTILES) -> dict[str, float | None]:
    """Nearest-rank percentiles: ``{"p50": ..., "p90": ..., "p99": ...}`` (``None`` when
    there are no values). The p-th is the smallest value with at least p% of the values at or
    below it (the nearest-rank definition, e.g. NIST's handbook)."""
    ordered = sorted(values)
    return {f"p{p}": ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] if ordered else None
            for p in points}


def replica_view(snapshot: dict, replica_id: str, node_id: str, latencies: RecentLatencies | None) -> dict:
    """One replica's entry of ``/stats?blocks=1``: the counters of plain ``/stats`` at the top
    level (so a client of ``/stats`` reads either), then ``replica_id``, ``node_id``,
    ``time`` (unix seconds of the snapshot), ``block_size``, ``blocks``, ``running``,
    ``waiting`` (see ``engine.snapshot.engine_snapshot``) and ``latency`` (``ttft_s`` and
    ``itl_s`` percentiles of the recent requests; ``None`` where nothing measures them, as
    in an offline run)."""
    return {**snapshot["stats"], "replica_id": replica_id, "node_id": node_id,
            "time": snapshot["time"], "block_size": snapshot["block_size"], "blocks": snapshot["blocks"],
            "running": snapshot["running"], "waiting": snapshot["waiting"],
            "latency": None if latencies is None else latencies.view()}


def node_id() -> str:
    """The Ray node this process runs on, or the host name outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not in a Ray worker: the host is the node
        pass
    return socket.gethostname()


class OfflineDashboard:
    """The dashboard of an offline ``LLM``: ``/dashboard``, ``/stats`` and ``/stats?blocks=1``
    on ``host:port``, from a daemon thread (stopped by ``close``).

    Args:
        llm: an ``engine.LLM``; snapshots come from its ``snapshots`` channel (taken between
            steps while ``generate`` runs).
        port: the TCP port (0: any free one; ``port`` tells which).
        host: the address to listen on (the loopback by default: the page has no API key).

    Raises:
        OSError: when the port cannot be bound.
    """

    def __init__(self, llm, port: int, host: str = "127.0.0.1") -> None:
        self.llm = llm
        self.replica_id = "offline"
        self.node_id = socket.gethostname()
        handler = _handler(self._stats)
        self.server = ThreadingHTTPServer((host, port), handler)
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}/dashboard"
        self._thread = threading.Thread(target=self.server.serve_forever, name="dashboard", daemon=True)
        self._thread.start()

    def _stats(self, blocks: bool) -> dict:
        if not blocks:
            return {"replicas": [{**self.llm.llm_engine.stats(), "replica_id": self.replica_id}]}
        snapshot = self.llm.snapshots.request().result(timeout=30)
        return {"replicas": [replica_view(snapshot, self.replica_id, self.node_id, None)]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def _handler(stats: Callable[[bool], dict]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlsplit(self.path)
            if url.path == "/dashboard":
                self._send(200, "text/html; charset=utf-8", page())
            elif url.path == "/stats":
                blocks = parse_qs(url.query).get("blocks", ["0"])[-1].lower() in ("1", "true", "yes", "on")
                self._send(200, "application/json", json.dumps(stats(blocks)).encode())
            else:
                body = {"error": {"message": f"no route {url.path}; the dashboard is /dashboard",
                                  "type": "not_found_error", "code": "not_found"}}
                self._send(404, "application/json", json.dumps(body).encode())

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the browser left mid-answer
                pass

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's name
            logger.debug("dashboard: " + format, *args)

    return Handler
