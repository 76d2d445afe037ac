"""A stand-in HTTP service on 127.0.0.1 for tests of this project's clients (``make run``'s
wrapper polling ``/stats``, the load test)."""
from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def stand_in_service(answer: Callable[[http.server.BaseHTTPRequestHandler], tuple[int, bytes]]) -> Iterator[str]:
    """Answer every GET and POST with ``answer(request)``: its status and JSON body (a POST's
    body read first), on a free port of 127.0.0.1 in a thread of its own. Yields the
    service's URL; the service stops when the block ends."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, body = answer(self)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _reply

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
