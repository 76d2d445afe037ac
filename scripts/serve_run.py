"""``serve run`` that stops the same clean way on SIGTERM as on Ctrl-C (``make run`` uses it).

    python scripts/serve_run.py app:deployment [serve run arguments...]

Ray's driver (the ``serve run`` process) answers SIGTERM with a C++ stack dump and dies
without shutting Serve down; only SIGINT takes ``serve run``'s own path (``serve.shutdown()``,
then Ray's). This runs ``serve run`` in a session of its own and turns every SIGTERM or SIGINT
it receives into one SIGINT for ``serve run``; so a terminal's Ctrl-C also reaches only the
driver, not Ray's processes, which the driver stops in order. Exits with ``serve run``'s
status. Standard library only: it starts in a blink and imports neither Ray nor torch.

It also sets ``RAY_SERVE_PROXY_USE_GRPC=1`` unless the environment sets it: Serve's HTTP proxy
then passes requests and their streamed responses to the ingress over Serve's interdeployment
gRPC transport instead of Ray actor calls, as the ingress calls the engine replicas
(``AppConfig.engine_transport``): less CPU per streamed token (docs/DEPLOYMENT.md, "How
requests cross between Serve's processes"). Ray's processes inherit it where ``serve run``
starts Ray itself; a cluster started with ``ray start`` needs it in ``ray start``'s
environment.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    # A process started in the background by a non-interactive shell (`make run &`) inherits
    # SIGINT ignored, and Python keeps an ignored SIGINT ignored: ``serve run`` would then
    # never see the SIGINT sent below. The child inherits SIG_DFL instead, so its Python
    # installs the KeyboardInterrupt handler that ``serve run``'s shutdown path needs.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    env = {"RAY_SERVE_PROXY_USE_GRPC": "1", **os.environ}
    child = subprocess.Popen([serve, "run", *argv], env=env, start_new_session=True)

    def stop(signum, frame) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return child.wait()  # retried after each handler (PEP 475)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
